"""Accuracy of a model that hears, through the real CLI (`troupe generate`),
on speech it was not trained on (issue 29, item 7):
- transcription: "Transcribe the audio." with each clip of a split of
  tools/make_speech_data.py (the held-out espeak-ng voices and speeds, or
  flite), exact match of the words;
- spoken questions: each clip's question asked about a fresh image (a
  scene drawn with a seed never used in training, for which the question
  has an answer), with the prompt text "Answer the question.".

    /usr/bin/python3 tools/eval_hearing.py --model DIR --speech /tmp/speech --split heldout

Prints Markdown tables (per task, per question type) and the wrong answers.
Needs numpy and Pillow (tools/shapes.py).
"""

import argparse
import concurrent.futures as cf
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shapes  # noqa: E402


def ask(troupe, model, clip, prompt, image=None):
    cmd = [troupe, "generate", "--direct", "-m", model, "--audio", clip, "--prompt", prompt,
           "--temperature", "0", "--json", "--threads", "1", "-n", "48"]
    if image:
        cmd += ["--image", image]
    if "<audio>" in prompt:
        cmd += ["--chat"]  # the placeholders stand where they are, in a user turn
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(shlex.quote, cmd))} failed:\n{r.stderr}")
    return json.loads(r.stdout[r.stdout.index("{"):])["text"].strip()


def scene_for(question, rng):
    """A scene for which `question` has an answer, and its (type, answer)."""
    for _ in range(20000):
        scene = shapes.make_scene(rng)
        if question == shapes.CAPTION_PROMPT:
            return scene, "caption", shapes.caption(scene)
        for t, q, a in shapes.all_questions(scene):
            if q == question:
                return scene, t, a
    raise RuntimeError(f"no scene answers {question!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--troupe", default="build/cli/troupe")
    ap.add_argument("--model", required=True)
    ap.add_argument("--speech", required=True, help="tools/make_speech_data.py's --out")
    ap.add_argument("--split", default="heldout")
    ap.add_argument("--count", type=int, default=0, help="clips (0: all)")
    ap.add_argument("--seed", type=int, default=777, help="the images' seed")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--audio-first", action="store_true",
                    help="ask spoken questions as '<audio>\\n<image>\\nAnswer the question.' "
                    "(placeholders) instead of the chat template's image-then-clip order")
    args = ap.parse_args()
    with open(os.path.join(args.speech, args.split + ".jsonl")) as f:
        clips = [json.loads(line) for line in f]
    if args.count:
        clips = clips[:args.count]
    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="troupe-hear-")
    work = []
    for i, c in enumerate(clips):
        path = os.path.join(args.speech, c["file"])
        work.append(("transcription", path, "Transcribe the audio.", None, c["text"], c))
        scene, t, a = scene_for(c["text"], rng)
        img = os.path.join(tmp, f"{i:04d}.png")
        shapes.render(scene, rng.choice([64, 96, 128, 160]), rng).save(img)
        q = "<audio>\n<image>\nAnswer the question." if args.audio_first else "Answer the question."
        work.append(("spoken " + t, path, q, img, a, c))
    with cf.ThreadPoolExecutor(args.jobs) as ex:
        got = list(ex.map(lambda w: ask(args.troupe, args.model, w[1], w[2], w[3]), work))
    table, wrong = {}, []
    for (kind, path, _, _, want, c), g in zip(work, got):
        ok = g == want
        for k in {kind, "transcription" if kind == "transcription" else "spoken questions, all"}:
            r, n = table.get(k, (0, 0))
            table[k] = (r + ok, n + 1)
        if not ok:
            wrong.append(f"{c['file']} ({c['voice']}, {c['speed']} wpm) {kind}: "
                         f"{c['text']!r}: want {want!r}, got {g!r}")
    print(f"# hearing accuracy: {len(clips)} clips of split {args.split!r}, images seed {args.seed}")
    print("\n| task | right | of | accuracy |\n|---|---|---|---|")
    for k in sorted(table):
        r, n = table[k]
        print(f"| {k} | {r} | {n} | {100 * r / n:.1f}% |")
    print(f"\n{len(wrong)} wrong answers" + (":" if wrong else ""))
    for w in wrong[:40]:
        print("  " + w)


if __name__ == "__main__":
    main()
