"""Training tokens/s of this checkout against another checkout's, alternating processes.

    .venv/bin/python benchmarks/train_ab.py --base /tmp/base/src [--rounds 3] [--steps 200]
        [--family gpt2 llama] [--threads 2]

Each round trains nanoGPT's tiny-Shakespeare CPU recipe (benchmarks/train_shakespeare_char.py's
RECIPE: 4 layers, d_model 128, context 64, batch 12, bf16 autocast where the CPU has it) for
`--steps` steps with `arlm.train.train`, once with the base's source tree on PYTHONPATH and once
with this one's, each in a fresh process; printed: each side's median training tokens/s (the
trainer's own figure: steps after the first log window) and the ratio. For checking that a
change made for large models costs the small ones nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

SIDE = """
import json, sys, tempfile
from pathlib import Path
import arlm  # (first, from PYTHONPATH: train_shakespeare_char puts this checkout's src on sys.path)
from arlm.train import TrainConfig, prepare, train
from arlm.train.data import default_corpus
sys.path.insert(0, sys.argv[1])
from train_shakespeare_char import RECIPE
assert arlm.__file__.startswith(sys.argv[6]), (arlm.__file__, sys.argv[6])
data = Path(sys.argv[2])
if not (data / "meta.json").exists():
    prepare([default_corpus()], data, tokenizer="char")
with tempfile.TemporaryDirectory() as out:
    cfg = TrainConfig(**{**RECIPE, "max_steps": int(sys.argv[3]), "eval_interval": 0, "eval_batches": 1,
                         "save_interval": 0, "log_interval": 25}, data_dir=str(data), out_dir=out,
                      family=sys.argv[4], threads=int(sys.argv[5]), progress=False, plot=False)
    result = train(cfg)
print(json.dumps({"tokens_per_s": result.tokens_per_s, "loss": list(result.losses.values())[-1]}))
"""


def run_side(src: str, data: Path, args, family: str) -> dict:
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run([sys.executable, "-c", SIDE, str(HERE), str(data), str(args.steps), family,
                          str(args.threads), src], env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"the side in {src} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the other checkout's src directory")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--family", nargs="+", default=["gpt2", "llama"])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    sides = {"base": str(Path(args.base).resolve()), "this": str(ROOT / "src")}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "shakespeare_char"
        for family in args.family:
            rates: dict[str, list[float]] = {n: [] for n in sides}
            for r in range(args.rounds):
                for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                    res = run_side(sides[name], data, args, family)
                    rates[name].append(res["tokens_per_s"])
                    print(f"{family} round {r} {name}: {res['tokens_per_s']:,.0f} tokens/s, loss {res['loss']:.4f}",
                          flush=True)
            base, this = (statistics.median(rates[n]) for n in sides)
            print(f"{family}: base {base:,.0f}, this {this:,.0f} tokens/s: {this / base:.2f}x")


if __name__ == "__main__":
    main()
