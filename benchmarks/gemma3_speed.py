"""Gemma 3 270M's decode and prefill speed, arlm beside llama.cpp on the same GGUF, alternating.

    .venv/bin/python benchmarks/gemma3_speed.py [--rounds 3] [--threads 2]

llama.cpp (`make bench-peers`): `llama-bench`'s tg (64 new tokens after an empty prompt: decode
at batch 1) and pp (a 512-token prompt), and `llama-batched-bench`'s tg speed for 8 sequences of
4 prompt tokens and 64 new ones each (decode at batch 8), in tokens/s. arlm: the default path
(`LLM.load("gemma3-270m")`) through its engine, stepped (benchmarks/run.py's `engine_run`): 64
greedy tokens after a 4-token prompt at batch 1 and at batch 8 (decode steps only), and one
512-token prompt (its first step). Each round runs both, arlm in this process and the llama.cpp
tools in their own; medians, and arlm / llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from arlm.llm import LLM  # noqa: E402
from arlm.loading import resolve_model_path  # noqa: E402
from arlm.runtime import runtime  # noqa: E402
from arlm.sampling import SamplingParams  # noqa: E402
from run import engine_run, machine  # noqa: E402

BIN = ROOT / "build" / "llama.cpp" / "bin"
BENCH, BATCHED = BIN / "llama-bench", BIN / "llama-batched-bench"
KINDS = ("decode", "decode_b8", "prefill")


def llama_cpp(path: Path, threads: int) -> dict[str, float]:
    out = subprocess.run([str(BENCH), "-m", str(path), "-t", str(threads), "-p", "512", "-n", "64", "-r", "1",
                          "-o", "json"], capture_output=True, text=True, check=True).stdout
    got = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in json.loads(out)}
    out = subprocess.run([str(BATCHED), "-m", str(path), "-t", str(threads), "-c", "2048", "-npp", "4", "-ntg", "64",
                          "-npl", "8", "--output-format", "jsonl"], capture_output=True, text=True, check=True).stdout
    got["decode_b8"] = json.loads(out.strip().splitlines()[-1])["speed_tg"]
    return got


def arlm(llm: LLM) -> dict[str, float]:
    prompts = [llm.tokenizer.encode(f"The cat number {i} sat on")[:4] for i in range(8)]
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    got = {}
    for kind, batch in (("decode", prompts[:1]), ("decode_b8", prompts)):
        r = engine_run(llm, batch, params)
        got[kind] = r["decode_tokens"] / r["decode_s"]
    ids = (llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. ") * 60)[:512]
    got["prefill"] = 512 / engine_run(llm, [ids], SamplingParams(max_new_tokens=1), steps=1)["prefill_s"]
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    for tool in (BENCH, BATCHED):
        if not tool.exists():
            print(f"{tool} is missing: make bench-peers builds it", file=sys.stderr)
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
    for k in KINDS:
        a, b = statistics.median(got["arlm"][k]), statistics.median(got["llama.cpp"][k])
        print(f"{k:9} arlm {a:8.1f} tok/s   llama.cpp {b:8.1f} tok/s   arlm / llama.cpp {a / b:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
