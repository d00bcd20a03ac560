#!/usr/bin/env python3
"""The format llama.cpp's quantizer picks for each tensor under each of its
K-quant and IQ4 file types ("Q4_K_M", ...), on inputs that exercise its
rules: many layers (the "more bits" layers of ffn_down / attn_v), grouped KV
with 4 or more query heads per KV head, none, rows that 256 does not divide
(the fallbacks), and tied embeddings. Output:
tests/fixtures/gguf_quants/mix_types.json, read by
tests/models/quant_mix_test.cpp against troupe's models/quant_mix.cpp.

Not run by CI; the output is committed. Run from the repository root after
building troupe (build/cli/troupe), with the packages of
tools/make_gguf_quant_fixtures.py:

    PYTHONPATH=/tmp/pydeps-llamacpp:/tmp/pydeps-gguf python3 tools/make_quant_mix_fixtures.py
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "gguf_quants", "mix_types.json")
TROUPE = os.path.join(ROOT, "build", "cli", "troupe")

FTYPES = ["Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
          "IQ4_NL", "IQ4_XS"]

# name -> (write-model arguments, model facts for the test)
WRITTEN = {
    "deep_gqa4": (["--layers", "16", "--hidden", "256", "--ffn", "512", "--heads", "8",
                   "--kv-heads", "2", "--vocab", "512"],
                  {"layers": 16, "heads": 8, "kv_heads": 2}),
    "deep_mha": (["--layers", "16", "--hidden", "256", "--ffn", "256", "--heads", "4",
                  "--kv-heads", "4", "--vocab", "512"],
                 {"layers": 16, "heads": 4, "kv_heads": 4}),
    "odd_rows": (["--layers", "9", "--hidden", "288", "--ffn", "320", "--heads", "4",
                  "--kv-heads", "2", "--vocab", "300"],
                 {"layers": 9, "heads": 4, "kv_heads": 2}),
}


def tensor_types(path):
    import gguf
    r = gguf.GGUFReader(path)
    return [[t.name, int(t.shape[0]), int(t.tensor_type)] for t in r.tensors
            if len(t.shape) == 2]


def main():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from make_gguf_quant_fixtures import quantize, write_gemma3
    work = "/tmp/troupe-quant-mix"
    os.makedirs(work, exist_ok=True)
    inputs, facts = {}, {}
    for name, (args, f) in WRITTEN.items():
        path = os.path.join(work, name + "-f32.gguf")
        subprocess.run([TROUPE, "write-model", "-o", path, "--format", "f32", "--shape",
                        "tinyllama", "--seed", "7"] + args, check=True)
        inputs[name] = path
        facts[name] = dict(f)
    inputs["llama3"] = os.path.join(ROOT, "tests", "fixtures", "llama", "llama3",
                                    "model-f32.gguf")
    facts["llama3"] = {"layers": 3, "heads": 5, "kv_heads": 1}
    gemma = os.path.join(work, "gemma3-f32.gguf")
    write_gemma3(gemma)
    inputs["gemma3"] = gemma
    facts["gemma3"] = {"layers": 6, "heads": 2, "kv_heads": 1}
    files = []
    for name, src in inputs.items():
        for ft in FTYPES:
            dst = os.path.join(work, f"{name}-{ft.lower()}.gguf")
            quantize(src, dst, ft)
            tensors = tensor_types(dst)
            # Tied: the token embedding is also the output matrix.
            facts[name]["tied"] = not any(t[0] == "output.weight" for t in tensors)
            files.append({"input": name, "ftype": ft.lower(), "tensors": tensors})
            os.remove(dst)
    with open(OUT, "w") as f:
        json.dump({"inputs": facts, "files": files}, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print("wrote", OUT, len(files), "files")


if __name__ == "__main__":
    main()
