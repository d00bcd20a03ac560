#!/usr/bin/env python3
"""tiny-llava-shapes that takes video: a model folder with troupe's video keys
and a transformers reference for the C++ fidelity test of the video path.
Written to tests/fixtures/llava_video/.

Not run by CI; the outputs are committed. Run from the repository root with
transformers 4.57.1, numpy and safetensors, torch 2.5.1, PyAV and pillow:

    PYTHONPATH=/tmp/pydeps-audio:/tmp/pydeps-torch:/tmp/pydeps-av:/tmp/pydeps-pil \\
        python3 tools/make_video_model_fixture.py

(/tmp/pydeps-* as `python3 -m pip install --target DIR` makes them:
transformers==4.57.1 numpy safetensors / torch==2.5.1 / av / pillow.)

The video path modelled (LLaVA-NeXT-Video, transformers'
LlavaNextVideoModel.get_video_features, plus LLaVA-NeXT's
mm_newline_position "frame"): each sampled frame goes through the image
preprocessor and the vision tower as an image (hidden_states
[vision_feature_layer], CLS dropped for the "default" strategy: 8 x 8 = 64
rows), is pooled spatially (2 x 2 windows, stride 2, on the row-major patch
grid: 4 x 4 = 16 rows), projected by the LLaVA projector, and followed by one
learned row `image_newline`: 17 rows a frame.

What it writes:
- config.json: assets/tiny-llava-shapes/config.json plus troupe's video keys
  (a troupe extension of the LLaVA config, named after transformers'
  LlavaNextVideoConfig where it has them): video_token_index 397,
  spatial_pool_stride 2, spatial_pool_mode "average", video_frame_newline
  true (an `image_newline` row [text hidden] after each frame's rows);
- tokenizer.json / tokenizer_config.json: the shapes tokenizer with the added
  special token "<video>" (id 397, one past the largest id and past the
  decoder's 397 rows: its positions always take video rows, never an
  embedding);
- video.safetensors: `image_newline` f32 [128], N(0, 1 / 128) from a seeded
  NumPy generator;
- model.safetensors.index.json over video.safetensors and text.safetensors,
  a relative symbolic link to assets/tiny-llava-shapes/model.safetensors
  (committed as a link);
- preprocessor_config.json and generation_config.json: the shapes model's;
- reference.bin, TRPF (tests/kernels/fixture_reader.hpp; the writer of
  tools/make_fixtures.py), computed in float64 (model.double()) from the
  float32 weights, the model being transformers' LlavaForConditionalGeneration
  loaded from assets/tiny-llava-shapes; the clip is
  tests/fixtures/video/square.mp4 (30 frames, 64 x 48), decoded whole with
  PyAV to RGB24, 4 frames sampled as vLLM does (numpy.linspace(0, total - 1,
  4).astype(int): frames 0, 9, 19, 29), each through CLIPImageProcessor
  (the folder's preprocessor_config.json, PIL images):
    pixel_values     f32 [4, 3, 64, 64]
    frame_index      i64 [4]   the frames sampled
    vision_features  f32 [4 * 64, 128] hidden_states[vision_feature_layer]
                     after the select strategy, before the projector (as
                     LlavaForConditionalGeneration.get_image_features)
    pooled           f32 [4 * 16, 128] transformers' LlavaNextVideoPooler
                     ("average", stride 2) per frame on vision_features
    pooled_max       f32 [4 * 16, 128] the same with mode "max"
    video_features   f32 [4 * 17, 128] multi_modal_projector(pooled), then
                     image_newline after each frame's 16 rows: frame f is
                     rows [17 f, 17 f + 17), the last one the newline
    tokens_per_frame i64 [1]   17
    frames           i64 [1]   4
    prompt.ids       i64 [n]   "<video>\\nWhat is in the video?" through the
                     folder's tokenizer.json with its post-processor (BOS
                     <s> = 0 prepended, as tokenizer_config's add_bos_token
                     says); one video token (397)
    prompt.expanded  i64 [L]   the video token replaced by 4 * 17 copies of
                     image_token_index (3), troupe's marker for media rows
    prompt.logits    f32 [L, 397] teacher-forced logits of the language model
                     (+ lm_head) fed inputs_embeds: the marked positions take
                     the video_features rows in order, the others the token
                     embeddings; use_cache=False
With --omni it writes tests/fixtures/llava_omni instead (NumPy only, no
reference): a model that hears and sees video, for the tests of a video's
audio track. It joins the two fixtures: tests/fixtures/llava_hears' config
(its audio tower, "<audio>" 397) plus the video keys above with "<video>" at
398, and links to their weights (audio.safetensors, video.safetensors,
text.safetensors), with an index over the three.

The script asserts that the pooler's "average" and "max" outputs equal a
hand computation of 2 x 2 pooling on the 8 x 8 row-major patch grid, that
the vision features are those get_image_features projects, and that the
language model + lm_head logits equal the full model's on the same
inputs_embeds.
"""

import json
import os
import shutil
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = "assets/tiny-llava-shapes"
OUT = "tests/fixtures/llava_video"
CLIP = "tests/fixtures/video/square.mp4"
FRAMES = 4
STRIDE = 2
PROMPT = "<video>\nWhat is in the video?"
SEED = 1397


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype="<f4")
        header[name] = {"dtype": "F32", "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        blobs.append(a.tobytes())
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)


def safetensors_names(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


def write_fixture(path, arrays):
    sys.path.insert(0, HERE)
    from make_fixtures import write_fixture as wf  # tools/make_fixtures.py
    wf(os.path.abspath(path), arrays)  # an absolute path makes os.path.join keep it


# --------------------------------------------------------------------------
# the model folder
# --------------------------------------------------------------------------


def video_token_id():
    """One past the largest id of the shapes tokenizer (vocabulary and added
    tokens); checked to be at or past the decoder's vocab_size."""
    with open(os.path.join(SRC, "tokenizer.json")) as f:
        tok = json.load(f)
    with open(os.path.join(SRC, "config.json")) as f:
        cfg = json.load(f)
    ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok["added_tokens"]]
    vid = max(ids) + 1
    assert vid >= cfg["text_config"]["vocab_size"], (vid, cfg["text_config"]["vocab_size"])
    return vid


def copy_tokenizer_with_video(src, out, vid):
    """src's tokenizer files with the added special token "<video>" = vid,
    and its preprocessor and generation configs."""
    with open(os.path.join(src, "tokenizer.json")) as f:
        tok = json.load(f)
    assert all(t["id"] != vid for t in tok["added_tokens"])
    tok["added_tokens"].append({"id": vid, "content": "<video>", "single_word": False,
                                "lstrip": False, "rstrip": False, "normalized": False,
                                "special": True})
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tok, f, indent=1, ensure_ascii=False)
    with open(os.path.join(src, "tokenizer_config.json")) as f:
        tc = json.load(f)
    tc["added_tokens_decoder"][str(vid)] = {
        "content": "<video>", "special": True, "normalized": False, "lstrip": False,
        "rstrip": False, "single_word": False}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=2)
    for name in ("preprocessor_config.json", "generation_config.json"):
        shutil.copyfile(os.path.join(src, name), os.path.join(out, name))


def write_folder(out, vid):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(SRC, "config.json")) as f:
        cfg = json.load(f)
    dt = cfg["text_config"]["hidden_size"]
    rng = np.random.default_rng(SEED)
    newline = rng.standard_normal(dt) / np.sqrt(dt)
    t = {"image_newline": newline.astype(np.float32)}
    write_safetensors(os.path.join(out, "video.safetensors"), t)

    link = os.path.join(out, "text.safetensors")
    if os.path.lexists(link):
        os.remove(link)
    os.symlink("../../../assets/tiny-llava-shapes/model.safetensors", link)
    weight_map = {k: "text.safetensors" for k in safetensors_names(link)}
    assert not set(weight_map) & set(t)
    weight_map.update({k: "video.safetensors" for k in t})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)

    cfg.update({"video_token_index": vid, "spatial_pool_stride": STRIDE,
                "spatial_pool_mode": "average", "video_frame_newline": True})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)

    copy_tokenizer_with_video(SRC, out, vid)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("Made by tools/make_video_model_fixture.py (see its docstring); do not edit.\n")
    return t["image_newline"]


# --------------------------------------------------------------------------
# the reference
# --------------------------------------------------------------------------


def sample_frames(path, n):
    """All frames decoded to RGB24, then vLLM's uniform sampling."""
    import av
    with av.open(path) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    idx = np.linspace(0, len(frames) - 1, n).astype(int)
    return idx, [frames[i] for i in idx]


def hand_pool(x, stride, op):
    """x [frames, g*g, d] in row-major patch order -> [frames, (g/s)^2, d]."""
    f, n, d = x.shape
    g = int(round(np.sqrt(n)))
    assert g * g == n and g % stride == 0
    h = g // stride
    w = x.reshape(f, h, stride, h, stride, d)
    return op(w, axis=(2, 4)).reshape(f, h * h, d)


def reference(out, vid, newline):
    import torch
    from PIL import Image
    from tokenizers import Tokenizer
    from transformers import (CLIPImageProcessor, LlavaForConditionalGeneration,
                              LlavaNextVideoConfig)
    from transformers.models.llava_next_video.modeling_llava_next_video import \
        LlavaNextVideoPooler

    torch.set_num_threads(1)
    model = LlavaForConditionalGeneration.from_pretrained(SRC, dtype=torch.float32)
    model = model.double().eval()
    cfg = model.config
    # The decoder's LM head is the stored (untied) one.
    from safetensors.numpy import load_file
    stored = load_file(os.path.join(SRC, "model.safetensors"))
    assert np.array_equal(model.lm_head.weight.detach().numpy(),
                          stored["language_model.lm_head.weight"].astype(np.float64))

    idx, frames = sample_frames(CLIP, FRAMES)
    proc = CLIPImageProcessor.from_pretrained(out)
    pixels = proc(images=[Image.fromarray(f) for f in frames],
                  return_tensors="np")["pixel_values"].astype(np.float32)
    vc = cfg.vision_config
    assert pixels.shape == (FRAMES, 3, vc.image_size, vc.image_size), pixels.shape
    pv = torch.from_numpy(pixels).double()

    with torch.no_grad():
        hs = model.vision_tower(pv, output_hidden_states=True).hidden_states
        feats = hs[cfg.vision_feature_layer]
        if cfg.vision_feature_select_strategy == "default":
            feats = feats[:, 1:]
        got = model.get_image_features(pv, cfg.vision_feature_layer,
                                       cfg.vision_feature_select_strategy)
        got = torch.stack(list(got)) if isinstance(got, (list, tuple)) else got
        assert torch.equal(got.reshape(-1, got.shape[-1]),
                           model.multi_modal_projector(feats).reshape(-1, got.shape[-1]))

        pooled = {}
        for mode in ("average", "max"):
            vcfg = LlavaNextVideoConfig(vision_config=vc.to_dict(),
                                        text_config=cfg.text_config.to_dict(),
                                        spatial_pool_mode=mode, spatial_pool_stride=STRIDE)
            pooler = LlavaNextVideoPooler(vcfg).double().eval()
            pooled[mode] = pooler(feats)
        per_frame = pooled["average"].shape[1]
        proj = model.multi_modal_projector(pooled["average"])  # [F, 16, 128]
        nl = torch.from_numpy(newline.astype(np.float64))
        video = torch.cat([proj, nl.expand(FRAMES, 1, -1)], dim=1)  # [F, 17, 128]
        per = video.shape[1]
        video = video.reshape(-1, video.shape[-1])

    f64 = feats.numpy()
    for mode, op in (("average", np.mean), ("max", np.max)):
        hand = hand_pool(f64, STRIDE, op)
        err = np.abs(hand - pooled[mode].numpy()).max()
        print(f"  LlavaNextVideoPooler {mode} vs hand 2x2 pooling: max abs diff {err:.2e}")
        assert pooled[mode].shape == hand.shape and err <= 1e-12 * np.abs(hand).max()

    tokenizer = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    ids = tokenizer.encode(PROMPT).ids  # post-processor: <s> first
    with open(os.path.join(SRC, "tokenizer_config.json")) as f:
        if json.load(f).get("add_bos_token"):
            assert ids[0] == cfg.text_config.bos_token_id, ids
    assert ids.count(vid) == 1, ids
    img = cfg.image_token_index
    assert img not in ids
    expanded = []
    for t in ids:
        expanded.extend([img] * (FRAMES * per) if t == vid else [t])
    x = torch.tensor([expanded])
    with torch.no_grad():
        e = model.get_input_embeddings()(x)
        mask = x == img
        assert int(mask.sum()) == video.shape[0]
        e[mask] = video
        h = model.language_model(inputs_embeds=e, use_cache=False).last_hidden_state
        logits = model.lm_head(h)[0]
        full = model(inputs_embeds=e, use_cache=False).logits[0]
    assert torch.equal(logits, full)
    print(f"  clip {CLIP}: frames {idx.tolist()}; prompt {len(ids)} ids -> {len(expanded)} "
          f"expanded; logit range {float(logits.max() - logits.min()):.3f}; "
          f"max |video_features| {float(video.abs().max()):.4f}")

    d = f64.shape[-1]
    arrays = [("pixel_values", pixels),
              ("frame_index", idx.astype(np.int64)),
              ("vision_features", f64.reshape(-1, d).astype(np.float32)),
              ("pooled", pooled["average"].numpy().reshape(-1, d).astype(np.float32)),
              ("pooled_max", pooled["max"].numpy().reshape(-1, d).astype(np.float32)),
              ("video_features", video.numpy().astype(np.float32)),
              ("tokens_per_frame", np.array([per], dtype=np.int64)),
              ("frames", np.array([FRAMES], dtype=np.int64)),
              ("prompt.ids", np.array(ids, dtype=np.int64)),
              ("prompt.expanded", np.array(expanded, dtype=np.int64)),
              ("prompt.logits", logits.numpy().astype(np.float32))]
    assert per_frame + 1 == per
    write_fixture(os.path.join(out, "reference.bin"), arrays)


def write_omni(out):
    """tests/fixtures/llava_omni: llava_hears + the video keys (see the docstring)."""
    hears = "tests/fixtures/llava_hears"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(hears, "config.json")) as f:
        cfg = json.load(f)
    vid = cfg["audio_token_index"] + 1
    cfg.update({"video_token_index": vid, "spatial_pool_stride": STRIDE,
                "spatial_pool_mode": "average", "video_frame_newline": True})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    weight_map = {}
    for name, target in (("text.safetensors", "../../../assets/tiny-llava-shapes/model.safetensors"),
                         ("audio.safetensors", "../llava_hears/audio.safetensors"),
                         ("video.safetensors", "../llava_video/video.safetensors")):
        link = os.path.join(out, name)
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(target, link)
        for k in safetensors_names(link):
            assert k not in weight_map, k
            weight_map[k] = name
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
    copy_tokenizer_with_video(hears, out, vid)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("Made by tools/make_video_model_fixture.py --omni (see its docstring); "
                "do not edit.\n")
    print(f"{out}: <audio> {cfg['audio_token_index']}, <video> {vid}")


def main():
    if "--omni" in sys.argv[1:]:
        write_omni("tests/fixtures/llava_omni")
        return
    vid = video_token_id()
    print(f"video token {vid}")
    newline = write_folder(OUT, vid)
    reference(OUT, vid, newline)


if __name__ == "__main__":
    main()
