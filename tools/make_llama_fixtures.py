#!/usr/bin/env python3
"""Builds small random-weight LLaMA checkpoints and transformers' reference
logits for troupe's fidelity tests, under tests/fixtures/llama/<name>/.

Not run by CI; the outputs are committed. Run from the repository root:

    # once: transformers for Debian's torch 1.13, kept OUT of the repository
    python3 -m pip install --target /work/pydeps --no-deps transformers==4.46.3 \\
        huggingface_hub==0.26.5 tokenizers==0.20.3 safetensors==0.4.5 regex tqdm \\
        filelock packaging requests pyyaml fsspec typing_extensions

    # stage 1: HF checkpoints + reference.bin (Debian python3-torch 1.13, numpy 1.24)
    PYTHONPATH=/work/pydeps /usr/bin/python3 tools/make_llama_fixtures.py hf

    # stage 2: GGUF files + checks (pip Python: gguf 0.19, safetensors, numpy)
    python3 tools/make_llama_fixtures.py gguf

    # optional cross-check: llama.cpp evaluates the GGUF files (writes nothing;
    # llama-cpp-python builds llama.cpp from source, several minutes on 2 cores)
    python3 -m pip install --target /work/pydeps-llamacpp --no-deps \\
        llama-cpp-python==0.3.36 diskcache
    PYTHONPATH=/work/pydeps-llamacpp python3 tools/make_llama_fixtures.py llamacpp

The llamacpp stage loads every GGUF file with llama.cpp (F32 KV cache) and
compares with reference.bin / reference-dequant.bin and greedy.tokens; with
llama-cpp-python 0.3.36 the F32 files agree to ~4e-7 x logit range and the
greedy continuations are identical.

(transformers 4.43 is the first release with rope_type "llama3"; 4.46.3 is the
newest one tried that runs on torch 1.13.)

Checkpoints (float32 weights, normal std WEIGHT_STD, norm weights 1 + 0.1 N(0,1)):
  odd     hidden 120, 6 heads x head_dim 20, 2 KV heads (GQA 3:1), FFN 232,
          vocab 301, 2 layers, untied lm_head, rope_theta 1e4, no scaling
  llama3  hidden 160, 5 heads x head_dim 32, 1 KV head (MQA), FFN 288,
          vocab 257, 3 layers, tied embeddings, rope_theta 5e5, rope_scaling
          llama3 (factor 8, low 1, high 4, original_max_position_embeddings 32,
          so scaling changes the frequencies inside the fixture's lengths)
Both: rms_norm_eps 1e-5, max_position_embeddings 256, bos 1, eos 2.

Files in tests/fixtures/llama/<name>/:
  config.json, generation_config.json, model.safetensors   (save_pretrained)
  model-f32.gguf            both; llama3 also model-f16.gguf, model-q8_0.gguf,
                            model-q4_0.gguf (2-D matrices in that type incl.
                            token_embd; 1-D norms and rope_freqs stay F32)
  reference.bin             TRPF (tests/kernels/fixture_reader.hpp):
      n_seqs        i64 [1]          = 3
      tokens.<i>    i64 [len]        lengths 1, 17, 48
      logits.<i>    f32 [len, vocab] transformers, model.double(), one
                                     teacher-forced forward per sequence
      greedy.prompt i64 [5]          BOS + 4 ids
      greedy.tokens i64 [12]         the 12 NEW ids of greedy generate
                                     (prompt excluded), float64; the prompt is
                                     the first deterministic candidate whose
                                     continuation has no EOS, >= 8 distinct
                                     ids and top-2 gaps >= 0.05
      greedy.top2_gap f32 [12]       top-1 minus top-2 logit at each step

  reference-dequant.bin     llama3 only, TRPF: logits.<fmt>.<i> f32 [len, vocab]
                            for fmt q8_0, q4_0: float64 numpy forward with the
                            file's DEQUANTIZED weights (same tokens.<i>); the
                            gap to reference.bin is the weight-rounding error
                            alone, so a quantized test can be tight against
                            this and loose (KL) against reference.bin

GGUF conventions (as llama.cpp's convert_hf_to_gguf.py): q_proj / k_proj rows
permuted to the adjacent-pair RoPE layout; llama3 scaling is stored as the F32
tensor rope_freqs.weight [head_dim / 2] of per-frequency divisors (llama.cpp
uses inv_freq[i] = theta^(-2i/d) / rope_freqs[i]); no llama.rope.scaling.* keys.

Precision note: transformers 4.46 does not compute everything in float64 under
model.double(): LlamaRMSNorm casts to float32 for the normalisation, eager
attention runs softmax in float32, and RoPE's inv_freq / angles / cos / sin are
float32. The script therefore also runs an independent float64 numpy forward
and prints (and bounds) the difference relative to the logit range.
generate() is called with synced_gpus=False: its default probes FSDP by
importing torch.distributed.fsdp, which fails on torch 1.13 under Python 3.11
(dataclass "mutable default" ValueError). generate() also rounds each step's
logits to float32 before its argmax; greedy() keeps only continuations whose
float64 top-1/top-2 gaps are all >= MIN_GREEDY_GAP, so that cannot matter.
"""

import json
import math
import os
import shutil
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.normpath(os.path.join(HERE, "..", "tests", "fixtures", "llama"))

WEIGHT_STD = 0.08
NORM_STD = 0.1
SEQ_LENS = (1, 17, 48)
PROMPT_LEN = 5
NEW_TOKENS = 12
MIN_GREEDY_GAP = 0.05  # smallest accepted top-1/top-2 logit gap in greedy.tokens
MIN_DISTINCT = 8  # distinct ids among the 12 greedy tokens (random models loop)
BOS, EOS = 1, 2

SPECS = {
    "odd": dict(
        seed=101,
        config=dict(hidden_size=120, num_attention_heads=6, num_key_value_heads=2,
                    head_dim=20, intermediate_size=232, vocab_size=301, num_hidden_layers=2,
                    tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=None,
                    rms_norm_eps=1e-5, max_position_embeddings=256),
        gguf=("f32",)),
    "llama3": dict(
        seed=202,
        config=dict(hidden_size=160, num_attention_heads=5, num_key_value_heads=1,
                    head_dim=32, intermediate_size=288, vocab_size=257, num_hidden_layers=3,
                    tie_word_embeddings=True, rope_theta=500000.0,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 32},
                    rms_norm_eps=1e-5, max_position_embeddings=256),
        gguf=("f32", "f16", "q8_0", "q4_0")),
}

# --------------------------------------------------------------------------
# shared: TRPF reader, independent float64 forward, RoPE tables
# --------------------------------------------------------------------------


def read_trpf(path):
    """Inverse of tools/make_fixtures.py:write_fixture -> {name: ndarray}."""
    dtypes = {0: np.float32, 1: np.uint8, 2: np.int32, 3: np.int64}
    out = {}
    with open(path, "rb") as f:
        assert f.read(4) == b"TRPF", path
        version, count = struct.unpack("<II", f.read(8))
        assert version == 1, path
        for _ in range(count):
            (n,) = struct.unpack("<I", f.read(4))
            name = f.read(n).decode()
            dt, ndim = struct.unpack("<II", f.read(8))
            dims = struct.unpack(f"<{ndim}q", f.read(8 * ndim))
            dtype = np.dtype(dtypes[dt]).newbyteorder("<")
            count_el = int(np.prod(dims)) if ndim else 1
            out[name] = np.frombuffer(f.read(count_el * dtype.itemsize), dtype=dtype).reshape(dims)
        assert f.read(1) == b"", path
    return out


def base_inv_freq(cfg):
    d = cfg["head_dim"]
    return float(cfg["rope_theta"]) ** (-np.arange(0, d, 2, dtype=np.float64) / d)


def llama3_divisors(cfg):
    """llama.cpp's rope_freqs (convert_hf_to_gguf.py): inv_freq / divisor is the
    llama3-scaled inverse frequency."""
    rs = cfg["rope_scaling"]
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    lo_wavelen, hi_wavelen = old / lo, old / hi
    out = []
    for freq in base_inv_freq(cfg):
        wavelen = 2 * math.pi / freq
        if wavelen < hi_wavelen:
            out.append(1.0)
        elif wavelen > lo_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float64)


def hf_inv_freq64(cfg):
    """transformers' _compute_llama3_parameters, in float64."""
    inv = base_inv_freq(cfg)
    rs = cfg.get("rope_scaling")
    if not rs:
        return inv
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return np.where(medium, smoothed, scaled)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, inv_freq, layout):
    """x [L, heads, d] float64, positions 0..L-1."""
    ang = np.arange(x.shape[0], dtype=np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = np.empty_like(x)
    half = x.shape[-1] // 2
    if layout == "halves":  # HF rotate_half
        a, b = x[..., :half], x[..., half:]
        out[..., :half] = a * cos - b * sin
        out[..., half:] = b * cos + a * sin
    else:  # adjacent pairs (GGUF / Meta)
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
    return out


def forward64(w, cfg, tokens, inv_freq, layout):
    """Plain float64 LLaMA forward. w uses HF names without the 'model.' prefix
    ('embed_tokens', 'layers.N.self_attn.q_proj', ..., 'norm', 'lm_head'),
    matrices [out, in]. Returns logits [L, vocab]."""
    h, hk, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    n = len(tokens)
    x = w["embed_tokens"][np.asarray(tokens)].astype(np.float64)
    causal = np.tril(np.ones((n, n), dtype=bool))
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        xn = _rms(x, w[p + "input_layernorm"], eps)
        q = _rope((xn @ w[p + "self_attn.q_proj"].T).reshape(n, h, d), inv_freq, layout)
        k = _rope((xn @ w[p + "self_attn.k_proj"].T).reshape(n, hk, d), inv_freq, layout)
        v = (xn @ w[p + "self_attn.v_proj"].T).reshape(n, hk, d)
        att = np.empty((n, h, d))
        for head in range(h):
            kv = head // (h // hk)
            s = (q[:, head, :] @ k[:, kv, :].T) / math.sqrt(d)
            s = np.where(causal, s, -np.inf)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            att[:, head, :] = (s / s.sum(axis=-1, keepdims=True)) @ v[:, kv, :]
        x = x + att.reshape(n, h * d) @ w[p + "self_attn.o_proj"].T
        xn = _rms(x, w[p + "post_attention_layernorm"], eps)
        g = xn @ w[p + "mlp.gate_proj"].T
        u = xn @ w[p + "mlp.up_proj"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ w[p + "mlp.down_proj"].T
    head_w = w["lm_head"] if "lm_head" in w else w["embed_tokens"]
    return _rms(x, w["norm"], eps) @ head_w.T


def hf_weights64(state):
    """safetensors / state_dict names -> forward64 names, float64."""
    out = {}
    for k, v in state.items():
        k = k[len("model."):] if k.startswith("model.") else k
        out[k[: -len(".weight")]] = np.asarray(v, dtype=np.float64)
    return out


def logit_range(arrs):
    return float(max(a.max() for a in arrs) - min(a.min() for a in arrs))


# --------------------------------------------------------------------------
# stage 1 (torch + transformers): checkpoints and reference.bin
# --------------------------------------------------------------------------


def make_hf(name, spec):
    import torch
    import transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, HERE)
    from make_fixtures import write_fixture  # noqa: E402 (tools/make_fixtures.py)

    cfg = dict(spec["config"])
    out_dir = os.path.join(OUT, name)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)

    torch.manual_seed(spec["seed"])
    config = LlamaConfig(**cfg, bos_token_id=BOS, eos_token_id=EOS, attention_bias=False,
                         mlp_bias=False, hidden_act="silu", torch_dtype="float32")
    model = LlamaForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(spec["seed"])
    with torch.no_grad():
        for pname, p in sorted(model.named_parameters()):  # tied lm_head listed once
            if p.dim() == 1:
                p.copy_(1.0 + NORM_STD * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(WEIGHT_STD * torch.randn(p.shape, generator=gen))
    if cfg["tie_word_embeddings"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(out_dir, safe_serialization=True)
    assert sorted(os.listdir(out_dir)) == ["config.json", "generation_config.json",
                                           "model.safetensors"], os.listdir(out_dir)

    # Reload what was written: the reference must come from the committed weights.
    model = LlamaForCausalLM.from_pretrained(out_dir, torch_dtype=torch.float32).eval()
    w64 = hf_weights64({k: v.numpy() for k, v in model.state_dict().items()})
    model = model.double()
    # Print which attention implementation ran (sdpa needs torch >= 2.1).
    print(f"[{name}] transformers {transformers.__version__}, torch {torch.__version__}, "
          f"attn_implementation={model.config._attn_implementation}")
    hf_inv = model.model.rotary_emb.inv_freq.double().numpy()
    inv64 = hf_inv_freq64(cfg)
    print(f"[{name}] inv_freq (HF float32): {np.array2string(hf_inv, precision=4)}")
    assert np.allclose(hf_inv, inv64, rtol=5e-6, atol=0), (hf_inv, inv64)
    if cfg["rope_scaling"]:
        base = base_inv_freq(cfg)
        changed = int(np.sum(~np.isclose(inv64, base, rtol=1e-12)))
        print(f"[{name}] llama3 scaling changes {changed}/{len(base)} frequencies")
        assert changed > 0

    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    vocab = cfg["vocab_size"]
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in SEQ_LENS]
    # Touch the first and last embedding rows and the special ids.
    seqs[2][[3, 10, 20, 30, 47]] = torch.tensor([0, vocab - 1, BOS, EOS, vocab - 1])

    arrays = [("n_seqs", np.array([len(seqs)], dtype=np.int64))]
    all_logits = []
    worst = 0.0
    with torch.no_grad():
        for i, ids in enumerate(seqs):
            logits = model(input_ids=ids[None], use_cache=False).logits[0]
            assert logits.dtype == torch.float64
            logits = logits.numpy()
            ref = forward64(w64, cfg, ids.numpy(), inv64, "halves")
            worst = max(worst, float(np.abs(logits - ref).max()))
            all_logits.append(logits)
            arrays += [(f"tokens.{i}", ids.numpy().astype(np.int64)),
                       (f"logits.{i}", logits.astype(np.float32))]
    rng = logit_range(all_logits)
    print(f"[{name}] HF(double) vs numpy float64: max |diff| {worst:.3e} = "
          f"{worst / rng:.2e} x logit range")
    assert worst <= 1e-5 * rng, "transformers and the float64 reference disagree"

    prompt, new, gaps = greedy(torch, model, cfg, spec["seed"])
    arrays += [("greedy.prompt", prompt.astype(np.int64)),
               ("greedy.tokens", new.astype(np.int64)),
               ("greedy.top2_gap", gaps.astype(np.float32))]
    print(f"[{name}] greedy prompt {prompt.tolist()} -> {new.tolist()} "
          f"(min top-2 gap {gaps.min():.3f})")

    # write_fixture joins its kernels/ directory with the name; an absolute
    # name makes os.path.join use it as is.
    write_fixture(os.path.join(out_dir, "reference.bin"), arrays)
    lo = min(a.min() for a in all_logits)
    hi = max(a.max() for a in all_logits)
    print(f"[{name}] logits: max |logit| {max(abs(lo), abs(hi)):.3f}, range [{lo:.3f}, {hi:.3f}]"
          f" (width {hi - lo:.3f}); per sequence std "
          + ", ".join(f"{a.std():.3f}" for a in all_logits))


def greedy(torch, model, cfg, seed):
    """First deterministic prompt whose 12-token greedy continuation contains no
    EOS, has >= MIN_DISTINCT distinct ids and every top-1/top-2 gap >=
    MIN_GREEDY_GAP (no near ties)."""
    vocab = cfg["vocab_size"]
    gen = torch.Generator().manual_seed(seed + 2)
    for attempt in range(500):
        prompt = torch.cat([torch.tensor([BOS]),
                            torch.randint(3, vocab, (PROMPT_LEN - 1,), generator=gen)])
        with torch.no_grad():
            out = model.generate(prompt[None], attention_mask=torch.ones(1, PROMPT_LEN,
                                                                         dtype=torch.long),
                                 do_sample=False, max_new_tokens=NEW_TOKENS, num_beams=1,
                                 pad_token_id=EOS, return_dict_in_generate=True,
                                 output_logits=True, synced_gpus=False)
        seq = out.sequences[0]
        new = seq[PROMPT_LEN:]
        if len(new) != NEW_TOKENS or bool((new == EOS).any()):
            continue
        if len(set(new.tolist())) < MIN_DISTINCT:  # skip early repetition loops
            continue
        # generate() rounds each step's logits to float32 before the argmax
        # (`.clone().float()` in transformers 4.46); take the gaps from a
        # float64 teacher-forced forward without the KV cache instead.
        step_logits = torch.stack([l[0] for l in out.logits])  # [12, vocab]
        with torch.no_grad():
            full = model(input_ids=seq[None], use_cache=False).logits[0]
        steps = full[PROMPT_LEN - 1:-1]
        assert torch.equal(steps.argmax(-1), new)
        assert torch.allclose(steps, step_logits.double(), rtol=0, atol=1e-5)
        top2 = steps.topk(2, dim=-1).values
        gaps = (top2[:, 0] - top2[:, 1]).numpy()
        if gaps.min() < MIN_GREEDY_GAP:
            continue
        print(f"  greedy: prompt accepted after {attempt + 1} tries")
        return prompt.numpy(), new.numpy(), gaps
    raise RuntimeError("no prompt without EOS / near ties found")


# --------------------------------------------------------------------------
# stage 2 (gguf-py): GGUF files and checks
# --------------------------------------------------------------------------


def permute(w, n_head):
    """convert_hf_to_gguf.py: HF halves layout -> adjacent pairs (rows)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def unpermute(w, n_head):
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_tensors(cfg, st):
    """[(gguf name, float32 array in GGUF row layout, HF name or None)]."""
    out = [("token_embd.weight", st["model.embed_tokens.weight"], "model.embed_tokens.weight")]
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for g, h, nh in (("attn_q", "self_attn.q_proj", cfg["num_attention_heads"]),
                         ("attn_k", "self_attn.k_proj", cfg["num_key_value_heads"]),
                         ("attn_v", "self_attn.v_proj", None),
                         ("attn_output", "self_attn.o_proj", None),
                         ("ffn_gate", "mlp.gate_proj", None), ("ffn_up", "mlp.up_proj", None),
                         ("ffn_down", "mlp.down_proj", None),
                         ("attn_norm", "input_layernorm", None),
                         ("ffn_norm", "post_attention_layernorm", None)):
            w = st[p + h + ".weight"]
            out.append((b + g + ".weight", permute(w, nh) if nh else w, p + h + ".weight"))
    out.append(("output_norm.weight", st["model.norm.weight"], "model.norm.weight"))
    if not cfg["tie_word_embeddings"]:
        out.append(("output.weight", st["lm_head.weight"], "lm_head.weight"))
    else:
        assert "lm_head.weight" not in st
    if cfg.get("rope_scaling"):
        out.append(("rope_freqs.weight", llama3_divisors(cfg).astype(np.float32), None))
    return out


def write_gguf(path, name, cfg, tensors, fmt):
    import gguf

    T = gguf.GGMLQuantizationType
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                 "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[fmt]
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"troupe-fixture-{name}")
    w.add_file_type(int(file_type))
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    vocab = cfg["vocab_size"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, vocab)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0, 0.0, 0.0] + [-float(i) for i in range(3, vocab)])
    w.add_token_types([int(gguf.TokenType.UNKNOWN), int(gguf.TokenType.CONTROL),
                       int(gguf.TokenType.CONTROL)] + [int(gguf.TokenType.NORMAL)] * (vocab - 3))
    w.add_unk_token_id(0)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    for tname, arr, _ in tensors:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arr.ndim == 1 or fmt == "f32":
            w.add_tensor(tname, arr)
        elif fmt == "f16":
            w.add_tensor(tname, arr.astype(np.float16))
        else:
            qt = T.Q8_0 if fmt == "q8_0" else T.Q4_0
            w.add_tensor(tname, gguf.quants.quantize(arr, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_gguf(path, cfg):
    """Reads a file back with gguf.GGUFReader; returns ({name: (type, float64
    array in row layout)}, {key: value})."""
    import gguf

    r = gguf.GGUFReader(path)
    kv = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}
    out = {}
    for t in r.tensors:
        assert t.name not in out, f"{path}: duplicate {t.name}"
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # ne -> row-major
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        out[t.name] = (t.tensor_type, np.asarray(data, dtype=np.float64).reshape(shape), t.data)
    return out, kv


def gguf_weights64(cfg, tensors):
    """GGUF tensors (as read) -> forward64 names, adjacent-pair q/k rows kept."""
    w = {"embed_tokens": tensors["token_embd.weight"][1], "norm": tensors["output_norm.weight"][1]}
    if "output.weight" in tensors:
        w["lm_head"] = tensors["output.weight"][1]
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for i in range(cfg["num_hidden_layers"]):
        for g, h in names.items():
            w[f"layers.{i}.{h}"] = tensors[f"blk.{i}.{g}.weight"][1]
    return w


def gguf_inv_freq(cfg, tensors):
    inv = base_inv_freq(cfg)
    if "rope_freqs.weight" in tensors:
        inv = inv / tensors["rope_freqs.weight"][1]
    return inv


def softmax64(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def make_gguf(name, spec):
    import gguf
    from safetensors.numpy import load_file

    T = gguf.GGMLQuantizationType
    out_dir = os.path.join(OUT, name)
    with open(os.path.join(out_dir, "config.json")) as f:
        cfg = json.load(f)
    for k, v in spec["config"].items():  # the file must say what the spec says
        assert cfg.get(k) == v, (name, k, cfg.get(k), v)
    st = load_file(os.path.join(out_dir, "model.safetensors"))
    assert all(v.dtype == np.float32 for v in st.values())
    tensors = gguf_tensors(cfg, st)
    ref = read_trpf(os.path.join(out_dir, "reference.bin"))
    n_seqs = int(ref["n_seqs"][0])
    ref_logits = [ref[f"logits.{i}"].astype(np.float64) for i in range(n_seqs)]
    rng = logit_range(ref_logits)
    dequant_ref = []

    for fmt in spec["gguf"]:
        path = os.path.join(out_dir, f"model-{fmt}.gguf")
        write_gguf(path, name, cfg, tensors, fmt)
        back, kv = read_gguf(path, cfg)

        # Metadata and tensor set.
        expect_kv = {"general.architecture": "llama",
                     "llama.context_length": cfg["max_position_embeddings"],
                     "llama.embedding_length": cfg["hidden_size"],
                     "llama.block_count": cfg["num_hidden_layers"],
                     "llama.feed_forward_length": cfg["intermediate_size"],
                     "llama.attention.head_count": cfg["num_attention_heads"],
                     "llama.attention.head_count_kv": cfg["num_key_value_heads"],
                     "llama.rope.dimension_count": cfg["head_dim"],
                     "llama.vocab_size": cfg["vocab_size"], "tokenizer.ggml.model": "llama",
                     "tokenizer.ggml.bos_token_id": BOS, "tokenizer.ggml.eos_token_id": EOS}
        for k, v in expect_kv.items():
            assert kv.get(k) == v, (path, k, kv.get(k), v)
        assert math.isclose(kv["llama.rope.freq_base"], cfg["rope_theta"], rel_tol=1e-7)
        assert math.isclose(kv["llama.attention.layer_norm_rms_epsilon"], cfg["rms_norm_eps"],
                            rel_tol=1e-6)
        assert len(kv["tokenizer.ggml.tokens"]) == cfg["vocab_size"]
        assert len(kv["tokenizer.ggml.scores"]) == cfg["vocab_size"]
        assert len(kv["tokenizer.ggml.token_type"]) == cfg["vocab_size"]
        assert set(back) == {g for g, _, _ in tensors}, (path, sorted(back))

        # Tensor types and values.
        qtype = {"f32": T.F32, "f16": T.F16, "q8_0": T.Q8_0, "q4_0": T.Q4_0}[fmt]
        for g, src, hf in tensors:
            ttype, val, raw = back[g]
            want_type = T.F32 if src.ndim == 1 else qtype
            assert ttype == want_type, (path, g, ttype)
            assert val.shape == src.shape, (path, g, val.shape, src.shape)
            if fmt == "f32":
                assert np.array_equal(val, src.astype(np.float64)), (path, g)
                if hf is not None:  # un-permuted GGUF == HF safetensors, bit for bit
                    nh = {"attn_q": cfg["num_attention_heads"],
                          "attn_k": cfg["num_key_value_heads"]}.get(g.split(".")[-2])
                    hf_val = unpermute(val, nh) if nh else val
                    assert np.array_equal(hf_val, st[hf].astype(np.float64)), (path, g, hf)
            elif ttype == T.F16:
                assert np.array_equal(val, src.astype(np.float16).astype(np.float64)), (path, g)
            elif ttype in (T.Q8_0, T.Q4_0):
                assert np.array_equal(raw, gguf.quants.quantize(src, ttype)), (path, g)
                err = np.abs(val - src).max() / np.abs(src).max()
                assert err < (0.01 if ttype == T.Q8_0 else 0.15), (path, g, err)

        # Logits from the GGUF weights (adjacent-pair RoPE, rope_freqs) in float64.
        w = gguf_weights64(cfg, back)
        inv = gguf_inv_freq(cfg, back)
        logits = [forward64(w, cfg, ref[f"tokens.{i}"], inv, "adjacent") for i in range(n_seqs)]
        diff = max(float(np.abs(a - b).max()) for a, b in zip(logits, ref_logits))
        size = os.path.getsize(path)
        if fmt == "f32":
            print(f"[{name}] {os.path.basename(path)} ({size} bytes): float64 forward from GGUF"
                  f" vs reference.bin max |diff| {diff:.3e} = {diff / rng:.2e} x range")
            assert diff <= 1e-5 * rng, (path, diff, rng)
            continue
        if fmt in ("q8_0", "q4_0"):
            dequant_ref += [(f"logits.{fmt}.{i}", l.astype(np.float32))
                            for i, l in enumerate(logits)]
        kls, kl_uniform, gaps, same = [], [], [], []
        for a, b in zip(ref_logits, logits):
            p, q = softmax64(a), softmax64(b)
            kls += list(np.sum(p * (np.log(p) - np.log(q)), axis=-1))
            kl_uniform += list(np.log(a.shape[-1]) + np.sum(p * np.log(p), axis=-1))
            top = np.sort(a, axis=-1)
            gaps += list(top[:, -1] - top[:, -2])
            same += list(a.argmax(-1) == b.argmax(-1))
        gaps, same = np.array(gaps), np.array(same)
        agree = ", ".join(f"gap>{m:g}xrange {int(same[gaps > m * rng].sum())}/"
                          f"{int((gaps > m * rng).sum())}" for m in (0.0, 0.01, 0.03, 0.1))
        print(f"[{name}] {os.path.basename(path)} ({size} bytes): dequantized weights, float64 "
              f"activations vs reference.bin: max |diff| {diff:.3e} = {diff / rng:.2e} x range; "
              f"KL(ref||q) per position mean {np.mean(kls):.2e} p90 "
              f"{np.percentile(kls, 90):.2e} max {np.max(kls):.2e} "
              f"(KL(ref||uniform) mean {np.mean(kl_uniform):.2e}); top-1 agreement {agree}")
    if dequant_ref:
        sys.path.insert(0, HERE)
        from make_fixtures import write_fixture  # tools/make_fixtures.py

        write_fixture(os.path.join(out_dir, "reference-dequant.bin"),
                      [("n_seqs", np.array([n_seqs], dtype=np.int64))] + dequant_ref)


def check_llamacpp(name, spec):
    """Optional: llama.cpp (llama-cpp-python) evaluates each GGUF file on the
    reference tokens; prints its difference to reference.bin. Writes nothing."""
    from llama_cpp import Llama

    out_dir = os.path.join(OUT, name)
    ref = read_trpf(os.path.join(out_dir, "reference.bin"))
    n_seqs = int(ref["n_seqs"][0])
    ref_logits = [ref[f"logits.{i}"].astype(np.float64) for i in range(n_seqs)]
    rng = logit_range(ref_logits)
    deq_path = os.path.join(out_dir, "reference-dequant.bin")
    deq = read_trpf(deq_path) if os.path.exists(deq_path) else {}
    for fmt in spec["gguf"]:
        path = os.path.join(out_dir, f"model-{fmt}.gguf")
        # type_k / type_v 0 = GGML_TYPE_F32: llama.cpp's default F16 KV cache
        # alone moves the logits by ~3e-4 x range.
        llm = Llama(model_path=path, n_ctx=64, n_batch=64, n_ubatch=64, logits_all=True,
                    n_threads=2, verbose=False, type_k=0, type_v=0)
        diff, kls, ddiff, dkls = 0.0, [], 0.0, []
        for i in range(n_seqs):
            toks = [int(t) for t in ref[f"tokens.{i}"]]
            llm.reset()
            llm.eval(toks)
            got = np.array(llm.scores[: len(toks)], dtype=np.float64)
            diff = max(diff, float(np.abs(got - ref_logits[i]).max()))
            p, q = softmax64(ref_logits[i]), softmax64(got)
            kls += list(np.sum(p * (np.log(p) - np.log(q)), axis=-1))
            if f"logits.{fmt}.{i}" in deq:
                d = deq[f"logits.{fmt}.{i}"].astype(np.float64)
                ddiff = max(ddiff, float(np.abs(got - d).max()))
                p = softmax64(d)
                dkls += list(np.sum(p * (np.log(p) - np.log(q)), axis=-1))
        if fmt == "f32":  # greedy continuation, one token at a time
            llm.reset()
            llm.eval([int(t) for t in ref["greedy.prompt"]])
            toks = []
            for _ in range(len(ref["greedy.tokens"])):
                toks.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                llm.eval([toks[-1]])
            print(f"[{name}] llama.cpp f32 greedy {toks} "
                  f"{'==' if toks == ref['greedy.tokens'].tolist() else '!='} greedy.tokens")
            assert toks == ref["greedy.tokens"].tolist()
        del llm
        extra = ""
        if dkls:
            extra = (f"; vs reference-dequant.bin max |diff| {ddiff:.3e} = {ddiff / rng:.2e} x "
                     f"range, KL mean {np.mean(dkls):.2e} max {np.max(dkls):.2e}")
        print(f"[{name}] llama.cpp {fmt}: vs reference.bin max |diff| {diff:.3e} = "
              f"{diff / rng:.2e} x range, KL mean {np.mean(kls):.2e} max {np.max(kls):.2e}"
              + extra)
        if fmt == "f32":
            assert diff <= 1e-3 * rng, (path, diff)


def total_size():
    total = 0
    for root, _, files in os.walk(OUT):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "hf":
        import torch

        torch.set_num_threads(2)
        for name, spec in SPECS.items():
            make_hf(name, spec)
    elif what == "gguf":
        for name, spec in SPECS.items():
            make_gguf(name, spec)
    elif what == "llamacpp":
        for name, spec in SPECS.items():
            check_llamacpp(name, spec)
        return
    else:
        print(__doc__)
        sys.exit(2)
    print(f"tests/fixtures/llama: {total_size()} bytes in total")


if __name__ == "__main__":
    main()
