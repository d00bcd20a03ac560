#!/usr/bin/env python3
"""GGUF files in the formats people download (K-quants, the legacy Q4_1 /
Q5_0 / Q5_1, IQ4_NL / IQ4_XS and llama.cpp's per-tensor mixes), made by
llama.cpp's own quantizer, with llama.cpp's logits and independently
dequantized weights, for troupe's fidelity tests (tests/models/
gguf_quant_fixture_test.cpp). Outputs under tests/fixtures/gguf_quants/.

Not run by CI; the outputs are committed. Run from the repository root after
building troupe (build/cli/troupe):

    python3 -m pip install --target /tmp/pydeps-llamacpp --no-deps \\
        llama-cpp-python==0.3.36 diskcache numpy
    python3 -m pip install --target /tmp/pydeps-gguf gguf==0.19.0 numpy
    PYTHONPATH=/tmp/pydeps-llamacpp:/tmp/pydeps-gguf python3 tools/make_gguf_quant_fixtures.py

Inputs (f32, random weights, not committed):
  kq:     `troupe write-model` LLaMA, hidden 256, FFN 256, 4 heads x 64,
          2 KV heads, 2 layers, vocab 512: every row a multiple of 256, so
          the K-quant ftypes use K-quants throughout.
  llama3: tests/fixtures/llama/llama3/model-f32.gguf (hidden 160, FFN 288):
          no row is a multiple of 256, so llama.cpp's Q4_K_M falls back per
          tensor (to Q5_0 / Q8_0), as it does for Gemma 3 270M (hidden 640).

  gemma3: a random Gemma 3 (text) written here with gguf-py: hidden 192
          (no row of 192 is a multiple of 256: llama.cpp falls back to
          Q5_0 / Q8_0, as for Gemma 3 270M's 640), 2 heads x 128, 1 KV head,
          FFN 256, 6 layers (5 windowed + 1 global, llama.cpp's pattern),
          a sliding window of 8 tokens (the 24-token sequence crosses it),
          vocab 300 (specials, the 256 byte tokens, a few words), norm
          weights 1 + 0.1 N(0, 1) (the converter's +1 already in).

For each llama.cpp ftype below, llama_model_quantize (llama-cpp-python's
llama.cpp) writes <input>-<ftype>.gguf; then
  - gguf-py (the llama.cpp project's numpy implementation, independent of
    ggml's C) dequantizes the first and last row of every 2-D tensor;
  - llama.cpp evaluates the file (F32 KV cache) on fixed tokens, all logits.
expected.bin (TRPF, tests/kernels/fixture_reader.hpp) holds, per file F:
  types.F          i32 [n]      ggml type of each 2-D tensor, in file order
  deq.F.<tensor>   f32 [2, k]   its first and last row, dequantized by gguf-py
  logits.F         f32 [t, v]   llama.cpp's logits for tokens.<input>
  exact.F          f32 [t, v]   gemma3 only: a float64 numpy forward over the
                                gguf-py-dequantized weights (what both
                                runtimes approximate; compare_gemma3_llamacpp.py
                                holds the same forward)
and tokens.<input> (i64).
"""
import ctypes
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "gguf_quants")
TROUPE = os.path.join(ROOT, "build", "cli", "troupe")

KQ_FTYPES = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL",
             "IQ4_XS"]
LLAMA3_FTYPES = ["Q4_K_M"]
GEMMA3_FTYPES = ["Q4_K_M"]


def write_gemma3(path, seed=3):
    """A random-weight Gemma 3 text model in f32 (llama.cpp reads it)."""
    import gguf
    rng = np.random.default_rng(seed)
    H, NH, NKV, D, F, L, WIN = 192, 2, 1, 128, 256, 6, 8
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    words = ["\u2581the", "\u2581a", "\u2581sea", "\u2581is", "\u2581blue", "\u2581and",
             "\u2581red", "\u2581cat", "\u2581dog", "\u2581sun", "\u2581day", "\u2581one",
             "\u2581two", "\u2581three", "\u2581of", "\u2581to", "\u2581in", "\u2581it",
             "\u2581we", "\u2581you", "\u2581he", "\u2581she", "\u2581they", "\u2581on",
             "\u2581at", "\u2581by", "\u2581for", "\u2581with", "\u2581as", "\u2581or",
             "\u2581an", "\u2581be", "\u2581go", "\u2581up", "\u2581no", "\u2581so",
             "\u2581if"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + words
    V = len(tokens)
    types = [3] * len(specials) + [6] * 256 + [1] * len(words)  # control, byte, normal
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(words))]
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_context_length(1024)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(WIN)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)

    def mat(rows, cols, std=0.05):
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    def norm(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w.add_tensor("token_embd.weight", mat(V, H, 0.5))
    w.add_tensor("output_norm.weight", norm(H))
    for l in range(L):
        p = f"blk.{l}."
        for name, arr in [("attn_norm", norm(H)), ("attn_q", mat(NH * D, H)),
                          ("attn_k", mat(NKV * D, H)), ("attn_v", mat(NKV * D, H)),
                          ("attn_q_norm", norm(D)), ("attn_k_norm", norm(D)),
                          ("attn_output", mat(H, NH * D)), ("post_attention_norm", norm(H)),
                          ("ffn_norm", norm(H)), ("ffn_gate", mat(F, H)), ("ffn_up", mat(F, H)),
                          ("ffn_down", mat(H, F)), ("post_ffw_norm", norm(H))]:
            w.add_tensor(p + name + ".weight", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return V
N_TOKENS = 24


def quantize(src, dst, ftype):
    import llama_cpp
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
    p.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {ftype} failed: {rc}")


def dequantized_rows(path):
    import gguf
    from gguf import quants
    r = gguf.GGUFReader(path)
    types, rows = [], []
    for t in r.tensors:
        if len(t.shape) != 2:
            continue
        types.append(int(t.tensor_type))
        full = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        full = full.reshape(-1, int(t.shape[0]))
        rows.append((t.name, np.stack([full[0], full[-1]])))
    return np.array(types, dtype=np.int32), rows


def llamacpp_logits(path, tokens):
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=64, n_batch=64, n_ubatch=64, logits_all=True, n_threads=2,
                verbose=False, type_k=0, type_v=0)
    llm.reset()
    llm.eval(tokens)
    out = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    del llm
    return out


def main():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import make_fixtures
    make_fixtures.OUT_DIR = OUT
    os.makedirs(OUT, exist_ok=True)
    work = "/tmp/troupe-gguf-quants"
    os.makedirs(work, exist_ok=True)
    kq = os.path.join(work, "kq-f32.gguf")
    subprocess.run([TROUPE, "write-model", "-o", kq, "--format", "f32", "--shape", "tinyllama",
                    "--layers", "2", "--hidden", "256", "--ffn", "256", "--heads", "4",
                    "--kv-heads", "2", "--vocab", "512", "--seed", "25"], check=True)
    gemma = os.path.join(work, "gemma3-f32.gguf")
    gemma_vocab = write_gemma3(gemma)
    inputs = {"kq": (kq, KQ_FTYPES),
              "llama3": (os.path.join(ROOT, "tests", "fixtures", "llama", "llama3",
                                      "model-f32.gguf"), LLAMA3_FTYPES),
              "gemma3": (gemma, GEMMA3_FTYPES)}
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from compare_gemma3_llamacpp import Exact
    rng = np.random.default_rng(25)
    arrays = []
    for name, (src, ftypes) in inputs.items():
        vocab = {"kq": 512, "llama3": 257, "gemma3": gemma_vocab}[name]
        tokens = [1] + [int(t) for t in rng.integers(3, vocab, N_TOKENS - 1)]
        arrays.append((f"tokens.{name}", np.array(tokens, dtype=np.int64)))
        f32_logits = llamacpp_logits(src, tokens)
        rng_f32 = float(f32_logits.max() - f32_logits.min())
        for ft in ftypes:
            key = f"{name}-{ft.lower()}"
            dst = os.path.join(OUT, key + ".gguf")
            quantize(src, dst, ft)
            types, rows = dequantized_rows(dst)
            arrays.append((f"types.{key}", types))
            for tname, r in rows:
                arrays.append((f"deq.{key}.{tname}", r))
            logits = llamacpp_logits(dst, tokens)
            arrays.append((f"logits.{key}", logits))
            if name == "gemma3":
                ex = Exact(dst).logits(tokens)
                arrays.append((f"exact.{key}", ex.astype(np.float32)))
                e = np.abs(logits - ex).max(1) / (ex.max(1) - ex.min(1))
                print(f"{key}: llama.cpp vs exact: max |diff| {e.max():.2e} x range, top-1 "
                      f"{int((logits.argmax(1) == ex.argmax(1)).sum())}/{len(tokens)}")
            d = np.abs(logits.astype(np.float64) - f32_logits).max()
            top1 = int((logits.argmax(-1) == f32_logits.argmax(-1)).sum())
            counts = {}
            for t in types:
                counts[int(t)] = counts.get(int(t), 0) + 1
            print(f"{key}: {os.path.getsize(dst)} bytes, ggml types {counts}; llama.cpp vs its "
                  f"f32 file: max |diff| {d / rng_f32:.2e} x range, top-1 {top1}/{len(tokens)}")
    make_fixtures.write_fixture("expected.bin", arrays)


if __name__ == "__main__":
    main()
