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

For each llama.cpp ftype below, llama_model_quantize (llama-cpp-python's
llama.cpp) writes <input>-<ftype>.gguf; then
  - gguf-py (the llama.cpp project's numpy implementation, independent of
    ggml's C) dequantizes the first and last row of every 2-D tensor;
  - llama.cpp evaluates the file (F32 KV cache) on fixed tokens, all logits.
expected.bin (TRPF, tests/kernels/fixture_reader.hpp) holds, per file F:
  types.F          i32 [n]      ggml type of each 2-D tensor, in file order
  deq.F.<tensor>   f32 [2, k]   its first and last row, dequantized by gguf-py
  logits.F         f32 [t, v]   llama.cpp's logits for tokens.<input>
and tokens.kq / tokens.llama3 (i64).
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
    inputs = {"kq": (kq, KQ_FTYPES),
              "llama3": (os.path.join(ROOT, "tests", "fixtures", "llama", "llama3",
                                      "model-f32.gguf"), LLAMA3_FTYPES)}
    rng = np.random.default_rng(25)
    arrays = []
    for name, (src, ftypes) in inputs.items():
        vocab = 512 if name == "kq" else 257
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
