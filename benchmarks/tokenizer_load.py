"""How long HF tokenizers takes to parse a model's tokenizer.json, its BPE merges as [a, b] pairs
(what `Tokenizer.to_str()` writes) against "a b" strings (what arlm's layout caches write where
no piece holds a space: `arlm.tokenizer.backend_json`).

    .venv/bin/python benchmarks/tokenizer_load.py [--model gemma3-270m] [--rounds 5]

The two texts of the same tokenizer are parsed alternately, --rounds times each, in this process;
printed: their sizes, the medians and the ratio, and whether the string form serializes back to
the pairs form (the same tokenizer).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from bench_args import positive_int  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m", help="a known model name or a model path (default gemma3-270m)")
    p.add_argument("--rounds", type=positive_int, default=5)
    args = p.parse_args()

    from arlm.llm import LLM
    from arlm.tokenizer import backend_json

    backend = LLM.load(args.model).tokenizer.backend
    forms = {"pairs": backend.to_str(), "strings": backend_json(backend)}
    if forms["strings"] == forms["pairs"]:
        sys.exit("tokenizer_load: this tokenizer's merges stay pairs (none, or a piece with a space)")
    times: dict[str, list[float]] = {k: [] for k in forms}
    for _ in range(args.rounds):
        for name, text in forms.items():
            t0 = time.perf_counter()
            HFTokenizer.from_str(text)
            times[name].append(time.perf_counter() - t0)
    same = HFTokenizer.from_str(forms["strings"]).to_str() == forms["pairs"]
    for name, text in forms.items():
        print(f"{name:8s} {len(text) / 1e6:6.1f} MB  parse median {statistics.median(times[name]):.3f} s  "
              f"{[round(t, 3) for t in times[name]]}")
    print(f"strings / pairs: {statistics.median(times['strings']) / statistics.median(times['pairs']):.2f}x the time; "
          f"the same tokenizer: {same}")


if __name__ == "__main__":
    main()
