"""What a pause in the memory traffic costs the next matrix call: a model's gate/up and down
layers called in turn (batch 1, its default 16-bit activations, 2 threads), with nothing between
the calls, with the calling thread spinning for --gap us (the memory idle), or with it reading
fresh memory for about as long instead (the memory busy).

    .venv/bin/python benchmarks/idle_gaps.py --model ~/.cache/arlm-bench/gguf/llama-3.2-1b-Q4_K_M.gguf
        [--gap 20] [--rounds 3]

Prints each variant's ms for the gate/up calls and the down calls (the time inside the calls
only), rounds alternating. A 64 MB buffer is rewritten before each pass, so no pass starts with
the last one's weights in the L3 cache.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import arlm  # noqa: E402

if __name__ == "__main__":
    arlm.prefer_huge_pages()  # as the arlm command does, before torch loads

import torch  # noqa: E402

from arlm.llm import LLM  # noqa: E402
from bench_args import positive_int  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a model name or GGUF file with packed (quantized) layers")
    p.add_argument("--gap", type=float, default=20.0, help="microseconds between two calls (default: 20)")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM.load(args.model)
    layers = [(b.mlp.gate_up, b.mlp.down) for b in llm.model.blocks]
    if not all(hasattr(m, "tensors") for pair in layers for m in pair):
        raise SystemExit("idle_gaps.py: the model's gate/up and down must each be one packed layer")
    op = torch.ops.arlm.linear_a8p_residual
    x_gu, x_down = torch.randn(1, layers[0][0].in_features), torch.randn(1, layers[0][1].in_features)
    flush = torch.ones(64 << 20, dtype=torch.uint8)
    fresh = torch.ones(512 << 20, dtype=torch.uint8)  # read a slice at a time: memory no cache holds
    at = [0]
    clock = time.perf_counter

    def spin() -> None:
        end = clock() + args.gap * 1e-6
        while clock() < end:
            pass

    step = 1 << 16  # 64 KB a read, until the gap is over
    def read() -> None:
        end = clock() + args.gap * 1e-6
        while clock() < end:
            if at[0] + step > fresh.numel():
                at[0] = 0
            fresh[at[0]:at[0] + step].max()
            at[0] += step

    variants = {"back to back": None, f"{args.gap:g} us idle": spin, f"{args.gap:g} us reading": read}

    def one_pass(between) -> tuple[float, float]:
        gu = down = 0.0
        flush.add_(1)
        for g, d in layers:
            t0 = clock()
            op(x_gu, *g.tensors())
            gu += clock() - t0
            if between:
                between()
            t0 = clock()
            op(x_down, *d.tensors())
            down += clock() - t0
            if between:
                between()
        return gu, down

    with torch.inference_mode():
        for between in variants.values():  # (warm-up: the kernels' scratch)
            one_pass(between)
        for r in range(args.rounds):
            for name, between in variants.items():
                got = [one_pass(between) for _ in range(5)]
                gu, down = (min(t[i] for t in got) for i in (0, 1))
                print(f"round {r} {name:>16}: gate/up {gu * 1e3:.2f} ms, down {down * 1e3:.2f} ms "
                      f"({len(layers)} calls each)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
