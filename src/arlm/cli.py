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

DTYPES = ("float32", "bfloat16", "float16")


class UsageError(Exception):
    """Bad command-line input; exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors in one line (no usage block) and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: error: {message}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="known name (smollm2), a .gguf file, an HF model directory or an arlm checkpoint")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default="auto", choices=("auto",) + DTYPES,
                   help="weight and activation dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--quantize", default="auto", choices=("auto", "none", "int8", "q4"),
                   help="weight quantization for decode (auto, on CPU: 4-bit where that is lossless, as "
                        "for a Q4_1 GGUF, int8 elsewhere, with 8-bit activations; none on GPU)")
    p.add_argument("--prefill-dtype", default="auto", choices=("auto", "quantized", "float32", "bfloat16"),
                   help="how a quantized model prefills: through the decode kernels (quantized) or a dense "
                        "copy of the weights (auto: quantized on AVX-512 VNNI CPUs, else bfloat16 with "
                        "AVX512-BF16 or AMX, else float32)")
    p.add_argument("--kv-dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                   help="KV cache dtype (auto: float16 under a quantized model on CPU, as llama.cpp's default "
                        "cache: half the bytes per decode step; else the model's dtype)")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all cores)")


def add_sampling_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=0, help="0 disables (default)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus mass in (0, 1] (default: 0.95)")
    p.add_argument("--min-p", type=float, default=0.0, help="0 disables (default)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 disables (default)")
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when this text appears (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")


def sampling_params(args: argparse.Namespace):
    from .sampling import SamplingParams

    try:
        return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repetition_penalty=args.repetition_penalty, seed=args.seed,
                              stop=list(args.stop), ignore_eos=args.ignore_eos)
    except ValueError as e:
        raise UsageError(f"arlm: error: {e}") from None


def check_device(name: str) -> None:
    """--device names a CPU or an available CUDA device (checked before any model loads)."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"arlm: error: --device {name!r}: expected cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"arlm: error: --device {name!r}: arlm runs on cpu or cuda[:N]")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"arlm: error: --device {name} requested but no CUDA device is available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"arlm: error: --device {name}: this machine has {torch.cuda.device_count()} "
                             "CUDA device(s)")


def load_llm(args: argparse.Namespace):
    from .llm import LLM

    check_device(args.device)
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError("arlm: error: --threads must be >= 1")
        if args.threads > (os.cpu_count() or 1):
            print(f"arlm: warning: --threads {args.threads} is more than this machine's {os.cpu_count()} cores: "
                  "the threads will take turns, and decode gets much slower", file=sys.stderr)
        import torch

        torch.set_num_threads(args.threads)
    quantize = None if args.quantize == "none" else args.quantize
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if args.device.startswith("cuda") else "float32")
    return LLM.load(args.model, device=args.device, dtype=_torch_dtype(dtype), quantize=quantize,
                    compile=args.compile, prefill_dtype=args.prefill_dtype, kv_dtype=args.kv_dtype)


def stats_line(stats, prefix: str = "") -> str:
    return (f"{prefix}prefill: {stats.prompt_tokens} tokens, {stats.prefill_tokens_per_s:.1f} tokens/s | "
            f"decode: {stats.decode_tokens} tokens, {stats.decode_tokens_per_s:.1f} tokens/s | "
            f"KV cache: {stats.kv_cache_bytes / 2**20:.2f} MiB ({stats.kv_cache_bytes} bytes)")


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
    it = llm.stream([prompt], params, context_shift=args.context_shift)
    gen = next(it)
    if not args.json and not args.chat:
        sys.stdout.write(prompt)  # show the continuation in context, as llama.cpp and gpt-fast do
    text = ""
    for chunk in it:
        text += chunk.text
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    if args.json:
        print(json.dumps({"model": llm.loaded.name, "prompt": args.prompt,
                          "prompt_token_ids": gen.prompts[0], "completion_token_ids": gen.completions[0],
                          "text": text, "finish_reason": gen.finish_reasons[0],
                          "stats": gen.stats.to_dict()}, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        print(f"[finish: {gen.finish_reasons[0]}] " + stats_line(gen.stats), file=sys.stderr)
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
        gen = session.generation
        print(f"[prefilled {session.last_prefill_tokens} new tokens, {session.cache.seq_lens[0]} cached] "
              + stats_line(gen.stats), file=sys.stderr)
    if failed:
        print(f"arlm chat: {failed} message(s) got no reply", file=sys.stderr)
    return 1 if failed else 0


def add_chat(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat; the KV cache persists between turns")
    add_model_args(p)
    add_sampling_args(p, max_new_tokens=256)
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--max-context", type=_positive_int, default=4096,
                   help="KV cache size in tokens, at most the model's context window (default: 4096)")
    p.set_defaults(func=cmd_chat)


# -- entry point -----------------------------------------------------------------------------------

from .train.cli import add_prepare, add_train  # noqa: E402 (training's flags live with training)

from .serve.cli import add_serve  # noqa: E402

SUBCOMMANDS: list[Callable] = [add_generate, add_chat, add_prepare, add_train, add_serve]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="arlm", description="Autoregressive transformer LMs: train, generate, serve.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"arlm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
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
