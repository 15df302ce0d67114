"""`arlm prepare` and `arlm train`: argument parsing only; the work is in data.py and trainer.py.

Every TrainConfig field is a flag (`--n-layer 6`, or nanoGPT's `--n_layer=6`), so the command
line, a config file and the dataclass never drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import typing
from pathlib import Path

from ..cli_common import UsageError, positive_int, read_chat_template
from ..config import ConfigError
from .config import TrainConfig, load_config, parse_value


VOCAB_SIZE = 4096  # prepare's --tokenizer bpe vocabulary, unless --vocab-size says


def _slug(tokenizer: str) -> str:
    return tokenizer if tokenizer in ("char", "bpe") else Path(tokenizer.rstrip("/")).stem.lower()


# -- arlm prepare ----------------------------------------------------------------------------------

def cmd_prepare(args: argparse.Namespace) -> int:
    from .data import default_corpus, prepare  # (imports torch and tokenizers: cli_common's doc)

    if args.chat:
        return prepare_chat_files(args)
    for flag in ("chat_template", "context_length", "skip_bad"):
        if getattr(args, flag):
            raise UsageError(f"arlm prepare: error: --{flag.replace('_', '-')} applies with --chat")
    if args.vocab_size is not None and args.tokenizer != "bpe":
        raise UsageError(f"arlm prepare: error: --vocab-size applies with --tokenizer bpe (a {args.tokenizer} "
                         "tokenizer brings its own vocabulary)")
    inputs = args.inputs or [default_corpus()]
    out = args.out or f"out/data/{Path(inputs[0]).stem}_{_slug(args.tokenizer)}"
    meta = prepare(inputs, out, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                   vocab_size=VOCAB_SIZE if args.vocab_size is None else args.vocab_size)
    print(f"wrote {out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens, "
          f"vocabulary {meta['vocab_size']:,} ({args.tokenizer} tokenizer)")
    return 0


def prepare_chat_files(args: argparse.Namespace) -> int:
    from .data import prepare_chat

    if args.inputs:
        raise UsageError("arlm prepare: error: give the chat files after --chat, and no text files beside them")
    if args.vocab_size is not None:
        raise UsageError("arlm prepare: error: --vocab-size does not apply with --chat (the --tokenizer model "
                         "brings its own vocabulary)")
    if args.tokenizer in ("char", "bpe"):
        raise UsageError("arlm prepare: error: --chat needs --tokenizer MODEL: the model whose tokenizer and "
                         "chat template render the conversations (smollm2, a .gguf, an HF directory, a checkpoint)")
    if args.context_length is None:
        raise UsageError("arlm prepare: error: --chat needs --context-length N: the rows conversations are packed "
                         "into (train with the same --context-length)")
    template = read_chat_template(args.chat_template) if args.chat_template else None
    out = args.out or f"out/data/{Path(args.chat[0]).stem}_{_slug(args.tokenizer)}"
    meta = prepare_chat(args.chat, out, tokenizer=args.tokenizer, context_length=args.context_length,
                        chat_template=template, val_fraction=args.val_fraction, skip_bad=args.skip_bad)
    if meta["skipped"]:
        print(f"skipped {len(meta['skipped'])} bad line(s); the first: {meta['skipped'][0]}", file=sys.stderr)
    print(f"wrote {out}: {meta['train_conversations']:,} train + {meta['val_conversations']:,} val conversations "
          f"in {meta['train_rows']:,} + {meta['val_rows']:,} rows of {args.context_length + 1} tokens "
          f"({meta['train_learned_tokens']:,} + {meta['val_learned_tokens']:,} learned, "
          f"{meta['train_padding']:.1%} padding); train with --context-length {args.context_length}")
    return 0


def add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="tokenize a text corpus into memory-mapped train/val token files")
    p.add_argument("inputs", nargs="*", help="text files, or directories of .txt files (default: tiny Shakespeare)")
    p.add_argument("--tokenizer", default="char",
                   help="char, bpe (trained on the corpus), or a model to take it from: smollm2, a .gguf, an HF "
                        "directory, an arlm checkpoint (default: char)")
    p.add_argument("--vocab-size", type=int, default=None, help=f"BPE vocabulary size (default: {VOCAB_SIZE})")
    p.add_argument("--val-fraction", type=float, default=0.1, help="last fraction held out (default: 0.1)")
    p.add_argument("--out", default=None, help="output directory (default: out/data/<corpus>_<tokenizer>)")
    chat = p.add_argument_group("chat data (supervised fine-tuning: only the assistant turns are learned)")
    chat.add_argument("--chat", nargs="+", default=None, metavar="FILE.jsonl",
                      help='conversations, one a line: {"messages": [{"role": ..., "content": ...}, ...]} or '
                           '{"prompt": ..., "completion": ...}')
    chat.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                      help="a Jinja2 chat template instead of the model's own (the checkpoints keep it)")
    chat.add_argument("--context-length", type=positive_int, default=None, metavar="N",
                      help="tokens per training row; conversations are packed into rows, none longer than N + 1")
    chat.add_argument("--skip-bad", action="store_true",
                      help="skip lines that cannot be trained on, and say how many (default: stop at the first)")
    p.set_defaults(func=cmd_prepare)


# -- arlm train ------------------------------------------------------------------------------------

def cmd_train(args: argparse.Namespace) -> int:
    from .trainer import train  # (imports torch: cli_common's doc)

    try:
        overrides = {f.name: parse_value(f.name, getattr(args, "set_" + f.name))
                     for f in dataclasses.fields(TrainConfig) if getattr(args, "set_" + f.name) is not None}
    except ConfigError as e:
        raise UsageError(f"arlm train: error: {e}") from None
    cfg = load_config(args.config, overrides)
    result = train(cfg, resume=args.resume, overwrite=args.overwrite)
    if int(os.environ.get("RANK", 0)) == 0:
        val = result.evals[-1]["val_loss"] if result.evals else math.nan
        print(f"done: step {result.step}, val loss {val:.4f} (best {result.best_val_loss:.4f}), "
              f"{result.tokens_per_s:,.0f} training tokens/s, {result.wall_s:.1f} s; "
              f"checkpoints in {result.out_dir} (latest, best)", file=sys.stderr)
    return 0


def add_train(sub) -> None:
    p = sub.add_parser(
        "train", help="train from scratch or fine-tune (teacher-forced; DDP under torchrun)",
        usage="arlm train [--config FILE] [--resume] [--overwrite] [--SETTING VALUE ...]",
        description="Settings come from the defaults (nanoGPT's tiny-Shakespeare CPU recipe), then --config, "
                    "then these flags. Run `torchrun --nproc_per_node=K -m arlm train ...` for DDP.")
    p.add_argument("--config", default=None, metavar="FILE", help="TOML or YAML file of settings (flat key = value)")
    run = p.add_mutually_exclusive_group()
    run.add_argument("--resume", action="store_true", help="continue exactly from <out_dir>/latest")
    run.add_argument("--overwrite", action="store_true", help="start over in an out_dir that holds a run")
    settings = p.add_argument_group("settings")
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flags = [f"--{f.name.replace('_', '-')}"] + ([f"--{f.name}"] if "_" in f.name else [])
        is_bool = bool in (hints[f.name], *typing.get_args(hints[f.name]))
        settings.add_argument(*flags, dest="set_" + f.name, default=None,
                              metavar="BOOL" if is_bool else f.name.upper(),
                              nargs="?" if is_bool else None, const="true" if is_bool else None,
                              help=(f.metadata.get("help", "") + ("" if f.default is None else
                                                                  f" (default: {f.default})")).replace("%", "%%"))
    p.set_defaults(func=cmd_train)
