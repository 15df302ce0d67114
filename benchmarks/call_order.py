"""How fast a model's packed layers stream their weights at batch 1, by the order of the calls and
the idle time between them: what a decode step's per-kind rates owe to their neighbours.

    .venv/bin/python benchmarks/call_order.py --model PATH.gguf [--threads 2] [--rounds 5]
        [--orders gate_up;down;gate_up,down;down,wo] [--gaps 0,10,20,30]

Loads the model on arlm's default path (weights on 2 MB pages) and calls each packed layer of its
blocks as the decode step does (`kernels.linear_a8p_residual`, a fused q/k/v's parts in one pass of
`linear_a8p_residual_parts`; one row of fresh random x) in the step's order (qkv, wo, gate_up,
down, layer after layer), or only the kinds an order names, in that same layer order. Printed per
order: each kind's weight bytes / its calls' summed time (GB/s), the best of --rounds passes.
"step" orders are run again with --gaps microseconds of idle spinning (this Python thread, the
pool's threads waiting) before every call. The host's best read (a 1 GiB torch.sum on the same
threads) comes first: the ceiling these rates are shares of.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import arlm  # noqa: E402
from bench_args import positive_int  # noqa: E402

KINDS = ("qkv", "wo", "gate_up", "down")
NAMES = {"wqkv": "qkv", "wo": "wo", "gate_up": "gate_up", "down": "down"}


def parse_orders(text: str) -> list[tuple[str, ...]]:
    orders = [tuple(k.strip() for k in part.split(",")) for part in text.split(";") if part.strip()]
    for order in orders:
        bad = [k for k in order if k not in KINDS and k != "step"]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown kind {bad[0]!r}: kinds are {', '.join(KINDS)} or step")
    return orders


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file or model name")
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--orders", type=parse_orders, default=parse_orders("step;gate_up;down;gate_up,down;down,wo"),
                    help="';'-separated orders, each a ','-separated list of kinds or 'step' (all)")
    ap.add_argument("--gaps", default="0,10,20,30", help="comma-separated idle microseconds before each call")
    args = ap.parse_args()
    try:
        gaps = [float(g) for g in args.gaps.split(",")]
    except ValueError:
        gaps = []
    if not gaps or not all(0 <= g < 1e6 for g in gaps):
        ap.error(f"--gaps: comma-separated microseconds (0 or more), got {args.gaps!r}")
    arlm.prefer_huge_pages()  # (before torch loads, as the arlm command does)
    import torch

    torch.set_num_threads(args.threads)
    from arlm import kernels
    from arlm.llm import LLM
    from arlm.loading.errors import LoadError
    from run import memory_bandwidth_gbs

    try:
        llm = LLM.load(args.model)
    except LoadError as e:
        print(f"call_order.py: {e}", file=sys.stderr)
        return 1
    if not kernels.packed_available():
        print("call_order.py: this build has no packed kernels", file=sys.stderr)
        return 1
    gen = torch.Generator().manual_seed(0)
    calls = []  # (kind, the op, its weights' tensors, x, bytes) in the step's order
    for block in llm.model.blocks:
        for owner in (block.attn, block.mlp):
            for attr, kind in NAMES.items():
                mod = getattr(owner, attr, None)
                layers = list(getattr(mod, "parts", [mod])) if mod is not None else []
                if not layers or not all(getattr(m, "packed", False) for m in layers):
                    continue
                ts = [t for m in layers for t in m.tensors()]
                # a fused projection's parts in one pass (the decode step's linear_a8p_residual_parts)
                op = (kernels.linear_a8p_residual if len(layers) == 1
                      else lambda x, *t: torch.ops.arlm.linear_a8p_residual_parts(x, list(t)))
                calls.append((kind, op, ts, torch.randn(1, mod.in_features, generator=gen),
                              sum(t.numel() * t.element_size() for t in ts)))
    if not calls:
        print(f"call_order.py: {args.model} has no packed layers in its blocks", file=sys.stderr)
        return 1
    print(f"{args.model}: {args.threads} threads; best 1 GiB read {memory_bandwidth_gbs():.1f} GB/s; "
          f"GB/s per kind, best of {args.rounds}")

    def run(order: tuple[str, ...], gap_us: float) -> dict[str, float]:
        chosen = [c for c in calls if "step" in order or c[0] in order]
        best: dict[str, float] = {}
        with torch.inference_mode():
            for _ in range(args.rounds):
                spent: dict[str, float] = {}
                for kind, op, ts, x, _ in chosen:
                    until = time.perf_counter() + gap_us * 1e-6
                    while time.perf_counter() < until:
                        pass
                    t0 = time.perf_counter()
                    op(x, *ts)
                    spent[kind] = spent.get(kind, 0.0) + time.perf_counter() - t0
                for kind, s in spent.items():
                    best[kind] = min(best.get(kind, s), s)
        held: dict[str, int] = {}
        for kind, _, _, _, b in chosen:
            held[kind] = held.get(kind, 0) + b
        return {kind: held[kind] / s / 1e9 for kind, s in best.items()}

    for order in args.orders:
        for gap in (gaps if "step" in order else [0.0]):
            got = run(order, gap)
            label = ",".join(order) + (f" gap {gap:g} us" if gap else "")
            print(f"{label:<22}" + "  ".join(f"{k} {v:6.1f}" for k, v in got.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
