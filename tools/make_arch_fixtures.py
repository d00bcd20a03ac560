#!/usr/bin/env python3
"""Random-weight checkpoints of the decoder architectures troupe runs besides
LLaMA (Qwen2, Mistral, Phi-3, Gemma 2, Gemma 3 text), saved by transformers 5,
with transformers' own float64 logits; and, for the architectures llama.cpp
writes under their own GGUF names (qwen2, phi3, gemma2), the same weights as
an f32 GGUF laid out as llama.cpp's converter lays them out, checked against
llama.cpp's logits. For tests/models/arch_fixture_test.cpp. Outputs under
tests/fixtures/arch/<name>/.

Not run by CI; the outputs are committed. Two stages, two environments (see
tools/make_tf5_fixtures.py for the transformers 5 install):

    PYTHONPATH=/tmp/pydeps-tf5:/tmp/pydeps-tf5b:/tmp/pydeps-gguf \\
        python3 tools/make_arch_fixtures.py            # HF folders, GGUF, reference.bin
    PYTHONPATH=/tmp/pydeps-llamacpp:/tmp/pydeps-gguf \\
        python3 tools/make_arch_fixtures.py --llamacpp # llama.cpp's logits on each GGUF

Weights: linear N(0, 0.08), biases N(0, 0.1), norm weights (1 + 0.1 N(0, 1)),
or 0.1 N(0, 1) where the family's RMSNorm multiplies by (1 + w) (Gemma).
Each reference.bin (TRPF) holds tokens.<i> i64 and logits.<i> f32 [len, vocab]
for i = 0, 1 (lengths 9 and 40: the second crosses every sliding window below).
llamacpp.bin holds llama.cpp's logits.<i> on model.gguf for the same tokens.

  qwen2    Qwen2ForCausalLM: q/k/v biases, tied embeddings, rope_theta 1e6,
           hidden 96, 4 heads x 24, 2 KV heads, FFN 160, 2 layers, vocab 300.
  phi3_longrope  Phi-3 with Phi-3.5's long-context RoPE (longrope: made-up
           long and short factors, original 512, max 4096): the sequences are
           within the original length, so transformers uses the short ones,
           and so does llama.cpp (its context, 256, is within it too).
  qwen2_yarn  the same shape with Qwen2.5's long-context RoPE: yarn, factor 4,
           original_max_position_embeddings 64, rope_theta 1e4 (so that the
           ramp between interpolated and extrapolated frequencies spans dims).
  mistral  MistralForCausalLM: sliding window 16 on every layer, hidden 64,
           4 heads x 16, 1 KV head, FFN 128, 2 layers, vocab 300 (llama.cpp
           writes Mistral as "llama" and drops the window: no GGUF here).
  phi3     Phi3ForCausalLM: fused qkv_proj and gate_up_proj, hidden 96, 4 heads
           x 24, 2 KV heads, FFN 128, 2 layers, vocab 300, no window.
  gemma2   Gemma2ForCausalLM: attention soft-capping 2.0 and final 3.0 (small,
           so that they bite on random weights), sliding window 12 on even
           layers, sandwich norms, GeGLU, scaled embeddings, hidden 64, 2
           heads x 32, 1 KV head, FFN 128, 4 layers, vocab 300.
  gemma3   Gemma3ForCausalLM (text): query-key norms, query_pre_attn_scalar 48
           (not head_dim: the scale is read), window 12 on 5 of 6 layers with
           RoPE bases 1e4 (local) and 1e6 (global) as per-layer-type
           rope_parameters, hidden 64, 2 heads x 32, 1 KV head, FFN 128,
           6 layers, vocab 300.
"""
import json
import math
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "arch")
LENGTHS = [9, 40]
GGUF_ARCHS = {"qwen2": "qwen2", "phi3": "phi3", "gemma2": "gemma2", "qwen2_yarn": "qwen2",
              "phi3_longrope": "phi3"}
# Phi-3.5's long-context RoPE factors, made up here (12 = head_dim / 2).
LONG = [1.0, 1.1, 1.3, 1.7, 2.4, 3.5, 5.0, 7.2, 10.0, 13.5, 17.0, 20.0]
SHORT = [1.0, 1.0, 1.02, 1.05, 1.1, 1.2, 1.35, 1.5, 1.7, 1.9, 2.1, 2.3]


def specs():
    from transformers import (Gemma2Config, Gemma3TextConfig, MistralConfig, Phi3Config,
                              Qwen2Config)
    common = dict(vocab_size=300, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  max_position_embeddings=128)
    return {
        "qwen2": (Qwen2Config(hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                              tie_word_embeddings=True, rms_norm_eps=1e-6, **common),
                  "Qwen2ForCausalLM"),
        "mistral": (MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                  sliding_window=16, rms_norm_eps=1e-5,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                  tie_word_embeddings=False, **common),
                    "MistralForCausalLM"),
        "phi3": (Phi3Config(hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
                            rms_norm_eps=1e-5, tie_word_embeddings=False,
                            original_max_position_embeddings=128, **common),
                 "Phi3ForCausalLM"),
        "gemma2": (Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                query_pre_attn_scalar=32, sliding_window=12,
                                attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                rms_norm_eps=1e-6, **common),
                   "Gemma2ForCausalLM"),
        "gemma3": (Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                    query_pre_attn_scalar=48, sliding_window=12,
                                    rms_norm_eps=1e-6, **common),
                   "Gemma3ForCausalLM"),
        "qwen2_yarn": (Qwen2Config(hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                                    "factor": 4.0,
                                                    "original_max_position_embeddings": 64},
                                   tie_word_embeddings=True, rms_norm_eps=1e-6,
                                   **dict(common, max_position_embeddings=256)),
                       "Qwen2ForCausalLM"),
        "phi3_longrope": (Phi3Config(hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     sliding_window=None, rms_norm_eps=1e-5,
                                     tie_word_embeddings=False,
                                     original_max_position_embeddings=512,
                                     rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                      "long_factor": LONG, "short_factor": SHORT,
                                                      "original_max_position_embeddings": 512},
                                     **dict(common, max_position_embeddings=4096)),
                          "Phi3ForCausalLM"),
    }


def tokens_for(vocab, seed):
    rng = np.random.default_rng(seed)
    return [[1] + [int(t) for t in rng.integers(3, vocab, n - 1)] for n in LENGTHS]


def spm_vocab(V):
    """A SentencePiece-style vocabulary of V entries llama.cpp loads."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581w{i}" for i in range(V - len(tokens))]
    types = [3] * len(specials) + [6] * 256 + [1] * (V - len(specials) - 256)
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(V - len(specials) - 256)]
    return tokens, scores, types


def write_gguf(name, cfg, sd, path):
    """The state dict `sd` (numpy f32, HF names) as llama.cpp's converter
    writes the architecture (convert_hf_to_gguf.py: names from gguf-py's
    tensor map, Gemma's norm weights + 1, Phi-3's fused tensors kept)."""
    import gguf
    arch = GGUF_ARCHS[name]
    w = gguf.GGUFWriter(path, arch)
    H, NH, NKV = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or H // NH
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(H)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    rp = cfg.rope_parameters
    if rp.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
    if rp.get("rope_type") == "longrope":  # llama.cpp's converter: factor tensors, attn factor
        orig = rp["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_tensor("rope_factors_long.weight", np.array(rp["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rp["short_factor"], dtype=np.float32))
    if name.startswith("phi3"):
        w.add_rope_dimension_count(D)
        w.add_sliding_window(0)
    if name == "gemma2":
        w.add_key_length(D)
        w.add_value_length(D)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    tokens, scores, types = spm_vocab(cfg.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    tmap = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    for hf, arr in sd.items():
        if name == "gemma2" and hf == "lm_head.weight":
            continue  # tied
        if name == "gemma2" and hf.endswith("norm.weight"):
            arr = arr + 1
        base, suffix = hf.rsplit(".", 1)
        mapped = tmap.get_name(base)
        if mapped is None:
            raise KeyError(f"{hf}: no GGUF name")
        w.add_tensor(f"{mapped}.{suffix}", np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_hf():
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import make_fixtures
    print("transformers", transformers.__version__, "torch", torch.__version__)
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    for seed, (name, (cfg, arch)) in enumerate(specs().items()):
        if only and name not in only:
            continue
        torch.manual_seed(100 + seed)
        cfg.architectures = [arch]
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        gemma = name.startswith("gemma")
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("norm.weight"):
                    p.copy_((0 if gemma else 1) + 0.1 * torch.randn_like(p))
                elif pname.endswith("bias"):
                    p.copy_(0.1 * torch.randn_like(p))
                else:
                    p.copy_(0.08 * torch.randn_like(p))
        out = os.path.join(OUT, name)
        os.makedirs(out, exist_ok=True)
        model.save_pretrained(out)
        gen = os.path.join(out, "generation_config.json")
        if os.path.exists(gen):
            os.remove(gen)
        saved = json.load(open(os.path.join(out, "config.json")))
        print(name, "config:", {k: saved.get(k) for k in ("architectures", "layer_types",
                                                           "rope_parameters", "sliding_window")})
        model = model.double().eval()
        arrays = []
        for i, toks in enumerate(tokens_for(cfg.vocab_size, 7 + seed)):
            with torch.no_grad():
                logits = model(torch.tensor([toks])).logits[0].numpy()
            arrays += [(f"tokens.{i}", np.array(toks, dtype=np.int64)),
                       (f"logits.{i}", logits.astype(np.float32))]
        make_fixtures.OUT_DIR = out
        make_fixtures.write_fixture("reference.bin", arrays)
        if name in GGUF_ARCHS:
            sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
            write_gguf(name, cfg, sd, os.path.join(out, "model.gguf"))
            print("wrote", os.path.join(out, "model.gguf"))


def read_trpf(path):
    import struct
    dt = {0: np.float32, 1: np.uint8, 2: np.int32, 3: np.int64}
    out = {}
    with open(path, "rb") as f:
        assert f.read(4) == b"TRPF"
        _, n = struct.unpack("<II", f.read(8))
        for _ in range(n):
            (klen,) = struct.unpack("<I", f.read(4))
            key = f.read(klen).decode()
            code, nd = struct.unpack("<II", f.read(8))
            shape = struct.unpack(f"<{nd}q", f.read(8 * nd))
            t = np.dtype(dt[code])
            out[key] = np.frombuffer(f.read(int(np.prod(shape)) * t.itemsize), t).reshape(shape)
    return out


def run_llamacpp():
    from llama_cpp import Llama
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import make_fixtures
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    for name in GGUF_ARCHS:
        if only and name not in only:
            continue
        d = os.path.join(OUT, name)
        ref = read_trpf(os.path.join(d, "reference.bin"))
        arrays = []
        for i in range(len(LENGTHS)):
            toks = [int(t) for t in ref[f"tokens.{i}"]]
            llm = Llama(model_path=os.path.join(d, "model.gguf"), n_ctx=64, n_batch=64,
                        n_ubatch=64, logits_all=True, n_threads=2, verbose=False, type_k=0,
                        type_v=0, flash_attn=False)
            llm.reset()
            llm.eval(toks)
            got = np.array(llm.scores[: len(toks)], dtype=np.float32)
            del llm
            want = ref[f"logits.{i}"].astype(np.float64)
            err = (np.abs(got - want).max(1) / (want.max(1) - want.min(1))).max()
            top1 = int((got.argmax(1) == want.argmax(1)).sum())
            print(f"{name} seq {i}: llama.cpp vs transformers max |diff| {err:.2e} of the range,"
                  f" top-1 {top1}/{len(toks)}")
            arrays.append((f"logits.{i}", got))
        make_fixtures.OUT_DIR = d
        make_fixtures.write_fixture("llamacpp.bin", arrays)


if __name__ == "__main__":
    if "--llamacpp" in sys.argv:
        run_llamacpp()
    else:
        make_hf()
