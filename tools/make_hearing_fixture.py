#!/usr/bin/env python3
"""tiny-llava-shapes with a random Whisper-style audio tower: a model folder
that hears (nonsense: the tower is untrained), for the tests that send
audio through troupe's actors, the cluster and the API. Written to
tests/fixtures/llava_hears/.

Not run by CI; the outputs are committed. NumPy only; run from the
repository root:

    python3 tools/make_hearing_fixture.py

With --out DIR and a shape (--d-model, --layers, --heads, --ffn,
--positions, --stack), the same for a bigger tower outside the repository,
for bench/audio_encoder.sh; Whisper-tiny's encoder is --d-model 384
--layers 4 --heads 6 --ffn 1536 --positions 1500 (30 s windows). The
decoder then comes through an absolute link.

What it writes:
- config.json: assets/tiny-llava-shapes/config.json plus troupe's audio keys:
  audio_config (a Whisper config: d_model 64, 2 layers of 4 heads, FFN 128,
  80 mel bins, max_source_positions 100, so a window is 200 frames, 2 s),
  audio_token_index 397, audio_stack_factor 8, audio_projector_hidden 96
  (a full window becomes ceil(100 / 8) = 13 tokens);
- tokenizer.json / tokenizer_config.json: the shapes tokenizer with the added
  special token "<audio>" (id 397, past the decoder's 397 rows: its
  positions always take audio rows, never an embedding);
- audio.safetensors: the tower (`audio_tower.*`, HF WhisperEncoder names) and
  the projector (`audio_projector.linear_{1,2}`), f32, drawn from a seeded
  NumPy generator;
- model.safetensors.index.json over audio.safetensors and text.safetensors,
  a symbolic link to assets/tiny-llava-shapes/model.safetensors (committed
  as a link: the decoder and the vision tower are the bundled model's);
- preprocessor_config.json and generation_config.json: the shapes model's.
"""

import argparse
import json
import os
import shutil
import struct

import numpy as np

SRC = "assets/tiny-llava-shapes"
OUT = "tests/fixtures/llava_hears"
AUDIO_TOKEN = 397
D, LAYERS, HEADS, FFN, MELS, POSITIONS = 64, 2, 4, 128, 80, 100
STACK, HIDDEN = 8, 96


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype="<f4")
        header[name] = {"dtype": "F32", "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        blobs.append(a.tobytes())
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)


def sinusoids(length, channels):
    # Whisper's initial positions (they are learned, but start as these).
    inc = np.log(10000) / (channels // 2 - 1)
    inv = np.exp(-inc * np.arange(channels // 2))
    t = np.arange(length)[:, None] * inv[None, :]
    return np.concatenate([np.sin(t), np.cos(t)], axis=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--d-model", type=int, default=D)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--heads", type=int, default=HEADS)
    ap.add_argument("--ffn", type=int, default=FFN)
    ap.add_argument("--positions", type=int, default=POSITIONS)
    ap.add_argument("--stack", type=int, default=STACK)
    args = ap.parse_args()
    write(args.out, args.d_model, args.layers, args.heads, args.ffn, args.positions, args.stack)


def write(out, D, LAYERS, HEADS, FFN, POSITIONS, STACK):
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(397)

    def w(*shape, scale=None):
        if scale is None:
            scale = 1.0 / np.sqrt(int(np.prod(shape[1:])))
        return rng.standard_normal(shape) * scale

    with open(os.path.join(SRC, "config.json")) as f:
        cfg = json.load(f)
    dt = cfg["text_config"]["hidden_size"]
    t = {}
    p = "audio_tower."
    t[p + "conv1.weight"] = w(D, MELS, 3)
    t[p + "conv1.bias"] = w(D, scale=0.02)
    t[p + "conv2.weight"] = w(D, D, 3)
    t[p + "conv2.bias"] = w(D, scale=0.02)
    t[p + "embed_positions.weight"] = sinusoids(POSITIONS, D)
    for i in range(LAYERS):
        q = f"{p}layers.{i}."
        for n in ("q", "k", "v", "out"):
            t[q + f"self_attn.{n}_proj.weight"] = w(D, D)
            if n != "k":
                t[q + f"self_attn.{n}_proj.bias"] = w(D, scale=0.02)
        for n in ("self_attn_layer_norm", "final_layer_norm"):
            t[q + n + ".weight"] = 1 + w(D, scale=0.05)
            t[q + n + ".bias"] = w(D, scale=0.02)
        t[q + "fc1.weight"] = w(FFN, D)
        t[q + "fc1.bias"] = w(FFN, scale=0.02)
        t[q + "fc2.weight"] = w(D, FFN)
        t[q + "fc2.bias"] = w(D, scale=0.02)
    t[p + "layer_norm.weight"] = 1 + w(D, scale=0.05)
    t[p + "layer_norm.bias"] = w(D, scale=0.02)
    # Rows of about unit scale: large enough that the answers depend on
    # the clip (the tests check that they do).
    t["audio_projector.linear_1.weight"] = w(HIDDEN, D * STACK)
    t["audio_projector.linear_1.bias"] = w(HIDDEN, scale=0.02)
    t["audio_projector.linear_2.weight"] = w(dt, HIDDEN, scale=2.0 / np.sqrt(HIDDEN))
    t["audio_projector.linear_2.bias"] = w(dt, scale=0.02)
    write_safetensors(os.path.join(out, "audio.safetensors"), t)

    link = os.path.join(out, "text.safetensors")
    if os.path.lexists(link):
        os.remove(link)
    if os.path.abspath(out) == os.path.abspath(OUT):
        os.symlink("../../../assets/tiny-llava-shapes/model.safetensors", link)
    else:
        os.symlink(os.path.abspath(os.path.join(SRC, "model.safetensors")), link)
    with open(link, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        text_names = [k for k in json.loads(f.read(n)) if k != "__metadata__"]
    weight_map = {k: "text.safetensors" for k in text_names}
    weight_map.update({k: "audio.safetensors" for k in t})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)

    cfg["audio_config"] = {
        "model_type": "whisper", "d_model": D, "encoder_layers": LAYERS,
        "encoder_attention_heads": HEADS, "encoder_ffn_dim": FFN, "num_mel_bins": MELS,
        "max_source_positions": POSITIONS, "activation_function": "gelu",
        "scale_embedding": False,
    }
    cfg.update({"audio_token_index": AUDIO_TOKEN, "audio_stack_factor": STACK,
                "audio_projector_hidden": HIDDEN})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)

    with open(os.path.join(SRC, "tokenizer.json")) as f:
        tok = json.load(f)
    tok["added_tokens"].append({"id": AUDIO_TOKEN, "content": "<audio>", "single_word": False,
                                "lstrip": False, "rstrip": False, "normalized": False,
                                "special": True})
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tok, f, indent=1, ensure_ascii=False)
    with open(os.path.join(SRC, "tokenizer_config.json")) as f:
        tc = json.load(f)
    tc["added_tokens_decoder"][str(AUDIO_TOKEN)] = {
        "content": "<audio>", "special": True, "normalized": False, "lstrip": False,
        "rstrip": False, "single_word": False}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=2)
    for name in ("preprocessor_config.json", "generation_config.json"):
        shutil.copyfile(os.path.join(SRC, name), os.path.join(out, name))
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("Made by tools/make_hearing_fixture.py (see its docstring); do not edit.\n")


if __name__ == "__main__":
    main()
