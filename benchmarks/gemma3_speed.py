"""Gemma 3 270M's decode and prefill speed, arlm beside llama.cpp on the same GGUF, alternating.

    .venv/bin/python benchmarks/gemma3_speed.py [--rounds 3] [--threads 2]

llama.cpp: `build/llama.cpp/bin/llama-bench` (`make bench-peers`), its tg (64 new tokens after
an empty prompt: decode at batch 1) and pp (a 512-token prompt) in tokens/s. arlm: the default
path (`LLM.load("gemma3-270m")`), 64 greedy tokens after a 4-token prompt (decode tokens/s from
the engine's stats) and one 512-token prompt (prefill tokens/s). Each round runs both, arlm in
this process and llama-bench in its own; medians, and arlm / llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from arlm.llm import LLM  # noqa: E402
from arlm.loading import resolve_model_path  # noqa: E402
from arlm.runtime import runtime  # noqa: E402
from arlm.sampling import SamplingParams  # noqa: E402
from run import machine  # noqa: E402

BENCH = ROOT / "build" / "llama.cpp" / "bin" / "llama-bench"


def llama_cpp(path: Path, threads: int) -> dict[str, float]:
    out = subprocess.run([str(BENCH), "-m", str(path), "-t", str(threads), "-p", "512", "-n", "64", "-r", "1",
                          "-o", "json"], capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    return {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}


def arlm(llm: LLM) -> dict[str, float]:
    out = llm.generate(["The cat sat on"], SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True))[0]
    ids = (llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. ") * 60)[:512]
    t0 = time.perf_counter()
    llm.engine.generate([ids], SamplingParams(max_new_tokens=1))
    return {"decode": out.stats.decode_tokens_per_s, "prefill": 512 / (time.perf_counter() - t0)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if not BENCH.exists():
        print(f"{BENCH} is missing: make bench-peers builds it", file=sys.stderr)
        return 1
    runtime().threads.pin(args.threads)
    path = resolve_model_path("gemma3-270m")
    print(f"machine: {machine()}")
    llm = LLM.load("gemma3-270m")
    arlm(llm)  # (a warm-up: the first steps build the kernels' scratch)
    got: dict[str, dict[str, list[float]]] = {"arlm": {}, "llama.cpp": {}}
    for r in range(args.rounds):
        for name, run in (("arlm", lambda: arlm(llm)), ("llama.cpp", lambda: llama_cpp(path, args.threads))):
            for k, v in run().items():
                got[name].setdefault(k, []).append(v)
        print(f"round {r}: " + json.dumps({n: {k: round(v[-1], 1) for k, v in d.items()} for n, d in got.items()}),
              flush=True)
    for k in ("decode", "prefill"):
        a, b = statistics.median(got["arlm"][k]), statistics.median(got["llama.cpp"][k])
        print(f"{k:8} arlm {a:8.1f} tok/s   llama.cpp {b:8.1f} tok/s   arlm / llama.cpp {a / b:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
