#!/usr/bin/env python3
"""A LLaVA that also hears, and transformers' logits for it, for troupe's
fidelity test (tests/models/llava_audio_fixture_test.cpp), under
tests/fixtures/llava_audio/odd/.

Not run by CI; the outputs are committed. Run from the repository root
after tools/make_audio_fixtures.py and tools/make_whisper_fixtures.py:

    PYTHONPATH=/tmp/pydeps-audio:/tmp/pydeps-torch python3 tools/make_llava_audio_fixtures.py

The model joins two committed random checkpoints and a random projector:
- tests/fixtures/llava/odd (a LlavaForConditionalGeneration: CLIP tower,
  projector, 3-layer LLaMA of hidden 48, vocabulary 300, image token 297);
- the encoder of tests/fixtures/whisper/odd (d_model 60, 48 frames a
  window) as `audio_tower.*`;
- `audio_projector.linear_{1,2}` (stack 3: 180 -> 40 -> 48, with biases),
  drawn here.
config.json is the LLaVA one plus troupe's audio keys: audio_config (the
Whisper config), audio_token_index 298, audio_stack_factor 3,
audio_projector_hidden 40.

The reference (reference.safetensors, float64 computed, stored f32):
    ids       [9]      the prompt: BOS, text, <image>, text, <audio>, text, <audio>, text
    pixels    [1, 3, 30, 30]  the image (random)
    clip_a    [17600]  1.1 s of speech16k (three windows: 48, 48 and 14 frames)
    clip_b    [3000]   0.19 s of it, from sample 20000 (one window of 18 frames)
    expanded  [53]     the ids with each image token repeated 25 times and each
                       audio token replaced by its clip's tokens (19 and 3)
                       of the image token
    logits    [53, 300]  LlavaForConditionalGeneration(inputs_embeds=...) where
                       the embeddings at the image's positions are
                       model.get_image_features(pixels) and at each clip's
                       the Whisper modules' output per window (features from
                       WhisperFeatureExtractor's NumPy path on the window's
                       own samples), stacked by 3 (zero-padded) and projected
"""

import json
import os

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from transformers import (LlavaForConditionalGeneration, WhisperFeatureExtractor,
                          WhisperForConditionalGeneration)

OUT = "tests/fixtures/llava_audio/odd"
STACK, HIDDEN = 3, 40
IMAGE, AUDIO = 297, 298


def main():
    os.makedirs(OUT, exist_ok=True)
    llava = LlavaForConditionalGeneration.from_pretrained("tests/fixtures/llava/odd").double().eval()
    whisper = WhisperForConditionalGeneration.from_pretrained("tests/fixtures/whisper/odd")
    enc = whisper.model.encoder.double().eval()

    g = torch.Generator().manual_seed(298)
    dt = llava.config.text_config.hidden_size
    w1 = (0.1 * torch.randn(HIDDEN, 60 * STACK, generator=g)).float()
    b1 = (0.1 * torch.randn(HIDDEN, generator=g)).float()
    w2 = (0.1 * torch.randn(dt, HIDDEN, generator=g)).float()
    b2 = (0.1 * torch.randn(dt, generator=g)).float()

    tensors = dict(load_file("tests/fixtures/llava/odd/model.safetensors"))
    for k, v in load_file("tests/fixtures/whisper/odd/model.safetensors").items():
        if k.startswith("model.encoder."):
            tensors["audio_tower." + k[len("model.encoder."):]] = v
    tensors.update({"audio_projector.linear_1.weight": w1.numpy(),
                    "audio_projector.linear_1.bias": b1.numpy(),
                    "audio_projector.linear_2.weight": w2.numpy(),
                    "audio_projector.linear_2.bias": b2.numpy()})
    save_file(tensors, f"{OUT}/model.safetensors", metadata={"format": "pt"})
    with open("tests/fixtures/llava/odd/config.json") as f:
        cfg = json.load(f)
    with open("tests/fixtures/whisper/odd/config.json") as f:
        cfg["audio_config"] = json.load(f)
    cfg.update({"audio_token_index": AUDIO, "audio_stack_factor": STACK,
                "audio_projector_hidden": HIDDEN})
    with open(f"{OUT}/config.json", "w") as f:
        json.dump(cfg, f, indent=1)

    speech = load_file("tests/fixtures/audio/expected.safetensors")["speech16k"]
    clip_a, clip_b = speech[:17600].copy(), speech[20000:23000].copy()
    fe = WhisperFeatureExtractor(feature_size=80)
    window = 48 * 160

    def audio_rows(clip):
        out = []
        for at in range(0, clip.size, window):
            piece = clip[at:at + window]
            if piece.size // 160 < 1:
                break
            feats = fe._np_extract_fbank_features(piece[None, :].astype(np.float64), "cpu")
            x = torch.from_numpy(feats.astype(np.float32)).double()  # [1, 80, frames]
            with torch.no_grad():
                x = torch.nn.functional.gelu(enc.conv1(x))
                x = torch.nn.functional.gelu(enc.conv2(x)).permute(0, 2, 1)
                x = x + enc.embed_positions.weight[: x.shape[1]]
                for layer in enc.layers:
                    x = layer(x, attention_mask=None, layer_head_mask=None)[0]
                x = enc.layer_norm(x)[0]  # [rows, 60]
                pad = (-x.shape[0]) % STACK
                x = torch.cat([x, torch.zeros(pad, 60, dtype=x.dtype)]).reshape(-1, 60 * STACK)
                h = torch.nn.functional.gelu(x @ w1.double().T + b1.double())
                out.append(h @ w2.double().T + b2.double())
        return torch.cat(out)

    a_rows, b_rows = audio_rows(clip_a), audio_rows(clip_b)
    print("audio tokens", a_rows.shape[0], b_rows.shape[0])
    pixels = torch.from_numpy(np.random.default_rng(30).standard_normal((1, 3, 30, 30))
                              .astype(np.float32))
    with torch.no_grad():
        img = llava.get_image_features(pixel_values=pixels.double(), vision_feature_layer=-2,
                                       vision_feature_select_strategy="default")
        img = (img[0] if isinstance(img, (list, tuple)) else img).reshape(-1, dt)
    ids = [1, 5, IMAGE, 7, AUDIO, 9, 10, AUDIO, 11]
    expanded, media = [], []
    clips = iter([a_rows, b_rows])
    for t in ids:
        if t == IMAGE:
            expanded += [IMAGE] * img.shape[0]
            media.append(img)
        elif t == AUDIO:
            rows = next(clips)
            expanded += [IMAGE] * rows.shape[0]
            media.append(rows)
        else:
            expanded.append(t)
    media = torch.cat(media)
    with torch.no_grad():
        emb = llava.get_input_embeddings()(torch.tensor([expanded]))
        mask = torch.tensor(expanded) == IMAGE
        emb[0, mask] = media
        logits = llava(inputs_embeds=emb).logits[0]
    print("expanded", len(expanded), "logits", tuple(logits.shape), "range",
          float(logits.min()), float(logits.max()))
    save_file({"ids": np.array(ids, np.float32), "pixels": pixels.numpy(),
               "clip_a": clip_a, "clip_b": clip_b,
               "expanded": np.array(expanded, np.float32),
               "logits": logits.float().numpy()}, f"{OUT}/reference.safetensors")
    with open(os.path.dirname(OUT) + "/README.md", "w") as f:
        f.write("Made by tools/make_llava_audio_fixtures.py (see its docstring); do not edit.\n")


if __name__ == "__main__":
    main()
