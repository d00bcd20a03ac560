#!/usr/bin/env python3
"""A random, odd-shaped Whisper checkpoint and transformers' encoder outputs
for troupe's fidelity test (tests/models/whisper_test.cpp), under
tests/fixtures/whisper/.

Not run by CI; the outputs are committed. Run from the repository root
after tools/make_audio_fixtures.py (its features are the input here):

    PYTHONPATH=/tmp/pydeps-audio:/tmp/pydeps-torch python3 tools/make_whisper_fixtures.py

Written:
- odd/: WhisperForConditionalGeneration.save_pretrained (safetensors,
  config.json): d_model 60, 3 heads of 20, FFN 88, 2 encoder layers, 80 mel
  bins, max_source_positions 24 (so 48 input frames), a 1-layer decoder
  troupe does not read. Weights are drawn wider than transformers' init
  (std 0.2 for matrices, biases and LayerNorms away from 0 and 1) so that
  every part of the encoder moves the output.
- odd/reference.safetensors:
    features        [2, 80, 48]  f32  frames 0-47 and 100-147 of the 80-bin
                                      features of speech16k.wav (chunk 5 s)
    encoder         [2, 24, 60]  f32  model.model.encoder(features) in float64
    short_features  [1, 80, 21]  f32  frames 200-220
    short_encoder   [1, 11, 60]  f32  the encoder's own modules on 21 frames
                                      (WhisperEncoder.forward insists on 48),
                                      positions 0-10, in float64
- projector/model.safetensors: audio_projector.linear_{1,2} (weights and
  biases) for stack 3, 60 -> 44 -> 36, and projector/reference.safetensors:
    rows [1, 11, 60] (short_encoder), out [1, 4, 36]: stacking (the last
    group padded with zeros), linear_1, GELU (erf), linear_2, in float64.
"""

import json
import os

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from transformers import WhisperConfig, WhisperForConditionalGeneration

OUT = "tests/fixtures/whisper"


def main():
    torch.manual_seed(29)
    cfg = WhisperConfig(
        vocab_size=101, num_mel_bins=80, d_model=60, encoder_layers=2, encoder_attention_heads=3,
        encoder_ffn_dim=88, decoder_layers=1, decoder_attention_heads=3, decoder_ffn_dim=32,
        max_source_positions=24, max_target_positions=16, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, suppress_tokens=[], begin_suppress_tokens=[])
    model = WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.model.encoder.named_parameters():
            if name == "embed_positions.weight":
                continue  # the sinusoids Whisper starts from, plus a little noise
            if "layer_norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
        pos = model.model.encoder.embed_positions.weight
        pos.add_(0.05 * torch.randn_like(pos))
    os.makedirs(f"{OUT}/odd", exist_ok=True)
    model.save_pretrained(f"{OUT}/odd", safe_serialization=True)

    audio = load_file("tests/fixtures/audio/expected.safetensors")
    mel = audio["mel80_chunk5"]  # [80, 500]
    feats = np.stack([mel[:, 0:48], mel[:, 100:148]]).astype(np.float32)
    short = mel[None, :, 200:221].astype(np.float32)

    enc = model.model.encoder.double()
    with torch.no_grad():
        full = enc(torch.from_numpy(feats).double()).last_hidden_state.numpy()
        # The same modules, by hand, on 21 frames: the positions of its 11 rows.
        x = torch.from_numpy(short).double()
        x = torch.nn.functional.gelu(enc.conv1(x))
        x = torch.nn.functional.gelu(enc.conv2(x)).permute(0, 2, 1)
        x = x + enc.embed_positions.weight[: x.shape[1]]
        for layer in enc.layers:
            x = layer(x, attention_mask=None, layer_head_mask=None)[0]
        short_out = enc.layer_norm(x).numpy()
    save_file({"features": feats, "encoder": full.astype(np.float32),
               "short_features": np.ascontiguousarray(short),
               "short_encoder": short_out.astype(np.float32)},
              f"{OUT}/odd/reference.safetensors")
    print("encoder", full.shape, "range", full.min(), full.max())
    print("short", short_out.shape, "range", short_out.min(), short_out.max())

    # The projector: stack 3 rows (11 -> 4 groups, the last padded), MLP.
    g = torch.Generator().manual_seed(7)
    w1 = 0.1 * torch.randn(44, 180, generator=g, dtype=torch.float64)
    b1 = 0.1 * torch.randn(44, generator=g, dtype=torch.float64)
    w2 = 0.1 * torch.randn(36, 44, generator=g, dtype=torch.float64)
    b2 = 0.1 * torch.randn(36, generator=g, dtype=torch.float64)
    w1, b1, w2, b2 = (t.float().double() for t in (w1, b1, w2, b2))  # what the f32 file holds
    rows = torch.from_numpy(short_out.astype(np.float32)).double()  # [1, 11, 60]
    padded = torch.cat([rows, torch.zeros(1, 1, 60, dtype=torch.float64)], dim=1)
    stacked = padded.reshape(1, 4, 180)
    out = torch.nn.functional.gelu(stacked @ w1.T + b1) @ w2.T + b2
    os.makedirs(f"{OUT}/projector", exist_ok=True)
    save_file({"audio_projector.linear_1.weight": w1.float().numpy(),
               "audio_projector.linear_1.bias": b1.float().numpy(),
               "audio_projector.linear_2.weight": w2.float().numpy(),
               "audio_projector.linear_2.bias": b2.float().numpy()},
              f"{OUT}/projector/model.safetensors")
    save_file({"rows": rows.float().numpy(), "out": out.float().numpy()},
              f"{OUT}/projector/reference.safetensors")
    with open(f"{OUT}/README.md", "w") as f:
        f.write("Made by tools/make_whisper_fixtures.py (see its docstring); do not edit.\n")
    print(json.dumps({"written": sorted(os.listdir(f"{OUT}/odd"))}))


if __name__ == "__main__":
    main()
