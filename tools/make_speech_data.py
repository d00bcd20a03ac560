#!/usr/bin/env python3
"""Spoken shapes questions for the model that hears (issue 29, item 7):
every question of docs/shapes.md, and "Describe the image.", said by a
speech synthesizer in many voices, speeds and pitches, with background
noise mixed in by sox. Deterministic: the same arguments give the same
clips (the synthesizers are; the noise is seeded).

    python3 tools/make_speech_data.py --out DIR --split train --count 20000
    python3 tools/make_speech_data.py --out DIR --split heldout --count 500
    python3 tools/make_speech_data.py --out DIR --split flite --count 500

Splits (no voice is in two of them):
- train: espeak-ng voices TRAIN_VOICES, speeds 130-200 words a minute,
  pitches 30-70, noise at 0-0.03 amplitude (white or brown);
- heldout: espeak-ng voices HELDOUT_VOICES, and speeds and pitches outside
  the training ranges' middle (120-130 and 200-210 wpm, pitch 20-30 and
  70-80);
- flite: another synthesizer altogether (Debian's flite, every voice it
  ships: kal, kal16, awb, rms, slt), reported apart.

Writes DIR/SPLIT/NNNNNN.wav (16 kHz mono PCM16) and DIR/SPLIT.jsonl, one
line per clip: {"file", "text", "voice", "speed", "pitch", "noise",
"seconds"}. Needs espeak-ng, flite and sox (Debian packages) and what
tools/shapes.py needs (NumPy, Pillow: PyPI, like the training tools).
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import wave

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shapes  # noqa: E402  (the questions of docs/shapes.md)

TRAIN_VOICES = ["en-us", "en-gb", "en-gb-scotland", "en-029", "en-gb-x-gbcwmd",
                "en-us+f3", "en-gb+f2", "en-us+m4", "en-029+f4"]
HELDOUT_VOICES = ["en-gb-x-rp", "en-us-nyc", "en-gb-x-gbclan", "en-us+f5", "en-gb+m7"]
FLITE_VOICES = ["kal", "kal16", "awb", "rms", "slt"]
RATE = 16000


def utterances(rng: random.Random):
    """A question about a random scene (the texts the model must hear)."""
    while True:
        scene = shapes.make_scene(rng)
        _, q, _ = shapes.sample_question(scene, rng)
        yield q


def synthesize(split, voice, speed, pitch, text, raw):
    if split == "flite":
        subprocess.run(["flite", "-voice", voice, "-t", text, "-o", raw], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    else:
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-p", str(pitch), "-w", raw,
                        text], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def write_noise(path, samples, kind, amplitude, seed):
    """Seeded white or brown noise of `amplitude` (RMS, full scale 1) as a
    16 kHz PCM16 WAV (the standard library's wave module)."""
    rng = random.Random(seed)
    x, level, out = 0.0, [], bytearray()
    for _ in range(samples):
        g = rng.gauss(0.0, 1.0)
        if kind == "brown":  # integrated white noise, kept bounded
            x = 0.98 * x + g
            level.append(x)
        else:
            level.append(g)
    rms = (sum(v * v for v in level) / max(1, len(level))) ** 0.5 or 1.0
    for v in level:
        q = int(max(-32767, min(32767, round(v / rms * amplitude * 32767))))
        out += q.to_bytes(2, "little", signed=True)
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(bytes(out))


def finish(raw, out, noise_kind, noise, seed):
    """To 16 kHz mono PCM16 (sox), with seeded noise mixed in when noise > 0."""
    base = ["sox", "-R", raw, "-r", str(RATE), "-c", "1", "-b", "16"]
    if noise <= 0:
        subprocess.run(base + [out], check=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        clean = os.path.join(tmp, "clean.wav")
        subprocess.run(base + [clean], check=True)
        with wave.open(clean, "rb") as w:
            samples = w.getnframes()
        hiss = os.path.join(tmp, "noise.wav")
        write_noise(hiss, samples, noise_kind, noise, seed)
        subprocess.run(["sox", "-R", "-m", "-v", "1", clean, "-v", "1", hiss, out], check=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--split", choices=["train", "heldout", "flite"], required=True)
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else {"train": 1234, "heldout": 2026,
                                                    "flite": 4242}[args.split]
    rng = random.Random(seed)
    folder = os.path.join(args.out, args.split)
    os.makedirs(folder, exist_ok=True)
    texts = utterances(random.Random(seed + 1))
    with open(os.path.join(args.out, args.split + ".jsonl"), "w") as index, \
            tempfile.TemporaryDirectory() as tmp:
        for k in range(args.count):
            text = next(texts)
            if args.split == "train":
                voice = rng.choice(TRAIN_VOICES)
                speed, pitch = rng.randint(130, 200), rng.randint(30, 70)
            elif args.split == "heldout":
                voice = rng.choice(HELDOUT_VOICES)
                speed = rng.choice([rng.randint(120, 129), rng.randint(201, 210)])
                pitch = rng.choice([rng.randint(20, 29), rng.randint(71, 80)])
            else:
                voice, speed, pitch = rng.choice(FLITE_VOICES), 0, 0
            noise_kind = rng.choice(["white", "brown"])
            noise = 0.0 if rng.random() < 0.3 else rng.uniform(0.0, 0.03)
            raw = os.path.join(tmp, "raw.wav")
            synthesize(args.split, voice, speed, pitch, text, raw)
            name = f"{k:06d}.wav"
            out = os.path.join(folder, name)
            finish(raw, out, noise_kind, noise, seed * 100003 + k)
            seconds = float(subprocess.run(["soxi", "-D", out], check=True, capture_output=True,
                                           text=True).stdout)
            index.write(json.dumps({"file": f"{args.split}/{name}", "text": text, "voice": voice,
                                    "speed": speed, "pitch": pitch,
                                    "noise": [noise_kind, round(noise, 4)],
                                    "seconds": round(seconds, 3)}) + "\n")


if __name__ == "__main__":
    main()
