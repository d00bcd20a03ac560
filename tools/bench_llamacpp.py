#!/usr/bin/env python3
"""llama.cpp's prefill and decode speed on the same GGUF files bench_llama uses.

Not run by CI. llama.cpp comes from PyPI's llama-cpp-python (built from source
by pip, so for this machine's CPU):
    python3 -m pip install --target /tmp/pydeps-llamacpp llama-cpp-python==0.3.36
    PYTHONPATH=/tmp/pydeps-llamacpp python3 tools/bench_llamacpp.py build/bench-models/tinyllama-q4_0.gguf ...
bench_llama calls it with --one in each of its rounds (--llamacpp DIR), and
with --quantize SRC DST FTYPE to make the K-quant (and other llama.cpp-only)
files it measures: llama.cpp's own quantizer (llama_model_quantize), e.g.
FTYPE Q4_K_M from the F16 file.
Prints, per file and thread count: prefill tokens/s (one batch of --prompt
tokens) and decode tokens/s (--gen single-token steps), median of --runs.
"""
import argparse
import statistics
import time

import llama_cpp


def measure(path, threads, prompt, gen, runs):
    llm = llama_cpp.Llama(model_path=path, n_ctx=prompt + gen + 16, n_batch=prompt, n_ubatch=prompt,
                          n_threads=threads, n_threads_batch=threads, verbose=False, logits_all=False)
    vocab = llm.n_vocab()
    pre, dec = [], []
    for r in range(runs):
        tokens = [259 + (r * 7919 + i * 104729) % (vocab - 259) for i in range(prompt)]
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(tokens)
        pre.append(prompt / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        for g in range(gen):
            llm.eval([259 + (g * 7919) % 30000])
        dec.append(gen / (time.perf_counter() - t0))
    return statistics.median(pre), statistics.median(dec)


def quantize(src, dst, ftype):
    import ctypes
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype.upper())
    p.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {ftype}: {rc}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantize", nargs=3, metavar=("SRC", "DST", "FTYPE"),
                    help="write DST from SRC with llama.cpp's quantizer and exit")
    ap.add_argument("models", nargs="*")
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--one", action="store_true",
                    help="one run of the first model at the first thread count; print only "
                         "'prefill_tps decode_tps' (bench_llama's interleaved rounds)")
    a = ap.parse_args()
    if a.quantize:
        quantize(*a.quantize)
        return
    if a.one:
        p, d = measure(a.models[0], int(a.threads.split(",")[0]), a.prompt, a.gen, 1)
        print(f"{p:.3f} {d:.3f}", flush=True)
        return
    print(f"llama.cpp (llama-cpp-python {llama_cpp.__version__}): prefill {a.prompt}, decode {a.gen}, median of {a.runs}")
    print(f"{'model':40} {'thr':>3} {'prefill t/s':>12} {'decode t/s':>11}")
    for t in [int(x) for x in a.threads.split(",")]:
        for m in a.models:
            p, d = measure(m, t, a.prompt, a.gen, a.runs)
            print(f"{m:40} {t:3d} {p:12.1f} {d:11.2f}", flush=True)


if __name__ == "__main__":
    main()
