"""One layer of each block type in a GGUF model, alone: its multiply-accumulate rate by rows.

    .venv/bin/python benchmarks/layer_rates.py --model PATH.gguf [--rows 1,8,64] [--threads 1]
        [--repeat 15] [--activations int8x2|int8] [--json build/layer_rates.json]

Loads the model on arlm's default path and, for each weight type it holds (Q4_K, Q6_K, Q8_0, ...),
takes its largest matrix (the LM head counts) and calls it on --rows rows of random activations,
--repeat times per row count. Printed per layer and row count: GMAC/s over the best wall time, and
over the best process CPU time per thread, the figure a busy host moves least (its neighbours
take wall time, not this process's CPU time). For a kernel change, run it once per build,
alternating (the builds are cached by source: check out one source, run, the other, run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from arlm.llm import LLM  # noqa: E402
from arlm.loading.errors import LoadError  # noqa: E402
from bench_args import positive_int, positive_int_list  # noqa: E402


def layers_by_kind(model: torch.nn.Module) -> dict[str, tuple[str, torch.nn.Module]]:
    """{block type: (name, module)}, the type's largest matrix (in x out) in the model."""
    best: dict[str, tuple[int, str, torch.nn.Module]] = {}
    for name, mod in model.named_modules():
        kind = getattr(mod, "kind", None)
        if kind is None or not hasattr(mod, "in_features"):
            continue
        size = mod.in_features * mod.out_features
        if kind not in best or size > best[kind][0]:
            best[kind] = (size, name, mod)
    return {k: (n, m) for k, (_, n, m) in sorted(best.items())}


def rate(mod: torch.nn.Module, rows: int, repeat: int, threads: int) -> dict:
    x = torch.randn(rows, mod.in_features, generator=torch.Generator().manual_seed(rows))
    macs = rows * mod.in_features * mod.out_features
    with torch.inference_mode():
        mod(x)  # (the kernels' scratch)
        wall, cpu = [], []
        for _ in range(repeat):
            c0, w0 = time.process_time(), time.perf_counter()
            mod(x)
            wall.append(time.perf_counter() - w0)
            cpu.append((time.process_time() - c0) / threads)
    return {"rows": rows, "gmacs_wall": macs / min(wall) / 1e9, "gmacs_cpu": macs / min(cpu) / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file or model name")
    ap.add_argument("--rows", type=positive_int_list, default=[1, 8, 64], help="comma-separated row counts")
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--repeat", type=positive_int, default=15)
    ap.add_argument("--activations", choices=("int8x2", "int8"), default="int8x2")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    try:
        llm = LLM.load(args.model, activations=args.activations)
    except LoadError as e:
        print(f"layer_rates.py: {e}", file=sys.stderr)
        return 1
    layers = layers_by_kind(llm.model)
    if not layers:
        print(f"layer_rates.py: {args.model} has no quantized layers on this path", file=sys.stderr)
        return 1
    from arlm import kernels

    isa = kernels.packed_isa() if kernels.packed_available() else "row kernels"
    print(f"{args.model}: {args.activations}, {args.threads} thread(s), {isa}; GMAC/s, best of {args.repeat}")
    print(f"{'type':<6} {'layer':<28} {'K x N':>14} {'rows':>5} {'wall':>8} {'cpu/thread':>11}")
    results = []
    for kind, (name, mod) in layers.items():
        for r in args.rows:
            got = {"type": kind, "layer": name, "in": mod.in_features, "out": mod.out_features,
                   **rate(mod, r, args.repeat, args.threads)}
            results.append(got)
            print(f"{kind:<6} {name:<28} {f'{mod.in_features} x {mod.out_features}':>14} {r:>5} "
                  f"{got['gmacs_wall']:>8.1f} {got['gmacs_cpu']:>11.1f}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": str(args.model), "activations": args.activations,
                                         "threads": args.threads, "isa": isa, "layers": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
