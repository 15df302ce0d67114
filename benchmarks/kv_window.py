"""Attention sinks along a stream: perplexity of a long text through a windowed KV cache.

    .venv/bin/python benchmarks/kv_window.py [--tokens 12288] [--window 1024] [--sinks 4]

SmolLM2 on its default path reads the first `--tokens` tokens of tinyshakespeare as one stream
and scores every token three ways, each keeping at most sinks + window tokens of context:
(a) sinks + window (`perplexity.stream_nll`: the first S tokens and the last W, StreamingLLM),
(b) the window alone (S = 0), (c) today's context shift, recomputing the last half of a full
window (along a stream that is strided perplexity with context S + W and stride (S + W) / 2);
and, where the stream fits the model's context, (d) full attention. Prints the perplexity over
the stream and over each quarter of it, and the wall time of each run (all on this machine's
threads; (a) and (b) run the stream in chunks of 512 tokens, (c) recomputes every token about
twice).

Not measured here yet: time per token in generation for each method, and a plot.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from arlm.kv_cache import kv_dtype_name  # noqa: E402
from arlm.llm import LLM  # noqa: E402
from arlm.perplexity import evaluate, stream_nll  # noqa: E402
from bench_args import positive_int  # noqa: E402
from run import machine  # noqa: E402


def ppl(nll) -> float:
    return math.exp(float(np.mean(nll)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=positive_int, default=12288)
    p.add_argument("--window", type=positive_int, default=1024)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--kv-dtype", default="auto")
    args = p.parse_args()
    print(f"machine: {machine()}")
    llm = LLM.load("smollm2", kv_dtype=args.kv_dtype)
    text = (ROOT.parent / "shared" / "data" / "tinyshakespeare.txt").read_text()
    ids = llm.tokenizer.encode(text)[:args.tokens]
    W, S = args.window, args.sinks
    print(f"{len(ids)} tokens of tinyshakespeare, window {W}, sinks {S}, KV cache {kv_dtype_name(llm.kv_dtype)} "
          f"(the model's context: {llm.context_length})")
    runs = [("(a) sinks + window", lambda: stream_nll(llm, ids, W, S)),
            ("(b) window alone", lambda: stream_nll(llm, ids, W, 0)),
            ("(c) context shift", lambda: np.asarray(evaluate(llm, ids, context=S + W, stride=(S + W) // 2).nll))]
    if len(ids) <= llm.context_length:
        runs.append(("(d) full attention", lambda: np.asarray(evaluate(llm, ids, context=len(ids),
                                                                       stride=len(ids)).nll)))
    for name, run in runs:
        t0 = time.perf_counter()
        nll = run()
        seconds = time.perf_counter() - t0
        q = len(nll) // 4
        quarters = ", ".join(f"{ppl(nll[i * q:(i + 1) * q]):.2f}" for i in range(4))
        print(f"{name:20s} perplexity {ppl(nll):8.3f}   by quarter: {quarters}   {seconds:6.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
