"""A prompt's attention over the paged KV cache, the op alone: one layer of a model's prefill.

    .venv/bin/python benchmarks/prompt_attention.py [--tokens 512] [--heads 32 --kv-heads 8 --head-dim 64]
        [--block-size 16] [--dtype float16] [--rounds 7] [--src OTHER_CHECKOUT/src]

Times `torch.ops.arlm.paged_attention` on a `--tokens` prompt of one sequence (fresh random q, k,
v; the pool's blocks in order), the path a prefill's layer takes (paged_attention.h: runs of
prompt tokens scored 16 keys at a time). Prints the median and best ms a layer over --rounds
rounds of 4 calls, and a hash of the output's bytes: two checkouts (`--src`, e.g. a `git worktree`
of an older commit) that print the same hash compute the same bits. Alternate the two by hand.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=positive_int, default=512)
    ap.add_argument("--heads", type=positive_int, default=32)
    ap.add_argument("--kv-heads", type=positive_int, default=8)
    ap.add_argument("--head-dim", type=positive_int, default=64)
    ap.add_argument("--block-size", type=positive_int, default=16)
    ap.add_argument("--dtype", choices=["float16", "float32"], default="float16", help="the KV pool's")
    ap.add_argument("--rounds", type=positive_int, default=7)
    ap.add_argument("--src", type=Path, default=Path(__file__).resolve().parents[1] / "src",
                    help="the arlm source tree to time (default: this checkout's)")
    args = ap.parse_args()
    if args.heads % args.kv_heads:
        ap.error("--heads must be a multiple of --kv-heads")
    if not (args.src / "arlm").is_dir():
        ap.error(f"--src {args.src}: no arlm package there")
    sys.path.insert(0, str(args.src))
    import torch

    from arlm import kernels

    if not kernels.native_available():
        sys.exit("prompt_attention.py: the native kernels did not build on this machine")
    torch.manual_seed(0)
    N, H, Hkv, D, BS = args.tokens, args.heads, args.kv_heads, args.head_dim, args.block_size
    blocks = -(-N // BS)
    q, k, v = torch.randn(N, H, D), torch.randn(N, Hkv, D), torch.randn(N, Hkv, D)
    dtype = getattr(torch, args.dtype)
    kp, vp = torch.zeros(blocks, Hkv, BS, D, dtype=dtype), torch.zeros(blocks, Hkv, BS, D, dtype=dtype)
    table = torch.arange(blocks, dtype=torch.int64)[None]
    seq, pos = torch.zeros(N, dtype=torch.int64), torch.arange(N, dtype=torch.int64)

    def run() -> torch.Tensor:
        return torch.ops.arlm.paged_attention(q, k, v, kp, vp, table, seq, pos, D ** -0.5, 0, 0, 0, None, None)

    y = run()
    times = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        for _ in range(4):
            run()
        times.append((time.perf_counter() - t) / 4 * 1e3)
    print(f"{N} tokens, {H}/{Hkv} heads of {D}, pool blocks of {BS}, {args.dtype} K/V, "
          f"{torch.get_num_threads()} threads ({args.src})")
    print(f"ms a layer: median {statistics.median(times):.2f}, best {min(times):.2f}; "
          f"output {hashlib.sha256(y.numpy().tobytes()).hexdigest()[:16]}")


if __name__ == "__main__":
    main()
