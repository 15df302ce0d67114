"""Verification: which draft tokens the target keeps, greedy or by the modified rejection rule
(the package doc states the rule and why it is exact)."""

from __future__ import annotations

import torch

from ... import kernels
from ...sampling import draw, penalized, warped_probs
from ..request import Request


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The rule's chance of keeping draft tokens x: min(1, p(x) / q(x)), from their probabilities
    under the target (p) and the drafter (q)."""
    return (p / q).clamp(max=1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What to draw from after rejecting a draft token: norm(max(0, p - q)) over the vocabulary
    (unnormalized: `draw` takes weights). Where p <= q everywhere (only by rounding: then x is
    always accepted), p itself."""
    r = (p - q).clamp_min(0.0)
    return r if float(r.sum()) > 0 else p


def verify(logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]) -> list[list[int]]:
    """The tokens each request keeps: `logits` holds, request after request, the target's logits
    at its k + 1 positions (k = len(draft)); returns the accepted draft tokens and one more (the
    correction at the first rejection, or the bonus after full acceptance)."""
    dev = logits.device
    seen = None
    if any(r.params.repetition_penalty != 1.0 for r in requests):
        # Position j of a draft has seen the draft's first j tokens as well.
        rows = []
        for r, d in zip(requests, drafts):
            base = r.seen if r.seen is not None else torch.zeros(logits.shape[1], dtype=torch.bool, device=dev)
            for j in range(len(d) + 1):
                m = base.clone()
                if j:
                    m[torch.tensor(d[:j], device=dev)] = True
                rows.append(m)
        seen = torch.stack(rows)
    params = [r.params for r, d in zip(requests, drafts) for _ in range(len(d) + 1)]
    logits = penalized(logits, params, seen)
    best = kernels.argmax_rows(logits).tolist()
    sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    probs = None
    if sampled:
        rows = [j for i in sampled for j in range(starts[i], starts[i + 1])]
        probs = dict(zip(rows, warped_probs(logits[rows], [params[j] for j in rows])))
    out = []
    for i, (req, d) in enumerate(zip(requests, drafts)):
        s, k = starts[i], len(d)
        if req.params.greedy:  # the argmax at each position: what plain greedy decoding emits
            kept = []
            for j in range(k):
                kept.append(best[s + j])
                if best[s + j] != d[j]:
                    break
            else:
                kept.append(best[s + k])
            out.append(kept)
            continue
        p = torch.stack([probs[s + j] for j in range(k + 1)])  # [k + 1, V]
        index = torch.tensor(d, device=dev)
        q = req.draft_probs[:k] if req.draft_probs is not None else \
            torch.zeros(k, p.shape[1], device=dev).scatter_(1, index[:, None], 1.0)  # a proposal: one-hot
        chance = acceptance_probability(p[torch.arange(k), index], q[torch.arange(k), index])
        u = torch.rand(k, generator=req.generator, device=dev)
        passed = (u < chance).tolist()
        a = passed.index(False) if False in passed else k
        last = p[k] if a == k else residual(p[a], q[a])
        out.append(d[:a] + draw(last[None], [req.generator]).tolist())
    return out
