"""The `arlm` command line: a thin layer over `arlm.llm` (and, per subcommand, its module).

Every user mistake ends in one line on stderr and a non-zero exit, never a traceback
(set ARLM_DEBUG=1 to see one for an unexpected error). torch, tokenizers and the modules that
import them are imported inside the commands that run a model (why: cli_common's doc).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable

from . import __version__
from .cli_common import (Parser, UsageError, add_chat_template_arg, add_model_args, add_sampling_args, add_speculative_args,
                         add_structured_args, add_window_args,
                         load_llm, positive_int,
                         sampling_params, stats_line)

# -- arlm generate ---------------------------------------------------------------------------------

def cmd_generate(args: argparse.Namespace) -> int:
    from .tokenizer import valid_text  # (imports tokenizers)

    if not args.prompt:
        raise UsageError("arlm generate: error: the prompt is empty")
    args.prompt = valid_text(args.prompt)  # bytes that were not UTF-8 become U+FFFD
    from . import bare, files

    files.WEIGHTS_ON_HUGE_PAGES = False  # (one command's tokens: its start first; files.load_weights)

    if (code := bare.generate(args)) is not None:  # (no torch: where a plan serves the command)
        return code
    params = sampling_params(args)
    llm = load_llm(args)
    if _COMMAND_LINE_PROCESS:  # (not a caller's process: this may replace it)
        bare.rerun_without_torch(llm, args)
    if params.structured is not None:  # (checked before the prompt is printed)
        from .structured import GrammarError  # (imports torch)

        try:
            llm.grammars.compile(params.structured)
        except GrammarError as e:
            raise UsageError(f"arlm generate: error: {e}") from None
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
    if bare.plan_settings(args):  # (for the next run of this file: the bare path's plan)
        from .bare import write

        write.save(llm, args.activations)
    return 0


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (streamed)")
    p.add_argument("prompt", help="the prompt text")
    add_model_args(p)
    add_chat_template_arg(p)
    add_sampling_args(p, max_new_tokens=128)
    add_speculative_args(p)
    add_window_args(p)
    add_structured_args(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument("--context-shift", action="store_true",
                   help="when the context window fills, go on from its last half (recomputed), as "
                        "nanoGPT's sample.py crops the context; default: stop (finish reason 'context')")
    p.set_defaults(func=cmd_generate)


# -- arlm embed ------------------------------------------------------------------------------------

def cmd_embed(args: argparse.Namespace) -> int:
    from .tokenizer import valid_text  # (imports tokenizers)

    path = Path(args.input)
    if path.is_file():  # one input per non-empty line
        try:
            texts = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
        except OSError as e:
            raise UsageError(f"arlm embed: error: cannot read {path}: {e.strerror}") from None
        if not texts:
            raise UsageError(f"arlm embed: error: {path} has no non-empty line to embed")
    elif not args.input.strip():
        raise UsageError("arlm embed: error: the text is empty")
    elif os.sep in args.input and not any(c.isspace() for c in args.input):  # a path that is not there
        raise UsageError(f"arlm embed: error: no such file: {args.input} (a text to embed has words, not a path)")
    else:
        texts = [valid_text(args.input)]
    llm = load_llm(args)
    vectors = llm.embed(texts)
    if args.json:
        print(json.dumps({"model": llm.loaded.name, "pooling": llm.POOLING, "dimensions": vectors.shape[1],
                          "data": [{"index": i, "text": t, "tokens": len(llm.encode_prompt(t)), "embedding": v.tolist()}
                                   for i, (t, v) in enumerate(zip(texts, vectors))]}, ensure_ascii=False))
    else:
        for v in vectors:
            print(" ".join(f"{x:.6g}" for x in v.tolist()))
    return 0


def add_embed(sub) -> None:
    p = sub.add_parser("embed", help="embeddings of a text, or of each line of a file (mean-pooled, L2-normalized)")
    p.add_argument("input", help="the text, or a file whose non-empty lines are embedded one by one")
    add_model_args(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (model, pooling, and each input's text, token count and vector) "
                        "instead of one line of numbers per input")
    p.set_defaults(func=cmd_embed)


# -- arlm chat -------------------------------------------------------------------------------------

def cmd_chat(args: argparse.Namespace) -> int:
    # (imports torch and tokenizers)
    from .llm import ChatSession, PromptError
    from .tokenizer import valid_text

    params = sampling_params(args)
    if args.max_context <= params.max_new_tokens:
        raise UsageError(f"arlm chat: error: --max-context ({args.max_context}) must be larger than "
                         f"--max-new-tokens ({params.max_new_tokens}): the reply must fit beside the prompt")
    llm = load_llm(args)
    if not llm.chat_template:
        raise PromptError(f"model {llm.loaded.name} has no chat template: give one with --chat-template "
                          "FILE|TEMPLATE (or use `arlm generate` for plain text)")
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
    add_chat_template_arg(p)
    add_sampling_args(p, max_new_tokens=256)
    add_speculative_args(p)
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--max-context", type=positive_int, default=4096,
                   help="KV cache size in tokens, at most the model's context window (default: 4096)")
    p.set_defaults(func=cmd_chat)


# -- arlm perplexity -------------------------------------------------------------------------------

def read_texts(paths: list[str], prog: str) -> str:
    """The files' contents, concatenated as they are (UTF-8)."""
    text = ""
    for path in paths:
        try:
            text += Path(path).read_bytes().decode("utf-8")
        except OSError as e:
            raise UsageError(f"{prog}: error: cannot read {path}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise UsageError(f"{prog}: error: {path} is not UTF-8 text (byte {e.start})") from None
    return text


def cmd_perplexity(args: argparse.Namespace) -> int:
    from .perplexity import evaluate, read_logits  # (imports torch)

    prog = "arlm perplexity"
    if args.kv_window:
        return stream_perplexity(args, prog)
    args.context = 512 if args.context is None else args.context
    if args.context < 2:
        raise UsageError(f"{prog}: error: --context must be at least 2, got {args.context}")
    stride = args.context // 2 if args.stride is None else args.stride
    if not 1 <= stride <= args.context:
        raise UsageError(f"{prog}: error: --stride must be in 1..{args.context} (the context), got {stride}")
    text = read_texts(args.files, prog)
    if not text:
        raise UsageError(f"{prog}: error: the text is empty")
    if args.save_logits is not None and not Path(args.save_logits).absolute().parent.is_dir():
        raise UsageError(f"{prog}: error: cannot write {args.save_logits}: no directory "
                         f"{Path(args.save_logits).absolute().parent}")
    base = None
    if args.kl_divergence is not None:
        try:
            base = read_logits(args.kl_divergence)
        except OSError as e:
            raise UsageError(f"{prog}: error: cannot read {args.kl_divergence}: {e.strerror or e}") from None
    llm = load_llm(args)
    tok = llm.tokenizer
    ids = tok.encode(text)[:args.max_tokens]
    if len(ids) < 2:
        raise UsageError(f"{prog}: error: the text is {len(ids)} token(s); perplexity needs at least 2")
    result = evaluate(llm, ids, args.context, stride, args.batch_tokens, args.save_logits, base)
    bos = tok.add_bos and tok.bos_id is not None
    if args.json:
        out = {**result.to_dict(), "files": args.files, "text_tokens": len(ids), "bos": bos,
               "context": args.context, "stride": stride, "batch_tokens": args.batch_tokens or args.context,
               "save_logits": args.save_logits}
        if base is not None:
            out["kl_divergence"] = {**out["kl_divergence"], "base": args.kl_divergence,
                                    "base_config": base[0]["config"]}
        print(json.dumps(out))
        return 0
    r, c = result, result.config
    print(f"perplexity: {r.perplexity:.4f} over {len(r.nll)} tokens (context {args.context}, stride {stride}, "
          f"{len(r.windows)} windows)")
    print(f"text: {len(args.files)} file(s), {len(ids)} tokens, "
          + ("a BOS token first (the tokenizer adds one)" if bos else "no BOS token (the tokenizer adds none)"))
    print(f"model: {c['model']} | quantization: {c['quantization']} | matmul: {c['matmul_path']} "
          f"({c['matmul_isa']}) | "
          f"activations: {c.get('activations', '-')} | "
          f"KV dtype: {c['kv_dtype']} | device: {c['device']}")
    if c.get("requantized"):
        print(f"re-quantized to int8 per row (no kernel for the file's type): {', '.join(c['requantized'])}")
    print(f"time: {r.seconds:.2f} s, {r.to_dict()['tokens_per_s']:.1f} tokens/s "
          f"({r.tokens_computed} window tokens through the model)")
    if args.save_logits:
        print(f"saved: {args.save_logits} ({len(r.nll)} rows of float16 log-probabilities)")
    if r.kl is not None:
        kl, bc = r.kl, base[0]["config"]
        print(f"KL divergence from {args.kl_divergence} (model {bc['model']}, quantization {bc['quantization']}, "
              f"matmul {bc.get('matmul_path', bc.get('prefill_dtype'))}, KV dtype {bc['kv_dtype']}):")
        print(f"  KL: mean {kl['mean_kl']:.6f}, median {kl['median_kl']:.6f}, 99% {kl['p99_kl']:.6f}, "
              f"max {kl['max_kl']:.6f}")
        print(f"  top-1 agreement: {kl['top1_agreement']:.2f} % | mean |Δ log p| of the text's token: "
              f"{kl['mean_abs_delta_logp']:.6f}")
        print(f"  perplexity: this run {kl['perplexity']:.4f}, base {kl['base_perplexity']:.4f}")
    return 0


def stream_perplexity(args: argparse.Namespace, prog: str) -> int:
    """`arlm perplexity --kv-window W`: the text as one stream through a window with attention
    sinks (`perplexity.stream_nll`), every token but the first scored once."""
    from .perplexity import run_config, stream_nll  # (imports torch)

    for flag, value in (("--context", args.context), ("--stride", args.stride),
                        ("--save-logits", args.save_logits), ("--kl-divergence", args.kl_divergence)):
        if value is not None:
            raise UsageError(f"{prog}: error: {flag} does not apply with --kv-window (the text is one stream: "
                             "each token sees the --kv-sinks first tokens and the last --kv-window)")
    if args.kv_sinks < 0:
        raise UsageError(f"{prog}: error: --kv-sinks must be >= 0")
    text = read_texts(args.files, prog)
    if not text:
        raise UsageError(f"{prog}: error: the text is empty")
    llm = load_llm(args)
    ids = llm.tokenizer.encode(text)[:args.max_tokens]
    if len(ids) < 2:
        raise UsageError(f"{prog}: error: the text is {len(ids)} token(s); perplexity needs at least 2")
    chunk = args.batch_tokens or 512
    t0 = time.perf_counter()
    nll = stream_nll(llm, ids, args.kv_window, args.kv_sinks, chunk=chunk)
    seconds = time.perf_counter() - t0
    ppl = math.exp(float(nll.mean()))
    config = run_config(llm)
    if args.json:
        print(json.dumps({"perplexity": ppl, "tokens_scored": len(nll), "seconds": round(seconds, 4),
                          "tokens_per_s": round(len(ids) / seconds, 2), **config, "files": args.files,
                          "text_tokens": len(ids), "kv_window": args.kv_window, "kv_sinks": args.kv_sinks,
                          "batch_tokens": chunk}))
        return 0
    print(f"perplexity: {ppl:.4f} over {len(nll)} tokens (one stream: {args.kv_sinks} sink tokens + a window of "
          f"{args.kv_window}, {chunk} tokens per pass)")
    print(f"model: {config['model']} | quantization: {config['quantization']} | KV dtype: {config['kv_dtype']} | "
          f"device: {config['device']}")
    print(f"time: {seconds:.2f} s, {len(ids) / seconds:.1f} tokens/s")
    return 0


def add_perplexity(sub) -> None:
    p = sub.add_parser("perplexity", help="perplexity of a text (sliding windows), KL divergence against a saved run")
    p.add_argument("files", nargs="+", metavar="FILE", help="text files, concatenated (UTF-8)")
    add_model_args(p, compile=False)
    p.add_argument("--context", type=int, default=None, help="tokens per window (default: 512)")
    p.add_argument("--stride", type=int, default=None,
                   help="tokens between window starts (default: context // 2); each token is scored once, "
                        "in the first window that reaches it")
    p.add_argument("--batch-tokens", type=positive_int, default=None,
                   help="tokens per forward pass at most (default: the context); windows share a pass as they fit")
    p.add_argument("--max-tokens", type=positive_int, default=None, help="only the text's first M tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--save-logits", default=None, metavar="BASE",
                   help="write every scored position's float16 log-probabilities to BASE (for --kl-divergence)")
    p.add_argument("--kl-divergence", default=None, metavar="BASE",
                   help="compare with a --save-logits file of the same text and windows: KL(base || this run), "
                        "top-1 agreement, both perplexities")
    add_window_args(p, stream=True)
    p.set_defaults(func=cmd_perplexity)


# -- arlm export -----------------------------------------------------------------------------------

def cmd_export(args: argparse.Namespace) -> int:
    from .export import FORMATS, export_model  # (imports torch once it loads the model)

    if args.type is not None and args.type not in FORMATS[args.to]:
        raise UsageError(f"arlm export: error: --type {args.type} does not apply to --to {args.to} "
                         f"(it takes {', '.join(FORMATS[args.to])})")
    print(export_model(args.model, args.to, args.out, args.type).summary())
    return 0


def add_export(sub) -> None:
    from .export import CANNOT_EXPRESS, FORMATS

    p = sub.add_parser("export", help="write a model as an HF transformers directory or a llama.cpp GGUF file",
                       description="Write a model as an HF transformers directory (config.json, model.safetensors, "
                                   "tokenizer and chat template) or a GGUF file llama.cpp runs. "
                                   + " ".join(f"{line}." for line in CANNOT_EXPRESS.values()))
    p.add_argument("model", metavar="MODEL",
                   help="an arlm checkpoint directory, or anything --model takes (smollm2, a .gguf, an HF directory)")
    p.add_argument("--to", required=True, choices=tuple(FORMATS), help="hf: a directory; gguf: a file")
    p.add_argument("out", metavar="OUT", help="the directory (hf; must not exist or be empty) or file (gguf) to write")
    p.add_argument("--type", default=None, choices=sorted({t for ts in FORMATS.values() for t in ts}),
                   help="; ".join(f"{to}: {', '.join(ts)} (default {ts[0]})" for to, ts in FORMATS.items()))
    p.set_defaults(func=cmd_export)


# -- entry point -----------------------------------------------------------------------------------

# Each subcommand's parser-adding function: here, or (module, name) in a module of its own,
# imported only when a parser needs it (`arlm generate` builds its own alone: serve's, trace's
# and train's modules are ~50 ms and ~8 MB of imports it never uses).
SUBCOMMANDS: dict[str, Callable | tuple[str, str]] = {
    "generate": add_generate, "embed": add_embed, "chat": add_chat, "perplexity": add_perplexity,
    "trace": ("trace.cli", "add_trace"), "prepare": ("train.cli", "add_prepare"), "train": ("train.cli", "add_train"),
    "serve": ("serve.cli", "add_serve"), "export": add_export}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line's parser, or (`command`, a subcommand's name) one that knows that
    subcommand alone: it parses that command's lines as the whole parser does."""
    import importlib

    parser = Parser(prog="arlm", description="Autoregressive transformer LMs: train, generate, serve.")
    parser.add_argument("--version", action="version", version=f"arlm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, add in SUBCOMMANDS.items():
        if command is not None and name != command:
            continue
        if isinstance(add, tuple):
            add = getattr(importlib.import_module(f".{add[0]}", __package__), add[1])
        add(sub)
    return parser


# Commands whose process may end without the interpreter's teardown: torch's takes ~0.5 s, a
# quarter of `arlm generate`'s start-to-finish, and these hold nothing that needs it (their
# output is flushed, their files written and closed before they return).
QUICK_EXIT = {"generate", "embed", "chat", "perplexity", "trace", "export"}


# Whether this process is the `arlm` command itself (`entry`), whose work another process may take
# over (exec), or a caller's that runs `main` and goes on
_COMMAND_LINE_PROCESS = False


def entry() -> None:
    """The `arlm` console script and `python -m arlm` (arlm.__main__): the command, then the
    process ends."""
    global _COMMAND_LINE_PROCESS
    _COMMAND_LINE_PROCESS = True
    code, quick = _run(None)
    if quick:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more can reach it
                pass
        os._exit(code)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> int:
    """Run one `arlm` command line; its exit code."""
    return _run(argv)[0]


def _run(argv: list[str] | None) -> tuple[int, bool]:
    """The exit code, and whether the command may end without the interpreter's teardown."""
    command = None
    try:
        given = sys.argv[1:] if argv is None else argv
        # (a command's own parser where the line starts with one: the others' modules not imported)
        args = build_parser(given[0] if given and given[0] in SUBCOMMANDS else None).parse_args(argv)
        command = args.command
        code = args.func(args)
    except UsageError as e:
        print(str(e), file=sys.stderr)
        code = 2
    except BrokenPipeError:  # the reader went away (`arlm generate ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        code = 1
    except (ValueError, OSError) as e:  # LoadError and ConfigError are ValueErrors
        print(f"arlm: error: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("\narlm: interrupted", file=sys.stderr)
        code = 130
    except Exception as e:  # noqa: BLE001 - the last line of defence against a traceback
        if os.environ.get("ARLM_DEBUG"):
            raise
        print(f"arlm: internal error: {type(e).__name__}: {e} (set ARLM_DEBUG=1 for a traceback)",
              file=sys.stderr)
        code = 1
    return code, command in QUICK_EXIT


if __name__ == "__main__":
    entry()
