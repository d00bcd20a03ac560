#!/usr/bin/env python3
"""Writes small weight-format fixtures with the reference Python writers.

Run with the pip Python (needs `gguf`, `safetensors`, `numpy` from PyPI):
    python3 tools/make_model_fixtures.py
CI does not run this; its outputs are committed under tests/fixtures/models/.
"""
import json
import os

import numpy as np

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models")


def gguf_fixture(rng):
    import gguf

    w = gguf.GGUFWriter(os.path.join(OUT, "tiny.gguf"), "llama")
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -7)
    w.add_float32("test.f32", 0.25)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "héllo ✓")
    w.add_array("test.strings", ["a", "bb", ""])
    w.add_array("test.ints", [1, -2, 3])
    w.add_uint64("test.u64", 2**63 + 5)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    f16 = rng.standard_normal((2, 8)).astype(np.float16)
    q8src = rng.standard_normal((2, 64)).astype(np.float32)
    q4src = rng.standard_normal((3, 32)).astype(np.float32)
    q8 = gguf.quants.quantize(q8src, gguf.GGMLQuantizationType.Q8_0)
    q4 = gguf.quants.quantize(q4src, gguf.GGMLQuantizationType.Q4_0)
    w.add_tensor("t.f32", f32)
    w.add_tensor("t.f16", f16)
    w.add_tensor("t.q8_0", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("t.q4_0", q4, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # What a correct reader must see: dequantized values by gguf-py.
    expect = {
        "t.f32": f32.ravel().tolist(),
        "t.f16": f16.astype(np.float32).ravel().tolist(),
        "t.q8_0": gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0).ravel().tolist(),
        "t.q4_0": gguf.quants.dequantize(q4, gguf.GGMLQuantizationType.Q4_0).ravel().tolist(),
        "shapes": {"t.f32": [3, 5], "t.f16": [2, 8], "t.q8_0": [2, 64], "t.q4_0": [3, 32]},
    }
    with open(os.path.join(OUT, "tiny.gguf.json"), "w") as f:
        json.dump(expect, f)


def safetensors_fixture(rng):
    from safetensors.numpy import save_file

    a = rng.standard_normal((4, 6)).astype(np.float32)
    b = rng.standard_normal((3,)).astype(np.float16)
    save_file({"a": a, "b": b}, os.path.join(OUT, "tiny.safetensors"), metadata={"format": "pt"})
    # A sharded checkpoint: two files and an index.
    c = rng.standard_normal((2, 2)).astype(np.float32)
    save_file({"a": a}, os.path.join(OUT, "shard-00001-of-00002.safetensors"))
    save_file({"b": b, "c": c}, os.path.join(OUT, "shard-00002-of-00002.safetensors"))
    index = {"metadata": {"total_size": a.nbytes + b.nbytes + c.nbytes},
             "weight_map": {"a": "shard-00001-of-00002.safetensors",
                            "b": "shard-00002-of-00002.safetensors",
                            "c": "shard-00002-of-00002.safetensors"}}
    with open(os.path.join(OUT, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    expect = {"a": a.ravel().tolist(), "b": b.astype(np.float32).ravel().tolist(),
              "c": c.ravel().tolist()}
    with open(os.path.join(OUT, "tiny.safetensors.json"), "w") as f:
        json.dump(expect, f)


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(1234)
    gguf_fixture(rng)
    safetensors_fixture(rng)
