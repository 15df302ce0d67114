"""The LM head's share of a batch-1 decode step, for a model whose vocabulary is large beside its
layers (Gemma 3 270M: the tied head is 262,144 x 640, 168M of its 268M parameters).

    .venv/bin/python benchmarks/head_share.py [--model gemma3-270m] [--threads 2]

The head alone (the model's `lm_head` on one row, median of 50) against the decode step of a
64-token greedy generation on the default path (`LLM.generate`'s decode tokens/s).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from arlm.llm import LLM  # noqa: E402
from arlm.runtime import runtime  # noqa: E402
from arlm.sampling import SamplingParams  # noqa: E402
from sampling_ops import median_ms  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    runtime().threads.pin(args.threads)
    llm = LLM.load(args.model)
    m = llm.model
    x = torch.randn(1, m.config.d_model)
    with torch.inference_mode():
        head = median_ms(lambda: m.lm_head(x), 50)
    out = llm.generate(["The cat sat on the"], SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True))[0]
    step = 1e3 / out.stats.decode_tokens_per_s
    print(f"{args.model}, {args.threads} threads: lm_head ({type(m.lm_head).__name__}, {m.config.vocab_size} x "
          f"{m.config.d_model}) {head:.2f} ms at batch 1; decode step {step:.2f} ms; the head's share {head / step:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
