"""Accuracy of the bundled model through the real CLI: draws fresh shapes
images (a seed never used in training), asks `troupe generate` for each
image's caption and three questions, and prints the accuracy table (per
question type, per caption object count, per attribute) as Markdown.

    /usr/bin/python3 tools/eval_shapes.py --troupe build/cli/troupe --count 300 --seed 2026

Options: --model PATH (default: the CLI's bundled model), --jobs N (parallel
CLI runs), --extra "ARGS" (passed to troupe generate, e.g. "--quant q8_0").
Needs numpy and Pillow.
"""

import argparse
import concurrent.futures as cf
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shapes  # noqa: E402
from make_shapes_sample import sample  # noqa: E402


def ask(troupe, model, extra, image, prompt):
    cmd = [troupe, "generate", "--image", image, "--prompt", prompt, "--temperature", "0", "--json", "--threads", "1"]
    if model:
        cmd += ["--model", model]
    cmd += extra
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(shlex.quote, cmd))} failed:\n{r.stderr}")
    return json.loads(r.stdout)


def parse_caption(text):
    """{position: (color, shape)} from a caption, or None if malformed."""
    out = {}
    text = text.replace(" and ", ", ")
    for part in text.split(", "):
        w = part.split()
        if len(w) < 4:
            return None
        pos = w[-1]
        out[pos] = (w[1], w[2])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--troupe", default="build/cli/troupe")
    ap.add_argument("--model", default="")
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--extra", default="")
    args = ap.parse_args()
    extra = shlex.split(args.extra)
    tmp = tempfile.mkdtemp(prefix="troupe-shapes-")
    work = []
    for i, (img, entry) in enumerate(sample(args.seed, args.count, [64, 80, 96, 128, 160, 224])):
        path = os.path.join(tmp, f"{i:04d}.png")
        img.save(path)
        work.append((path, "caption", shapes.CAPTION_PROMPT, entry["caption"], entry))
        for q in entry["questions"]:
            work.append((path, q["type"], q["question"], q["answer"], entry))
    with cf.ThreadPoolExecutor(args.jobs) as ex:
        results = list(ex.map(lambda w: ask(args.troupe, args.model, extra, w[0], w[2]), work))
    by_type, by_attr, by_color, by_shape, encode_ms = {}, {}, {}, {}, []

    def add(d, k, ok):
        r, t = d.get(k, (0, 0))
        d[k] = (r + ok, t + 1)

    attr_of = {**{c: "color" for c in shapes.COLORS}, **{s: "shape" for s in shapes.SHAPES},
               **{p: "position" for p in shapes.POSITIONS}, "one": "count", "two": "count", "three": "count",
               "yes": "yes/no", "no": "yes/no"}
    wrong = []
    for (path, t, q, a, entry), res in zip(work, results):
        got = res["text"].strip()
        ok = got == a
        if "image_encode_ms" in res.get("timings", {}):
            encode_ms.append(res["timings"]["image_encode_ms"])
        if t == "caption":
            add(by_type, f"caption, {entry['objects']} object{'s' if entry['objects'] > 1 else ''}", ok)
            want, have = parse_caption(a), parse_caption(got) or {}
            for pos, (c, s) in want.items():
                add(by_attr, "caption: object's color", have.get(pos, ("", ""))[0] == c)
                add(by_attr, "caption: object's shape", have.get(pos, ("", ""))[1] == s)
                add(by_color, c, have.get(pos, ("", ""))[0] == c)
                add(by_shape, s, have.get(pos, ("", ""))[1] == s)
            add(by_attr, "caption: set of positions", set(have) == set(want))
        else:
            add(by_type, t, ok)
            add(by_type, "all questions", ok)
            add(by_attr, f"answer is a {attr_of[a]}", ok)
        if not ok:
            wrong.append(f"{os.path.basename(path)} {q!r}: want {a!r}, got {got!r}")

    def table(title, d):
        print(f"\n| {title} | right | of | accuracy |\n|---|---|---|---|")
        for k in sorted(d):
            r, n = d[k]
            print(f"| {k} | {r} | {n} | {100 * r / n:.1f}% |")

    print(f"# shapes accuracy: {args.count} images, seed {args.seed}, {len(work)} prompts")
    table("question type", by_type)
    table("attribute", by_attr)
    table("caption color", by_color)
    table("caption shape", by_shape)
    if encode_ms:
        print(f"\nimage encode: median {statistics.median(encode_ms):.2f} ms per image (1 thread)")
    print(f"\n{len(wrong)} wrong answers" + (":" if wrong else ""))
    for w in wrong[:40]:
        print("  " + w)
    q = by_type.get("all questions", (0, 1))
    c12 = [by_type.get(k, (0, 0)) for k in ("caption, 1 object", "caption, 2 objects")]
    c12 = (sum(r for r, _ in c12), max(1, sum(n for _, n in c12)))
    c3 = by_type.get("caption, 3 objects", (0, 1))
    ok = q[0] / q[1] >= 0.95 and c12[0] / c12[1] >= 0.95 and c3[0] / c3[1] >= 0.90
    print(f"\nquestions {100 * q[0] / q[1]:.1f}% (>= 95), captions 1-2 objects {100 * c12[0] / c12[1]:.1f}% (>= 95), "
          f"3 objects {100 * c3[0] / c3[1]:.1f}% (>= 90): {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
