#!/usr/bin/env python3
"""LLaVA references from transformers for troupe's fidelity tests.

Not run by CI; the outputs are committed. Run from the repository root with
Debian's python3-torch 1.13 and transformers 4.46.3 in /work/pydeps (see
tools/make_llama_fixtures.py for the pip command that installs it):

    # the random-weight fixtures under tests/fixtures/llava/{odd,full}
    PYTHONPATH=/work/pydeps /usr/bin/python3 tools/make_llava_fixtures.py

    # references for any Hugging Face LLaVA folder (e.g. the bundled model)
    PYTHONPATH=/work/pydeps /usr/bin/python3 tools/make_llava_fixtures.py \\
        --model assets/tiny-llava-shapes --out DIR \\
        --images a.npy b.png ... --prompts prompts.json [--max-new-tokens 16]

--images: pixel_values as .npy (f32 [3, H, W] or [1, 3, H, W]), or an image
file (.png/.jpg) run through the folder's preprocessor_config.json with
transformers' CLIPImageProcessor (PIL). prompts.json is a list of
{"text": "...", "images": [i, ...]} or {"ids": [...], "images": [...]}: the
text is tokenized with the folder's tokenizer.json (no special tokens added:
put BOS / the chat template into the text) and holds ONE image token per
image, in order; "images" indexes --images. Without --prompts one prompt is
used per image: [BOS?] <image> + the ids of "What is in the image?".

Every reference is computed in float64 (model.double()) from the committed
float32 weights, with use_cache=False.

Image tokens: transformers 4.46 has two paths in LlavaForConditionalGeneration
.forward. "Legacy" (taken when an input row holds fewer image tokens than
config.image_seq_length) expands each single <image> token itself; the other
path expects ids ALREADY expanded by the processor (tokens_per_image copies
of image_token_index per image) and scatters the image features over them.
This script always feeds the expanded ids, and sets config.image_seq_length =
tokens_per_image so the second path is the one taken (it asserts so). The
compact ids (one image token per image, what troupe's expand_image_tokens
takes) are stored next to the expanded ones.

Files written (per fixture folder, or DIR):
  config.json, model.safetensors, generation_config.json  (random fixtures)
  reference.bin  TRPF (tests/kernels/fixture_reader.hpp):
    pixel_values     f32 [n_images, 3, H, W]
    vision_features  f32 [n_images * tokens_per_image, vision_hidden]
                     hidden_states[vision_feature_layer] after the select
                     strategy (CLS dropped for "default"), before the projector
    image_features   f32 [n_images * tokens_per_image, text_hidden] projector out
    tokens_per_image i64 [1]
    n_prompts        i64 [1]
    prompt.<p>.ids       i64 [n]  compact (one image token per image)
    prompt.<p>.expanded  i64 [L]  what transformers was fed
    prompt.<p>.images    i64 [k]  indices into pixel_values, in prompt order
    prompt.<p>.logits    f32 [L, vocab] teacher-forced
    prompt.<p>.greedy    i64 [m]  greedy continuation (argmax of float64 logits,
                                  full forward per step; stops after EOS when
                                  the config has one, --model mode only)
    prompt.<p>.greedy_gap f32 [m] top-1 minus top-2 logit at each greedy step

  reference-mixed.bin  (random fixtures only) TRPF: n_prompts,
    image_features and prompt.<p>.logits as above, from transformers run on
    the weights of troupe's mixed plan dequantized (vision encoder matrices
    int8 per row, projector f16, decoder matrices incl. embeddings int8
    ("odd") or Q4_0 ("full"); patch / class / position embeddings, norms and
    biases f32), with the quantizers of kernels/quant.cpp re-implemented in
    numpy float32. What is left between troupe's mixed model and this is
    troupe's int8 quantization of activations in integer matmuls.

Random fixtures (float32 safetensors, weights N(0, 0.1), biases N(0, 0.05),
LayerNorm / RMSNorm weights 1 + 0.1 N(0,1), class / position embeddings
N(0, 0.5)):
  odd   CLIP hidden 42, 3 heads x 14, MLP 72, 3 layers, image 30, patch 6
        (25 patches), quick_gelu, vision_feature_layer -2 (2 layers run),
        strategy "default" (25 tokens/image); LLaMA hidden 48, 6 heads x 8,
        2 KV heads, FFN 80, 3 layers, vocab 300, untied; image token 297
  full  CLIP hidden 32, 4 heads x 8, MLP 64, 3 layers, image 32, patch 8
        (16 patches), gelu, vision_feature_layer 1 (1 layer run), strategy
        "full" (17 tokens/image), layer_norm_eps 1e-6; LLaMA hidden 64,
        4 heads x 16, 1 KV head, FFN 96, 2 layers, vocab 320, tied; image
        token 3 (every text matrix has 32k columns, so q4_0 applies)
  Both: projector gelu, rms_norm_eps 1e-5, bos 1, eos 2, two images; prompt 0
  holds both images, prompt 1 image 1 only; 10 greedy tokens without stopping.
The script also runs an independent float64 numpy CLIP + projector forward
and checks transformers' vision features against it.
"""

import argparse
import json
import math
import os
import shutil
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.normpath(os.path.join(HERE, "..", "tests", "fixtures", "llava"))
BOS, EOS = 1, 2
GREEDY_TOKENS = 10

SPECS = {
    "odd": dict(
        seed=401,
        vision=dict(hidden_size=42, num_attention_heads=3, intermediate_size=72,
                    num_hidden_layers=3, image_size=30, patch_size=6, hidden_act="quick_gelu",
                    layer_norm_eps=1e-5, projection_dim=16),
        text=dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                  intermediate_size=80, num_hidden_layers=3, vocab_size=300,
                  tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=512,
                  rope_theta=10000.0),
        llava=dict(image_token_index=297, vision_feature_layer=-2,
                   vision_feature_select_strategy="default", projector_hidden_act="gelu"),
        prompts=[([BOS, 17, 250, "I", 9, 33, 120, "I", 77, 5, 64, 199], [0, 1]),
                 ([BOS, "I", 41, 8, 150, 260], [1])],
        mixed_text_format="int8"),
    "full": dict(
        seed=402,
        vision=dict(hidden_size=32, num_attention_heads=4, intermediate_size=64,
                    num_hidden_layers=3, image_size=32, patch_size=8, hidden_act="gelu",
                    layer_norm_eps=1e-6, projection_dim=16),
        text=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                  intermediate_size=96, num_hidden_layers=2, vocab_size=320,
                  tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=512,
                  rope_theta=10000.0),
        llava=dict(image_token_index=3, vision_feature_layer=1,
                   vision_feature_select_strategy="full", projector_hidden_act="gelu"),
        prompts=[([BOS, 200, "I", 12, 301, 45, "I", 6, 88, 140], [0, 1]),
                 ([BOS, 99, 7, "I", 250, 31], [1])],
        mixed_text_format="q4_0"),
}


def write_fixture(path, arrays):
    sys.path.insert(0, HERE)
    from make_fixtures import write_fixture as wf  # tools/make_fixtures.py
    wf(path, arrays)  # an absolute path makes os.path.join keep it


# --------------------------------------------------------------------------
# independent float64 numpy CLIP + projector
# --------------------------------------------------------------------------


def _ln(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _act(name, x):
    if name == "quick_gelu":
        return x / (1 + np.exp(-1.702 * x))
    if name in ("gelu", "gelu_python"):
        return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    raise ValueError(name)


def numpy_image_features(sd, cfg, pixels):
    """sd: state dict (numpy float64, 4.46 names); pixels [N, 3, H, W]."""
    vc = cfg.vision_config
    p = "vision_tower.vision_model."
    d, heads, ps = vc.hidden_size, vc.num_attention_heads, vc.patch_size
    hd = d // heads
    n_img, _, h, w = pixels.shape
    g = h // ps
    conv = sd[p + "embeddings.patch_embedding.weight"].reshape(d, -1)
    patches = pixels.reshape(n_img, 3, g, ps, g, ps).transpose(0, 2, 4, 1, 3, 5).reshape(n_img, g * g, -1)
    x = np.concatenate([np.broadcast_to(sd[p + "embeddings.class_embedding"], (n_img, 1, d)),
                        patches @ conv.T], axis=1) + sd[p + "embeddings.position_embedding.weight"]
    x = _ln(x, sd[p + "pre_layrnorm.weight"], sd[p + "pre_layrnorm.bias"], vc.layer_norm_eps)
    L = vc.num_hidden_layers
    layer = cfg.vision_feature_layer
    run = layer if layer >= 0 else L + 1 + layer
    for i in range(run):
        q = f"{p}encoder.layers.{i}."
        lin = lambda t, n: t @ sd[q + n + ".weight"].T + sd[q + n + ".bias"]  # noqa: E731
        hn = _ln(x, sd[q + "layer_norm1.weight"], sd[q + "layer_norm1.bias"], vc.layer_norm_eps)
        t = x.shape[1]
        qs = lin(hn, "self_attn.q_proj").reshape(n_img, t, heads, hd)
        ks = lin(hn, "self_attn.k_proj").reshape(n_img, t, heads, hd)
        vs = lin(hn, "self_attn.v_proj").reshape(n_img, t, heads, hd)
        s = np.einsum("nqhd,nkhd->nhqk", qs, ks) / math.sqrt(hd)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        att = np.einsum("nhqk,nkhd->nqhd", s, vs).reshape(n_img, t, d)
        x = x + lin(att, "self_attn.out_proj")
        hn = _ln(x, sd[q + "layer_norm2.weight"], sd[q + "layer_norm2.bias"], vc.layer_norm_eps)
        x = x + lin(_act(vc.hidden_act, lin(hn, "mlp.fc1")), "mlp.fc2")
    if cfg.vision_feature_select_strategy == "default":
        x = x[:, 1:]
    m = "multi_modal_projector."
    y = x @ sd[m + "linear_1.weight"].T + sd[m + "linear_1.bias"]
    y = _act(cfg.projector_hidden_act, y) @ sd[m + "linear_2.weight"].T + sd[m + "linear_2.bias"]
    return x.reshape(-1, d), y.reshape(-1, y.shape[-1])


# --------------------------------------------------------------------------
# references for one model
# --------------------------------------------------------------------------


def tokens_per_image(cfg):
    vc = cfg.vision_config
    n = (vc.image_size // vc.patch_size) ** 2
    return n if cfg.vision_feature_select_strategy == "default" else n + 1


def expand(ids, image_token, per_image):
    out = []
    for t in ids:
        out.extend([image_token] * per_image if t == image_token else [t])
    return out


def references(torch, model, pixels, prompts, eos, max_new, state64=None):
    """model: float64 LlavaForConditionalGeneration; pixels float32 numpy
    [N, 3, H, W]; prompts: [(compact ids, image indices)]. Returns arrays."""
    cfg = model.config
    per = tokens_per_image(cfg)
    model.config.image_seq_length = per  # take the "already expanded" path
    pv = torch.from_numpy(pixels).double()
    with torch.no_grad():
        out = model.vision_tower(pv, output_hidden_states=True)
        feats = out.hidden_states[cfg.vision_feature_layer]
        if cfg.vision_feature_select_strategy == "default":
            feats = feats[:, 1:]
        proj = model.multi_modal_projector(feats)
        got = model.get_image_features(pv, cfg.vision_feature_layer,
                                       cfg.vision_feature_select_strategy)
    assert torch.equal(got, proj)
    feats = feats.reshape(-1, feats.shape[-1]).numpy()
    proj = proj.reshape(-1, proj.shape[-1]).numpy()
    if state64 is not None:
        nf, npj = numpy_image_features(state64, cfg, pixels.astype(np.float64))
        ef = np.abs(nf - feats).max() / (feats.max() - feats.min())
        ep = np.abs(npj - proj).max() / (proj.max() - proj.min())
        print(f"  numpy float64 vs transformers: vision features {ef:.2e}, projector {ep:.2e} x range")
        assert ef < 1e-9 and ep < 1e-9
    arrays = [("pixel_values", pixels.astype(np.float32)),
              ("vision_features", feats.astype(np.float32)),
              ("image_features", proj.astype(np.float32)),
              ("tokens_per_image", np.array([per], dtype=np.int64)),
              ("n_prompts", np.array([len(prompts)], dtype=np.int64))]
    tok = cfg.image_token_index
    embed = model.get_input_embeddings()
    for p, (ids, imgs) in enumerate(prompts):
        assert sum(1 for t in ids if t == tok) == len(imgs), "one image token per image"
        full = expand(ids, tok, per)
        sel = pv[list(imgs)]

        def logits_of(seq):
            x = torch.tensor([seq])
            with torch.no_grad():
                lg = model(input_ids=x, pixel_values=sel, use_cache=False).logits[0]
                # the same through inputs_embeds, merged by hand: proves which path ran
                e = embed(x)
                f = model.get_image_features(sel, cfg.vision_feature_layer,
                                             cfg.vision_feature_select_strategy).reshape(-1, e.shape[-1])
                e[x == tok] = f
                lg2 = model.language_model(inputs_embeds=e, use_cache=False).logits[0]
            assert torch.equal(lg, lg2), "transformers did not scatter features over expanded ids"
            return lg

        logits = logits_of(full)
        seq, new, gaps = list(full), [], []
        for _ in range(max_new):
            last = logits_of(seq)[-1] if new else logits[-1]
            top2 = torch.topk(last, 2).values
            t = int(last.argmax())
            new.append(t)
            gaps.append(float(top2[0] - top2[1]))
            seq.append(t)
            if eos is not None and t in eos:
                break
        print(f"  prompt {p}: {len(ids)} ids -> {len(full)} expanded, images {list(imgs)}, "
              f"logit range {float(logits.max() - logits.min()):.3f}, greedy {new} "
              f"(min gap {min(gaps) if gaps else float('nan'):.4f})")
        arrays += [(f"prompt.{p}.ids", np.array(ids, dtype=np.int64)),
                   (f"prompt.{p}.expanded", np.array(full, dtype=np.int64)),
                   (f"prompt.{p}.images", np.array(imgs, dtype=np.int64)),
                   (f"prompt.{p}.logits", logits.numpy().astype(np.float32)),
                   (f"prompt.{p}.greedy", np.array(new, dtype=np.int64)),
                   (f"prompt.{p}.greedy_gap", np.array(gaps, dtype=np.float32))]
    return arrays


# --------------------------------------------------------------------------
# troupe's weight formats, dequantized (kernels/quant.cpp), for the
# mixed-precision references
# --------------------------------------------------------------------------


def fake_int8_sym(w):
    """Per row: d = max|w| / 127, q = clamp(roundf(w / d)), w' = d * q (float32)."""
    w = w.astype(np.float32)
    d = (np.abs(w).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    x = (w * inv).astype(np.float32)
    q = np.clip(np.sign(x) * np.floor(np.abs(x) + np.float32(0.5)), -127, 127).astype(np.float32)
    return (d * q).astype(np.float32)


def fake_q4_0(w):
    """ggml's quantize_row_q4_0 then dequantize_row_q4_0 (float32)."""
    w = w.astype(np.float32)
    rows, cols = w.shape
    assert cols % 32 == 0
    b = w.reshape(rows, cols // 32, 32)
    idx = np.abs(b).argmax(axis=2)  # first index of the largest |v| (ggml keeps the first)
    mx = np.take_along_axis(b, idx[..., None], axis=2)
    d = (mx / np.float32(-8)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    x = (b * inv + np.float32(8.5)).astype(np.float32)
    q = np.minimum(15, np.trunc(x)).astype(np.float32)
    dh = d.astype(np.float16).astype(np.float32)
    return ((q - 8) * dh).astype(np.float32).reshape(rows, cols)


def mixed_state(state, text_format):
    """The weights troupe's mixed plan holds: vision matrices int8, projector
    f16, every decoder matrix (embeddings and LM head included) `text_format`;
    the patch embedding, class / position embeddings, norms and biases f32."""
    fake = {"int8": fake_int8_sym, "q4_0": fake_q4_0}[text_format]
    out = {}
    for k, v in state.items():
        v = v.astype(np.float32)
        if v.ndim == 2 and k.startswith("vision_tower.") and ".encoder.layers." in k:
            v = fake_int8_sym(v)
        elif v.ndim == 2 and k.startswith("multi_modal_projector."):
            v = v.astype(np.float16).astype(np.float32)
        elif v.ndim == 2 and k.startswith("language_model."):
            v = fake(v)
        out[k] = v
    return out


# --------------------------------------------------------------------------
# random fixtures
# --------------------------------------------------------------------------


def make_random(name, spec):
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    out_dir = os.path.join(OUT, name)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    torch.manual_seed(spec["seed"])
    vision = dict(spec["vision"])
    text = dict(spec["text"], bos_token_id=BOS, eos_token_id=EOS, hidden_act="silu")
    cfg = LlavaConfig(vision_config=vision, text_config=text, **spec["llava"])
    cfg.image_seq_length = tokens_per_image(cfg)
    model = LlavaForConditionalGeneration(cfg).float().eval()
    gen = torch.Generator().manual_seed(spec["seed"])
    with torch.no_grad():
        for pname, p in sorted(model.named_parameters()):
            if "class_embedding" in pname or "position_embedding" in pname:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1 and pname.endswith(".weight"):  # LayerNorm / RMSNorm
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out_dir, safe_serialization=True)
    print(f"[{name}] wrote {sorted(os.listdir(out_dir))}")
    model = LlavaForConditionalGeneration.from_pretrained(out_dir, torch_dtype=torch.float32).eval()
    from safetensors.numpy import load_file
    stored = load_file(os.path.join(out_dir, "model.safetensors"))
    state64 = {k: v.astype(np.float64) for k, v in stored.items()}
    model = model.double()
    print(f"[{name}] attn_implementation={model.config._attn_implementation}, "
          f"tokens/image {tokens_per_image(model.config)}")
    vc = model.config.vision_config
    pixels = (torch.rand((2, 3, vc.image_size, vc.image_size), generator=gen) * 3.9 - 1.8).numpy()
    tok = model.config.image_token_index
    prompts = [([tok if t == "I" else t for t in ids], imgs) for ids, imgs in spec["prompts"]]
    arrays = references(torch, model, pixels.astype(np.float32), prompts, None, GREEDY_TOKENS,
                        state64)
    write_fixture(os.path.join(out_dir, "reference.bin"), arrays)

    # The same prompts on the mixed-precision weights, dequantized.
    fmt = spec["mixed_text_format"]
    mixed = mixed_state(stored, fmt)
    if model.config.text_config.tie_word_embeddings:
        mixed["language_model.lm_head.weight"] = mixed["language_model.model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v).double() for k, v in mixed.items()},
                                                strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    print(f"[{name}] mixed: vision int8, projector f16, decoder {fmt} (dequantized)")
    arrays = references(torch, model, pixels.astype(np.float32), prompts, None, 0)
    keep = ("image_features", "logits")
    write_fixture(os.path.join(out_dir, "reference-mixed.bin"),
                  [(k, v) for k, v in arrays if k.endswith(keep) or k == "n_prompts"])


# --------------------------------------------------------------------------
# any HF folder
# --------------------------------------------------------------------------


def load_image(path, folder):
    if path.endswith(".npy"):
        a = np.load(path).astype(np.float32)
        return a[0] if a.ndim == 4 else a
    from PIL import Image
    from transformers import CLIPImageProcessor
    proc = CLIPImageProcessor.from_pretrained(folder)
    return proc(images=Image.open(path), return_tensors="np")["pixel_values"][0].astype(np.float32)


def make_for_model(args):
    import torch
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(args.model, torch_dtype=torch.float32)
    model = model.double().eval()
    cfg = model.config
    pixels = np.stack([load_image(p, args.model) for p in args.images])
    tok = cfg.image_token_index
    tokenizer = None
    if os.path.exists(os.path.join(args.model, "tokenizer.json")):
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    if args.prompts:
        with open(args.prompts) as f:
            spec = json.load(f)
    else:
        spec = [{"text": "<image>\nWhat is in the image?", "images": [i]} for i in range(len(pixels))]
    prompts = []
    for s in spec:
        if "ids" in s:
            ids = list(s["ids"])
        else:
            assert tokenizer is not None, "text prompts need tokenizer.json"
            ids = tokenizer.encode(s["text"], add_special_tokens=False).ids
        prompts.append((ids, list(s["images"])))
    eos = cfg.text_config.eos_token_id
    gen_path = os.path.join(args.model, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id", eos)
    eos = None if eos is None else (set(eos) if isinstance(eos, list) else {eos})
    arrays = references(torch, model, pixels, prompts, eos, args.max_new_tokens)
    os.makedirs(args.out, exist_ok=True)
    write_fixture(os.path.abspath(os.path.join(args.out, "reference.bin")), arrays)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a Hugging Face LLaVA folder (default: the random fixtures)")
    ap.add_argument("--out", help="output folder for --model")
    ap.add_argument("--images", nargs="*", default=[])
    ap.add_argument("--prompts")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--only", nargs="*", default=list(SPECS))
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    if args.model:
        if not args.out or not args.images:
            ap.error("--model needs --out and --images")
        make_for_model(args)
        return
    for name in args.only:
        make_random(name, SPECS[name])


if __name__ == "__main__":
    main()
