"""The benchmark scripts reject a bad number the way argparse does: one `script: error: ...` line
and exit code 2, before a model is loaded or any work is done (each script costs its imports,
~1-2 s, and nothing more). Every case was a traceback, some of them after seconds of work.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a subprocess or a model load per test

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
# A hang guard for each script (its imports take ~1-2 s on a quiet machine).
TIMEOUT = 300

# The script run as `python script.py ...` would run it, but ended at the first sign of work:
# opening model weights or the training text, or starting a process (a server, a busy loop, or
# `uname` for the machine's description). A check of the arguments made after any of these
# fails the test whatever the machine's speed (a time limit would depend on its load).
WATCH = """
import os, runpy, sys
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
WORK = (".gguf", ".safetensors", "weights.bin", "tinyshakespeare.txt")
SPAWN = {"subprocess.Popen", "os.posix_spawn", "os.fork", "os.system", "os.exec"}
def hook(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes)) and os.fsdecode(args[0]).endswith(WORK):
        what = "opened " + os.fsdecode(args[0])
    elif event in SPAWN:
        what = event + " " + repr(args[:2])
    else:
        return
    os.write(2, ("work before the arguments were checked: " + what + "\\n").encode())
    os._exit(3)
sys.addaudithook(hook)
runpy.run_path(script, run_name="__main__")
"""

CASES = [
    ("run.py", ["--threads", "0"]),
    ("run.py", ["--threads", "-1"]),
    ("run.py", ["--repeat", "0"]),
    ("run.py", ["--new-tokens", "0"]),
    ("run.py", ["--new-tokens", "1"]),  # decode tokens/s divides by new_tokens - 1
    ("run.py", ["--new-tokens", "514"]),  # the 512-token prompt + 513 no longer fit llama.cpp's 1024
    ("run.py", ["--batch-new-tokens", "0"]),
    ("run.py", ["--batch-new-tokens", "9000"]),
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
]


@pytest.mark.parametrize("script,argv", CASES, ids=[f"{s}:{' '.join(a)}" for s, a in CASES])
def test_bad_argument_is_argparse_error(script, argv, tmp_path):
    if script == "train_shakespeare_char.py":
        argv = [*argv, "--out", str(tmp_path)]  # were the check missing, nothing lands in the repo
    proc = subprocess.run([sys.executable, "-c", WATCH, str(BENCH / script), *argv], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr  # (3: WATCH saw work start)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"{script}: error: " in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == [], "the script wrote files before failing"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py") if p.name != "bench_args.py"))
def test_help_still_works(script):
    proc = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr


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
