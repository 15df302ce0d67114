"""Decode, prefill and serving speed of one configuration against another checkout's, alternating.

    .venv/bin/python benchmarks/speed_ab.py --base /tmp/base --rounds 5     # base: a worktree of the commit before
    .venv/bin/python benchmarks/speed_ab.py --side '{"activations": "int8"}'  # one side's figures, one JSON line

A side: decode tokens/s at batch 1 (64-token prompt, 128 new tokens) and batch 8 (64 new tokens),
prefill tokens/s of one 512-token prompt (random prompt ids, greedy, EOS ignored), then
`arlm serve` driven by 8 concurrent streaming clients (64 tokens each, greedy): aggregate output
tokens/s. With --base, each round runs the base's side then this checkout's, each in a fresh
process (PYTHONPATH=<checkout>/src), and the medians and their ratios are printed: the machine
drifts more than most changes, so only alternating runs and medians compare (docs/benchmarks.md).
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
METRICS = ("decode_b1", "decode_b8", "prefill_512", "serve_8_clients")


def side(kwargs: dict, metrics: tuple[str, ...] = METRICS) -> dict:
    """This process's checkout (sys.path / PYTHONPATH decides which): the figures asked for."""
    if metrics == ("serve_8_clients",):  # (a server of its own: nothing to load here)
        return {"serve_8_clients": serve_8_clients()}
    import arlm

    getattr(arlm, "prefer_huge_pages", lambda: None)()  # (as the arlm command does, before torch loads)
    import torch

    from arlm.llm import LLM
    from arlm.sampling import SamplingParams

    llm = LLM.load("smollm2", **kwargs)
    g = torch.Generator().manual_seed(0)
    short = torch.randint(1000, 20000, (64,), generator=g).tolist()
    batch = [torch.randint(1000, 20000, (64,), generator=g).tolist() for _ in range(8)]
    long_prompt = torch.randint(1000, 20000, (512,), generator=g).tolist()

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)

    llm.generate([short], params(8))  # warm
    (c,) = llm.generate([short], params(128))
    out = {"decode_b1": c.stats.decode_tokens_per_s}
    out["decode_b8"] = llm.generate(batch, params(64))[0].stats.decode_tokens_per_s
    (c,) = llm.generate([long_prompt], params(1))
    out["prefill_512"] = c.stats.prefill_tokens_per_s
    del llm
    out["serve_8_clients"] = serve_8_clients()
    return out


def serve_8_clients(clients: int = 8, max_tokens: int = 64) -> float:
    """Aggregate output tokens/s of `clients` concurrent streams against a fresh `arlm serve`
    of this process's checkout."""
    path = list(sys.path)
    sys.path.insert(0, str(HERE))
    from serve import PROMPTS, free_port, load, run_server, stop  # (it puts this checkout's src on sys.path)

    sys.path[:] = path

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = run_server([sys.executable, "-m", "arlm", "serve", "--port", str(port)], dict(os.environ), url)
    try:
        asyncio.run(load(url, "smollm2", PROMPTS[:1], 4, concurrent=True))  # warm
        return asyncio.run(load(url, "smollm2", PROMPTS[:clients], max_tokens, concurrent=True))["tokens_per_s"]
    finally:
        stop(proc)


def run_side(checkout: Path, kwargs: dict, metrics: tuple[str, ...]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout / "src")}
    r = subprocess.run([sys.executable, __file__, "--side", json.dumps(kwargs), "--metrics", ",".join(metrics)],
                       env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{checkout}: side failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", type=json.loads, help="run one side in this process: LLM.load keyword arguments as JSON")
    ap.add_argument("--base", type=Path, help="the other checkout (a git worktree of the commit to compare with)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--kwargs", type=json.loads, default={}, help="LLM.load keyword arguments for both sides")
    ap.add_argument("--metrics", default=",".join(METRICS), help=f"which figures (default: all of {','.join(METRICS)})")
    args = ap.parse_args()
    metrics = tuple(args.metrics.split(","))
    if not set(metrics) <= set(METRICS) or metrics not in (METRICS, ("serve_8_clients",)):
        ap.error(f"--metrics: all of {','.join(METRICS)}, or serve_8_clients alone")
    if args.side is not None:
        print(json.dumps({"config": args.side, **{k: round(v, 1) for k, v in side(args.side, metrics).items()}}))
        return
    if args.base is None:
        ap.error("give --base CHECKOUT (or --side JSON for one side)")
    runs: dict[str, list[dict]] = {"base": [], "this": []}
    for r in range(args.rounds):
        for name, checkout in (("base", args.base.resolve()), ("this", ROOT)):
            runs[name].append(run_side(checkout, args.kwargs, metrics))
            print(f"round {r + 1} {name}: {json.dumps(runs[name][-1])}", flush=True)
    print(f"\nmedians of {args.rounds} alternating rounds (tokens/s), this / base:")
    for m in metrics:
        base = statistics.median(x[m] for x in runs["base"])
        this = statistics.median(x[m] for x in runs["this"])
        print(f"  {m:16s} base {base:8.1f}   this {this:8.1f}   ratio {this / base:5.3f}")


if __name__ == "__main__":
    main()
