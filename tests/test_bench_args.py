"""The benchmark scripts reject a bad number the way argparse does: one `script: error: ...` line
and exit code 2, before a model is loaded or any work is done. Every case was a traceback, some of
them after seconds of work. (All the cases run in two processes: a script's imports, torch's
and arlm's, cost ~1-2 s each time a process makes them.)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every benchmark script imported (two processes), a GGUF read

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
# A hang guard for each script (its imports take ~1-2 s on a quiet machine).
TIMEOUT = 300

# The scripts run as `python script.py ...` would run them (`runpy`, as __main__), each ended at
# the first sign of work: opening model weights or the training text, or starting a process (a
# server, a busy loop, or `uname` for the machine's description). A check of the arguments made
# after any of these fails the test whatever the machine's speed (a time limit would depend on
# its load). One process runs many cases, one after another (argv: the cases as JSON): each
# script's own code runs afresh for each case, the libraries it imports (torch, arlm) are
# imported once, not once a case. A case's result is one JSON line on fd 1; work seen ends the
# process (exit 3) after a line naming the case.
WATCH = """
import contextlib, io, json, os, runpy, sys, traceback
cases = json.loads(sys.argv[1])  # [[script, argv, cwd], ...]
WORK = (".gguf", ".safetensors", "weights.bin", "tinyshakespeare.txt")
SPAWN = {"subprocess.Popen", "os.posix_spawn", "os.fork", "os.system", "os.exec"}
current = [None]
def report(**result):
    os.write(1, (json.dumps({"case": current[0], **result}) + "\\n").encode())
def hook(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes)) and os.fsdecode(args[0]).endswith(WORK):
        what = "opened " + os.fsdecode(args[0])
    elif event in SPAWN:
        what = event + " " + repr(args[:2])
    else:
        return
    report(code=3, stdout="", stderr="work before the arguments were checked: " + what)
    os._exit(3)
sys.addaudithook(hook)
for i, (script, argv, cwd) in enumerate(cases):
    current[0] = i
    sys.path.insert(0, os.path.dirname(script))
    os.chdir(cwd)
    sys.argv = [script, *argv]
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
    report(code=code, stdout=out.getvalue(), stderr=err.getvalue())
"""
WORKERS = 2  # processes running the cases (the reference machine's cores)


def run_cases(cases: list[tuple[str, list[str], Path]]) -> list[dict]:
    """Each case (script, argv, cwd) run under WATCH: {code, stdout, stderr}, in order; the cases
    split between WORKERS processes run side by side."""
    import concurrent.futures as cf
    import json

    def worker(part: list[int]) -> dict[int, dict]:
        proc = subprocess.run([sys.executable, "-c", WATCH, json.dumps(
            [[str(BENCH / cases[i][0]), cases[i][1], str(cases[i][2])] for i in part])],
            capture_output=True, text=True, timeout=TIMEOUT * len(part))
        got = {}
        for line in proc.stdout.splitlines():
            if line.startswith('{"case"'):
                r = json.loads(line)
                got[part[r.pop("case")]] = r
        for i in part:  # (cases after one that ended the process: not run)
            got.setdefault(i, {"code": None, "stdout": "", "stderr": f"not run: the worker ended with "
                               f"{proc.returncode} before it:\n{proc.stderr[-2000:]}"})
        return got

    parts = [list(range(len(cases)))[k::WORKERS] for k in range(WORKERS)]
    results: dict[int, dict] = {}
    with cf.ThreadPoolExecutor(WORKERS) as pool:
        for got in pool.map(worker, parts):
            results.update(got)
    return [results[i] for i in range(len(cases))]


CASES = [
    ("run.py", ["--threads", "0"]),
    ("run.py", ["--threads", "-1"]),
    ("run.py", ["--repeat", "0"]),
    ("run.py", ["--new-tokens", "0"]),
    ("run.py", ["--new-tokens", "1"]),  # decode tokens/s divides by new_tokens - 1
    ("run.py", ["--new-tokens", "514"]),  # the 512-token prompt + 513 no longer fit llama.cpp's 1024
    ("run.py", ["--batch-new-tokens", "0"]),
    ("run.py", ["--batch-new-tokens", "9000"]),
    ("layer_rates.py", ["--model", "m.gguf", "--rows", "1,0"]),
    ("layer_rates.py", ["--model", "m.gguf", "--threads", "0"]),
    ("layer_rates.py", ["--model", "m.gguf", "--activations", "int4"]),
    ("phases.py", ["--threads", "0"]),
    ("phases.py", ["--cases", "1x32", "--steps", "0"]),
    ("phases.py", ["--cases", "1x32", "--repeat", "0"]),
    ("phases.py", ["--cases", "1x99999"]),
    ("phases.py", ["--cases", "1x32,2x8192"]),  # 8193 cache slots
    ("phases.py", ["--kv-dtype", "int3"]),
    ("kv_cache.py", ["--llama-cpp-caches", "q9"]),
    ("serve.py", ["--threads", "0"]),
    ("serve.py", ["--clients", "0"]),
    ("serve.py", ["--clients", "1,-8"]),
    ("serve.py", ["--clients", "1,,8"]),
    ("serve.py", ["--max-tokens", "0"]),
    ("serve.py", ["--max-tokens", "9000"]),
    ("sampling_ops.py", ["--batch", "0"]),
    ("shared.py", ["--rounds", "0"]),
    ("shared.py", ["--busy", "1,-1"]),
    ("shared.py", ["--busy", "x"]),
    ("serve.py", ["--context", "0"]),
    ("serve.py", ["--context", "8190"]),  # + the engine step's 40 tokens overflow the window
    ("train_shakespeare_char.py", ["--threads", "0"]),
    ("train_shakespeare_char.py", ["--steps", "0"]),
    ("train_shakespeare_char.py", ["--steps", "50"]),  # no steps after the warm-up window
    ("train_shakespeare_char.py", ["--reference-steps", "-1"]),
    ("train_shakespeare_char.py", ["--reference-steps", "50"]),
    ("train_shakespeare_char.py", ["--ddp", "-1"]),
    ("train_shakespeare_char.py", ["--ddp", "5"]),  # 12 // 5 x 5 is not the recipe's batch of 12
    ("train_shakespeare_char.py", ["--seed", "-1"]),
    ("gpu.py", ["--device", "mps"]),
    ("tokenizer_load.py", ["--rounds", "0"]),
    ("call_order.py", ["--model", "m.gguf", "--rounds", "0"]),
    ("call_order.py", ["--model", "m.gguf", "--gaps", "10,x"]),
    ("call_order.py", ["--model", "m.gguf", "--gaps", "-5"]),
    ("call_order.py", ["--model", "m.gguf", "--orders", "gate_up,foo"]),
    ("kernel_ab.py", ["a.cpp", "b.cpp", "--rounds", "0"]),
    ("sizes.py", ["--rounds", "0"]),
    ("sizes.py", ["--parts", "decode1,depth"]),  # (the part is "deep")
]


SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.name != "bench_args.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every case of CASES (in an empty directory of its own) and every script's --help, run once:
    (script, argv) -> (result, that directory)."""
    cases = []
    for script, argv in CASES:
        cwd = tmp_path_factory.mktemp("case")
        if script == "train_shakespeare_char.py":
            argv = [*argv, "--out", str(cwd)]  # were the check missing, nothing lands in the repo
        cases.append((script, argv, cwd))
    cases += [(script, ["--help"], tmp_path_factory.mktemp("help")) for script in SCRIPTS]
    results = run_cases(cases)
    keys = [(s, tuple(a)) for s, a in CASES] + [(s, ("--help",)) for s in SCRIPTS]
    return {key: (r, cwd) for key, r, (_, _, cwd) in zip(keys, results, cases)}


@pytest.mark.parametrize("script,argv", CASES, ids=[f"{s}:{' '.join(a)}" for s, a in CASES])
def test_bad_argument_is_argparse_error(script, argv, runs):
    r, cwd = runs[script, tuple(argv)]
    assert r["code"] == 2, r["stdout"] + r["stderr"]  # (3: WATCH saw work start)
    assert "Traceback" not in r["stderr"], r["stderr"]
    assert f"{script}: error: " in r["stderr"], r["stderr"]
    assert list(cwd.iterdir()) == [], "the script wrote files before failing"


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_still_works(script, runs):
    r, _ = runs[script, ("--help",)]
    assert r["code"] == 0 and "usage:" in r["stdout"], r["stderr"]


def test_int_types_accept_their_range():
    sys.path.insert(0, str(BENCH))
    try:
        from bench_args import int_range, positive_int, positive_int_list
    finally:
        sys.path.remove(str(BENCH))
    assert positive_int("1") == 1 and int_range(2, 513)("513") == 513 and int_range(0)("0") == 0
    assert positive_int_list("1,8,32") == [1, 8, 32]
    for parse, text in ((positive_int, "0"), (positive_int, "1.5"), (int_range(2, 513), "514"),
                        (positive_int_list, ""), (positive_int_list, "1,x")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_max_seq_len_constant_matches_the_gguf(smollm2_path):
    """The scripts check contexts against a constant (reading the GGUF costs seconds): keep it true."""
    import gguf

    sys.path.insert(0, str(BENCH))
    try:
        from bench_args import SMOLLM2_MAX_SEQ_LEN
    finally:
        sys.path.remove(str(BENCH))
    field = gguf.GGUFReader(str(smollm2_path)).fields["llama.context_length"]
    assert int(field.parts[field.data[0]][0]) == SMOLLM2_MAX_SEQ_LEN
