"""The `arlm` command in a subprocess: bad input fails cleanly; --json and piped chat match the API.

Bad input: non-zero exit, exactly one line on stderr naming the problem, no traceback, nothing on
stdout. These fail before the model loads, so they are cheap and run one after another in one
process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from arlm.cli import build_parser
from arlm.llm import ChatSession
from arlm.sampling import SamplingParams

ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
ENV.pop("ARLM_DEBUG", None)
# For a command whose float32 output is compared with this process's: the same fixed width. Left
# to itself the command narrows its steps while other processes keep the cores busy, and torch's
# float32 GEMMs sum in another order at another width.
SAME_WIDTH = ("--threads", str(torch.get_num_threads()))


def arlm(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "arlm", *args], input=stdin, capture_output=True, text=True,
                          env=ENV, timeout=timeout)


def bad_inputs(tmp: Path, gguf: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (arguments, a word the one-line error must contain)."""
    not_gguf = tmp / "weights.gguf"
    not_gguf.write_text("this is not a model\n")
    truncated = tmp / "truncated.gguf"
    with open(gguf, "rb") as src:
        truncated.write_bytes(src.read(1 << 20))
    empty_dir = tmp / "empty_model_dir"
    empty_dir.mkdir()
    return {
        "empty-prompt": (["generate", ""], "empty"),
        "unknown-model-name": (["generate", "hi", "--model", "no-such-model"], "unknown model"),
        "missing-path": (["generate", "hi", "--model", str(tmp / "missing.gguf")], "unknown model"),
        "not-gguf": (["generate", "hi", "--model", str(not_gguf)], "not a GGUF"),
        "truncated-gguf": (["generate", "hi", "--model", str(truncated)], "truncated"),
        "dir-without-config": (["generate", "hi", "--model", str(empty_dir)], "config.json"),
        "negative-temperature": (["generate", "hi", "--temperature", "-1"], "temperature"),
        "top-p-zero": (["generate", "hi", "--top-p", "0"], "top_p"),
        "top-p-above-one": (["generate", "hi", "--top-p", "1.5"], "top_p"),
        "negative-top-k": (["generate", "hi", "--top-k", "-1"], "top_k"),
        "non-numeric-temperature": (["generate", "hi", "--temperature", "warm"], "temperature"),
        "chat-bad-top-p": (["chat", "--top-p", "2"], "top_p"),
        "unknown-kv-dtype": (["generate", "hi", "--kv-dtype", "int3"], "kv-dtype"),
        "bogus-device": (["generate", "hi", "--device", "bogus"], "--device"),
        "unsupported-device": (["generate", "hi", "--device", "meta"], "cpu or cuda"),
        "empty-device": (["chat", "--device", ""], "--device"),
        "seed-too-large": (["generate", "hi", "--seed", "9" * 25], "seed"),
        "chat-zero-context": (["chat", "--max-context", "0"], "max-context"),
        "chat-context-below-reply": (["chat", "--max-context", "64", "--max-new-tokens", "64"], "max-context"),
        "serve-replicas-not-a-number": (["serve", "--replicas", "two"], "--replicas"),
        "serve-auto-replicas-range": (["serve", "--replicas", "auto", "--min-replicas", "3", "--max-replicas", "2"],
                                      "--max-replicas"),
        "serve-max-replicas-without-auto": (["serve", "--replicas", "2", "--max-replicas", "4"], "--replicas auto"),
    }


# `python -c BAD_RUNS CASES`: each command line of CASES (JSON) through `arlm`'s main() in turn, in
# this one process, its stdin empty and its fd 1 and fd 2 captured apart (what the terminal would
# show, C-level writes included); one JSON line a case, [exit code, stdout, stderr], on the
# original fd 1. The first case pays the imports (and would show anything they print).
BAD_RUNS = """
import json, os, sys, tempfile
from arlm.cli import main
report = os.dup(1)
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
for argv in json.loads(sys.argv[1]):
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    saved = [os.dup(1), os.dup(2)]
    sys.stdout.flush(); sys.stderr.flush()
    os.dup2(files[0].fileno(), 1); os.dup2(files[1].fileno(), 2)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    sys.stdout.flush(); sys.stderr.flush()
    os.dup2(saved[0], 1); os.dup2(saved[1], 2)
    texts = []
    for f in files:
        f.seek(0)
        texts.append(f.read().decode(errors="replace"))
    os.write(report, (json.dumps([code, *texts]) + "\\n").encode())
"""


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory, smollm2_path):
    """Every bad-input command, one after another in one process of its own (BAD_RUNS: one
    interpreter's imports for all of them, not one each): name -> (returncode, stdout, stderr,
    the word its error must contain). test_console_script_entry_point and
    test_help_and_usage_errors_import_nothing_heavy run commands in processes of their own."""
    import json

    cases = bad_inputs(tmp_path_factory.mktemp("cli"), smollm2_path)
    assert sorted(cases) == sorted(BAD_INPUTS)
    # The kernels built first, here: on a fresh machine (an empty ~/.cache/arlm) the first command
    # would build them, saying so on stderr (one line more).
    from arlm import kernels

    kernels.native_available()
    r = subprocess.run([sys.executable, "-c", BAD_RUNS, json.dumps([args for args, _ in cases.values()])],
                       capture_output=True, text=True, env=ENV, timeout=300 + 30 * len(cases))
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == len(cases), r.stdout[-2000:] + r.stderr[-2000:]
    return {name: (*json.loads(line), cases[name][1]) for name, line in zip(cases, lines)}


BAD_INPUTS = ["empty-prompt", "unknown-model-name", "missing-path", "not-gguf", "truncated-gguf",
              "dir-without-config", "negative-temperature", "top-p-zero", "top-p-above-one", "negative-top-k",
              "non-numeric-temperature", "chat-bad-top-p", "unknown-kv-dtype", "bogus-device", "unsupported-device",
              "empty-device", "seed-too-large", "chat-zero-context", "chat-context-below-reply",
              "serve-replicas-not-a-number", "serve-auto-replicas-range", "serve-max-replicas-without-auto"]


@pytest.mark.slow
@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_fails_with_one_line(bad_runs, name):
    code, out, err, word = bad_runs[name]
    assert code != 0
    assert "Traceback" not in err
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1, err
    assert word.lower() in lines[0].lower()
    assert out == ""


def test_console_script_entry_point():
    script = shutil.which("arlm", path=str(Path(sys.executable).parent))
    assert script is not None, "pip install -e . installs the arlm console script beside the interpreter"
    r = subprocess.run([script, "generate", "hi", "--top-k", "-1"], capture_output=True, text=True, env=ENV,
                       timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "top_k" in r.stderr


# What `arlm --help` and a usage error must not import: torch alone is ~1 s of a warm start.
HEAVY = {"torch", "numpy", "tokenizers", "transformers", "safetensors", "gguf", "llguidance", "jinja2", "rich",
         "fastapi", "starlette", "uvicorn", "ray"}


def imported_modules(importtime: str) -> set[str]:
    """The top-level names of the modules a `python -X importtime` run imported (its stderr)."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in importtime.splitlines()
            if line.startswith("import time:") and "|" in line}


def test_help_and_usage_errors_import_nothing_heavy():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    runs = {"--help": (["--help"], 0), "--version": (["--version"], 0),
            **{f"{name} --help": ([name, "--help"], 0) for name in sub.choices},
            "missing prompt": (["generate"], 2), "unknown command": (["bogus"], 2),
            "not a number": (["generate", "hi", "--temperature", "warm"], 2),
            "bad choice": (["trace", "--kv-dtype", "int3"], 2), "serve type": (["serve", "--replicas", "two"], 2)}
    procs = {name: subprocess.Popen([sys.executable, "-X", "importtime", "-m", "arlm", *args], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=ENV)
             for name, (args, _) in runs.items()}
    for name, p in procs.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode == runs[name][1], (name, err[-2000:])
        if p.returncode == 0:
            assert out.startswith("usage: arlm") or out.startswith("arlm "), (name, out)
        else:
            assert err.splitlines()[-1].startswith("arlm"), (name, err[-2000:])  # the one-line error, last
        assert "arlm" in imported_modules(err), (name, err[-2000:])  # (the parse read the lines)
        assert not imported_modules(err) & HEAVY, (name, sorted(imported_modules(err) & HEAVY))


@pytest.mark.slow
def test_generate_json_matches_api(smollm2):
    prompt = "The capital of France is"
    r = arlm("generate", prompt, "--temperature", "0", "--max-new-tokens", "12", "--quantize", "none", "--json",
             *SAME_WIDTH)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"prompt_token_ids", "completion_token_ids", "text", "finish_reason", "stats"}
    assert set(out["stats"]) >= {"prompt_tokens", "prefill_tokens_per_s", "decode_tokens", "decode_tokens_per_s",
                                 "kv_cache_bytes"}
    ref = smollm2.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0))[0]
    assert out["prompt_token_ids"] == ref.prompt_ids
    assert out["completion_token_ids"] == ref.token_ids
    assert out["text"] == ref.text and out["finish_reason"] == ref.finish_reason
    assert out["stats"]["prompt_tokens"] == len(ref.prompt_ids)
    kv = out["stats"]["kv_cache"]  # float32 weights: a float32 cache, 2 x 30 x 3 x 64 x 4 bytes a token
    assert kv["dtype"] == "float32" and kv["bytes_per_token"] == 46080 and kv["bytes"] == out["stats"]["kv_cache_bytes"]
    assert out["stats"]["matmul"]["path"] == "float32"  # unquantized: its own weights' dtype


@pytest.mark.slow
def test_generate_with_a_kv_window():
    r = arlm("generate", "The history of Rome", "--temperature", "0", "--max-new-tokens", "40", "--kv-window", "16",
             "--kv-sinks", "4", "--kv-dtype", "int8", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["completion_token_ids"]) == 40
    r = arlm("generate", "hi", "--kv-window", "16", "--speculative", "ngram")
    assert r.returncode != 0 and "--kv-window" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_generate_with_a_quantized_kv_cache_reports_it():
    r = arlm("generate", "The capital of France is", "--temperature", "0", "--max-new-tokens", "8",
             "--kv-dtype", "int8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    kv = out["stats"]["kv_cache"]
    assert kv["dtype"] == "int8" and kv["bytes_per_token"] == 12240 and "Paris" in out["text"]
    from cpu_flags import matmul_path_expected  # the matrix path auto chose, named with its instructions

    assert out["stats"]["matmul"]["path"] == matmul_path_expected() and out["stats"]["matmul"]["isa"]
    r = arlm("generate", "Hi", "--max-new-tokens", "2", "--matmul-path", "avx2")  # forced, in the stats line
    assert r.returncode == 0 and "matmul: avx2 (AVX2)" in r.stderr, r.stderr
    r = arlm("generate", "Hi", "--matmul-path", "vnni", "--activations", "float32")  # one line, no traceback
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "matmul path vnni" in r.stderr


@pytest.mark.slow
def test_chat_through_stdin_two_turns(smollm2):
    turns = ["What is the capital of France?", "And of Germany?"]
    r = arlm("chat", "--temperature", "0", "--max-new-tokens", "24", "--quantize", "none", *SAME_WIDTH,
             stdin="\n".join(turns) + "\n")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    session = ChatSession(smollm2, SamplingParams(max_new_tokens=24, temperature=0), max_context=4096)
    replies, prefills = [], []
    for t in turns:
        replies.append("".join(c.text for c in session.send(t)))
        prefills.append(session.last_prefill_tokens)
    assert r.stdout == "".join(reply + "\n" for reply in replies)
    stats = [line for line in r.stderr.splitlines() if line.startswith("[prefilled")]
    assert len(stats) == 2
    new = [int(line.split()[1]) for line in stats]
    cached = [int(line.split(",")[1].split()[0]) for line in stats]
    assert new == prefills
    # Turn two takes turn one's whole blocks from the prefix cache and prefills its own tokens
    # (~13 with the template) plus at most the part of turn one past its last full block.
    assert cached[0] == 0 and cached[1] > 0 and cached[1] % ChatSession.BLOCK_SIZE == 0
    assert new[1] < 20 + ChatSession.BLOCK_SIZE and new[1] < cached[1]


@pytest.mark.slow
def test_prompt_bytes_that_are_not_utf8_become_replacement_characters():
    # (the default path: the weights' type is beside the point, and it loads at once)
    r = subprocess.run([sys.executable, "-m", "arlm", "generate", b"ab\xff\xfecd", "--temperature", "0",
                        "--max-new-tokens", "2"], capture_output=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ab\ufffd\ufffdcd".encode()), r.stdout


@pytest.mark.slow
def test_chat_turn_that_does_not_fit_fails_the_exit_code_not_the_session():
    too_long = "word " * 400
    r = arlm("chat", "--temperature", "0", "--max-new-tokens", "8", "--max-context", "256",
             stdin=f"{too_long}\nHello!\n")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "a reply of up to 8 tokens" in r.stderr and "do not fit the context window of 256" in r.stderr
    assert len([line for line in r.stderr.splitlines() if line.startswith("[prefilled")]) == 1  # turn two ran
    assert r.stdout.strip()
