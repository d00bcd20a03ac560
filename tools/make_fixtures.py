#!/usr/bin/env python3
"""Regenerates the kernel reference fixtures in tests/fixtures/kernels/.

Not run by CI; the outputs are committed. Run from the repository root:

    /usr/bin/python3 tools/make_fixtures.py torch   # ops.bin, attention.bin
                                                    # (Debian python3-torch 1.13)
    python3 tools/make_fixtures.py gguf             # quant.bin
                                                    # (pip: gguf 0.x + numpy)

File format (read by tests/kernels/fixture_reader.hpp), little endian:
magic "TRPF", u32 version (1), u32 count, then per array: u32 name length,
name bytes, u32 dtype (0 = f32, 1 = u8, 2 = i32, 3 = i64), u32 ndim,
i64 dims[ndim], raw row-major data.

The torch part computes every reference in float64 from float32 inputs and
rounds the result to float32 once, except where a model computes in float32
on purpose (RoPE's inv_freq and angle, see rope_inv_freq / rope_angles).
"""

import math
import os
import struct
import sys

import numpy as np

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures",
                       "kernels")

_DTYPES = {np.dtype(np.float32): 0, np.dtype(np.uint8): 1, np.dtype(np.int32): 2,
           np.dtype(np.int64): 3}


def write_fixture(name, arrays):
    """arrays: list of (name, numpy array) in file order."""
    path = os.path.join(OUT_DIR, name)
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"TRPF")
        f.write(struct.pack("<II", 1, len(arrays)))
        for key, arr in arrays:
            arr = np.ascontiguousarray(arr)
            if arr.dtype not in _DTYPES:
                raise TypeError(f"{key}: unsupported dtype {arr.dtype}")
            enc = key.encode()
            f.write(struct.pack("<I", len(enc)))
            f.write(enc)
            f.write(struct.pack("<II", _DTYPES[arr.dtype], arr.ndim))
            f.write(struct.pack(f"<{arr.ndim}q", *arr.shape))
            f.write(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
    print(f"wrote {path} ({os.path.getsize(path)} bytes, {len(arrays)} arrays)")


# --------------------------------------------------------------------------
# torch part: attention.bin and ops.bin
# --------------------------------------------------------------------------


def _attention_case(torch, gen, name, n_q, n_kv, n_heads, n_kv_heads, d, causal, window, sinks):
    """Arrays for one attention case.

    Mask rule (query i, key j, n_q == n_kv when causal): keep j if
    (not causal or j <= i) and (window == 0 or j < sinks or i - j < window).
    """
    F = torch.nn.functional
    q = torch.randn(n_q, n_heads, d, generator=gen, dtype=torch.float32)
    k = torch.randn(n_kv, n_kv_heads, d, generator=gen, dtype=torch.float32)
    v = torch.randn(n_kv, n_kv_heads, d, generator=gen, dtype=torch.float32)
    group = n_heads // n_kv_heads
    # [heads, tokens, d]; query head h reads kv head h // group (HF repeat_kv).
    qh = q.double().transpose(0, 1)
    kh = k.double().transpose(0, 1).repeat_interleave(group, dim=0)
    vh = v.double().transpose(0, 1).repeat_interleave(group, dim=0)
    i = torch.arange(n_q).unsqueeze(1)
    j = torch.arange(n_kv).unsqueeze(0)
    keep = torch.ones(n_q, n_kv, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window > 0:
        keep &= (j < sinks) | (i - j < window)
    mask = None if bool(keep.all()) else keep
    # torch 1.13 ships the pre-release of F.scaled_dot_product_attention as
    # F._scaled_dot_product_attention(q, k, v, attn_mask, dropout_p,
    # need_attn_weights, is_causal); torch >= 2.0 has the public name.
    if hasattr(F, "scaled_dot_product_attention"):
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    else:
        out = F._scaled_dot_product_attention(qh, kh, vh, mask, 0.0, False, False)[0]
    # Independent check with the textbook formula.
    scores = qh @ kh.transpose(1, 2) / math.sqrt(d)
    scores = scores.masked_fill(~keep, float("-inf"))
    ref = torch.softmax(scores, dim=-1) @ vh
    assert torch.allclose(out, ref, atol=1e-12, rtol=0), name
    if causal and window == 0:
        if hasattr(F, "scaled_dot_product_attention"):
            alt = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        else:
            alt = F._scaled_dot_product_attention(qh, kh, vh, None, 0.0, False, True)[0]
        assert torch.allclose(out, alt, atol=1e-12, rtol=0), name
    out = out.transpose(0, 1).float().contiguous()
    params = np.array([int(causal), window, sinks, n_heads, n_kv_heads], dtype=np.int64)
    return [(f"{name}.q", q.numpy()), (f"{name}.k", k.numpy()), (f"{name}.v", v.numpy()),
            (f"{name}.out", out.numpy()), (f"{name}.params", params)]


def rope_inv_freq(torch, theta, rot, llama3=None):
    """inv_freq exactly as transformers computes it (float32 throughout):
    _compute_default_rope_parameters, then _compute_llama3_parameters."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))
    if llama3 is None:
        return inv_freq
    factor, low_freq_factor, high_freq_factor, old_context_len = llama3
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def rope_angles(torch, inv_freq, pos):
    """transformers: freqs = inv_freq[None, :, None].float() @ position_ids[:, None, :].float()
    (a K=1 matmul: one float32 product per entry)."""
    return (inv_freq[:, None].float() @ pos[None, :].float()).t()  # [tokens, rot/2]


def _rope_case(torch, gen, name, tokens, heads, head_dim, rot, layout, theta, pos, llama3=None):
    x = torch.randn(tokens, heads, head_dim, generator=gen, dtype=torch.float32)
    pos = torch.tensor(pos, dtype=torch.int64)
    inv = rope_inv_freq(torch, theta, rot, llama3)
    ang = rope_angles(torch, inv, pos).double()  # float32 angles, exact cos/sin below
    xd = x.double()
    out = xd.clone()
    if layout == "neox":  # HF: q * cos + rotate_half(q) * sin on the first rot dims
        emb = torch.cat((ang, ang), dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        xr = xd[..., :rot]
        rotated = torch.cat((-xr[..., rot // 2:], xr[..., : rot // 2]), dim=-1)
        out[..., :rot] = xr * cos + rotated * sin
    else:  # Meta's original: complex multiply of adjacent pairs
        xc = torch.view_as_complex(xd[..., :rot].reshape(tokens, heads, rot // 2, 2).contiguous())
        freqs_cis = torch.polar(torch.ones_like(ang), ang)[:, None, :]
        out[..., :rot] = torch.view_as_real(xc * freqs_cis).reshape(tokens, heads, rot)
    l3 = llama3 or (0.0, 0.0, 0.0, 0.0)
    params = np.array([0.0 if layout == "neox" else 1.0, theta, rot, 1.0 if llama3 else 0.0, *l3],
                      dtype=np.float32)
    return [(f"rope.{name}.x", x.numpy()), (f"rope.{name}.pos", pos.numpy()),
            (f"rope.{name}.inv_freq", inv.numpy()), (f"rope.{name}.params", params),
            (f"rope.{name}.out", out.float().numpy())]


def make_ops(torch):
    F = torch.nn.functional
    gen = torch.Generator().manual_seed(7)
    arrays = []
    # RoPE. params = {layout (0 neox, 1 adjacent), theta, rotary_dims, llama3?,
    # factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}.
    pos = [0, 1, 5, 100, 4097, 65537]
    arrays += _rope_case(torch, gen, "neox", 6, 2, 64, 64, "neox", 10000.0, pos)
    arrays += _rope_case(torch, gen, "adjacent", 6, 2, 64, 64, "adjacent", 10000.0, pos)
    arrays += _rope_case(torch, gen, "partial", 6, 2, 80, 40, "neox", 10000.0, pos)
    arrays += _rope_case(torch, gen, "adjacent_partial", 6, 2, 80, 40, "adjacent", 10000.0, pos)
    arrays += _rope_case(torch, gen, "llama3", 6, 2, 64, 64, "neox", 500000.0,
                         [0, 3, 2048, 8191, 40000, 131071], (8.0, 1.0, 4.0, 8192.0))

    # Activations on one vector with a wide range and special points.
    x = torch.cat([torch.linspace(-12, 12, 97), torch.randn(90, generator=gen) * 3,
                   torch.tensor([0.0, -0.0, 1e-3, -1e-3, 1e-7, 30.0, -30.0, 80.0, -80.0, 5.5])]).float()
    xd = x.double()
    arrays += [("act.x", x.numpy()),
               ("act.silu", F.silu(xd).float().numpy()),
               ("act.gelu_tanh", F.gelu(xd, approximate="tanh").float().numpy()),
               ("act.gelu_erf", F.gelu(xd).float().numpy()),
               ("act.gelu_quick", (xd * torch.sigmoid(1.702 * xd)).float().numpy())]
    g = torch.randn(3, 45, generator=gen) * 2
    u = torch.randn(3, 45, generator=gen)
    arrays += [("swiglu.gate", g.numpy()), ("swiglu.up", u.numpy()),
               ("swiglu.out", (F.silu(g.double()) * u.double()).float().numpy())]

    # Softmax: random rows, a row far from zero, a row with -inf (masked) entries.
    sx = torch.randn(5, 37, generator=gen) * 5
    sx[1] += 1000.0
    sx[2, ::3] = float("-inf")
    arrays += [("softmax.x", sx.numpy()),
               ("softmax.out", torch.softmax(sx.double(), dim=-1).float().numpy()),
               ("softmax.out_scale_0.125", torch.softmax(0.125 * sx.double(), dim=-1).float().numpy())]

    # RMSNorm (HF LlamaRMSNorm, eps 1e-6) and LayerNorm (eps 1e-5).
    nx = torch.randn(4, 67, generator=gen) * 2 + 0.5
    nw = torch.randn(67, generator=gen)
    nb = torch.randn(67, generator=gen)
    nxd = nx.double()
    rms = nw.double() * (nxd * torch.rsqrt(nxd.pow(2).mean(-1, keepdim=True) + 1e-6))
    ln = F.layer_norm(nxd + 3.0, (67,), nw.double(), nb.double(), 1e-5)
    arrays += [("norm.x", nx.numpy()), ("norm.weight", nw.numpy()), ("norm.bias", nb.numpy()),
               ("norm.rms_1e-6", rms.float().numpy()),
               ("norm.x_plus_3", (nx + 3.0).numpy()), ("norm.layer_1e-5", ln.float().numpy())]

    # Patch embedding: conv2d stride = kernel = 7 on [2, 3, 14, 21] -> [2, 6, 24].
    img = torch.randn(2, 3, 14, 21, generator=gen)
    cw = torch.randn(24, 3, 7, 7, generator=gen) * 0.1
    cb = torch.randn(24, generator=gen)
    conv = F.conv2d(img.double(), cw.double(), cb.double(), stride=7)
    conv = conv.flatten(2).transpose(1, 2).contiguous()  # CLIP: [batch, patches, hidden]
    arrays += [("conv.input", img.numpy()), ("conv.weight", cw.numpy()), ("conv.bias", cb.numpy()),
               ("conv.out", conv.float().numpy())]
    write_fixture("ops.bin", arrays)


def make_attention(torch):
    gen = torch.Generator().manual_seed(20240601)
    arrays = []
    arrays += _attention_case(torch, gen, "causal_gqa", 33, 33, 4, 2, 64, True, 0, 0)
    arrays += _attention_case(torch, gen, "bidir", 20, 29, 2, 2, 64, False, 0, 0)
    arrays += _attention_case(torch, gen, "window", 40, 40, 2, 1, 64, True, 8, 2)
    write_fixture("attention.bin", arrays)


# --------------------------------------------------------------------------
# gguf part: quant.bin
# --------------------------------------------------------------------------


def _quant_inputs():
    """Rows of 128 floats (4 blocks of 32) with the cases that break sloppy
    quantizers: zero blocks, rounding ties, sign ties in the absmax, large
    and tiny magnitudes, constant blocks, spikes."""
    rng = np.random.default_rng(1234)
    cols = 128
    rows = []
    rows.append(rng.standard_normal(cols))
    rows.append(rng.standard_normal(cols) * 100.0)
    r = rng.standard_normal(cols)
    r[32:64] = 0.0  # one all-zero block
    rows.append(r)
    rows.append(np.zeros(cols))  # all zero
    # Q8_0 ties: absmax 127 gives d = 1, so x*id lands exactly on .5 values.
    t = np.concatenate([[127.0], np.arange(31) * 1.0 - 15.5])
    # Q4_0 ties: max -8 gives d = 1, id = 1; x + 8.5 hits integers.
    u = np.concatenate([[-8.0], np.arange(31) * 0.5 - 7.5])
    # sign tie in the absmax: +5 first, then -5 (first occurrence wins)
    w = rng.standard_normal(32)
    w[3], w[20] = 5.0, -5.0
    v = rng.standard_normal(32)
    v[7], v[9] = -6.0, 6.0
    rows.append(np.concatenate([t, u, w, v]))
    rows.append(rng.standard_normal(cols) * 1e5)  # large (d stays finite in f16)
    rows.append(rng.standard_normal(cols) * 1e-6)  # tiny: f16 scale underflows
    c = np.full(cols, 3.0)
    c[64:96] = -0.1
    rows.append(c)  # constant blocks
    s = rng.standard_normal(cols) * 0.01
    s[5], s[77] = 40.0, -33.0  # spikes
    rows.append(s)
    rows.append(rng.uniform(-1.0, 1.0, cols))
    x = np.stack(rows).astype(np.float32)
    return x


def make_quant():
    import gguf  # pip gguf (run with the pip python3)
    from gguf import GGMLQuantizationType as T

    x = _quant_inputs()
    arrays = [("x", x)]
    for name, qt in (("q8_0", T.Q8_0), ("q4_0", T.Q4_0)):
        raw = gguf.quants.quantize(x, qt)
        deq = gguf.quants.dequantize(raw, qt)
        assert raw.dtype == np.uint8 and raw.shape == (x.shape[0], x.shape[1] // 32 * (
            34 if name == "q8_0" else 18)), raw.shape
        assert deq.dtype == np.float32 and deq.shape == x.shape
        arrays += [(f"{name}.bytes", raw), (f"{name}.deq", deq)]
    write_fixture("quant.bin", arrays)


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "torch":
        import torch  # Debian python3-torch (run with /usr/bin/python3)
        torch.set_num_threads(1)
        make_attention(torch)
        if len(sys.argv) < 3 or sys.argv[2] != "attention":
            make_ops(torch)
    elif what == "gguf":
        make_quant()
    else:
        print(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main()
