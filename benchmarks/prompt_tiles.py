"""The prompt's rows on the AMX tiles or on AVX512-VNNI: one model's prefill both ways, alternating.

    .venv/bin/python benchmarks/prompt_tiles.py --model PATH.gguf [--tokens 512] [--rounds 5] [--threads 2]

On a CPU with AMX-INT8 the packed kernels take a prompt's rows 16 at a time on the tiles
(a8_linear.cpp's amx_tile; every row's result the bits VNNI gives it). Each round runs a fresh
process with ARLM_AMX=1, then one with ARLM_AMX=0 (the VNNI kernels alone); each process loads the
model, prefills a --tokens prompt of real text three times (the engine's first step) and reports
its best. Printed: both paths' median prefill tokens/s over the wall clock and over the process's
CPU time (the figure a busy machine skews less), and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, time
sys.path.insert(0, {root!r} + "/src"); sys.path.insert(0, {root!r} + "/benchmarks")
import torch
from arlm import kernels
from arlm.llm import LLM
from arlm.sampling import SamplingParams
from run import engine_run
from sizes import prompt_ids
from arlm.runtime import runtime
torch.set_num_threads({threads})
runtime().threads.pin({threads})  # (the kernels' speed, not the governor's reading of a busy machine)
llm = LLM.load({model!r})
ids = prompt_ids(llm, {tokens}, 0)
wall, cpu = [], []
for _ in range(3):
    c0 = time.process_time()
    r = engine_run(llm, [ids], SamplingParams(max_new_tokens=1), steps=1)
    wall.append(r["prefill_s"]); cpu.append((time.process_time() - c0) / {threads})
print(json.dumps({{"amx": kernels.amx_active(), "wall": min(wall), "cpu": min(cpu)}}))
"""


def one(model: str, tokens: int, threads: int, amx: bool) -> dict:
    env = {**os.environ, "ARLM_AMX": "1" if amx else "0", "OMP_NUM_THREADS": str(threads)}
    code = CHILD.format(root=str(ROOT), model=model, tokens=tokens, threads=threads)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a model name or GGUF file")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    runs: dict[str, list[dict]] = {"amx": [], "vnni": []}
    for r in range(args.rounds):
        for name in ("amx", "vnni"):
            got = one(args.model, args.tokens, args.threads, name == "amx")
            if name == "amx" and not got["amx"]:
                sys.exit("prompt_tiles: no AMX-INT8 here (or ARLM_AMX=0 / not granted): nothing to compare")
            runs[name].append(got)
            print(f"round {r + 1} {name}: {args.tokens / got['wall']:.1f} tok/s wall, "
                  f"{args.tokens / got['cpu']:.1f} tok/s CPU time", flush=True)
    med = {name: {k: statistics.median(x[k] for x in v) for k in ("wall", "cpu")} for name, v in runs.items()}
    print(f"\n{Path(args.model).name}, prefill {args.tokens} tokens, {args.threads} threads, "
          f"{args.rounds} rounds, load average {os.getloadavg()[0]:.1f}")
    for name in ("amx", "vnni"):
        print(f"  {name:>4}: {args.tokens / med[name]['wall']:7.1f} tok/s wall, "
              f"{args.tokens / med[name]['cpu']:7.1f} tok/s CPU time")
    print(f"  amx / vnni: {med['vnni']['wall'] / med['amx']['wall']:.2f}x wall, "
          f"{med['vnni']['cpu'] / med['amx']['cpu']:.2f}x CPU time")


if __name__ == "__main__":
    main()
