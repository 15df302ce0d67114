"""One model's packed layers at prompt size on the AMX tiles or on AVX512-VNNI, alternating.

    .venv/bin/python benchmarks/amx_layers.py --model PATH.gguf [--rows 512] [--threads 1] [--rounds 2]
        [--layers blocks.0.mlp.gate_up,blocks.0.mlp.down,blocks.0.attn.wqkv.parts.2]

Each round runs a fresh process with ARLM_AMX=1, then one with ARLM_AMX=0; each times
`kernels.linear_a8p_residual` (the default int8x2 activations' kernel) on --rows random rows for
each named layer (best of 5 after 2 warm-ups) and prints milliseconds of wall and CPU time. The
whole-prefill view of the same switch is benchmarks/prompt_tiles.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench_args import positive_int

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, time
sys.path.insert(0, {root!r} + "/src")
import torch
from arlm import kernels
from arlm.llm import LLM
from arlm.runtime import runtime
torch.set_num_threads({threads})
runtime().threads.pin({threads})
llm = LLM.load({model!r})
modules = dict(llm.model.named_modules())
out = {{}}
for name in {layers!r}:
    m = modules[name]
    x = torch.randn({rows}, m.in_features, generator=torch.Generator().manual_seed(0))
    t = m.tensors()
    for _ in range(2):
        kernels.linear_a8p_residual(x, *t)
    wall, cpu = [], []
    for _ in range(5):
        c0, w0 = time.process_time(), time.perf_counter()
        kernels.linear_a8p_residual(x, *t)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    out[name] = {{"kind": getattr(m, "kind", type(m).__name__), "wall_ms": 1e3 * min(wall), "cpu_ms": 1e3 * min(cpu)}}
print(json.dumps({{"amx": kernels.amx_active(), "layers": out}}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a GGUF file (benchmarks/make_gguf.py's shapes)")
    p.add_argument("--rows", type=positive_int, default=512)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--rounds", type=positive_int, default=2)
    p.add_argument("--layers", default="blocks.0.mlp.gate_up,blocks.0.mlp.down,blocks.0.attn.wqkv.parts.2")
    args = p.parse_args()
    code = CHILD.format(root=str(ROOT), model=args.model, threads=args.threads, rows=args.rows,
                        layers=args.layers.split(","))
    for r in range(args.rounds):
        for amx in ("1", "0"):
            env = {**os.environ, "ARLM_AMX": amx, "OMP_NUM_THREADS": str(args.threads)}
            run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
            if run.returncode != 0:
                sys.exit(f"amx_layers: the child failed: {run.stderr.strip().splitlines()[-1:]}")
            got = json.loads(run.stdout.strip().splitlines()[-1])
            row = ", ".join(f"{n} ({v['kind']}) {v['wall_ms']:.1f} ms" for n, v in got["layers"].items())
            print(f"round {r + 1} {'tiles' if got['amx'] else 'vnni '}: {row}", flush=True)


if __name__ == "__main__":
    main()
