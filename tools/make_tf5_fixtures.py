#!/usr/bin/env python3
"""LLaMA checkpoints saved by transformers 5 (which writes `rope_parameters`
instead of `rope_theta` / `rope_scaling`) and transformers' own logits, for
tests/models/tf5_fixture_test.cpp. Outputs under tests/fixtures/tf5/<name>/.

Not run by CI; the outputs are committed. PyPI's torch and transformers 5
(torch's CUDA libraries must be loadable even on a CPU-only machine):

    python3 -m pip install --target /tmp/pydeps-tf5 --no-deps torch transformers \\
        tokenizers safetensors huggingface_hub regex pyyaml tqdm packaging numpy \\
        filelock sympy mpmath networkx jinja2 MarkupSafe typing_extensions fsspec
    python3 -m pip install --target /tmp/pydeps-tf5b httpx2 click typer kernels
    (plus nvidia-cufile, nvidia-nccl-cu13, nvidia-cusparselt-cu13 and
    nvidia-nvshmem-cu13 in LD_LIBRARY_PATH where /usr/local/cuda lacks them)
    PYTHONPATH=/tmp/pydeps-tf5:/tmp/pydeps-tf5b python3 tools/make_tf5_fixtures.py

Checkpoints (float32, linear weights N(0, 0.08), norm weights 1 + 0.1 N(0, 1)):
  theta   hidden 96, 4 heads x 24, 2 KV heads, FFN 160, vocab 211, 2 layers,
          rope_parameters {rope_type default, rope_theta 20000} (not 10000:
          a reader that falls back to the old default is caught)
  llama3  hidden 128, 4 heads x 32, 1 KV head, FFN 224, vocab 193, 2 layers,
          tied embeddings, rope_parameters {rope_type llama3, rope_theta 5e5,
          factor 8, low 1, high 4, original_max_position_embeddings 16}
  llava   LlavaForConditionalGeneration (transformers 5 names its tensors
          vision_tower.embeddings.*, no vision_model. level, and
          language_model.model.*): CLIP tower hidden 32, 2 layers, 28x28
          images in 14-pixel patches (4 image tokens), text LLaMA hidden 64,
          FFN 96, 2 layers, vocab 300, image token 299.
  llava_siglip  LlavaForConditionalGeneration in LLaVA-Interleave's layout:
          SigLIP tower (hidden 32, 2 layers, 30-pixel images in 14-pixel
          patches: 4 image tokens, the last 2 pixels dropped), LLaVA
          projector, Qwen2 text (hidden 64, 2 layers, vocab 300); a
          SiglipImageProcessor config and a 50x37 random image.png with the
          processor's pixel_values.
reference.bin (TRPF): tokens.<i> i64 [len] and logits.<i> f32 [len, vocab],
i = 0, 1 (lengths 9 and 40), transformers' forward in float64; for llava:
pixel_values f32 [1, 3, 28, 28], image_features f32 [4, 64], ids i64 (one
image token), expanded i64 (what transformers was fed) and logits f32.
"""
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "tf5")

SPECS = {
    "theta": dict(vocab_size=211, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
                  tie_word_embeddings=False),
    "llama3": dict(vocab_size=193, hidden_size=128, intermediate_size=224, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16},
                   tie_word_embeddings=True),
}


def main():
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import make_fixtures
    print("transformers", transformers.__version__, "torch", torch.__version__)
    if "--siglip" in sys.argv:  # only the SigLIP LLaVA
        make_llava_siglip(torch, make_fixtures)
        return
    for name, spec in SPECS.items():
        torch.manual_seed(5)
        cfg = LlamaConfig(bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5, **spec)
        model = LlamaForCausalLM(cfg)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("norm.weight"):
                    p.copy_(1 + 0.1 * torch.randn_like(p))
                else:
                    p.copy_(0.08 * torch.randn_like(p))
        out = os.path.join(OUT, name)
        os.makedirs(out, exist_ok=True)
        model.save_pretrained(out)
        saved = json.load(open(os.path.join(out, "config.json")))
        assert "rope_parameters" in saved and "rope_theta" not in saved, saved
        model = model.double().eval()
        rng = np.random.default_rng(7)
        arrays = []
        for i, n in enumerate([9, 40]):
            toks = [1] + [int(t) for t in rng.integers(3, spec["vocab_size"], n - 1)]
            with torch.no_grad():
                logits = model(torch.tensor([toks])).logits[0].numpy()
            arrays += [(f"tokens.{i}", np.array(toks, dtype=np.int64)),
                       (f"logits.{i}", logits.astype(np.float32))]
        make_fixtures.OUT_DIR = out
        make_fixtures.write_fixture("reference.bin", arrays)
        for extra in ("generation_config.json",):
            p = os.path.join(out, extra)
            if os.path.exists(p):
                os.remove(p)
    make_llava(torch, make_fixtures)
    make_llava_siglip(torch, make_fixtures)


def make_llava_siglip(torch, make_fixtures):
    """LLaVA-Interleave's layout (llava-hf/llava-interleave-qwen-*-hf): a SigLIP
    tower, the LLaVA projector and a Qwen2 text model, every tower row kept
    ("full") from the last layer (-1). The image is 30 pixels a side in
    14-pixel patches: SigLIP's convolution drops the last 2 (as 384 / 14 does)."""
    from PIL import Image
    from transformers import LlavaConfig, LlavaForConditionalGeneration, Qwen2Config
    from transformers import SiglipImageProcessor, SiglipVisionConfig
    torch.manual_seed(11)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, image_size=30, patch_size=14)
    text = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, bos_token_id=1,
                       eos_token_id=2, rms_norm_eps=1e-6, max_position_embeddings=128,
                       tie_word_embeddings=False)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=299,
                      image_seq_length=4, vision_feature_layer=-1,
                      vision_feature_select_strategy="full")
    model = LlavaForConditionalGeneration(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname and pname.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    out = os.path.join(OUT, "llava_siglip")
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(out, extra)):
            os.remove(os.path.join(out, extra))
    proc = SiglipImageProcessor(size={"height": 30, "width": 30})
    proc.save_pretrained(out)
    rng = np.random.default_rng(12)
    img = Image.fromarray(rng.integers(0, 256, (37, 50, 3), dtype=np.uint8), "RGB")
    img.save(os.path.join(out, "image.png"))
    pixels = proc(images=img, return_tensors="pt")["pixel_values"].double()
    assert tuple(pixels.shape) == (1, 3, 30, 30), pixels.shape
    model = model.double().eval()
    ids = [1, 5, 299, 7, 8, 9, 10]
    expanded = [t for i in ids for t in ([299] * 4 if i == 299 else [i])]
    with torch.no_grad():
        feats = model.model.get_image_features(pixel_values=pixels)
        if hasattr(feats, "pooler_output"):
            feats = feats.pooler_output
        if isinstance(feats, (list, tuple)):
            feats = torch.cat(list(feats), 0)
        feats = feats.reshape(-1, 64)
        logits = model(input_ids=torch.tensor([expanded]), pixel_values=pixels).logits[0]
    make_fixtures.OUT_DIR = out
    make_fixtures.write_fixture("reference.bin", [
        ("pixel_values", pixels.numpy().astype(np.float32)),
        ("image_features", feats.numpy().astype(np.float32)),
        ("ids", np.array(ids, dtype=np.int64)),
        ("expanded", np.array(expanded, dtype=np.int64)),
        ("logits", logits.numpy().astype(np.float32))])


def make_llava(torch, make_fixtures):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig
    from transformers import LlavaForConditionalGeneration
    torch.manual_seed(9)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, image_size=28, patch_size=14,
                              projection_dim=16)
    text = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, bos_token_id=1,
                       eos_token_id=2, rms_norm_eps=1e-5, max_position_embeddings=128)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=299,
                      image_seq_length=4)
    model = LlavaForConditionalGeneration(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname and pname.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.02 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    out = os.path.join(OUT, "llava")
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(out, extra)):
            os.remove(os.path.join(out, extra))
    from safetensors import safe_open
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(k.startswith("vision_tower.embeddings.") for k in keys), keys[:5]
    model = model.double().eval()
    pixels = torch.randn(1, 3, 28, 28, dtype=torch.float64)
    ids = [1, 5, 299, 7, 8, 9, 10]
    expanded = [t for i in ids for t in ([299] * 4 if i == 299 else [i])]
    with torch.no_grad():
        feats = model.model.get_image_features(pixel_values=pixels)
        if hasattr(feats, "pooler_output"):  # transformers 5 returns an output object
            feats = feats.pooler_output
        if isinstance(feats, (list, tuple)):
            feats = torch.cat(list(feats), 0)
        feats = feats.reshape(-1, 64)
        logits = model(input_ids=torch.tensor([expanded]), pixel_values=pixels).logits[0]
    make_fixtures.OUT_DIR = out
    make_fixtures.write_fixture("reference.bin", [
        ("pixel_values", pixels.numpy().astype(np.float32)),
        ("image_features", feats.numpy().astype(np.float32)),
        ("ids", np.array(ids, dtype=np.int64)),
        ("expanded", np.array(expanded, dtype=np.int64)),
        ("logits", logits.numpy().astype(np.float32))])


if __name__ == "__main__":
    main()
