"""Unseeded sampling in numpy, as `arlm.sampling` samples: temperature, then top-k, top-p, min-p
(HF's order, the same rules for ties and for the nucleus's boundary), then one draw by the
inverse CDF. A seeded request takes the torch path, whose generator's stream it must reproduce;
an unseeded one only needs the same distribution, which tests/test_bare.py compares with the
torch path's `warped_probs` on the same logits.
"""

from __future__ import annotations

import numpy as np


def warped_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The distribution [V] float64 one row draws from."""
    x = logits.astype(np.float32) / np.float32(temperature)
    V = x.shape[0]
    if 0 < top_k < V:  # the k largest, ties at the k-th value kept
        kth = np.partition(x, V - top_k)[V - top_k]
        x = np.where(x < kth, -np.inf, x)
    if top_p < 1.0:  # the smallest most likely set whose mass reaches top_p
        order = np.argsort(-x, kind="stable")
        p = _softmax(x[order])
        keep = (np.cumsum(p) - p) < top_p  # (the first token's mass before it is 0: always kept)
        drop = np.empty(V, dtype=bool)
        drop[order] = ~keep
        x = np.where(drop, -np.inf, x)
    if min_p > 0.0:  # at least min_p times the most likely token's probability
        p = _softmax(x)
        x = np.where(p < min_p * p.max(), -np.inf, x)
    return _softmax(x)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """The token where the cumulative probability first exceeds a uniform draw (never one of
    probability 0)."""
    cum = np.cumsum(probs)
    i = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
    nonzero = np.flatnonzero(probs)
    return int(min(i, nonzero[-1]))
