"""Unseeded sampling in numpy, as `arlm.sampling` samples: temperature, then top-k, top-p, min-p
(HF's order, the same rules for ties and for the nucleus's boundary), then one draw by the
inverse CDF. A seeded request takes the torch path, whose generator's stream it must reproduce;
an unseeded one only needs the same distribution, which tests/test_bare.py compares with the
torch path's `warped_probs` on the same logits.

As the torch path does on CPU, top-p first looks at the NUCLEUS_CANDIDATES likeliest tokens
(a partition, not a sort of the vocabulary: ~0.3 ms a step where a full sort of 49k was ~9)
and sorts the whole row only where they hold less than top_p of the mass.
"""

from __future__ import annotations

import numpy as np

NUCLEUS_CANDIDATES = 256


def filtered(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
             min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The tokens a row may draw and their weights (probabilities up to one factor), float64."""
    x = logits.astype(np.float32) / np.float32(temperature)
    V = x.shape[0]
    ids = np.arange(V)
    if 0 < top_k < V:  # the k largest, ties at the k-th value kept
        kth = np.partition(x, V - top_k)[V - top_k]
        ids = np.flatnonzero(x >= kth)
    top = float(x[ids].max())
    w = np.exp(x[ids].astype(np.float64) - top)
    if top_p < 1.0:  # the smallest likeliest set whose mass reaches top_p
        total = w.sum()
        n = min(NUCLEUS_CANDIDATES, len(ids))
        part = np.argpartition(-w, n - 1)[:n] if n < len(ids) else np.arange(len(ids))
        order = part[np.argsort(-w[part], kind="stable")]
        mass = np.cumsum(w[order]) / total
        if mass[-1] < top_p and n < len(ids):  # (a flat row: the whole row sorted)
            order = np.argsort(-w, kind="stable")
            mass = np.cumsum(w[order]) / total
        keep = order[(mass - w[order] / total) < top_p]  # (the first token's mass before it is 0: kept)
        ids, w = ids[keep], w[keep]
    if min_p > 0.0:  # at least min_p times the likeliest token's probability
        keep = w >= min_p * w.max()
        ids, w = ids[keep], w[keep]
    return ids, w


def warped_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The distribution [V] float64 one row draws from."""
    ids, w = filtered(logits, temperature, top_k, top_p, min_p)
    out = np.zeros(logits.shape[0])
    out[ids] = w / w.sum()
    return out


def draw(probs: np.ndarray, rng: np.random.Generator, ids: np.ndarray | None = None) -> int:
    """The token where the cumulative weight first passes a uniform draw times the total (never
    one of weight 0); ids: the tokens the weights are of (default: 0, 1, ...)."""
    cum = np.cumsum(probs)
    i = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
    i = min(i, int(np.flatnonzero(probs)[-1]))
    return int(ids[i]) if ids is not None else i


def sample(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float,
           rng: np.random.Generator) -> int:
    ids, w = filtered(logits, temperature, top_k, top_p, min_p)
    return draw(w, rng, ids)
