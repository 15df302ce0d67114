"""What every `arlm` subcommand shares: one-line usage errors, the model and sampling flags, the
model loader, memory sizes. A leaf module: the subcommands (cli.py, serve/cli.py, train/cli.py)
import it, it imports none of them.

torch, tokenizers and the arlm modules that import them are imported inside the functions that
use them: ~1 s that `arlm --help` and usage errors should not pay (tests/test_cli.py checks that
they import none of them)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from .settings import ACTIVATIONS, DEFAULT_ACTIVATIONS, KV_SINKS, auto_dtype

DTYPES = ("float32", "bfloat16", "float16")


class UsageError(Exception):
    """Bad command-line input; exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse that reports errors in one line (no usage block) and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: error: {message}")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _torch_dtype(name: str):
    import torch  # (~1 s: see the module doc)

    return getattr(torch, name)


def add_model_args(p: argparse.ArgumentParser, compile: bool = True) -> None:
    """--model, --device, --dtype, --quantize, --matmul-path (and its older name --prefill-dtype),
    --activations, --kv-dtype, --threads, and --compile where the command honours it (`arlm serve`
    does not: its steps run natively)."""
    p.add_argument("--model", default="smollm2",
                   help="known name (smollm2), a .gguf file, an HF model directory or an arlm checkpoint")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default="auto", choices=("auto",) + DTYPES,
                   help="weight and activation dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--quantize", default="auto", choices=("auto", "none", "int8", "q4"),
                   help="weight quantization (auto, on CPU: a GGUF's Q4_1 and Q8_0 blocks as stored, int8 per "
                        "row for other types or a float model's matrices; none on GPU)")
    p.add_argument("--matmul-path", default="auto", choices=("auto", "vnni", "avx2", "bf16", "float32"),
                   help="how a quantized model's prompt tokens multiply: the integer kernels, packed "
                        "(vnni: AVX-512 VNNI's instructions, or AVX2's on CPUs without them) or in rows "
                        "(avx2), or a dense bf16 / float32 copy of the weights through torch's GEMMs "
                        "(oneDNN; AMX tiles where the CPU has them); decode stays on the integer kernels. "
                        "auto: chosen from the CPU's flags - vnni where the packed kernels are built "
                        "(AVX-512 VNNI or AVX2), else bf16 with AVX512-BF16 or AMX, else float32. The "
                        "stats say which ran, with its instructions")
    p.add_argument("--prefill-dtype", default=None, choices=("auto", "quantized", "float32", "bfloat16"),
                   help=argparse.SUPPRESS)  # the older name of --matmul-path
    p.add_argument("--activations", default=DEFAULT_ACTIVATIONS, choices=ACTIVATIONS,
                   help="a quantized model's activation precision: int8x2 (default: 8 bits taken twice, "
                        "~16 bits, float32's answers), int8 (one 8-bit pass, as llama.cpp: batched decode "
                        "~1.3x and prefill ~1.5x faster, less faithful) or float32 (slow)")
    p.add_argument("--kv-dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16", "int8", "int4"),
                   help="KV cache dtype (auto: float16 under a quantized model on CPU, as llama.cpp's default "
                        "cache: half the bytes per decode step; else the model's dtype). int8: 8-bit K and V "
                        "with a scale per group of 32 (llama.cpp's q8_0), 0.53x float16's bytes; int4: "
                        "Hadamard-rotated 4-bit V and 5-bit K, 0.34x")
    if compile:
        p.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    p.add_argument("--threads", type=int, default=None,
                   help="pin the threads of every step at N (default: all cores while the machine is quiet, "
                        "fewer while other processes keep cores busy, watched every few steps)")


def add_chat_template_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="a Jinja2 chat template (a file, or the template itself) instead of the model's own; "
                        "one that renders `tools` with <tool_call> blocks makes `arlm serve` use that format")


def read_chat_template(value: str) -> str:
    """--chat-template's template: a file's text, or the value itself where it is Jinja; its
    syntax checked (UsageError in one line otherwise)."""
    # (jinja2: ~0.1 s, only with --chat-template)
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"arlm: error: --chat-template {value}: cannot read it: {e}") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise UsageError(f"arlm: error: --chat-template {value}: no such file (nor a Jinja2 template)")
    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(text)
    except TemplateSyntaxError as e:
        raise UsageError(f"arlm: error: --chat-template: line {e.lineno}: {e.message}") from None
    return text


def add_window_args(p: argparse.ArgumentParser, stream: bool = False) -> None:
    """--kv-window and --kv-sinks (a sliding window with attention sinks: EngineConfig.kv_window)."""
    what = ("score the text as one stream, each token attending to the last W tokens (and the --kv-sinks "
            "first), past the model's context with a bounded KV cache (StreamingLLM; default: off: windows of "
            "--context)") if stream else \
        ("attend to the last W tokens (and the --kv-sinks first): generation runs past the "
         "model's context with a bounded KV cache (StreamingLLM; default: off)")
    p.add_argument("--kv-window", type=positive_int, default=0, metavar="W", help=what)
    p.add_argument("--kv-sinks", type=int, default=KV_SINKS, metavar="S",
                   help=f"with --kv-window, the first S tokens every token attends to (default: {KV_SINKS})")


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """--speculative and its settings (arlm.engine.speculative)."""
    p.add_argument("--speculative", default=None, metavar="METHOD",
                   help="speculative decoding: ngram (prompt lookup), self:N (the model's first N layers), or a "
                        "draft model with the same vocabulary (name or path); greedy output is unchanged, "
                        "sampled output keeps its distribution")
    p.add_argument("--num-speculative-tokens", "--speculative-k", type=positive_int, default=8, metavar="K",
                   help="the most tokens drafted per sequence and step (default: 8)")
    p.add_argument("--speculative-fixed", action="store_true",
                   help="always draft K tokens (default: adaptive, from the acceptance rate and the load)")
    p.add_argument("--prompt-lookup-min", type=positive_int, default=1, metavar="N",
                   help="ngram: the shortest suffix looked up (default: 1)")
    p.add_argument("--prompt-lookup-max", type=positive_int, default=4, metavar="N",
                   help="ngram: the longest suffix looked up, tried first (default: 4)")


def speculative_config(args: argparse.Namespace):
    """The SpeculativeConfig the flags ask for, or None (no --speculative)."""
    from .engine.speculative import SpeculativeConfig  # (imports torch)

    if getattr(args, "speculative", None) is None:
        return None
    try:
        return SpeculativeConfig(method=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                                 adaptive=not args.speculative_fixed, ngram_min=args.prompt_lookup_min,
                                 ngram_max=args.prompt_lookup_max)
    except ValueError as e:
        raise UsageError(f"arlm: error: --speculative: {e}") from None


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
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from the logit of every token already generated, in [-2, 2] (default: 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times its count from each generated token's logit, in [-2, 2] (default: 0)")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (clamped to [-100, 100]) to token ID's logit (repeatable)")
    p.add_argument("--min-tokens", type=int, default=0, help="no end-of-sequence token before this many (default: 0)")
    p.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                   help="stop at this token id as at end-of-sequence (repeatable)")


def add_structured_args(p: argparse.ArgumentParser) -> None:
    """--json-schema / --json-object / --regex / --choice (arlm.structured: enforced token by token)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="SCHEMA", default=None,
                   help="the output is JSON valid against this schema (a file, or the schema's JSON text)")
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument("--regex", metavar="PATTERN", default=None, help="the output matches this regular expression")
    g.add_argument("--choice", metavar="A,B,...", default=None, help="the output is one of these strings")


def structured_output(args: argparse.Namespace):
    """The StructuredOutput the flags ask for, or None."""
    from .structured import GrammarError, StructuredOutput  # (imports torch)

    try:
        if getattr(args, "json_schema", None):
            text = args.json_schema
            if not text.lstrip().startswith("{"):
                try:
                    text = Path(text).read_text(encoding="utf-8")
                except OSError as e:
                    raise UsageError(f"arlm: error: --json-schema: cannot read {args.json_schema}: "
                                     f"{e.strerror or e}") from None
            try:
                schema = json.loads(text)
            except ValueError as e:
                raise UsageError(f"arlm: error: --json-schema: not JSON: {e}") from None
            return StructuredOutput("json_schema", schema)
        if getattr(args, "json_object", False):
            return StructuredOutput("json")
        if getattr(args, "regex", None):
            return StructuredOutput("regex", args.regex)
        if getattr(args, "choice", None):
            return StructuredOutput("choice", [c for c in args.choice.split(",") if c])
    except GrammarError as e:
        raise UsageError(f"arlm: error: {e}") from None
    return None


def sampling_params(args: argparse.Namespace):
    from .sampling import SamplingParams  # (imports torch)

    bias = {}
    for item in args.logit_bias:
        tid, _, value = item.partition("=")
        try:
            bias[int(tid)] = float(value)
        except ValueError:
            raise UsageError(f"arlm: error: --logit-bias {item!r}: expected ID=BIAS, e.g. 42=-100") from None
    try:
        return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repetition_penalty=args.repetition_penalty, seed=args.seed,
                              stop=list(args.stop), ignore_eos=args.ignore_eos,
                              presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                              logit_bias=bias or None, min_tokens=args.min_tokens,
                              stop_token_ids=list(args.stop_token_id), structured=structured_output(args))
    except ValueError as e:
        raise UsageError(f"arlm: error: {e}") from None


def check_device(name: str) -> None:
    """--device names a CPU or an available CUDA device (checked before any model loads)."""
    import torch  # (~1 s: see the module doc)

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


def _startup_done() -> None:
    """What start-up made (modules, the model) lives as long as the process: out of the collector's
    sight from here (gc.freeze), and its default thresholds back (__main__ raised them)."""
    import gc

    gc.freeze()
    gc.set_threshold(700, *gc.get_threshold()[1:])


def load_llm(args: argparse.Namespace):
    # (imports torch and tokenizers)
    from .llm import LLM
    from .runtime import runtime

    check_device(args.device)
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError("arlm: error: --threads must be >= 1")
        if args.threads > (os.cpu_count() or 1):
            print(f"arlm: warning: --threads {args.threads} is more than this machine's {os.cpu_count()} cores: "
                  "the threads will take turns, and decode gets much slower", file=sys.stderr)
        runtime().threads.pin(args.threads)  # (fixed: no narrowing beside busy neighbours)
    quantize = None if args.quantize == "none" else args.quantize
    dtype = args.dtype if args.dtype != "auto" else auto_dtype(args.device)
    if getattr(args, "kv_window", 0) and getattr(args, "speculative", None) not in (None, "off"):
        raise UsageError("arlm: error: --speculative does not run with --kv-window yet")
    if getattr(args, "kv_sinks", 0) < 0:
        raise UsageError("arlm: error: --kv-sinks must be >= 0")
    template = read_chat_template(args.chat_template) if getattr(args, "chat_template", None) else None
    if template is not None and getattr(args, "chat", None) is False:
        raise UsageError("arlm: error: --chat-template applies with --chat (the prompt is used as it is otherwise)")
    llm = LLM.load(args.model, device=args.device, dtype=_torch_dtype(dtype), quantize=quantize,
                   compile=getattr(args, "compile", False), matmul_path=args.matmul_path,
                   prefill_dtype=args.prefill_dtype,
                   kv_dtype=args.kv_dtype, activations=args.activations,
                   kv_window=getattr(args, "kv_window", 0), kv_sinks=getattr(args, "kv_sinks", KV_SINKS))
    if template is not None:
        llm.chat_template = template
    _startup_done()
    spec = speculative_config(args)
    if spec is not None:
        try:
            llm.speculative = spec
            llm.drafter(spec)
        except (ValueError, FileNotFoundError) as e:
            raise UsageError(f"arlm: error: --speculative {args.speculative}: {e}") from None
    return llm


def stats_line(stats, prefix: str = "") -> str:
    spec = (f" | speculative: {stats.spec_accepted}/{stats.spec_proposed} draft tokens accepted "
            f"({stats.spec_acceptance_rate:.0%}), {stats.spec_tokens_per_pass:.2f} tokens per pass"
            if stats.spec_passes else "")
    return (f"{prefix}prefill: {stats.prompt_tokens} tokens, {stats.prefill_tokens_per_s:.1f} tokens/s | "
            f"decode: {stats.decode_tokens} tokens, {stats.decode_tokens_per_s:.1f} tokens/s | "
            f"KV cache: {stats.kv_dtype or '-'}, {stats.kv_bytes_per_token} bytes/token, "
            f"{stats.kv_cache_bytes / 2**20:.2f} MiB ({stats.kv_cache_bytes} bytes) | "
            f"matmul: {stats.matmul_path or '-'} ({stats.matmul_isa or '-'}) | threads: "
            + _threads_text(stats) + spec)


def _threads_text(stats) -> str:
    if stats.threads_pinned:
        return f"{stats.threads} (pinned)"
    text = f"{stats.threads} of {stats.threads_widest}"
    if stats.threads_narrowest < stats.threads_widest:
        text += f", {stats.threads_narrowest} at the narrowest ({stats.thread_changes} changes: others busy)"
    return text



_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1TiB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (e.g. 2GiB, 512MiB, 1GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
