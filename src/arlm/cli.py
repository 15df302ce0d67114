"""The `arlm` command line: a thin layer over `arlm.llm` (and, per subcommand, its module).

Every user mistake ends in one line on stderr and a non-zero exit, never a traceback
(set ARLM_DEBUG=1 to see one for an unexpected error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable

from .cli_common import (Parser, UsageError, add_model_args, add_sampling_args, load_llm, positive_int,
                         sampling_params, stats_line)
from .serve.cli import add_serve
from .train.cli import add_prepare, add_train

# -- arlm generate ---------------------------------------------------------------------------------

def cmd_generate(args: argparse.Namespace) -> int:
    from .tokenizer import valid_text

    if not args.prompt:
        raise UsageError("arlm generate: error: the prompt is empty")
    args.prompt = valid_text(args.prompt)  # bytes that were not UTF-8 become U+FFFD
    params = sampling_params(args)
    llm = load_llm(args)
    if args.chat:
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt = args.prompt
    stream = llm.stream([prompt], params, context_shift=args.context_shift)
    if not args.json and not args.chat:
        sys.stdout.write(prompt)  # show the continuation in context, as llama.cpp and gpt-fast do
    text = ""
    for chunk in stream:
        text += chunk.text
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    req = stream.requests[0]
    if args.json:
        print(json.dumps({"model": llm.loaded.name, "prompt": args.prompt,
                          "prompt_token_ids": req.prompt_ids, "completion_token_ids": req.output_ids,
                          "text": text, "finish_reason": req.finish_reason,
                          "stats": stream.stats.to_dict()}, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        print(f"[finish: {req.finish_reason}] " + stats_line(stream.stats), file=sys.stderr)
    return 0


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (streamed)")
    p.add_argument("prompt", help="the prompt text")
    add_model_args(p)
    add_sampling_args(p, max_new_tokens=128)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument("--context-shift", action="store_true",
                   help="when the context window fills, go on from its last half (recomputed), as "
                        "nanoGPT's sample.py crops the context; default: stop (finish reason 'context')")
    p.set_defaults(func=cmd_generate)


# -- arlm chat -------------------------------------------------------------------------------------

def cmd_chat(args: argparse.Namespace) -> int:
    from .llm import ChatSession, PromptError
    from .tokenizer import valid_text

    params = sampling_params(args)
    if args.max_context <= params.max_new_tokens:
        raise UsageError(f"arlm chat: error: --max-context ({args.max_context}) must be larger than "
                         f"--max-new-tokens ({params.max_new_tokens}): the reply must fit beside the prompt")
    llm = load_llm(args)
    if not llm.chat_template:
        raise PromptError(f"model {llm.loaded.name} has no chat template (use `arlm generate` for plain text)")
    session = ChatSession(llm, params, system=args.system, max_context=args.max_context)
    interactive = sys.stdin.isatty()
    failed = 0  # turns that got no reply: a non-zero exit at the end
    if interactive:
        print(f"arlm chat with {llm.loaded.name}: /reset starts over, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        line = valid_text(line).strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            session = ChatSession(llm, params, system=args.system, max_context=args.max_context)
            continue
        try:
            for chunk in session.send(line):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        except PromptError as e:
            print(f"arlm chat: error: {e}", file=sys.stderr)
            failed += 1
            continue
        sys.stdout.write("\n")
        print(f"[prefilled {session.last_prefill_tokens} new tokens, {session.cached_tokens} cached] "
              + stats_line(session.stats), file=sys.stderr)
    if failed:
        print(f"arlm chat: {failed} message(s) got no reply", file=sys.stderr)
    return 1 if failed else 0


def add_chat(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat; the KV cache persists between turns")
    add_model_args(p)
    add_sampling_args(p, max_new_tokens=256)
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--max-context", type=positive_int, default=4096,
                   help="KV cache size in tokens, at most the model's context window (default: 4096)")
    p.set_defaults(func=cmd_chat)


# -- entry point -----------------------------------------------------------------------------------

SUBCOMMANDS: list[Callable] = [add_generate, add_chat, add_prepare, add_train, add_serve]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="arlm", description="Autoregressive transformer LMs: train, generate, serve.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"arlm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .config import ConfigError
    from .loading.errors import LoadError

    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`arlm generate ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 1
    except (LoadError, ConfigError, ValueError, OSError) as e:
        print(f"arlm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\narlm: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the last line of defence against a traceback
        if os.environ.get("ARLM_DEBUG"):
            raise
        print(f"arlm: internal error: {type(e).__name__}: {e} (set ARLM_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
