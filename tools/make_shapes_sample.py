"""Writes the committed shapes test sample: PNG images plus their expected
caption and answers (tests/fixtures/shapes/answers.json), checked by
tests/cli/shapes_test.cpp through the real `troupe generate` binary.

    /usr/bin/python3 tools/make_shapes_sample.py tests/fixtures/shapes --count 48 --seed 777

Needs numpy and Pillow. Seed 777 is never used in training (docs/shapes.md).
"""

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shapes  # noqa: E402


def sample(seed: int, count: int, sizes, questions_per_image: int = 3):
    """[(PIL image, entry)]: equal numbers of 1-, 2- and 3-object scenes, each
    with its caption and `questions_per_image` questions of distinct types."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        scene = shapes.make_scene(rng, n_objects=1 + i % 3)
        side = rng.choice(sizes)
        img = shapes.render(scene, side, rng)
        qs = shapes.all_questions(scene)
        by_type = {}
        for q in qs:
            by_type.setdefault(q[0], []).append(q)
        types = rng.sample(sorted(by_type), min(questions_per_image, len(by_type)))
        picked = []
        for t in types:
            pool = by_type[t]
            if t == "exists":
                want = rng.choice(["yes", "no"])
                pool = [q for q in pool if q[2] == want] or pool
            picked.append(rng.choice(pool))
        entry = {
            "objects": len(scene),
            "size": side,
            "caption": shapes.caption(scene),
            "questions": [{"type": t, "question": q, "answer": a} for t, q, a in picked],
        }
        out.append((img, entry))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--count", type=int, default=48)
    ap.add_argument("--seed", type=int, default=777)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    entries = []
    for i, (img, entry) in enumerate(sample(args.seed, args.count, [64, 72, 80, 96, 112])):
        name = f"shapes_{i:03d}.png"
        img.save(os.path.join(args.out, name), optimize=True)
        entry = {"file": name, **entry}
        entries.append(entry)
    with open(os.path.join(args.out, "answers.json"), "w") as f:
        json.dump({"seed": args.seed, "prompt_caption": shapes.CAPTION_PROMPT, "images": entries}, f, indent=1)
    print(f"wrote {len(entries)} images to {args.out}")


if __name__ == "__main__":
    main()
