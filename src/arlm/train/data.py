"""Training data: a text corpus -> token ids in memory-mapped files, and batches drawn from them.

`prepare` writes a directory:

    train.bin, val.bin   token ids, uint16 (uint32 for vocabularies over 65,536), back to back
    tokenizer.json       the tokenizer that made them (it travels on into every checkpoint)
    meta.json            {"vocab_size", "dtype", "tokenizer", "train_tokens", "val_tokens",
                          "files": {name: fingerprint of train.bin, val.bin, tokenizer.json}, ...}

meta.json is removed before the other files are written and written again after them, with their
fingerprints: `TokenData.open` refuses a directory that an interrupted `prepare` left half old, half
new, rather than training on token ids that the tokenizer beside them did not make.

The split is by position: the first 90% of the tokens train, the last 10% validate (nanoGPT's
split), so validation text is never seen in training, not even as a neighbour of a sample.

`prepare_chat` writes chat data for supervised fine-tuning (meta.json's "format": "chat"):
conversations rendered with the model's chat template, packed into rows of context_length + 1
tokens (arlm.train.chat), the first 90% of the conversations to train, the last 10% to validate.
Beside each split's ids:

    train_mask.bin, val_mask.bin   uint8 per token: 1 where the token is a target the loss learns
    train_pos.bin, val_pos.bin     each token's position in its conversation (0 starts one), uint16

A batch of chat rows (`ChatData`) carries the targets to ignore and where each conversation
starts, so that attention stays inside a conversation and RoPE counts from 0 in each.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ..config import ConfigError
from ..files import atomic_write, atomic_write_text, remove_stale_tmp, unwritable_directory
from ..loading import LoadError, resolve_model_path
from ..loading.checkpoint import TOKENIZER_FILE as CKPT_TOKENIZER
from ..loading.checkpoint import is_checkpoint_dir, read_meta
from ..loading.gguf import open_gguf
from ..tokenizer import Tokenizer, TokenizerError
from .chat import BadConversation, ChatEncoder, EncodedConversation, packed_arrays, read_chat_file

META_FILE, TOKENIZER_FILE = "meta.json", "tokenizer.json"
SPLITS = ("train", "val")
SPLIT_FILES = {name: f"{name}.bin" for name in SPLITS}
MASK_FILES = {name: f"{name}_mask.bin" for name in SPLITS}
POS_FILES = {name: f"{name}_pos.bin" for name in SPLITS}
EOT = "<|endoftext|>"  # the BPE tokenizer's one special token, between documents
IGNORE = -100  # a target the loss skips (F.cross_entropy's ignore_index)


class DataError(ValueError):
    """A corpus or prepared-data directory that cannot be used."""


def inconsistent(path: Path, why: str) -> DataError:
    return DataError(f"data in {path} is incomplete or inconsistent (was `arlm prepare` interrupted?): "
                     f"run it again ({why})")


def fingerprint(path: Path, whole_below: int = 1 << 24, slices: int = 64, slice_bytes: int = 1 << 12) -> str:
    """blake2b of a file's size and contents: all of them below `whole_below` bytes, else `slices`
    evenly spaced slices, so that checking a multi-GB split at every open costs a few reads."""
    size = path.stat().st_size
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as fh:
        if size < whole_below:
            h.update(fh.read())
        else:
            for i in range(slices):
                fh.seek(size * i // slices)
                h.update(fh.read(slice_bytes))
    return h.hexdigest()


def default_corpus() -> Path:
    """Tiny Shakespeare, shipped in the repository's data/ directory."""
    local = Path("data/tinyshakespeare.txt")
    if local.exists():
        return local
    return Path(__file__).resolve().parents[3] / "data" / "tinyshakespeare.txt"


# -- tokenizers ------------------------------------------------------------------------------------

def char_tokenizer(text: str) -> Tokenizer:
    """One token per character of `text`, ids in sorted character order (nanoGPT's ids).

    Expressed as an HF BPE model with no merges, so it saves into a checkpoint's tokenizer.json
    and reloads like any other tokenizer. Characters outside the vocabulary are dropped.
    """
    vocab = {ch: i for i, ch in enumerate(sorted(set(text)))}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()  # join the characters back without separators
    return Tokenizer(backend)


def train_bpe_tokenizer(files: list[Path], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2's scheme) trained on `files`, with `<|endoftext|>` as EOS."""
    if vocab_size < 257 + 1:
        raise ConfigError(f"a byte-level BPE needs vocab_size >= 258 (256 bytes + {EOT}), got {vocab_size}")
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train([str(f) for f in files], trainer)
    eot = backend.token_to_id(EOT)
    return Tokenizer(backend, eos_ids=[eot])


def pretrained_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer of an existing model: smollm2, a .gguf, an HF directory, an arlm checkpoint."""
    return pretrained_tokenizer_and_template(spec)[0]


def pretrained_tokenizer_and_template(spec: str) -> tuple[Tokenizer, str | None]:
    """The tokenizer and chat template (None where it has none) of an existing model, read
    without its weights where the format allows."""
    path = resolve_model_path(spec)
    if path.is_dir():
        if is_checkpoint_dir(path) and (path / CKPT_TOKENIZER).exists():
            template = read_meta(path).get("chat_template")
            return Tokenizer.from_file(path / CKPT_TOKENIZER), template
        if (path / "tokenizer.json").exists():
            config = path / "tokenizer_config.json"
            template = json.loads(config.read_text()).get("chat_template") if config.exists() else None
            return Tokenizer.from_hf_dir(path), template
        raise LoadError(f"{path} holds no tokenizer.json")
    gf = open_gguf(path)  # a GGUF keeps its tokenizer in its metadata: read that alone, not the weights
    try:
        return Tokenizer.from_gguf_fields(gf.tokenizer_fields), gf.chat_template
    except (TokenizerError, KeyError) as e:
        raise LoadError(f"{path}: cannot build its tokenizer ({e})") from None


def encode_text(tokenizer: Tokenizer, text: str, block_chars: int = 1 << 20) -> np.ndarray:
    """All of `text` as token ids, encoded in ~1 MB blocks cut at line ends (in parallel)."""
    blocks, start = [], 0
    while start < len(text):
        end = text.find("\n", start + block_chars)
        end = len(text) if end < 0 else end + 1
        blocks.append(text[start:end])
        start = end
    encoded = tokenizer.backend.encode_batch(blocks, add_special_tokens=False)
    return np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encoded])


# -- prepare ---------------------------------------------------------------------------------------

def read_corpus(inputs: list[str | Path]) -> list[tuple[Path, str]]:
    """(path, text) of each input file, or of every *.txt file in an input directory."""
    files: list[Path] = []
    for spec in inputs:
        p = Path(spec)
        if p.is_dir():
            found = sorted(p.rglob("*.txt"))
            if not found:
                raise DataError(f"corpus directory {p} holds no .txt files")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"corpus not found: {p}")
    docs = []
    for f in files:
        try:
            docs.append((f, f.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            raise DataError(f"corpus file {f} is not UTF-8 text") from None
    if not any(text.strip() for _, text in docs):
        raise DataError(f"corpus is empty: {', '.join(str(f) for f, _ in docs)}")
    return docs


def prepare(inputs: list[str | Path], out_dir: str | Path, tokenizer: str = "char", vocab_size: int = 4096,
            val_fraction: float = 0.1) -> dict:
    """Tokenize `inputs` into `out_dir` (see the module docstring); returns the metadata written.

    tokenizer: "char", "bpe" (trained here, `vocab_size` entries) or a model to borrow one from.
    Documents (files) are joined with the tokenizer's EOS token where it has one.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction}")
    out = Path(out_dir)
    if (why := unwritable_directory(out)) is not None:  # (before the tokenizing, not after it)
        raise DataError(f"cannot write the output directory {out}: {why}")
    docs = read_corpus(inputs)
    if tokenizer == "char":
        tok = char_tokenizer("".join(text for _, text in docs))
    elif tokenizer == "bpe":
        tok = train_bpe_tokenizer([f for f, _ in docs], vocab_size)
    else:
        tok = pretrained_tokenizer(tokenizer)
    pieces = []
    for i, (_, text) in enumerate(docs):
        if i and tok.eos_id is not None:
            pieces.append(np.array([tok.eos_id], dtype=np.int64))
        pieces.append(encode_text(tok, text))
    ids = np.concatenate(pieces)
    n_train = int(len(ids) * (1.0 - val_fraction))  # nanoGPT's cut: 1,003,854 / 111,540 for Shakespeare
    n_val = len(ids) - n_train
    if n_val < 2 or n_train < 2:
        fix = "use a larger --val-fraction" if n_val < 2 and len(ids) >= 8 else "the corpus is too small"
        raise DataError(f"a validation fraction of {val_fraction} of {len(ids)} tokens leaves {n_val} for validation "
                        f"and {n_train} for training (at least 2 each): {fix}")
    dtype = token_dtype(tok)
    splits = {"train": ids[:n_train], "val": ids[n_train:]}
    meta = {"format": "text", "vocab_size": tok.vocab_size, "dtype": np.dtype(dtype).name, "tokenizer": tokenizer,
            "train_tokens": len(splits["train"]), "val_tokens": len(splits["val"]),
            "sources": [str(f) for f, _ in docs], "characters": sum(len(t) for _, t in docs)}
    return write_prepared(out, {SPLIT_FILES[name]: arr.astype(dtype) for name, arr in splits.items()}, tok, meta)


def token_dtype(tok: Tokenizer) -> type:
    return np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32


def write_prepared(out: Path, arrays: dict[str, np.ndarray], tok: Tokenizer, meta: dict) -> dict:
    """Write `arrays` (file name -> array) and the tokenizer into `out`, then meta.json with their
    fingerprints (see the module docstring); returns the metadata written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / META_FILE).unlink(missing_ok=True)  # until the files it describes are all in place
    for name, arr in arrays.items():
        atomic_write(out / name, lambda tmp, arr=arr: arr.tofile(tmp))
    atomic_write_text(out / TOKENIZER_FILE, tok.to_json())
    files = [*arrays, TOKENIZER_FILE]
    meta = {**meta, "files": {f: fingerprint(out / f) for f in files}}
    atomic_write_text(out / META_FILE, json.dumps(meta, indent=2))
    remove_stale_tmp(out, [*files, META_FILE])  # what a killed prepare left behind
    return meta


def read_conversations(files: list[str | Path], encoder: ChatEncoder, max_tokens: int,
                       skip_bad: bool) -> tuple[list[EncodedConversation], list[str]]:
    """Every conversation of the chat files, encoded, and the bad lines skipped ("file:line: why").
    Without `skip_bad` the first bad line is a DataError naming its file and line."""
    convs, bad = [], []
    for f in map(Path, files):
        if f.is_dir():
            raise DataError(f"chat file {f} is a directory: name the .jsonl files in it")
        if not f.is_file():
            raise DataError(f"chat file not found: {f}")
        for lineno, parsed in read_chat_file(f):
            try:
                if isinstance(parsed, BadConversation):
                    raise parsed
                conv = encoder.encode(parsed)
                if len(conv.ids) > max_tokens:
                    raise BadConversation(f"the conversation is {len(conv.ids)} tokens, longer than a row of "
                                          f"{max_tokens} (--context-length {max_tokens - 1}, plus its last target)")
            except BadConversation as e:
                if not skip_bad:
                    raise DataError(f"{f}:{lineno}: {e} (--skip-bad skips such lines)") from None
                bad.append(f"{f}:{lineno}: {e}")
                continue
            convs.append(conv)
    return convs, bad


def prepare_chat(inputs: list[str | Path], out_dir: str | Path, tokenizer: str, context_length: int,
                 chat_template: str | None = None, val_fraction: float = 0.1, skip_bad: bool = False) -> dict:
    """Chat JSONL files (arlm.train.chat) into `out_dir` for training at `context_length` (see the
    module docstring); returns the metadata written, whose "skipped" lists the bad lines skipped.

    tokenizer: the model whose tokenizer and chat template render the conversations;
    chat_template: a Jinja2 template to use instead of the model's.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if context_length < 2:
        raise ConfigError(f"context_length must be at least 2, got {context_length}")
    out = Path(out_dir)
    if (why := unwritable_directory(out)) is not None:  # (before the tokenizing, not after it)
        raise DataError(f"cannot write the output directory {out}: {why}")
    tok, template = pretrained_tokenizer_and_template(tokenizer)
    template = chat_template or template
    if not template:
        raise DataError(f"{tokenizer} has no chat template: give one with --chat-template FILE")
    convs, bad = read_conversations(inputs, ChatEncoder(template, tok), context_length + 1, skip_bad)
    if not convs:
        files = ", ".join(map(str, inputs))
        raise DataError(f"no conversation to train on in {files}: " + (
            f"--skip-bad skipped all {len(bad)} line(s); the first: {bad[0]}" if bad else "no line but blank ones"))
    n_train = int(len(convs) * (1.0 - val_fraction))
    if n_train < 1 or n_train == len(convs):
        raise DataError(f"{len(convs)} conversation(s) cannot be split into training and validation at "
                        f"--val-fraction {val_fraction}: " + ("give more conversations" if len(convs) < 2 else
                                                               "change --val-fraction"))
    pad_id = tok.eos_id if tok.eos_id is not None else 0
    pos_dtype = np.uint16 if context_length + 1 <= 1 << 16 else np.uint32
    arrays, meta = {}, {"format": "chat", "vocab_size": tok.vocab_size, "dtype": np.dtype(token_dtype(tok)).name,
                        "pos_dtype": np.dtype(pos_dtype).name, "tokenizer": tokenizer,
                        "context_length": context_length, "chat_template": template}
    for name, part in (("train", convs[:n_train]), ("val", convs[n_train:])):
        ids, learned, pos = packed_arrays(part, context_length + 1, pad_id)
        arrays |= {SPLIT_FILES[name]: ids.astype(token_dtype(tok)), MASK_FILES[name]: learned,
                   POS_FILES[name]: pos.astype(pos_dtype)}
        real = sum(len(c.ids) for c in part)
        meta |= {f"{name}_tokens": len(ids), f"{name}_rows": len(ids) // (context_length + 1),
                 f"{name}_conversations": len(part), f"{name}_learned_tokens": int(learned.sum()),
                 f"{name}_padding": round(1.0 - real / len(ids), 4)}
    meta |= {"sources": [str(f) for f in inputs], "skipped": bad}
    return write_prepared(out, arrays, tok, meta)


# -- batches ---------------------------------------------------------------------------------------

@dataclass
class Batch:
    """One micro-batch: inputs `x` and next-token targets `y`, each [B, T] int64.

    A chat batch's targets are IGNORE where they are not learned, and its rows pack several
    conversations: `input_pos` [B, T] counts from 0 in each and `doc_ids` [B, T] tells them apart
    (Transformer.forward's arguments). A text batch has neither (plain causal attention).
    """

    x: torch.Tensor
    y: torch.Tensor
    input_pos: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None


def _to(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    if device.type != "cuda":
        return list(tensors)
    return [t.pin_memory().to(device, non_blocking=True) for t in tensors]


@dataclass
class TokenData:
    """A prepared directory's splits as read-only memory maps, and its tokenizer.

    `open` returns the type of the directory's format: this one (text: any window of the split
    is a sample) or `ChatData` (packed conversation rows, masked targets)."""

    path: Path
    meta: dict
    tokenizer: Tokenizer
    splits: dict[str, np.memmap]

    @classmethod
    def split_files(cls, meta: dict) -> dict[str, tuple[str, np.dtype]]:
        """file name -> (split, dtype) of the per-token files this format keeps."""
        return {SPLIT_FILES[name]: (name, np.dtype(meta["dtype"])) for name in SPLITS}

    @classmethod
    def from_maps(cls, path: Path, meta: dict, tokenizer: Tokenizer, maps: dict[str, np.memmap]) -> "TokenData":
        return cls(path, meta, tokenizer, {name: maps[SPLIT_FILES[name]] for name in SPLITS})

    @classmethod
    def open(cls, directory: str | Path) -> "TokenData":
        """Map a directory `prepare` or `prepare_chat` wrote, after checking that its files are
        the ones meta.json describes and that every token id is inside the tokenizer's vocabulary."""
        path = Path(directory)
        if not (path / META_FILE).is_file():
            if any((path / f).exists() for f in [*SPLIT_FILES.values(), TOKENIZER_FILE]):
                raise inconsistent(path, f"{META_FILE} is missing")
            raise DataError(f"no prepared data in {path} (run `arlm prepare` first)")
        try:
            meta = json.loads((path / META_FILE).read_text())
            fmt = meta.get("format", "text")  # (directories older than the chat format: text)
            if fmt not in FORMATS:
                raise DataError(f"data in {path} has format {fmt!r}, which this arlm does not read")
            kind, vocab_size = FORMATS[fmt], int(meta["vocab_size"])
            layout = kind.split_files(meta)
            sizes = {f: int(meta[f"{name}_tokens"]) * dtype.itemsize for f, (name, dtype) in layout.items()}
        except DataError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as e:  # (AttributeError: not a JSON object)
            raise inconsistent(path, f"{META_FILE} is not readable ({e!r})") from None
        for f in [*layout, TOKENIZER_FILE]:
            if not (path / f).is_file():
                raise inconsistent(path, f"{f} is missing")
        for f, size in sizes.items():
            if (path / f).stat().st_size != size:
                raise inconsistent(path, f"{f} holds {(path / f).stat().st_size} bytes, {META_FILE} says {size}")
        for f, expected in meta.get("files", {}).items():  # absent in directories older than the check
            if fingerprint(path / f) != expected:
                raise inconsistent(path, f"{f} is not the file {META_FILE} describes")
        tokenizer = Tokenizer.from_file(path / TOKENIZER_FILE)
        if tokenizer.vocab_size != vocab_size:
            raise inconsistent(path, f"{TOKENIZER_FILE} has {tokenizer.vocab_size} tokens, "
                                     f"{META_FILE} says {vocab_size}")
        maps = {f: np.memmap(path / f, dtype=dtype, mode="r") for f, (_, dtype) in layout.items()}
        data = kind.from_maps(path, meta, tokenizer, maps)
        # One pass over the ids (about a second a GB from the page cache), and the embedding lookup
        # can never go out of range mid-run, whatever the fingerprints missed.
        for name, arr in data.splits.items():
            top = int(arr.max()) if len(arr) else -1
            if top >= vocab_size:
                raise inconsistent(path, f"{SPLIT_FILES[name]} holds token id {top}, "
                                         f"outside the vocabulary of {vocab_size}")
        return data

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def check_context(self, context_length: int) -> None:
        for name, arr in self.splits.items():
            if len(arr) <= context_length:
                raise DataError(f"context_length {context_length} is longer than the data: the {name} split of "
                                f"{self.path} has {len(arr)} tokens, and a sample needs context_length + 1")

    def offsets(self, split: str, count: int, context_length: int, rng: np.random.Generator) -> np.ndarray:
        """`count` random window starts, uniform over the split (with replacement, as nanoGPT)."""
        return rng.integers(0, len(self.splits[split]) - context_length, size=count)

    def batch(self, split: str, offsets: np.ndarray, context_length: int, device: torch.device) -> Batch:
        """The windows of context_length + 1 tokens at `offsets`: inputs and next-token targets,
        each [len(offsets), context_length]."""
        window = offsets[:, None] + np.arange(context_length + 1)  # [B, T + 1]
        (tokens,) = _to(device, torch.from_numpy(self.splits[split][window].astype(np.int64)))
        return Batch(tokens[:, :-1], tokens[:, 1:])


@dataclass
class ChatData(TokenData):
    """Chat rows (`prepare_chat`): each sample is one row of context_length + 1 tokens holding
    whole conversations; only the targets the mask marks are learned, and no token attends
    across a conversation's edge."""

    masks: dict[str, np.memmap]
    positions: dict[str, np.memmap]

    @classmethod
    def split_files(cls, meta: dict) -> dict[str, tuple[str, np.dtype]]:
        return {**super().split_files(meta), **{MASK_FILES[name]: (name, np.dtype(np.uint8)) for name in SPLITS},
                **{POS_FILES[name]: (name, np.dtype(meta["pos_dtype"])) for name in SPLITS}}

    @classmethod
    def from_maps(cls, path: Path, meta: dict, tokenizer: Tokenizer, maps: dict[str, np.memmap]) -> "ChatData":
        return cls(path, meta, tokenizer, *({name: maps[files[name]] for name in SPLITS}
                                            for files in (SPLIT_FILES, MASK_FILES, POS_FILES)))

    @property
    def row_tokens(self) -> int:
        return int(self.meta["context_length"]) + 1

    def check_context(self, context_length: int) -> None:
        packed = int(self.meta["context_length"])
        if context_length != packed:
            raise DataError(f"the chat data in {self.path} is packed in rows for context_length {packed}: train with "
                            f"--context-length {packed}, or prepare it again with --context-length {context_length}")

    def offsets(self, split: str, count: int, context_length: int, rng: np.random.Generator) -> np.ndarray:
        """`count` random row starts (with replacement)."""
        return rng.integers(0, len(self.splits[split]) // self.row_tokens, size=count) * self.row_tokens

    def batch(self, split: str, offsets: np.ndarray, context_length: int, device: torch.device) -> Batch:
        window = offsets[:, None] + np.arange(context_length + 1)  # [B, T + 1]: whole rows
        tokens, learned, pos = (torch.from_numpy(a[split][window].astype(np.int64))
                                for a in (self.splits, self.masks, self.positions))
        # Token t + 1 is learned where the mask says so and it is not the first of a conversation
        # (whose previous token is another conversation's, or a row's padding).
        y = torch.where((learned[:, 1:] == 1) & (pos[:, 1:] > 0), tokens[:, 1:], IGNORE)
        input_pos = pos[:, :-1]
        doc_ids = (input_pos == 0).cumsum(dim=1)
        return Batch(*_to(device, tokens[:, :-1], y, input_pos, doc_ids))


FORMATS: dict[str, type[TokenData]] = {"text": TokenData, "chat": ChatData}
