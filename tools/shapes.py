"""The synthetic "shapes" image set of troupe's bundled tiny LLaVA.

The specification (colors, shapes, positions, canonical caption order and
answer forms) is docs/shapes.md; this module is its reference
implementation, used by tools/train_tiny_llava.py (training data),
tools/eval_shapes.py (accuracy of `troupe generate`) and
tools/make_shapes_sample.py (the committed test sample).

Needs numpy and Pillow only. Everything is a pure function of a seed:
    scene = make_scene(rng)                  # what is in the image
    img = render(scene, size, rng)           # a square PIL RGB image
    caption(scene), questions(scene, rng)    # the texts and their answers
"""

import math
import random

import numpy as np
from PIL import Image, ImageDraw

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 220, 50),
    "purple": (150, 50, 190),
    "orange": (245, 140, 30),
    "white": (240, 240, 240),
}
SHAPES = ["circle", "square", "triangle", "star"]
# Canonical order of positions: captions list objects in this order.
POSITIONS = ["left", "right", "top", "bottom", "center"]
CENTERS = {
    "left": (0.22, 0.5),
    "right": (0.78, 0.5),
    "top": (0.5, 0.22),
    "bottom": (0.5, 0.78),
    "center": (0.5, 0.5),
}
PHRASE = {
    "left": "on the left",
    "right": "on the right",
    "top": "at the top",
    "bottom": "at the bottom",
    "center": "in the center",
}
NUMBERS = ["zero", "one", "two", "three"]

# Object size: the diameter of its bounding circle as a fraction of the side.
MIN_SIZE, MAX_SIZE = 0.20, 0.34
JITTER = 0.04


def make_scene(rng: random.Random, n_objects=None):
    """1-3 objects at distinct positions, with colors, shapes, sizes, jitter."""
    n = n_objects or rng.choice([1, 2, 3])
    while True:
        positions = rng.sample(POSITIONS, n)
        objects = []
        for pos in positions:
            size = rng.uniform(MIN_SIZE, MAX_SIZE if n == 1 else MAX_SIZE - 0.04)
            r = size / 2
            cx, cy = CENTERS[pos]
            cx = min(max(cx + rng.uniform(-JITTER, JITTER), r + 0.02), 1 - r - 0.02)
            cy = min(max(cy + rng.uniform(-JITTER, JITTER), r + 0.02), 1 - r - 0.02)
            objects.append(
                {
                    "color": rng.choice(list(COLORS)),
                    "shape": rng.choice(SHAPES),
                    "position": pos,
                    "x": cx,
                    "y": cy,
                    "size": size,
                    "angle": rng.uniform(-12, 12),
                }
            )
        # Objects do not touch: bounding circles keep a gap.
        ok = all(
            math.hypot(a["x"] - b["x"], a["y"] - b["y"]) > (a["size"] + b["size"]) / 2 + 0.03
            for i, a in enumerate(objects)
            for b in objects[i + 1:]
        )
        if ok:
            objects.sort(key=lambda o: POSITIONS.index(o["position"]))
            return objects


def _polygon(shape, cx, cy, r, angle):
    a0 = math.radians(angle)
    if shape == "square":
        k = r / math.sqrt(2) * 1.15  # a square's corners poke out less than a circle
        k = min(k, r)
        pts = [(-k, -k), (k, -k), (k, k), (-k, k)]
    elif shape == "triangle":
        pts = [(r * math.cos(math.radians(-90 + 120 * i)), r * math.sin(math.radians(-90 + 120 * i))) for i in range(3)]
    elif shape == "star":
        pts = []
        for i in range(10):
            rr = r if i % 2 == 0 else r * 0.45
            t = math.radians(-90 + 36 * i)
            pts.append((rr * math.cos(t), rr * math.sin(t)))
    else:
        raise ValueError(shape)
    c, s = math.cos(a0), math.sin(a0)
    return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in pts]


def render(scene, size: int, rng: random.Random) -> Image.Image:
    """A square RGB image of side `size` (any resolution >= 32)."""
    nprng = np.random.default_rng(rng.getrandbits(63))
    ss = 3 if size < 256 else 2  # supersampling for anti-aliased edges
    big = size * ss
    base = np.array([rng.randint(15, 95) for _ in range(3)], dtype=np.float32)
    # Background: a dark tint, a soft gradient and blotches.
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    bg = base[None, None, :] + (20 * rng.uniform(-1, 1)) * xx[..., None] + (20 * rng.uniform(-1, 1)) * yy[..., None]
    img = Image.fromarray(np.clip(bg, 0, 255).astype(np.uint8)).resize((big, big), Image.BILINEAR)
    draw = ImageDraw.Draw(img)
    for o in scene:
        base_color = COLORS[o["color"]]
        color = tuple(int(min(255, max(0, c + rng.randint(-18, 18)))) for c in base_color)
        cx, cy, r = o["x"] * big, o["y"] * big, o["size"] / 2 * big
        if o["shape"] == "circle":
            rr = r * 0.92
            draw.ellipse([cx - rr, cy - rr, cx + rr, cy + rr], fill=color)
        else:
            draw.polygon(_polygon(o["shape"], cx, cy, r, o["angle"]), fill=color)
    img = img.resize((size, size), Image.LANCZOS)
    arr = np.asarray(img).astype(np.float32)
    arr += nprng.normal(0, rng.uniform(3, 12), arr.shape).astype(np.float32)
    return Image.fromarray(np.clip(arr + 0.5, 0, 255).astype(np.uint8))


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def describe(o) -> str:
    return f"{article(o['color'])} {o['color']} {o['shape']} {PHRASE[o['position']]}"


def caption(scene) -> str:
    """Objects in canonical position order, joined by ', ' and ' and '."""
    parts = [describe(o) for o in sorted(scene, key=lambda o: POSITIONS.index(o["position"]))]
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


CAPTION_PROMPT = "Describe the image."


def all_questions(scene):
    """Every question the spec defines for this scene: [(type, question, answer)]."""
    out = [("count", "How many shapes are there?", NUMBERS[len(scene)])]
    by_shape = {}
    for o in scene:
        by_shape.setdefault(o["shape"], []).append(o)
    for o in scene:
        out.append(("shape_at", f"What shape is {PHRASE[o['position']]}?", o["shape"]))
        out.append(("color_at", f"What color is the shape {PHRASE[o['position']]}?", o["color"]))
        if len(by_shape[o["shape"]]) == 1:
            out.append(("color_of", f"What color is the {o['shape']}?", o["color"]))
        if sum(1 for p in scene if p["shape"] == o["shape"] and p["color"] == o["color"]) == 1:
            out.append(("where", f"Where is the {o['color']} {o['shape']}?", o["position"]))
            out.append(("exists", f"Is there {article(o['color'])} {o['color']} {o['shape']}?", "yes"))
    present = {(o["color"], o["shape"]) for o in scene}
    # "no" questions are near misses: a present shape in another color, or a
    # present color on another shape.
    near = [(c, o["shape"]) for o in scene for c in COLORS] + [(o["color"], s) for o in scene for s in SHAPES]
    near = sorted({p for p in near if p not in present})
    for c, s in near:
        out.append(("exists", f"Is there {article(c)} {c} {s}?", "no"))
    return out


QUESTION_TYPES = ["caption", "count", "shape_at", "color_at", "color_of", "where", "exists"]


def sample_question(scene, rng: random.Random, caption_share=0.3):
    """One (type, question, answer): a caption with probability caption_share,
    else a question type drawn uniformly, then a question of that type
    (yes and no equally likely for `exists`)."""
    if rng.random() < caption_share:
        return ("caption", CAPTION_PROMPT, caption(scene))
    qs = all_questions(scene)
    types = sorted({t for t, _, _ in qs})
    t = rng.choice(types)
    pool = [q for q in qs if q[0] == t]
    if t == "exists":
        want = rng.choice(["yes", "no"])
        pool = [q for q in pool if q[2] == want] or pool
    return rng.choice(pool)


def texts_for_vocabulary():
    """Every word the spec can produce, in sentences (tokenizer training)."""
    lines = [CAPTION_PROMPT, "How many shapes are there?"] + [n for n in NUMBERS]
    for c in COLORS:
        for s in SHAPES:
            for p in POSITIONS:
                lines.append(describe({"color": c, "shape": s, "position": p}))
                lines.append(f"What color is the {s}? What shape is {PHRASE[p]}? Where is the {c} {s}? {p}")
                lines.append(f"Is there {article(c)} {c} {s}? yes no What color is the shape {PHRASE[p]}? {c} {s}")
    return lines
