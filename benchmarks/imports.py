"""What an `arlm` command imports, from `python -X importtime`: the modules, their total time,
the imports the command itself makes by cumulative time, and each package's own time.

    .venv/bin/python benchmarks/imports.py [--repeat 5] [--top 12] -- generate "The cat sat on the" --max-new-tokens 8
    .venv/bin/python benchmarks/imports.py -- --help

The command runs --repeat times in fresh processes after one run that is not counted (it writes
the bytecode and warms the file cache); every figure is the median over the runs. The children
write bytecode even where PYTHONDONTWRITEBYTECODE is set here: a user's warm start reads it, and
without it arlm's own modules would be compiled at every start. Compare two checkouts by running
this once with each on PYTHONPATH (the children inherit it). Times follow the machine's load;
the module counts do not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections import defaultdict

# Packages worth naming in the summary wherever they are imported from.
NAMED = ("torch", "numpy", "tokenizers", "safetensors", "gguf", "llguidance", "jinja2", "rich", "transformers",
         "fastapi", "uvicorn", "yaml")


def parse(log: str) -> list[tuple[int, str, int, int]]:
    """(depth, module, self us, cumulative us) for each line of a -X importtime log, in its order
    (a module's line follows those of the modules it imported)."""
    rows = []
    for line in log.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cum_us, name = line[len("import time:"):].split("|")
        rows.append(((len(name) - len(name.lstrip(" ")) - 1) // 2, name.strip(), int(self_us), int(cum_us)))
    return rows


def summary(rows: list[tuple[int, str, int, int]]) -> dict:
    top = {name: cum for depth, name, _, cum in rows if depth == 0}  # what the command imports itself
    own: dict[str, int] = defaultdict(int)
    count: dict[str, int] = defaultdict(int)
    for _, name, self_us, _ in rows:
        own[name.split(".")[0]] += self_us
        count[name.split(".")[0]] += 1
    named = {}
    for _, name, _, cum in rows:
        if name in NAMED and name not in named:
            named[name] = cum
    return {"modules": len(rows), "total": sum(top.values()), "top": top, "own": dict(own), "count": dict(count),
            "named": named}


def by_median(runs: list[dict], key: str) -> list[tuple[str, float]]:
    """(name, median ms) of one of the summaries' tables, largest first."""
    names = {n for r in runs for n in r[key]}
    return sorted(((n, statistics.median(r[key].get(n, 0) for r in runs) / 1e3) for n in names), key=lambda x: -x[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the arlm command line, after --")
    a = ap.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    runs = []
    for i in range(a.repeat + 1):
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "arlm", *args], capture_output=True, text=True,
                           env=env, timeout=600)
        if r.returncode not in (0, 2):  # (2: a usage error, also worth measuring)
            sys.exit(f"arlm {' '.join(args)} failed:\n{r.stderr[-2000:]}")
        if i:
            runs.append(summary(parse(r.stderr)))

    def med(values) -> float:
        return statistics.median(values) / 1e3  # ms

    import arlm
    print(f"arlm {' '.join(args)}  (arlm from {os.path.dirname(arlm.__file__)}; {a.repeat} runs, medians)")
    print(f"modules imported: {statistics.median(r['modules'] for r in runs):.0f}   "
          f"import time: {med([r['total'] for r in runs]):.0f} ms")
    print("the command's own imports, cumulative:")
    for n, ms in by_median(runs, "top")[:a.top]:
        print(f"  {ms:8.1f} ms  {n}")
    print("named packages, cumulative where first imported:" + ("" if runs[0]["named"] else " none"))
    for n, ms in by_median(runs, "named"):
        print(f"  {ms:8.1f} ms  {n}")
    print("each package's own time (modules):")
    for n, ms in by_median(runs, "own")[:a.top]:
        print(f"  {ms:8.1f} ms  {n} ({runs[0]['count'][n]})")


if __name__ == "__main__":
    main()
