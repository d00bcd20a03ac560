#!/usr/bin/env python3
"""Teaches the bundled tiny LLaVA (assets/tiny-llava-shapes) to hear
(issue 29, item 7): a tiny Whisper-style audio tower and an
Ultravox-style projector are added, and the model learns to transcribe a
spoken shapes question and to answer one about an image, from speech that
tools/make_speech_data.py synthesized (espeak-ng training voices, noise
mixed in by sox). The vision tower and its projector stay frozen; image
questions asked in text are mixed in so that the decoder keeps what it
knew.

    PYTHONPATH=/tmp/pydeps-audio:/tmp/pydeps-torch:/tmp/pydeps-pil \\
      python3 tools/train_hearing.py --speech /tmp/speech --work build-hear \\
      --out build-hear/out --steps 3000

The audio tower (the layout troupe loads as `audio_tower.*`: Whisper's
encoder) has d_model 128, 2 layers, 4 heads, an FFN of 512, 80 mel bins and
100 positions: a window is 2 s (200 log-mel frames, 100 encoder rows). The
projector stacks 4 rows (zero-padded at the end) and maps them through a
GELU MLP to the decoder's width: 25 tokens per 2 s window, 12.5 tokens a
second. Each window's features are its own samples' (WhisperFeatureExtractor's
NumPy path), and each window is encoded alone, as troupe does
(llava_model::encode_audio): a 2.5 s question is a whole window and a
0.5 s one.

Prompts are what troupe's template renders for a turn with media (images,
then clips, then the text):
    USER: <audio>\\nTranscribe the audio. ASSISTANT:           -> the words said
    USER: <image>\\n<audio>\\n ASSISTANT:                       -> the answer
    USER: <image>\\n<audio>\\nAnswer the question. ASSISTANT:   -> the answer
    USER: <image>\\n<question> ASSISTANT:                       -> the answer (text, kept)

Later runs (docs/audio.md) resume with --distill (the model before audio
training, given the question as text, teaches the spoken path),
--audio-first (spoken questions as "<audio>\n<image>\n...") and
--shift-text (text questions whose image stands later).

Resumable: checkpoint.pt in --work every --save-every steps. The tokenizer
gains `<audio>` and `<video>` (ids 397 and 398, after its vocabulary); the exported folder is the
bundled model's plus audio_config and the audio weights.
"""

import argparse
import json
import math
import os
import random
import sys
import time
import wave

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shapes  # noqa: E402
from train_tiny_llava import IMAGE_SIZE, PATCH, preprocess  # noqa: E402

BASE = "assets/tiny-llava-shapes"
D, LAYERS, HEADS, FFN, MELS, POSITIONS = 128, 2, 4, 512, 80, 100
STACK, HIDDEN = 4, 256
WINDOW = 2 * POSITIONS * 160  # samples a window (2 s)
TRANSCRIBE = "Transcribe the audio."
ANSWER = "Answer the question."


def read_wav(path):
    with wave.open(path) as w:
        assert w.getframerate() == 16000 and w.getsampwidth() == 2 and w.getnchannels() == 1
        x = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    return x.astype(np.float32) / 32768.0


def window_features(fe, samples):
    """Each window's log-mel features, float16 [80, frames] (troupe's cut)."""
    out = []
    for at in range(0, samples.size, WINDOW):
        piece = samples[at:at + WINDOW]
        if piece.size // 160 < 1:
            break
        feats = fe._np_extract_fbank_features(piece[None, :].astype(np.float64), "cpu")[0]
        out.append(feats.astype(np.float16))
    return out


def load_speech(folder, split, work):
    """The split's clips: text and per-window features (cached in --work)."""
    cache = os.path.join(work, f"speech-{split}.pt")
    if os.path.exists(cache):
        return torch.load(cache)
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=MELS)
    items = []
    with open(os.path.join(folder, split + ".jsonl")) as f:
        for line in f:
            e = json.loads(line)
            items.append({"text": e["text"],
                          "windows": window_features(fe, read_wav(os.path.join(folder, e["file"])))})
    torch.save(items, cache)
    return items


class AudioTower(torch.nn.Module):
    """Whisper's encoder (transformers' modules, troupe's names), run on
    one window's own frames, and the stacking projector."""

    def __init__(self, text_hidden):
        super().__init__()
        from transformers import WhisperConfig
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        cfg = WhisperConfig(d_model=D, encoder_layers=LAYERS, encoder_attention_heads=HEADS,
                            encoder_ffn_dim=FFN, num_mel_bins=MELS, max_source_positions=POSITIONS,
                            activation_function="gelu", scale_embedding=False,
                            attn_implementation="eager")
        self.tower = WhisperEncoder(cfg)
        self.linear_1 = torch.nn.Linear(D * STACK, HIDDEN)
        self.linear_2 = torch.nn.Linear(HIDDEN, text_hidden)

    def forward(self, feats):  # [N, 80, frames] (one frame count) -> [N, tokens, text hidden]
        enc = self.tower
        x = F.gelu(enc.conv1(feats))
        x = F.gelu(enc.conv2(x)).permute(0, 2, 1)
        x = x + enc.embed_positions.weight[: x.shape[1]]
        for layer in enc.layers:
            x = layer(x, attention_mask=None, layer_head_mask=None)[0]
        x = enc.layer_norm(x)
        pad = (-x.shape[1]) % STACK
        if pad:
            x = torch.cat([x, x.new_zeros(x.shape[0], pad, D)], dim=1)
        x = x.reshape(x.shape[0], -1, D * STACK)
        return self.linear_2(F.gelu(self.linear_1(x)))

    def rows(self, windows):
        """A clip's rows: its windows' in order (windows of equal frames batched)."""
        out = [None] * len(windows)
        by_frames = {}
        for i, w in enumerate(windows):
            by_frames.setdefault(w.shape[1], []).append(i)
        for idx in by_frames.values():
            x = torch.from_numpy(np.stack([windows[i] for i in idx]).astype(np.float32))
            y = self(x)
            for k, i in enumerate(idx):
                out[i] = y[k]
        return torch.cat(out)


def load_base(tok_extra):
    from tokenizers import AddedToken, Tokenizer
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(BASE, attn_implementation="eager")
    tok = Tokenizer.from_file(os.path.join(BASE, "tokenizer.json"))
    if tok_extra:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tok_extra])
        model.resize_token_embeddings(tok.get_vocab_size())
    return model, tok


class Sampler:
    """Training examples: (kind, answer text, scene or None, clip windows or
    None, a seed for the rendering and wording, the question's text for a
    spoken question or None)."""

    def __init__(self, speech, seed, transcribe=0.4, spoken=0.4, captions=0.15):
        self.rng = random.Random(seed)
        self.transcribe, self.spoken, self.captions = transcribe, spoken, captions
        self.speech = speech
        self.by_text = {}
        for i, c in enumerate(speech):
            self.by_text.setdefault(c["text"], []).append(i)

    def __call__(self):
        # Every choice from the seeded generator: the image's rendering and
        # the prompt's wording too (the last element).
        r, extra = self.rng.random(), self.rng.randrange(1 << 30)
        if r < self.transcribe:
            c = self.speech[self.rng.randrange(len(self.speech))]
            return ("transcribe", c["text"], None, c["windows"], extra, None)
        scene = shapes.make_scene(self.rng)
        for _ in range(20):
            t, q, a = shapes.sample_question(scene, self.rng, self.captions)
            if q in self.by_text:
                break
        if r < self.transcribe + self.spoken and q in self.by_text:
            c = self.speech[self.rng.choice(self.by_text[q])]
            return ("spoken", a, scene, c["windows"], extra, q)
        return ("text:" + q, a, scene, None, extra, None)


# Where a spoken question's clip stands: after the image (troupe's chat
# template's order), or before it (--audio-first: the prompt's own
# placeholders, "<audio>\n<image>\nAnswer the question."). The tiny
# decoder reads the image through what follows it at once: the base model
# given 30 padding tokens between the image and a text question answers
# 57% instead of 95% (captions 1/10, "where" 3/10).
AUDIO_FIRST = False
# Text questions whose image is moved later by up to this many padding
# tokens (half of them; --shift-text): the decoder learns to read the image
# wherever it stands, as it must when a clip comes first.
SHIFT_TEXT = 0


def encode_example(tok, ex, image_id, n_img, n_audio, audio_marker):
    """Prompt ids (media as markers) and answer ids."""
    kind, answer, scene, _, extra = ex[:5]
    bos = tok.token_to_id("<s>")
    eos = tok.token_to_id("</s>")
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    ids = [bos] + enc("USER: ")
    if kind == "spoken" and AUDIO_FIRST:
        tail = " ASSISTANT:" if extra % 2 else ANSWER + " ASSISTANT:"
        ids += [audio_marker] * n_audio + enc("\n") + [image_id] * n_img + enc("\n" + tail)
        return ids, enc(" " + answer) + [eos]
    if SHIFT_TEXT and kind.startswith("text:") and extra % 4 >= 2:
        ids += [tok.token_to_id("<pad>")] * (1 + (extra >> 2) % SHIFT_TEXT)
    if scene is not None:
        ids += [image_id] * n_img + enc("\n")
    if kind == "transcribe":
        ids += [audio_marker] * n_audio + enc("\n" + TRANSCRIBE + " ASSISTANT:")
    elif kind == "spoken":
        tail = " ASSISTANT:" if extra % 2 else ANSWER + " ASSISTANT:"
        ids += [audio_marker] * n_audio + enc("\n" + tail)
    else:
        ids += enc(kind[5:] + " ASSISTANT:")
    return ids, enc(" " + answer) + [eos]


def distill_loss(teacher, tok, examples, seqs, feats_of, s_logits, s_hidden, temperature):
    """For the spoken questions of a batch: the frozen teacher (the model
    before it heard anything) answers the same question asked in text about
    the same image; the student's answer distribution (KL) and its hidden
    states at every layer (mean squared error relative to the teacher's
    scale) are pulled towards the teacher's at the answer's positions."""
    cfg = teacher.config
    image_id = cfg.image_token_index
    n_img = (IMAGE_SIZE // PATCH) ** 2
    picks = [i for i, ex in enumerate(examples) if ex[0] == "spoken"]
    if not picks:
        return None, None
    t_seqs = [encode_example(tok, ("text:" + examples[i][5],) + examples[i][1:5], image_id, n_img,
                             0, -1) for i in picks]
    L = max(len(p) + len(a) for p, a in t_seqs)
    pad = tok.token_to_id("<pad>")
    ids = torch.full((len(picks), L), pad, dtype=torch.long)
    mask = torch.zeros((len(picks), L), dtype=torch.long)
    for j, (p, a) in enumerate(t_seqs):
        ids[j, : len(p) + len(a)] = torch.tensor(p + a)
        mask[j, : len(p) + len(a)] = 1
    with torch.no_grad():
        emb = teacher.get_input_embeddings()(ids).clone()
        for j, i in enumerate(picks):
            emb[j, (ids[j] == image_id).nonzero().squeeze(-1)] = feats_of[i]
        out = teacher(inputs_embeds=emb, attention_mask=mask, output_hidden_states=True)
    kl, hid = 0.0, 0.0
    for j, i in enumerate(picks):
        (sp, sa), (tp, _) = seqs[i], t_seqs[j]
        s_at = slice(len(sp) - 1, len(sp) + len(sa) - 1)
        t_at = slice(len(tp) - 1, len(tp) + len(sa) - 1)
        T = temperature
        kl = kl + F.kl_div(F.log_softmax(s_logits[i, s_at] / T, -1),
                           F.softmax(out.logits[j, t_at] / T, -1), reduction="batchmean") * T * T
        for sh, th in zip(s_hidden[1:], out.hidden_states[1:]):
            t = th[j, t_at]
            hid = hid + F.mse_loss(sh[i, s_at], t) / (t.pow(2).mean() + 1e-6) / (len(s_hidden) - 1)
    return kl / len(picks), hid / len(picks)


def batch_loss(model, audio, tok, examples, audio_marker, teacher=None, distill=0.0,
               hidden_weight=1.0, temperature=1.0):
    cfg = model.config
    image_id = cfg.image_token_index
    n_img = (IMAGE_SIZE // PATCH) ** 2
    pix, rows, seqs = [], [], []
    for ex in examples:
        if ex[2] is not None:
            rng = random.Random(ex[4])
            pix.append(preprocess(shapes.render(ex[2], rng.choice([64, 80, 100, 128]), rng)))
        r = audio.rows(ex[3]) if ex[3] is not None else None
        rows.append(r)
        seqs.append(encode_example(tok, ex, image_id, n_img, 0 if r is None else r.shape[0],
                                   audio_marker))
    feats = None
    if pix:
        with torch.no_grad():
            x = torch.from_numpy(np.stack(pix))
            hidden = model.vision_tower(x, output_hidden_states=True).hidden_states[
                cfg.vision_feature_layer][:, 1:]
            feats = model.multi_modal_projector(hidden)
    L = max(len(p) + len(a) for p, a in seqs)
    pad = tok.token_to_id("<pad>")
    ids = torch.full((len(seqs), L), pad, dtype=torch.long)
    lbl = torch.full((len(seqs), L), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, (p, a) in enumerate(seqs):
        full = p + a
        ids[i, : len(full)] = torch.tensor(full)
        mask[i, : len(full)] = 1
        lbl[i, len(p): len(full)] = torch.tensor(a)
    emb = model.get_input_embeddings()(ids)
    emb = emb.clone()
    k = 0
    feats_of = {}
    for i, ex in enumerate(examples):
        if ex[2] is not None:
            at = (ids[i] == image_id).nonzero().squeeze(-1)
            emb[i, at] = feats[k]
            feats_of[i] = feats[k]
            k += 1
        if rows[i] is not None:
            at = (ids[i] == audio_marker).nonzero().squeeze(-1)
            emb[i, at] = rows[i]
    use_teacher = teacher is not None and distill > 0
    out = model(inputs_embeds=emb, attention_mask=mask, output_hidden_states=use_teacher)
    logits = out.logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), lbl[:, 1:].reshape(-1))
    if use_teacher:
        kl, hid = distill_loss(teacher, tok, examples, seqs, feats_of, logits, out.hidden_states,
                               temperature)
        if kl is not None:
            loss = loss + distill * (kl + hidden_weight * hid)
    return loss


@torch.no_grad()
def greedy(model, audio, tok, ex, audio_marker, max_new=40):
    cfg = model.config
    image_id = cfg.image_token_index
    n_img = (IMAGE_SIZE // PATCH) ** 2
    rng = random.Random(5)
    r = audio.rows(ex[3]) if ex[3] is not None else None
    p, _ = encode_example(tok, ex, image_id, n_img, 0 if r is None else r.shape[0], audio_marker)
    feats = None
    if ex[2] is not None:
        x = torch.from_numpy(preprocess(shapes.render(ex[2], 100, rng)))[None]
        hidden = model.vision_tower(x, output_hidden_states=True).hidden_states[
            cfg.vision_feature_layer][:, 1:]
        feats = model.multi_modal_projector(hidden)[0]
    eos = tok.token_to_id("</s>")
    out = []
    for _ in range(max_new):
        ids = torch.tensor([p + out])
        emb = model.get_input_embeddings()(ids).clone()
        if feats is not None:
            emb[0, (ids[0] == image_id).nonzero().squeeze(-1)] = feats
        if r is not None:
            emb[0, (ids[0] == audio_marker).nonzero().squeeze(-1)] = r
        nxt = int(model(inputs_embeds=emb).logits[0, -1].argmax())
        if nxt == eos:
            break
        out.append(nxt)
    return tok.decode(out).strip()


def quick_eval(model, audio, tok, speech, audio_marker, n=40, seed=99):
    model.eval()
    audio.eval()
    s = Sampler(speech, seed)
    right, total = {}, {}
    for _ in range(n):
        ex = s()
        kind = ex[0] if not ex[0].startswith("text:") else "text"
        got = greedy(model, audio, tok, ex, audio_marker)
        total[kind] = total.get(kind, 0) + 1
        right[kind] = right.get(kind, 0) + (got == ex[1])
    model.train()
    audio.train()
    return {k: f"{right[k]}/{total[k]}" for k in sorted(total)}


def export(model, audio, tok, out):
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    t = {"audio_tower." + k: v.detach().contiguous() for k, v in audio.tower.state_dict().items()}
    for n in ("linear_1", "linear_2"):
        lin = getattr(audio, n)
        t[f"audio_projector.{n}.weight"] = lin.weight.detach().contiguous()
        t[f"audio_projector.{n}.bias"] = lin.bias.detach().contiguous()
    save_file(t, os.path.join(out, "audio.safetensors"))
    # One index over both files (troupe and transformers read it).
    import struct

    with open(os.path.join(out, "model.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        names = [k for k in json.loads(f.read(n)) if k != "__metadata__"]
    wm = {k: "model.safetensors" for k in names}
    wm.update({k: "audio.safetensors" for k in t})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(wm.items()))}, f, indent=1)
    cfg = json.load(open(os.path.join(out, "config.json")))
    cfg["audio_config"] = {"model_type": "whisper", "d_model": D, "encoder_layers": LAYERS,
                           "encoder_attention_heads": HEADS, "encoder_ffn_dim": FFN,
                           "num_mel_bins": MELS, "max_source_positions": POSITIONS,
                           "activation_function": "gelu", "scale_embedding": False}
    cfg.update({"audio_token_index": tok.token_to_id("<audio>"), "audio_stack_factor": STACK,
                "audio_projector_hidden": HIDDEN})
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)
    tok.save(os.path.join(out, "tokenizer.json"))
    tc = json.load(open(os.path.join(BASE, "tokenizer_config.json")))
    for t_ in ("<audio>", "<video>"):
        tc["added_tokens_decoder"][str(tok.token_to_id(t_))] = {
            "content": t_, "special": True, "normalized": False, "lstrip": False,
            "rstrip": False, "single_word": False}
    json.dump(tc, open(os.path.join(out, "tokenizer_config.json"), "w"), indent=2)
    import shutil

    for name in ("preprocessor_config.json", "generation_config.json"):
        shutil.copyfile(os.path.join(BASE, name), os.path.join(out, name))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--speech", required=True, help="tools/make_speech_data.py's --out")
    ap.add_argument("--work", default="build-hear")
    ap.add_argument("--out", default="build-hear/out")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3, help="the audio tower's peak")
    ap.add_argument("--decoder-lr-scale", type=float, default=0.2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--transcribe-share", type=float, default=0.4)
    ap.add_argument("--spoken-share", type=float, default=0.4,
                    help="spoken questions about an image (the rest: text questions)")
    ap.add_argument("--caption-share", type=float, default=0.15,
                    help="of the image examples, captions ('Describe the image.')")
    ap.add_argument("--projector-lr-scale", type=float, default=0.0,
                    help="the image projector's learning rate scale (0: frozen)")
    ap.add_argument("--restart-schedule", action="store_true",
                    help="resume with a fresh warmup and cosine over the steps left")
    ap.add_argument("--distill", type=float, default=0.0,
                    help="weight of distillation from the model before training (the teacher "
                    "hears each spoken question as text): KL of the answer plus hidden states")
    ap.add_argument("--hidden-weight", type=float, default=1.0,
                    help="of the distillation, the hidden states' weight beside the KL")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--audio-first", action="store_true",
                    help="spoken questions as <audio> before <image> (see AUDIO_FIRST)")
    ap.add_argument("--shift-text", type=int, default=0,
                    help="move half the text questions' image later by 1..N padding tokens")
    ap.add_argument("--export-only", action="store_true")
    args = ap.parse_args()
    global AUDIO_FIRST
    AUDIO_FIRST = args.audio_first
    global SHIFT_TEXT
    SHIFT_TEXT = args.shift_text
    torch.set_num_threads(args.threads)
    os.makedirs(args.work, exist_ok=True)
    model, tok = load_base(["<audio>", "<video>"])
    audio_marker = tok.token_to_id("<audio>")
    text_hidden = model.config.text_config.hidden_size
    torch.manual_seed(args.seed)
    audio = AudioTower(text_hidden)
    for p in model.vision_tower.parameters():
        p.requires_grad_(False)
    proj = list(model.multi_modal_projector.parameters())
    for p in proj:
        p.requires_grad_(args.projector_lr_scale > 0)
    proj_ids = {id(p) for p in proj}
    dec = [p for p in model.parameters() if p.requires_grad and id(p) not in proj_ids]
    groups = [{"params": list(audio.parameters()), "scale": 1.0},
              {"params": dec, "scale": args.decoder_lr_scale}]
    if args.projector_lr_scale > 0:
        groups.append({"params": proj, "scale": args.projector_lr_scale})
        dec = dec + proj
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    ckpt = os.path.join(args.work, "checkpoint.pt")
    step = 0
    if os.path.exists(ckpt):
        st = torch.load(ckpt)
        model.load_state_dict(st["model"])
        audio.load_state_dict(st["audio"])
        if len(st["opt"]["param_groups"]) == len(opt.param_groups):
            opt.load_state_dict(st["opt"])
        else:
            print("the parameter groups changed: a fresh optimizer", flush=True)
        step = st["step"]
        print(f"resumed at step {step}", flush=True)
    if args.export_only:
        export(model, audio, tok, args.out)
        return
    t0 = time.time()
    train = load_speech(args.speech, "train", args.work)
    print(f"{len(train)} training clips ({time.time() - t0:.0f} s)", flush=True)
    sample = Sampler(train, args.seed + step, args.transcribe_share, args.spoken_share,
                     args.caption_share)
    teacher = None
    if args.distill > 0:
        teacher, _ = load_base(["<audio>", "<video>"])
        teacher.eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
    warmup, avg, t0 = 100, None, time.time()
    start, span = (step, args.steps - step) if args.restart_schedule else (0, args.steps)
    model.train()
    while step < args.steps:
        lr = args.lr * min(1.0, (step - start + 1) / warmup) * \
            (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - start) / max(1, span))))
        for g in opt.param_groups:
            g["lr"] = lr * g["scale"]
        loss = batch_loss(model, audio, tok, [sample() for _ in range(args.batch)], audio_marker,
                          teacher, args.distill, args.hidden_weight, args.temperature)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(audio.parameters()) + dec, 1.0)
        opt.step()
        step += 1
        avg = loss.item() if avg is None else 0.98 * avg + 0.02 * loss.item()
        if step % 20 == 0:
            print(f"step {step} loss {avg:.4f} lr {lr:.2e} {(time.time() - t0) / 20:.2f}s/step",
                  flush=True)
            t0 = time.time()
        if step % args.save_every == 0 or step == args.steps:
            torch.save({"model": model.state_dict(), "audio": audio.state_dict(),
                        "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        if step % args.eval_every == 0 or step == args.steps:
            print(f"eval step {step}: {quick_eval(model, audio, tok, train, audio_marker)}",
                  flush=True)
    export(model, audio, tok, args.out)
    print(f"saved {args.out}", flush=True)


if __name__ == "__main__":
    main()
