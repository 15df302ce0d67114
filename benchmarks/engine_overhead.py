"""Where a decode step's time goes: the forward pass against the engine's own bookkeeping.

Runs the default CPU model (`LLM.load("smollm2")`) through `llm.engine` at batch 1, 8 and 32
(16-token prompts, 64 greedy tokens each) and reports, per decode step, the wall time of
`Engine.step` and of `ModelRunner.execute` inside it (the forward pass: embeddings, the layer
stack, the head); the rest is scheduling, sampling and postprocessing in Python.

    .venv/bin/python benchmarks/engine_overhead.py [--threads 2] [--model smollm2|PATH.gguf]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from arlm.llm import LLM  # noqa: E402
from arlm.sampling import SamplingParams  # noqa: E402
from bench_args import positive_int  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--model", default="smollm2", help="a known name or a GGUF file (default: %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM.load(args.model)
    engine, runner = llm.engine, llm.engine.runner
    forward = {"s": 0.0}
    execute = runner.execute

    def timed(*a, **kw):
        t0 = time.perf_counter()
        out = execute(*a, **kw)
        forward["s"] += time.perf_counter() - t0
        return out

    runner.execute = timed
    params = SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
    print(f"{'batch':>5} {'step ms':>8} {'forward ms':>10} {'bookkeeping ms':>14} {'share':>6}")
    for B in (1, 8, 32):
        prompts = [list(range(300 + 7 * i, 316 + 7 * i)) for i in range(B)]
        for _ in range(2):  # the first run sizes the cache and warms up; the second is timed
            for p in prompts:
                engine.add_request(p, params)
            engine.step()  # prefill
            forward["s"], total, steps = 0.0, 0.0, 0
            while engine.has_unfinished():
                engine.step()
                total += engine.last_step.seconds
                steps += 1
        rest = total - forward["s"]
        print(f"{B:>5} {total / steps * 1e3:8.2f} {forward['s'] / steps * 1e3:10.2f} {rest / steps * 1e3:14.3f} "
              f"{rest / total:6.1%}")


if __name__ == "__main__":
    main()
