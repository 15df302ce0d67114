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
from ..files import atomic_write, atomic_write_text, remove_stale_tmp
from ..loading import LoadError, load_model, resolve_model_path
from ..loading.checkpoint import TOKENIZER_FILE as CKPT_TOKENIZER
from ..loading.checkpoint import is_checkpoint_dir
from ..tokenizer import Tokenizer, TokenizerError

META_FILE, TOKENIZER_FILE = "meta.json", "tokenizer.json"
SPLITS = ("train", "val")
SPLIT_FILES = {name: f"{name}.bin" for name in SPLITS}
EOT = "<|endoftext|>"  # the BPE tokenizer's one special token, between documents


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
    path = resolve_model_path(spec)
    if path.is_dir():
        if is_checkpoint_dir(path) and (path / CKPT_TOKENIZER).exists():
            return Tokenizer.from_file(path / CKPT_TOKENIZER)
        if (path / "tokenizer.json").exists():
            return Tokenizer.from_hf_dir(path)
        raise LoadError(f"{path} holds no tokenizer.json")
    # A GGUF keeps its tokenizer in its metadata: read that alone, not the weights.
    import gguf  # (~0.3 s that the other tokenizers do without)

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception:  # not a GGUF (or a damaged one): let the model loader say what it is
        return load_model(spec).tokenizer
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.ggml.")}
    try:
        return Tokenizer.from_gguf_fields(fields)
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
    if out.exists() and not out.is_dir():
        raise DataError(f"the output directory {out} is a file")
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
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / META_FILE).unlink(missing_ok=True)  # until the files it describes are all in place
    splits = {"train": ids[:n_train], "val": ids[n_train:]}
    for name, arr in splits.items():
        atomic_write(out / SPLIT_FILES[name], lambda tmp, arr=arr: arr.astype(dtype).tofile(tmp))
    atomic_write_text(out / TOKENIZER_FILE, tok.to_json())
    files = [*SPLIT_FILES.values(), TOKENIZER_FILE]
    meta = {"vocab_size": tok.vocab_size, "dtype": np.dtype(dtype).name, "tokenizer": tokenizer,
            "train_tokens": len(splits["train"]), "val_tokens": len(splits["val"]),
            "files": {f: fingerprint(out / f) for f in files},
            "sources": [str(f) for f, _ in docs], "characters": sum(len(t) for _, t in docs)}
    atomic_write_text(out / META_FILE, json.dumps(meta, indent=2))
    remove_stale_tmp(out, [*files, META_FILE])  # what a killed prepare left behind
    return meta


# -- batches ---------------------------------------------------------------------------------------

@dataclass
class TokenData:
    """A prepared directory's splits as read-only memory maps, and its tokenizer."""

    path: Path
    meta: dict
    tokenizer: Tokenizer
    splits: dict[str, np.memmap]

    @classmethod
    def open(cls, directory: str | Path) -> "TokenData":
        """Map a directory `prepare` wrote, after checking that its files are the ones meta.json
        describes and that every token id is inside the tokenizer's vocabulary."""
        path = Path(directory)
        files = [*SPLIT_FILES.values(), TOKENIZER_FILE]
        if not (path / META_FILE).is_file():
            if any((path / f).exists() for f in files):
                raise inconsistent(path, f"{META_FILE} is missing")
            raise DataError(f"no prepared data in {path} (run `arlm prepare` first)")
        try:
            meta = json.loads((path / META_FILE).read_text())
            dtype, vocab_size = np.dtype(meta["dtype"]), int(meta["vocab_size"])
            sizes = {SPLIT_FILES[name]: int(meta[f"{name}_tokens"]) * dtype.itemsize for name in SPLITS}
        except (ValueError, TypeError, KeyError) as e:
            raise inconsistent(path, f"{META_FILE} is not readable ({e})") from None
        for f in files:
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
        splits = {name: np.memmap(path / SPLIT_FILES[name], dtype=dtype, mode="r") for name in SPLITS}
        # One pass over the ids (about a second a GB from the page cache), and the embedding lookup
        # can never go out of range mid-run, whatever the fingerprints missed.
        for name, arr in splits.items():
            top = int(arr.max()) if len(arr) else -1
            if top >= vocab_size:
                raise inconsistent(path, f"{SPLIT_FILES[name]} holds token id {top}, "
                                         f"outside the vocabulary of {vocab_size}")
        return cls(path, meta, tokenizer, splits)

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

    def batch(self, split: str, offsets: np.ndarray, context_length: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs x and next-token targets y, each [len(offsets), context_length] int64."""
        window = offsets[:, None] + np.arange(context_length + 1)  # [B, T + 1]
        tokens = torch.from_numpy(self.splits[split][window].astype(np.int64))
        if device.type == "cuda":
            tokens = tokens.pin_memory().to(device, non_blocking=True)
        return tokens[:, :-1], tokens[:, 1:]
