"""`arlm trace`: run a real generation with the engine's step hook on and show every step."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from ..cli_common import (UsageError, add_chat_template_arg, add_model_args, add_sampling_args, add_speculative_args, load_llm,
                          positive_int, sampling_params)
from ..engine.block_pool import DEFAULT_BLOCK_SIZE
from ..files import atomic_write_text
from .page import render_page


def _writable(path: str, prog: str) -> Path:
    p = Path(path)
    if not p.absolute().parent.is_dir():
        raise UsageError(f"{prog}: error: cannot write {path}: no directory {p.absolute().parent}")
    return p


def read_prompts(path: str, prog: str) -> list[str]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UsageError(f"{prog}: error: cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{prog}: error: {path} is not UTF-8 text (byte {e.start})") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise UsageError(f"{prog}: error: {path} holds no prompt (one a line)")
    return prompts


def cmd_trace(args: argparse.Namespace) -> int:
    # (torch and tokenizers: cli_common's doc)
    from ..engine import Engine, EngineConfig
    from ..tokenizer import valid_text
    from .tracer import run_trace

    prog = "arlm trace"
    prompts = [valid_text(args.prompt)] if args.prompt else []
    if args.batch_prompts:
        prompts += read_prompts(args.batch_prompts, prog)
    if not prompts or not all(p for p in prompts):
        raise UsageError(f"{prog}: error: the prompt is empty")
    if args.max_new_tokens < 1:
        raise UsageError(f"{prog}: error: --max-new-tokens must be >= 1")
    out = _writable(args.out, prog) if args.out else None
    json_path = _writable(args.json, prog) if args.json else None
    params = sampling_params(args)
    llm = load_llm(args)
    if args.chat:
        prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    ids = llm.prompt_ids(prompts)
    engine = None
    if args.paged:
        total = sum(len(p) + params.max_new_tokens for p in ids)
        tokens = args.kv_cache_tokens or max(2 * args.block_size, -(-total * 5 // 4 // args.block_size) * args.block_size)
        engine = Engine(llm.runner, llm.tokenizer.eos_ids,
                        EngineConfig(block_size=args.block_size, kv_cache_tokens=tokens, max_num_seqs=len(ids),
                                     kv_dtype=llm.kv_dtype))
        engine.grammars = llm.grammars
    trace = run_trace(llm, ids, params, engine=engine, drafter=llm.drafter(None))
    trace["command"] = "arlm trace " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if sys.argv[1:2] == ["trace"] else ""
    if json_path:
        atomic_write_text(json_path, json.dumps(trace))
    if out:
        atomic_write_text(out, render_page(trace))
    if args.tui or not out:
        from .tui import print_trace  # (rich: ~0.2 s that a run writing only --out does without)

        print_trace(trace)
    written = [str(p) for p in (out, json_path) if p]
    if written:
        print(f"arlm trace: {len(trace['steps'])} steps; wrote {', '.join(written)}", file=sys.stderr)
    return 0


def add_trace(sub) -> None:
    p = sub.add_parser("trace", help="generate with every engine step recorded: an HTML page, JSON, or the terminal")
    p.add_argument("prompt", nargs="?", default="The cat sat on the", help="the prompt (default: The cat sat on the)")
    add_model_args(p, compile=False)
    add_chat_template_arg(p)
    add_sampling_args(p, max_new_tokens=16)
    add_speculative_args(p)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--batch-prompts", metavar="FILE", default=None,
                   help="more prompts, one a line, generated together in one batch")
    p.add_argument("--paged", action="store_true",
                   help="run on a paged pool (blocks, as arlm serve) instead of arlm generate's contiguous cache")
    p.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_SIZE,
                   help=f"with --paged: tokens per block (default: {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--kv-cache-tokens", type=positive_int, default=None,
                   help="with --paged: the pool's size in tokens (default: what the prompts need, plus a quarter)")
    p.add_argument("--out", metavar="HTML", default=None, help="write a self-contained HTML page that steps through it")
    p.add_argument("--json", metavar="FILE", default=None, help="write the trace as JSON")
    p.add_argument("--tui", action="store_true", help="show the steps in the terminal (the default without --out)")
    p.set_defaults(func=cmd_trace)
