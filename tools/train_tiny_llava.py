"""Trains troupe's bundled tiny LLaVA on the synthetic shapes set (docs/shapes.md)
and saves it in the Hugging Face layout.

The committed model was made by these runs (about 3 hours on 2 CPU
cores in all; each resumes the previous one's checkpoint in --work, which
the third took from build-train2 to build-train3):

    PYTHONPATH=/work/pydeps /usr/bin/python3 tools/train_tiny_llava.py \
        --work build-train2 --out assets/tiny-llava-shapes \
        --scenes 60000 --vision-steps 1500 --steps 1500 --eval-images 48
    PYTHONPATH=/work/pydeps /usr/bin/python3 tools/train_tiny_llava.py \
        --work build-train2 --out assets/tiny-llava-shapes \
        --scenes 60000 --vision-steps 1500 --steps 2500 --lr 1e-3 --restart-schedule \
        --type-weights exists=4,color_of=3,where=3 --eval-every 500 --eval-images 32
    # the attention loss: started with --steps 4500 --lr 1e-3 and stopped
    # at the step-2800 checkpoint, then:
    PYTHONPATH=/work/pydeps /usr/bin/python3 tools/train_tiny_llava.py \
        --work build-train3 --out build-train3/out \
        --scenes 60000 --vision-steps 1500 --steps 3800 --lr 8e-4 --restart-schedule \
        --type-weights exists=4,color_of=3,where=3 --attn-weight 0.3 --eval-every 250 --eval-images 48
    # round 2 of the attention loss, stronger, with color_of weighted most:
    PYTHONPATH=/work/pydeps /usr/bin/python3 tools/train_tiny_llava.py \
        --work build-train3 --out build-train3/out \
        --scenes 60000 --vision-steps 1500 --steps 4800 --lr 6e-4 --restart-schedule \
        --type-weights color_of=6,exists=3,where=3 --attn-weight 0.5 --eval-every 250 --eval-images 48

Stage 1 trains the vision tower alone on a per-patch shape/color loss with
large batches (a from-scratch ViT learns shapes far faster from that dense
signal than from answer tokens); stage 2 trains the whole model on captions
and questions, keeping the per-patch loss as an auxiliary term; with
--attn-weight, questions that name an object by its attributes also teach
head 0 of --attn-layers to attend, at the last prompt token, to that
object's patches (the image precedes the question in the LLaVA layout, so
the answer must find the object by content). The scenes
(--scenes, rendered at random sides and resized by the model's
preprocessor) are generated once in 2 processes and cached in --work.

Needs torch and transformers (PyPI's transformers 4.46 over Debian's
python3-torch 1.13 works; Debian's torch uses whatever BLAS the system's
libblas.so.3 alternative points at: install libopenblas0-pthread first or
it is ~25x slower), tokenizers, numpy and Pillow. CPU only. Resumable:
checkpoints in --work (vision.pt during stage 1, checkpoint.pt during
stage 2) are written every 100 steps and picked up on restart; the final
model is written to --out after the last step (or with --export-only from
the newest checkpoint). The model card's accuracy table comes from
tools/eval_shapes.py, which runs the C++ `troupe generate`.
"""

import argparse
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shapes  # noqa: E402

IMAGE_SIZE = 64
PATCH = 8
MEAN = [0.48145466, 0.4578275, 0.40821073]  # CLIP's
STD = [0.26862954, 0.26130258, 0.27577711]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}{% endfor %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def build_tokenizer():
    """A byte-level BPE whose merges make every word of the spec one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<image>"]
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        min_frequency=1,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = shapes.texts_for_vocabulary()
    corpus += ["USER: <image>\n" + q + " ASSISTANT: " for q in corpus[:50]]
    corpus = corpus * 4
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


def resize_crop(img: Image.Image) -> np.ndarray:
    """The geometric half of CLIPImageProcessor with this model's
    preprocessor_config.json: shortest edge to 64 (bicubic, PIL), center crop
    64. Returns uint8 [64, 64, 3]."""
    img = img.convert("RGB")
    w, h = img.size
    if min(w, h) != IMAGE_SIZE:
        if w <= h:
            nw, nh = IMAGE_SIZE, int(IMAGE_SIZE * h / w)
        else:
            nw, nh = int(IMAGE_SIZE * w / h), IMAGE_SIZE
        img = img.resize((nw, nh), Image.BICUBIC)
    w, h = img.size
    left, top = (w - IMAGE_SIZE) // 2, (h - IMAGE_SIZE) // 2
    img = img.crop((left, top, left + IMAGE_SIZE, top + IMAGE_SIZE))
    return np.asarray(img)


def normalize(a: np.ndarray) -> np.ndarray:
    """Rescale and normalize uint8 [..., 64, 64, 3] to float [..., 3, 64, 64]."""
    a = a.astype(np.float32) / 255.0
    a = (a - np.array(MEAN, np.float32)) / np.array(STD, np.float32)
    return np.moveaxis(a, -1, -3)


def preprocess(img: Image.Image) -> np.ndarray:
    """CLIPImageProcessor with this model's preprocessor_config.json."""
    return normalize(resize_crop(img))


def _make_chunk(args):
    seed, chunk, n = args
    rng = random.Random(seed * 1_000_003 + chunk)
    imgs, labels, scenes = [], [], []
    for _ in range(n):
        scene = shapes.make_scene(rng)
        side = rng.choice([64, 64, 80, 96, 128, 160, 224])
        imgs.append(resize_crop(shapes.render(scene, side, rng)))
        labels.append(patch_labels(scene))
        scenes.append(scene)
    return np.stack(imgs), np.stack(labels), scenes


def load_dataset(work, n, seed, procs=2):
    """`n` scenes drawn from `seed`, rendered at random sides and resized to
    64x64 by the preprocessor, with their per-patch labels; generated once
    (in `procs` processes) and cached in --work."""
    path = os.path.join(work, f"data-{seed}-{n}.npz")
    if not os.path.exists(path):
        import multiprocessing

        chunk = 1000
        jobs = [(seed, i, min(chunk, n - i * chunk)) for i in range((n + chunk - 1) // chunk)]
        t0 = time.time()
        with multiprocessing.Pool(procs) as pool:
            parts = pool.map(_make_chunk, jobs)
        np.savez(path + ".tmp.npz", images=np.concatenate([p[0] for p in parts]),
                 labels=np.concatenate([p[1] for p in parts]),
                 scenes=json.dumps([s for p in parts for s in p[2]]))
        os.replace(path + ".tmp.npz", path)
        print(f"generated {n} scenes in {time.time() - t0:.0f}s", flush=True)
    d = np.load(path)
    return d["images"], d["labels"], json.loads(str(d["scenes"]))


def patch_labels(scene) -> np.ndarray:
    """Per-patch targets of the auxiliary vision loss: [patches, 2] with the
    shape (0 = background, 1 + index in SHAPES) and color (0 = background,
    1 + index in COLORS) of the object covering at least a quarter of the
    patch. Training only: the head that predicts them is not exported."""
    from PIL import ImageDraw

    mask = Image.new("L", (IMAGE_SIZE, IMAGE_SIZE), 0)
    draw = ImageDraw.Draw(mask)
    for i, o in enumerate(scene):
        cx, cy, r = o["x"] * IMAGE_SIZE, o["y"] * IMAGE_SIZE, o["size"] / 2 * IMAGE_SIZE
        if o["shape"] == "circle":
            rr = r * 0.92
            draw.ellipse([cx - rr, cy - rr, cx + rr, cy + rr], fill=i + 1)
        else:
            draw.polygon(shapes._polygon(o["shape"], cx, cy, r, o["angle"]), fill=i + 1)
    m = np.asarray(mask).reshape(IMAGE_SIZE // PATCH, PATCH, IMAGE_SIZE // PATCH, PATCH).transpose(0, 2, 1, 3)
    m = m.reshape(-1, PATCH * PATCH)
    out = np.zeros((m.shape[0], 2), np.int64)
    colors = list(shapes.COLORS)
    for i, o in enumerate(scene):
        hit = (m == i + 1).sum(1) >= PATCH * PATCH // 4
        out[hit, 0] = 1 + shapes.SHAPES.index(o["shape"])
        out[hit, 1] = 1 + colors.index(o["color"])
    return out


def weighted_question(scene, rng, weights):
    """shapes.sample_question with question types drawn by `weights` (type ->
    relative weight, default 1) instead of uniformly: more practice on the
    types the model gets wrong. The questions and answers are the spec's."""
    if not weights:
        return shapes.sample_question(scene, rng)
    if rng.random() < 0.3:
        return ("caption", shapes.CAPTION_PROMPT, shapes.caption(scene))
    qs = shapes.all_questions(scene)
    types = sorted({t for t, _, _ in qs})
    t = rng.choices(types, weights=[weights.get(t, 1.0) for t in types])[0]
    pool = [q for q in qs if q[0] == t]
    if t == "exists":
        want = rng.choice(["yes", "no"])
        pool = [q for q in pool if q[2] == want] or pool
    return rng.choice(pool)


def batches(tok, images, labels, scenes, seed, n_images, per_image, n_image_tokens, image_id, weights=None):
    """Endless stage-2 batches from the generated scenes: `n_images` scenes,
    `per_image` questions each (drawn afresh every time a scene comes up)."""
    rng = random.Random(seed)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    head = tok.encode("USER: ", add_special_tokens=False).ids
    while True:
        idx = [rng.randrange(len(scenes)) for _ in range(n_images)]
        seqs = []
        for i in idx:
            asked = set()
            for _ in range(per_image):
                for _ in range(4):  # avoid asking the same thing twice
                    t, q, a = weighted_question(scenes[i], rng, weights)
                    if q not in asked:
                        break
                asked.add(q)
                mid = tok.encode("\n" + q + " ASSISTANT:", add_special_tokens=False).ids
                ans = tok.encode(" " + a, add_special_tokens=False).ids + [eos]
                seqs.append(([bos] + head + [image_id] * n_image_tokens + mid, ans, lookup_target(t, q, a, labels[i])))
        yield torch.from_numpy(normalize(images[idx])), seqs, torch.from_numpy(labels[idx])


def lookup_target(t, q, a, plabels):
    """For a question that names an object by its attributes (color_of,
    where, exists-yes): the patches that object covers, as a bool mask over
    the image tokens; else None. The target of the attention loss."""
    if t not in ("color_of", "where") and not (t == "exists" and a == "yes"):
        return None
    words = q.rstrip("?").split()
    shape = next(w for w in words if w in shapes.SHAPES)
    color = next((w for w in words if w in shapes.COLORS), None)
    m = plabels[:, 0] == 1 + shapes.SHAPES.index(shape)
    if color is not None:
        m &= plabels[:, 1] == 1 + list(shapes.COLORS).index(color)
    return m if m.any() else None


def aux_loss_and_accuracy(aux, hidden, labels):
    """Cross-entropy of the per-patch shape and color heads, and the shape and
    color accuracy on patches that an object covers."""
    pred = aux(hidden)  # [N, patches, 5 + 8]
    n_shape = len(shapes.SHAPES) + 1
    ps, pc = pred[..., :n_shape], pred[..., n_shape:]
    loss = F.cross_entropy(ps.reshape(-1, n_shape), labels[..., 0].reshape(-1)) + \
        F.cross_entropy(pc.reshape(-1, pc.shape[-1]), labels[..., 1].reshape(-1))
    on = labels[..., 0] > 0
    with torch.no_grad():
        acc_s = (ps.argmax(-1) == labels[..., 0])[on].float().mean().item()
        acc_c = (pc.argmax(-1) == labels[..., 1])[on].float().mean().item()
    return loss, acc_s, acc_c


def pretrain_vision(model, aux, images, labels, args):
    """Stage 1: the vision tower alone learns per-patch shape and color
    (large batches, no decoder), which a from-scratch ViT picks up far
    faster than from answer tokens. Resumable from --work/vision.pt."""
    path = os.path.join(args.work, "vision.pt")
    params = list(model.vision_tower.parameters()) + list(aux.parameters())
    opt = torch.optim.AdamW(params, lr=args.vision_lr, betas=(0.9, 0.98), weight_decay=0.05)
    step = 0
    if os.path.exists(path):
        st = torch.load(path)
        model.vision_tower.load_state_dict(st["vision"])
        aux.load_state_dict(st["aux"])
        opt.load_state_dict(st["opt"])
        step = st["step"]
    if step >= args.vision_steps:
        return
    held = 2000  # the last scenes are the stage's validation set
    n = len(images) - held
    rng = np.random.default_rng(args.seed + step)
    warmup = min(100, args.vision_steps // 10)
    t0, avg = time.time(), None
    model.vision_tower.train()
    while step < args.vision_steps:
        lr = args.vision_lr * min(1.0, (step + 1) / warmup) * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * step / args.vision_steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = rng.integers(0, n, args.vision_batch)
        pix = torch.from_numpy(normalize(images[idx]))
        hidden = model.vision_tower(pix, output_hidden_states=True).hidden_states[model.config.vision_feature_layer][:, 1:]
        loss, acc_s, acc_c = aux_loss_and_accuracy(aux, hidden, torch.from_numpy(labels[idx]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        cur = np.array([loss.item(), acc_s, acc_c])
        avg = cur if avg is None else 0.95 * avg + 0.05 * cur
        if step % 20 == 0:
            print(f"vision step {step} aux {avg[0]:.4f} shape {avg[1]:.3f} color {avg[2]:.3f} lr {lr:.2e} "
                  f"{(time.time() - t0) / 20:.2f}s/step", flush=True)
            t0 = time.time()
        if step % 100 == 0 or step == args.vision_steps:
            torch.save({"vision": model.vision_tower.state_dict(), "aux": aux.state_dict(), "opt": opt.state_dict(),
                        "step": step}, path + ".tmp")
            os.replace(path + ".tmp", path)
        if step % 250 == 0 or step == args.vision_steps:
            model.vision_tower.eval()
            with torch.no_grad():
                s = slice(n, len(images))
                hidden = model.vision_tower(torch.from_numpy(normalize(images[s])), output_hidden_states=True) \
                    .hidden_states[model.config.vision_feature_layer][:, 1:]
                vl, vs, vc = aux_loss_and_accuracy(aux, hidden, torch.from_numpy(labels[s]))
            print(f"vision eval step {step}: aux {vl.item():.4f} shape {vs:.3f} color {vc:.3f}", flush=True)
            model.vision_tower.train()


def make_model(tok):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        num_channels=3,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
        projection_dim=128,
    )
    text = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        pad_token_id=tok.token_to_id("<pad>"),
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tok.token_to_id("<image>"),
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        pad_token_id=tok.token_to_id("<pad>"),
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
    )
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(cfg)


def step_loss(model, pix, seqs, per_image, pad_id, aux=None, labels=None, attn=None):
    """The answer tokens' cross-entropy; with `aux`, also the per-patch loss;
    with `attn` = (layers, weight), also the attention loss: at the last
    prompt token, head 0 of each of those decoder layers should put its
    attention on the patches of the object a lookup question names (see
    lookup_target), taught as -log(attention mass on those patches)."""
    cfg = model.config
    hidden = model.vision_tower(pix, output_hidden_states=True).hidden_states[cfg.vision_feature_layer][:, 1:]
    feats = model.multi_modal_projector(hidden)
    aux_loss = None
    if aux is not None:
        aux_loss = aux_loss_and_accuracy(aux, hidden, labels)[0]
    feats = feats.repeat_interleave(per_image, dim=0)  # [B, T_img, H]
    L = max(len(p) + len(a) for p, a, _ in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    lbl = torch.full((len(seqs), L), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, (p, a, _) in enumerate(seqs):
        full = p + a
        ids[i, : len(full)] = torch.tensor(full)
        mask[i, : len(full)] = 1
        lbl[i, len(p) : len(full)] = torch.tensor(a)
    lm = model.language_model
    emb = lm.get_input_embeddings()(ids)
    is_img = (ids == cfg.image_token_index).unsqueeze(-1).expand_as(emb)
    emb = emb.masked_scatter(is_img, feats.to(emb.dtype))
    want_attn = attn is not None and any(tg is not None for _, _, tg in seqs)
    out = lm(inputs_embeds=emb, attention_mask=mask, output_attentions=want_attn)
    logits = out.logits
    lm_loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), lbl[:, 1:].reshape(-1))
    if want_attn:
        layers, weight = attn
        img_pos = (ids[0] == cfg.image_token_index).nonzero().squeeze(-1)
        terms = []
        for i, (p, _, tg) in enumerate(seqs):
            if tg is None:
                continue
            cols = img_pos[torch.from_numpy(np.asarray(tg))]
            for layer in layers:
                mass = out.attentions[layer][i, 0, len(p) - 1, cols].sum()
                terms.append(-torch.log(mass.clamp_min(1e-6)))
        lm_loss = lm_loss + weight * torch.stack(terms).mean()
    return lm_loss if aux_loss is None else (lm_loss, aux_loss)


def export(model, tok, out):
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    json.dump(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "unk_token": None,
            "add_bos_token": True,
            "add_eos_token": False,
            "model_max_length": 256,
            "chat_template": CHAT_TEMPLATE,
            "added_tokens_decoder": {
                str(tok.token_to_id(t)): {"content": t, "special": True, "normalized": False, "lstrip": False,
                                           "rstrip": False, "single_word": False}
                for t in ["<s>", "</s>", "<pad>", "<image>"]
            },
        },
        open(os.path.join(out, "tokenizer_config.json"), "w"),
        indent=2,
    )
    json.dump(
        {
            "image_processor_type": "CLIPImageProcessor",
            "processor_class": "LlavaProcessor",
            "do_resize": True,
            "size": {"shortest_edge": IMAGE_SIZE},
            "resample": 3,
            "do_center_crop": True,
            "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": MEAN,
            "image_std": STD,
            "do_convert_rgb": True,
        },
        open(os.path.join(out, "preprocessor_config.json"), "w"),
        indent=2,
    )
    gen = os.path.join(out, "generation_config.json")
    json.dump(
        {
            "bos_token_id": tok.token_to_id("<s>"),
            "eos_token_id": tok.token_to_id("</s>"),
            "pad_token_id": tok.token_to_id("<pad>"),
            "do_sample": False,
            "max_new_tokens": 48,
        },
        open(gen, "w"),
        indent=2,
    )


@torch.no_grad()
def quick_eval(model, tok, seed, n=64):
    """Greedy answers on fresh scenes: fraction exactly right per type."""
    model.eval()
    rng = random.Random(seed)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    cfg = model.config
    n_img = (IMAGE_SIZE // PATCH) ** 2
    right, total = {}, {}
    for _ in range(n):
        scene = shapes.make_scene(rng)
        pix = torch.from_numpy(preprocess(shapes.render(scene, rng.choice([64, 100, 150]), rng)))[None]
        feats = model.get_image_features(pix, cfg.vision_feature_layer, cfg.vision_feature_select_strategy)
        for t, q, a in [("caption", shapes.CAPTION_PROMPT, shapes.caption(scene)), shapes.sample_question(scene, rng, 0)]:
            ids = [bos] + tok.encode("USER: ", add_special_tokens=False).ids + [cfg.image_token_index] * n_img
            ids += tok.encode("\n" + q + " ASSISTANT:", add_special_tokens=False).ids
            out = []
            for _ in range(40):
                x = torch.tensor([ids + out])
                emb = model.language_model.get_input_embeddings()(x)
                m = (x == cfg.image_token_index).unsqueeze(-1).expand_as(emb)
                emb = emb.masked_scatter(m, feats)
                nxt = int(model.language_model(inputs_embeds=emb).logits[0, -1].argmax())
                if nxt == eos:
                    break
                out.append(nxt)
            got = tok.decode(out).strip()
            key = t if t != "caption" else f"caption{len(scene)}"
            total[key] = total.get(key, 0) + 1
            right[key] = right.get(key, 0) + (got == a)
    model.train()
    return {k: right[k] / total[k] for k in sorted(total)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="build-train")
    ap.add_argument("--out", default="assets/tiny-llava-shapes")
    ap.add_argument("--scenes", type=int, default=60000, help="generated training scenes (cached in --work)")
    ap.add_argument("--vision-steps", type=int, default=1500, help="stage 1: vision tower alone, per-patch loss")
    ap.add_argument("--vision-batch", type=int, default=128)
    ap.add_argument("--vision-lr", type=float, default=2e-3)
    ap.add_argument("--steps", type=int, default=1500, help="stage 2: the whole model on answers")
    ap.add_argument("--images", type=int, default=24, help="stage 2: images per step")
    ap.add_argument("--per-image", type=int, default=3, help="stage 2: questions per image per step")
    ap.add_argument("--lr", type=float, default=1.5e-3, help="stage 2 peak; the vision tower gets --vision-lr-scale of it")
    ap.add_argument("--vision-lr-scale", type=float, default=0.3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234, help="training data seed (evaluation uses others)")
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-images", type=int, default=64, help="images of the quick greedy evaluation")
    ap.add_argument("--aux-weight", type=float, default=0.5, help="stage 2 weight of the per-patch shape/color loss")
    ap.add_argument("--attn-weight", type=float, default=0.0,
                    help="stage 2 weight of the attention loss on lookup questions (0: off)")
    ap.add_argument("--attn-layers", default="1,2", help="decoder layers whose head 0 the attention loss teaches")
    ap.add_argument("--type-weights", default="", help="question type weights, e.g. exists=3,where=2 (default: uniform)")
    ap.add_argument("--restart-schedule", action="store_true",
                    help="resume with a fresh warmup + cosine over the remaining steps (to extend a finished run)")
    ap.add_argument("--export-only", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.work, exist_ok=True)

    tok_path = os.path.join(args.work, "tokenizer.json")
    if os.path.exists(tok_path):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tok_path)
    else:
        tok = build_tokenizer()
        tok.save(tok_path)
    model = make_model(tok)
    n_params = sum(p.numel() for p in model.parameters())
    # Auxiliary per-patch shape/color head on the vision features: a dense
    # signal that teaches the from-scratch ViT shapes far sooner than the
    # answer tokens alone. Not part of the exported model.
    aux = torch.nn.Linear(model.config.vision_config.hidden_size, len(shapes.SHAPES) + 1 + len(shapes.COLORS) + 1)
    vision_params = list(model.vision_tower.parameters())
    vision_ids = {id(p) for p in vision_params}
    other_params = [p for p in model.parameters() if id(p) not in vision_ids] + list(aux.parameters())
    opt = torch.optim.AdamW([{"params": vision_params, "scale": args.vision_lr_scale},
                             {"params": other_params, "scale": 1.0}], lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    ckpt = os.path.join(args.work, "checkpoint.pt")
    step = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        aux.load_state_dict(state["aux"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        print(f"resumed at step {step}", flush=True)
    if args.export_only:
        export(model, tok, args.out)
        return
    print(f"{n_params / 1e6:.2f}M parameters, vocab {tok.get_vocab_size()}", flush=True)
    images, labels, scenes = load_dataset(args.work, args.scenes, args.seed)
    if step == 0:
        pretrain_vision(model, aux, images, labels, args)

    n_img_tokens = (IMAGE_SIZE // PATCH) ** 2
    # A fresh question seed on every (re)start so a resumed run does not replay batches.
    weights = {k: float(v) for k, v in (kv.split("=") for kv in args.type_weights.split(",") if kv)}
    stream = batches(tok, images, labels, scenes, args.seed + 7 + step, args.images, args.per_image, n_img_tokens,
                     tok.token_to_id("<image>"), weights)
    attn_cfg = None
    if args.attn_weight > 0:
        attn_cfg = ([int(x) for x in args.attn_layers.split(",")], args.attn_weight)
        # (output_attentions makes the sdpa attention fall back to the eager path, which returns the weights)
    warmup = 100
    start, span = (step, args.steps - step) if args.restart_schedule else (0, args.steps)
    t0, avg, aux_avg = time.time(), None, None
    model.train()
    for pix, seqs, plabels in stream:
        if step >= args.steps:
            break
        lr = args.lr * min(1.0, (step - start + 1) / warmup) * \
            (0.03 + 0.97 * 0.5 * (1 + math.cos(math.pi * (step - start) / max(1, span))))
        for g in opt.param_groups:
            g["lr"] = lr * g["scale"]
        lm_loss, aux_loss = step_loss(model, pix, seqs, args.per_image, tok.token_to_id("<pad>"), aux, plabels,
                                      attn_cfg)
        loss = lm_loss + args.aux_weight * aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        avg = lm_loss.item() if avg is None else 0.98 * avg + 0.02 * lm_loss.item()
        aux_avg = aux_loss.item() if aux_avg is None else 0.98 * aux_avg + 0.02 * aux_loss.item()
        if step % 20 == 0:
            print(f"step {step} loss {avg:.4f} aux {aux_avg:.4f} lr {lr:.2e} {(time.time() - t0) / 20:.2f}s/step", flush=True)
            t0 = time.time()
        if step % args.save_every == 0 or step == args.steps:
            torch.save({"model": model.state_dict(), "aux": aux.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        if step % args.eval_every == 0 or step == args.steps:
            print(f"eval step {step}: {quick_eval(model, tok, 99, args.eval_images)}", flush=True)
    export(model, tok, args.out)
    print(f"saved {args.out}", flush=True)


if __name__ == "__main__":
    main()
