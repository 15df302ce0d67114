"""The sampler's per-step operations at a serving batch, each beside what it replaced, alternating,
medians: the draw (two-level inverse CDF vs the exponential race it replaced) and the grammar
mask (the native `kernels.mask_rows` from llguidance's bitmask vs unpacking the bitmask into a
[B, V] bool tensor and gather / masked_fill / scatter over a copy of the logits).

    .venv/bin/python benchmarks/sampling_ops.py [--batch 32] [--vocab 49152] [--repeat 21]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from arlm import kernels  # noqa: E402
from arlm.sampling import draw  # noqa: E402
from bench_args import positive_int  # noqa: E402


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """The draw before: argmax(p_i / E_i), E_i ~ Exp(1) from each row's own generator."""
    race = torch.empty_like(probs)
    for i in range(probs.shape[0]):
        race[i].exponential_(1.0, generator=generators[i])
    return kernels.argmax_rows(probs / race.clamp_min_(1e-20))


def unpack_and_fill(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """The mask before: the bitmask unpacked to bools, then gather / masked_fill / scatter on a copy."""
    out = logits.clone()
    mask = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")[:, :logits.shape[1]]
    allowed = torch.from_numpy(mask.astype(bool))
    out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
    return out


def median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=positive_int, default=32)
    p.add_argument("--vocab", type=positive_int, default=49152)
    p.add_argument("--repeat", type=positive_int, default=21)
    args = p.parse_args()
    B, V = args.batch, args.vocab
    g = torch.Generator().manual_seed(0)
    probs = torch.randn(B, V, generator=g).softmax(-1)
    gens = [torch.Generator().manual_seed(i) for i in range(B)]
    logits = torch.randn(B, V, generator=g)
    bits = torch.randint(-2**31, 2**31 - 1, (B, (V + 31) // 32), generator=g, dtype=torch.int32)
    bits[:, : bits.shape[1] // 2] = 0  # half the vocabulary refused outright
    rows = torch.arange(B)
    print(f"torch threads {torch.get_num_threads()}, batch {B}, vocab {V}, medians of {args.repeat}")
    pairs = {"draw": (lambda: draw(probs, gens), lambda: exponential_race(probs, gens)),
             "mask": (lambda: kernels.mask_rows(logits.clone(), rows, bits), lambda: unpack_and_fill(logits, rows, bits))}
    for name, (new, old) in pairs.items():
        a, b = [], []
        for _ in range(3):  # alternating
            a.append(median_ms(new, args.repeat))
            b.append(median_ms(old, args.repeat))
        na, nb = statistics.median(a), statistics.median(b)
        print(f"{name}: now {na:.3f} ms, before {nb:.3f} ms ({nb / na:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
