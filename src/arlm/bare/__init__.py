"""`arlm generate` without torch: the decode kernels called from numpy, for a start as quick as
llama.cpp's.

`import torch` alone takes ~1 s here, more than llama.cpp's whole start to its first token on a
1B file. Yet a greedy `arlm generate` on a GGUF file needs nothing of torch once the file's layout
cache exists: its weights are bytes in a map, and the layer stack, the head and the argmax are
native code (kernels/decode.cpp). So the torch path, after loading such a file, writes a *plan*
beside the layout cache (`write`: every tensor the native stack takes, as offsets into the
map), and builds the same kernels once more without libtorch (`library`: bare_api.cpp's C
functions over bare_aten.h's views); a later `arlm generate` whose options the plan serves reads
it (`model`) and runs prefill, decode and the argmax through ctypes, with the tokenizer and the
text streamer the torch path uses (SentencePiece's BPE, Gemma's, from arrays the plan's writer
checked against it: `pieces`). Its tokens and text are the torch path's (tests/test_bare.py).

Served: a GGUF file (or a known name) whose plan for these activations is current; greedy
decoding, or sampling without --seed (temperature, top-k, top-p, min-p in numpy: `sampling`, the
torch path's distribution; a seeded draw is its generator's stream, so --seed takes the torch
path); --chat with the file's own template; stop strings, --ignore-eos, --max-new-tokens,
--threads, --json (the torch path's object); the CPU's packed kernels (AVX-512 VNNI or AVX2, the default
matmul path there) and a float KV cache. Anything else - a chat template given, a KV window,
structured output, speculation, penalties or a logit bias, another matmul path, dtype or KV type,
a prompt and output longer than the plan's RoPE rows - takes the torch path, as does a file whose plan or
library is not there yet (the torch path writes the plan; the library builds in the background,
once per machine and source version). Where only the plan was missing, the `arlm` process writes it
once the model is loaded and runs the command on here, in its place (`rerun_without_torch`).
ARLM_BARE=0 turns this path off.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# What each option must be for the plan to serve the command (the CLI's defaults, or values the
# plan computes the same way)
_DEFAULTS = {"device": "cpu", "dtype": "auto", "quantize": "auto", "prefill_dtype": None, "kv_window": 0,
             "chat_template": None, "compile": False, "speculative": None,
             "repetition_penalty": 1.0, "presence_penalty": 0.0,
             "frequency_penalty": 0.0, "logit_bias": [], "min_tokens": 0, "stop_token_id": [], "json_schema": None,
             "json_object": False, "regex": None, "choice": None, "grammar": None, "context_shift": False}


_LOAD = ("device", "dtype", "quantize", "prefill_dtype", "kv_window", "compile", "chat_template")


def enabled() -> bool:
    """ARLM_BARE=0 turns the bare path off: no plan read, written or library built; so do the
    switches that take the torch path off the native kernels (ARLM_NO_NATIVE, ARLM_NO_FUSED)."""
    return os.environ.get("ARLM_BARE", "1") != "0" and not os.environ.get("ARLM_NO_NATIVE") \
        and not os.environ.get("ARLM_NO_FUSED")


def plan_settings(args: argparse.Namespace) -> bool:
    """Whether the model was loaded as a plan serves it (the defaults; activations int8x2 or
    int8): then the torch path writes the plan after its run (`write.save`)."""
    if not enabled():
        return False
    if getattr(args, "matmul_path", "auto") not in ("auto", "vnni") or getattr(args, "kv_dtype", "auto") != "auto":
        return False
    return args.activations in ("int8x2", "int8") and all(
        getattr(args, name, _DEFAULTS[name]) == _DEFAULTS[name] for name in _LOAD)


def _served(args: argparse.Namespace) -> bool:
    import math

    if args.seed is not None or args.max_new_tokens < 1 or not (math.isfinite(args.temperature) and
                                                                 args.temperature >= 0):
        return False  # (a seeded draw is the torch generator's stream; bad values: the torch path says why)
    if not (0 <= args.top_k < 2**31 and 0.0 < args.top_p <= 1.0 and 0.0 <= args.min_p <= 1.0):
        return False
    if any(not s for s in args.stop) or (args.threads is not None and not 1 <= args.threads < 2**15) \
            or getattr(args, "kv_sinks", 0) < 0:
        return False  # (values the torch path refuses, with its own message)
    return plan_settings(args) and all(getattr(args, name, value) == value for name, value in _DEFAULTS.items())


def _model_file(spec: str) -> Path | None:
    from ..model_files import known_model_file

    known = known_model_file(spec)
    if known is not None:
        return known
    path = Path(spec).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def generate(args: argparse.Namespace) -> int | None:
    """Run `arlm generate` here where the bare path serves it (its exit code), else None (the
    torch path runs it: nothing has been written to stdout or stderr)."""
    if not _served(args):
        return None
    from ..model_files import cache_dir, hash_remembered

    path = _model_file(args.model)
    if path is None or not hash_remembered(path):  # (a file never loaded: the torch path hashes it)
        return None
    from . import library
    from .model import BareModel, BarePlan

    lib = library.load()
    if lib is None or not lib.packed():
        return None
    from ..tokenizer import Tokenizer

    try:  # (a plan, a cache or a tokenizer file that cannot be read as written: the torch path rebuilds)
        plan = BarePlan(cache_dir(path, "packed"), args.activations)
        model = BareModel(plan, lib)
        tok = plan.plan["tokenizer"]
        tokenizer = Tokenizer(_tokenizer_backend(plan.directory, tok.get("pieces")), tok["bos_id"],
                              tok["eos_ids"], tok["add_bos"])
        template, max_len, vocab = plan.plan.get("chat_template"), model.max_len, model.arch["vocab_size"]
    except Exception:  # noqa: BLE001 - any of them (tokenizers raises Exception itself)
        return None
    _release_freed_heap()
    prompt = args.prompt
    if args.chat:  # (the template the model's file carries; a failing one: the torch path says why)
        from ..text import PromptError, render_chat, template_tokens

        if not template:
            return None
        try:
            prompt = render_chat(template, [{"role": "user", "content": args.prompt}],
                                 **template_tokens(tokenizer))
        except PromptError:
            return None
    ids = tokenizer.encode(prompt)
    if not ids or len(ids) + args.max_new_tokens > max_len or max(ids) >= vocab:
        return None  # (the torch path says what is wrong, or runs the long sequence)
    threads = args.threads or _default_threads()
    lib.set_threads(threads)
    k, v = model.new_cache(len(ids) + args.max_new_tokens)
    t0 = time.perf_counter()
    try:  # (the prompt's pass before anything is printed: a plan the kernels refuse leaves it to torch)
        logits = model.prefill(ids, k, v)
    except (RuntimeError, ValueError, IndexError, KeyError):
        return None
    if args.threads is not None and args.threads > (os.cpu_count() or 1):
        print(f"arlm: warning: --threads {args.threads} is more than this machine's {os.cpu_count()} cores: "
              "the threads will take turns, and decode gets much slower", file=sys.stderr)
    isa = "AVX512-VNNI+AMX-INT8" if lib.amx() else lib.packed_isa()
    return _run(model, tokenizer, prompt, ids, args, threads, isa, (k, v, logits, time.perf_counter() - t0))


def _tokenizer_backend(directory: Path, pieces_check: list[int] | None):
    """The tokenizer as the plan's writer stored it: SentencePiece's BPE as arrays where it wrote
    them (`pieces`: ~0.1 s where HF's parse of Gemma's takes ~1 s), else HF tokenizers' parse of
    tokenizer.json."""
    if pieces_check:
        from . import pieces

        path = directory / pieces.FILE
        try:
            if path.stat().st_size == pieces_check[0]:  # (its CRC is checked where it is written)
                return pieces.PieceTokenizer.load(path)
        except (OSError, ValueError):
            pass
    from tokenizers import Tokenizer as HFTokenizer

    return HFTokenizer.from_file(str(directory / "tokenizer.json"))


def rerun_without_torch(llm, args: argparse.Namespace) -> None:
    """The torch path's first run of a command the bare path serves (the file's first load, or
    its plan not written yet): the plan written now, and the command run again in this process's
    place (exec) without torch, as every later run of it is. The first load's peak memory is then
    the torch process's while it builds the layout cache, or the bare run's, not the torch
    process's (~290 MB at 1B) beside the whole model's pages. Returns where it cannot: the bare
    library not built yet, the plan not written, or this command a rerun already (a prompt the
    plan does not serve: the torch path runs it)."""
    if os.environ.get("ARLM_BARE_RERUN") or not _served(args):
        return
    from . import library, write

    lib = library.load()
    if lib is None or not lib.packed() or write.save(llm, args.activations) is None:
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        os.execve(sys.executable, [sys.executable, "-m", "arlm", *sys.argv[1:]], {**os.environ, "ARLM_BARE_RERUN": "1"})
    except OSError:  # (no interpreter to start: the torch path goes on)
        return


def _default_threads() -> int:
    """The torch path's width: OMP_NUM_THREADS, else the physical cores this process may run on
    (torch's default; a core's second hardware thread only contends for its units)."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "")))
    except ValueError:
        pass
    allowed = os.sched_getaffinity(0)
    cores, cpu, phys = set(), None, "0"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "processor":
                    cpu = int(value)
                elif key == "physical id":
                    phys = value
                elif key == "core id" and cpu in allowed:
                    cores.add((phys, value))
    except (OSError, ValueError):
        pass
    return len(cores) or len(allowed)


def _release_freed_heap() -> None:
    """Hand the heap a parse freed back to the OS (glibc's malloc_trim): the tokenizer's JSON tree
    (~20 MB of Llama 3's) would otherwise stay in the process's memory beside the weights, whose
    pages come after it, and raise its peak by as much."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # (not glibc)
        pass


def _run(model, tokenizer, prompt: str, ids: list[int], args: argparse.Namespace, threads: int, isa: str,
         prefilled: tuple) -> int:
    """Print the continuation of the prompt (its pass done: `prefilled` is the cache k, v, the
    last position's logits and the seconds it took), then the stats line; or, with --json, the
    torch path's one JSON object. The exit code."""
    import numpy as np

    from ..settings import GREEDY_BELOW
    from ..text import TextStreamer
    from . import sampling

    k, v, logits, prefill_s = prefilled
    greedy = args.temperature < GREEDY_BELOW
    rng = np.random.default_rng()  # (unseeded: a seeded request takes the torch path)
    eos = set() if args.ignore_eos else set(tokenizer.eos_ids)
    streamer = TextStreamer(tokenizer, list(args.stop))
    if not args.chat and not args.json:
        sys.stdout.write(prompt)  # (as the torch path: the continuation in context)
    t1 = time.perf_counter()
    reason, out, text = None, [], ""
    while reason is None:
        token = model.next_token(logits) if greedy else \
            sampling.sample(logits, args.temperature, args.top_k, args.top_p, args.min_p, rng)
        out.append(token)
        reason = "eos" if token in eos else "length" if len(out) >= args.max_new_tokens else None
        piece, hit = streamer.push(token, final=reason is not None)
        if hit:
            reason = "stop"
        text += piece
        if not args.json:
            sys.stdout.write(piece)
            sys.stdout.flush()
        if reason is None:
            logits = model.decode(token, len(ids) + len(out) - 1, k, v)
    decode_s, decoded = time.perf_counter() - t1, len(out) - 1
    a = model.arch
    per_token = 2 * a["n_layer"] * a["n_kv_heads"] * a["head_dim"] * k.itemsize
    decode_rate = decoded / decode_s if decoded and decode_s > 0 else 0.0
    if args.json:  # (GenerationStats.to_dict's fields)
        import json

        stats = {"prompt_tokens": len(ids), "prefill_seconds": round(prefill_s, 4),
                 "prefill_tokens_per_s": round(len(ids) / prefill_s if prefill_s > 0 else 0.0, 2),
                 "decode_tokens": decoded, "decode_seconds": round(decode_s if decoded else 0.0, 4),
                 "decode_tokens_per_s": round(decode_rate, 2), "kv_cache_bytes": 2 * k.nbytes,
                 "kv_cache": {"dtype": model.p["kv"]["dtype"], "bytes_per_token": per_token, "bytes": 2 * k.nbytes},
                 "matmul": {"path": "vnni", "isa": isa},
                 "threads": {"width": threads, "narrowest": threads, "widest": threads,
                             "pinned": args.threads is not None, "changes": 0},
                 "speculative": {"proposed": 0, "accepted": 0, "passes": 0, "acceptance_rate": 0.0,
                                 "tokens_per_pass": 0.0}}
        print(json.dumps({"model": model.p["name"], "prompt": args.prompt, "prompt_token_ids": ids,
                          "completion_token_ids": out, "text": text, "finish_reason": reason, "stats": stats},
                         ensure_ascii=False))
        return 0
    sys.stdout.write("\n")
    print(f"[finish: {reason}] prefill: {len(ids)} tokens, {len(ids) / max(prefill_s, 1e-9):.1f} tokens/s | "
          f"decode: {decoded} tokens, {decode_rate:.1f} tokens/s | "
          f"KV cache: {model.p['kv']['dtype']}, {per_token} bytes/token, {2 * k.nbytes / 2**20:.2f} MiB "
          f"({2 * k.nbytes} bytes) | matmul: vnni ({isa}) | threads: "
          + (f"{threads} (pinned)" if args.threads else f"{threads} of {threads}") + " | no torch", file=sys.stderr)
    return 0
