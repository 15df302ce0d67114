"""Which 4-bit KV-cache scheme for SmolLM2-135M: candidate schemes simulated, measured by perplexity.

    .venv/bin/python benchmarks/kv_schemes.py [--windows 4] [--context 2048] [--text FILE]

The float32 model runs whole windows of `--context` tokens (the training forward, causal SDPA)
with K (after RoPE) and V replaced by what a cache of each scheme would hand back: quantized and
dequantized, group by group. In the cache every token's K/V are written before any query reads
them, so this is what a quantized cache gives at every position. KIVI's per-channel keys
quantize a group of 32 (or 16) tokens once it is complete; a query reads the tokens of its own
incomplete group in full precision (its residual), simulated with two score matrices and a mask.

Prints perplexity, its change against the float32 cache, KL(float32 || scheme) averaged over the
scored tokens, top-1 agreement, and each scheme's bytes per token against float16. This is the
measurement behind the 4-bit scheme arlm ships (docs/benchmarks.md, "KV-cache compression").
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from arlm import model as model_mod  # noqa: E402
from arlm.llm import LLM  # noqa: E402


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def groups(x: torch.Tensor, g: int = 32) -> torch.Tensor:  # (g: a group's size along the last dim)
    return x.reshape(*x.shape[:-1], x.shape[-1] // g, g)


def q8_0(x):  # symmetric, groups of 32, float16 scale (llama.cpp's q8_0)
    xg = groups(x)
    d = (xg.abs().amax(-1, keepdim=True) / 127).half().float()
    q = torch.where(d > 0, torch.round(xg / d), torch.zeros_like(xg)).clamp(-127, 127)
    return (q * d).reshape(x.shape)


def q4_0(x):  # symmetric, groups of 32, float16 scale (llama.cpp's q4_0: the extreme maps to -8)
    xg = groups(x)
    idx = xg.abs().argmax(-1, keepdim=True)
    m = xg.gather(-1, idx)
    d = (m / -8).half().float()
    q = torch.where(d != 0, torch.round(xg / d), torch.zeros_like(xg)).clamp(-8, 7)
    return (q * d).reshape(x.shape)


def q4_1(x, dim=-1, g=32, bits=4):  # asymmetric, groups of g along `dim`, float16 scale and minimum
    if dim != -1:
        return q4_1(x.transpose(dim, -1), g=g, bits=bits).transpose(dim, -1)
    xg = groups(x, g)
    top = 2 ** bits - 1
    lo, hi = xg.amin(-1, keepdim=True).half().float(), xg.amax(-1, keepdim=True)
    d = ((hi - lo) / top).half().float()
    q = torch.where(d > 0, torch.round((xg - lo) / d), torch.zeros_like(xg)).clamp(0, top)
    return (q * d + lo).reshape(x.shape)


def rotated(fn, h):
    return lambda x: fn(x @ h) @ h.T  # h orthonormal: (x h) h^T = x


SCHEMES = {  # name -> (K fn, V fn, bytes per row of 64 values for K and V, or "kivi")
    "float16": (lambda x: x.half().float(), lambda x: x.half().float(), 128 + 128),
    "q8_0 K, q8_0 V": (q8_0, q8_0, 68 + 68),
    "q8_0 K, q4_1 V": (q8_0, q4_1, 68 + 40),
    "q4_0 K, q4_0 V": (q4_0, q4_0, 36 + 36),
    "q4_1 K, q4_1 V": (q4_1, q4_1, 40 + 40),
    "Hadamard q4_0 K, q4_0 V": ("had", q4_0, 36 + 36),
    "Hadamard q4_1 K, q4_1 V": ("had1", q4_1, 40 + 40),
    "Hadamard q4_1 K and V": ("had1", "had1", 40 + 40),
    "q4_1/16 K, q4_1 V": (lambda x: q4_1(x, g=16), q4_1, 48 + 40),
    "Hadamard q4_1/16 K, q4_1 V": ("had16", q4_1, 48 + 40),
    "Hadamard q4_1/16 K, Hadamard q4_1 V": ("had16", "had1", 48 + 40),
    "Hadamard q5_1 K, Hadamard q4_1 V": ("had5", "had1", 48 + 40),
    "KIVI-32: K per channel, V q4_1": ("kivi", q4_1, 40 + 40),
    "KIVI-16: K per channel, V q4_1": ("kivi16", q4_1, 48 + 40),
}


def run(llm: LLM, ids: torch.Tensor, k_fn, v_fn, kivi: int) -> torch.Tensor:
    """Log-probabilities [T - 1, vocab] of one window with K/V passed through k_fn / v_fn."""
    orig = model_mod.Attention.forward

    def forward(self, x, rope, mask, kv_cache, input_pos, kv_len):
        B, T, _ = x.shape
        H, H_kv = self.n_head, self.n_kv_heads
        qkv = self.wqkv(x).view(B, T, H + 2 * H_kv, self.head_dim)
        qk, v = qkv[:, :, : H + H_kv], qkv[:, :, H + H_kv:]
        qk = model_mod.apply_rope(qk, *rope)
        q, k = qk[:, :, :H], qk[:, :, H:]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, d]
        vq = v_fn(v)
        if not kivi:
            y = F.scaled_dot_product_attention(q, k_fn(k), vq, is_causal=True, enable_gqa=True)
        else:  # keys per channel in groups of 32 tokens; a query's own incomplete group in full
            G = kivi
            kq = q4_1(k[:, :, : T // G * G], dim=2, g=G)
            kq = torch.cat([kq, k[:, :, T // G * G:]], 2)
            rep = H // H_kv
            qf = q * self.head_dim ** -0.5
            kf, kqq = k.repeat_interleave(rep, 1), kq.repeat_interleave(rep, 1)
            t = torch.arange(T)
            done = (t[None, :] // G + 1) * G - 1 <= t[:, None]  # key j's group complete at query t
            s = torch.where(done, qf @ kqq.transpose(-1, -2), qf @ kf.transpose(-1, -2))
            s = s.masked_fill(t[None, :] > t[:, None], float("-inf"))
            y = s.softmax(-1) @ vq.repeat_interleave(rep, 1)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    model_mod.Attention.forward = forward
    try:
        with torch.inference_mode():
            return llm.model(ids[None])[0, :-1].log_softmax(-1)
    finally:
        model_mod.Attention.forward = orig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--text", default=str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"))
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--schemes", default=None, help="names separated by ; (default: all)")
    args = p.parse_args()
    torch.manual_seed(0)
    llm = LLM.load(args.model, quantize="none")
    ids = llm.tokenizer.encode(Path(args.text).read_text())
    wins = [torch.tensor(ids[i * args.context:(i + 1) * args.context]) for i in range(args.windows)]
    had = hadamard(llm.model.config.head_dim)
    names = args.schemes.split(";") if args.schemes else list(SCHEMES)
    base = [run(llm, w, lambda x: x, lambda x: x, 0) for w in wins]
    base_nll = torch.cat([-b.gather(-1, w[1:, None])[:, 0] for b, w in zip(base, wins)])
    print(f"{args.windows} windows of {args.context} tokens of {Path(args.text).name}; "
          f"float32 cache perplexity {base_nll.mean().exp():.4f}")
    print(f"{'scheme':34} {'bytes/fp16':>10} {'ppl':>9} {'Δppl':>8} {'KL':>9} {'top-1':>7}")
    for name in names:
        k_fn, v_fn, nbytes = SCHEMES[name]
        kivi = {"kivi": 32, "kivi16": 16}.get(k_fn, 0) if isinstance(k_fn, str) else 0
        k_fn = {"had": rotated(q4_0, had), "had1": rotated(q4_1, had),
                "had16": rotated(lambda x: q4_1(x, g=16), had),
                "had5": rotated(lambda x: q4_1(x, bits=5), had)}.get(k_fn, k_fn) if isinstance(k_fn, str) else k_fn
        v_fn = rotated(q4_1, had) if v_fn == "had1" else v_fn
        nll, kl, agree = [], [], []
        for b, w in zip(base, wins):
            lp = run(llm, w, k_fn, v_fn, kivi)
            nll.append(-lp.gather(-1, w[1:, None])[:, 0])
            kl.append((b.exp() * (b - lp)).sum(-1))
            agree.append(b.argmax(-1) == lp.argmax(-1))
        nll_t, kl_t, ag = torch.cat(nll), torch.cat(kl), torch.cat(agree).float()
        ppl, base_ppl = nll_t.mean().exp().item(), base_nll.mean().exp().item()
        print(f"{name:34} {nbytes / 256:10.3f} {ppl:9.4f} {100 * (ppl / base_ppl - 1):+7.2f}% "
              f"{kl_t.mean():9.5f} {100 * ag.mean():6.2f}%", flush=True)


if __name__ == "__main__":
    main()
