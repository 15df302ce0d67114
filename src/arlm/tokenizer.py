"""Tokenizers at the edge of the engine: text <-> token ids, built on HF `tokenizers`.

Also the incremental detokenizer that streaming needs: it yields text pieces that are always
valid UTF-8, holding back bytes while a character is split across tokens.
"""

from __future__ import annotations

import functools

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .files import atomic_write_text

# Pre-tokenizer splits named by llama.cpp's `tokenizer.ggml.pre`. The GPT-2 regex is the
# ByteLevel pre-tokenizer's own; the others split text differently before byte-level BPE.
_GPT2_FAMILY = {"default", "gpt2", "gpt-2"}
_DIGIT_FIRST = {"smollm", "starcoder", "refact", "smaug"}  # each digit its own piece, then GPT-2
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen 2 / 2.5 / 3 (and the distills on Qwen's vocabulary): Llama 3's split, one digit at a time.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_REGEX_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
                 "falcon3": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
                 "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}

CONTROL_TOKEN = 3  # llama.cpp token types: 1 normal, 3 control, 4 user-defined
USER_DEFINED_TOKEN = 4


def valid_text(text: str) -> str:
    """`text` with every lone surrogate (a byte that was not UTF-8, as Python hands it over from
    argv or stdin, or a JSON "\\ud800") turned into U+FFFD, as a UTF-8 decoder with
    errors="replace" does; valid text comes back as it is."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        try:  # the original bytes, where Python escaped them (surrogateescape)
            raw = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raw = text.encode("utf-8", "surrogatepass")
        return raw.decode("utf-8", "replace")


class TokenizerError(ValueError):
    pass


@dataclass
class Tokenizer:
    """Text <-> ids. `bos_id`/`eos_ids` may be None/empty for tokenizers without them."""

    backend: HFTokenizer
    bos_id: int | None = None
    eos_ids: list[int] = field(default_factory=list)
    add_bos: bool = False

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int | None:
        return self.eos_ids[0] if self.eos_ids else None

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids for `text` (through `valid_text`); special-token text such as `<|im_start|>`
        maps to its id."""
        # (encode_batch_fast: no character offsets, ~2x faster, and it lets go of the GIL, which
        # encode does not: a server's other threads run while a long prompt is tokenized)
        ids = self.backend.encode_batch_fast([valid_text(text)], add_special_tokens=False)[0].ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE piece mapped back through GPT-2's
        byte <-> character table; a piece may be part of a UTF-8 character)."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        table = _byte_decoder()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return self.decode([token_id]).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """A token as OpenAI's logprobs name it: its text, or "bytes:\\xNN..." for a piece of a
        UTF-8 character."""
        b = self.token_bytes(token_id)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{c:02x}" for c in b)

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf_fields(cls, fields: dict) -> "Tokenizer":
        """Build from a GGUF file's `tokenizer.ggml.*` metadata: byte-level BPE ("gpt2": GPT-2,
        SmolLM, Qwen, Llama 3) or SentencePiece's BPE ("llama": Gemma, Llama 2)."""
        kind = fields.get("tokenizer.ggml.model")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        if kind == "gpt2":
            merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
            vocab = {tok: i for i, tok in enumerate(tokens)}
            bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
            backend = HFTokenizer(bpe)
            backend.pre_tokenizer = _pre_tokenizer(fields.get("tokenizer.ggml.pre", "default"))
            backend.decoder = decoders.ByteLevel()
        elif kind == "llama":
            backend = _sentencepiece_bpe(fields)
            tokens = [backend.id_to_token(i) for i in range(len(tokens))]  # (as respelled there)
        else:
            raise TokenizerError(f"unsupported GGUF tokenizer model {kind!r} (byte-level BPE 'gpt2', "
                                 "SentencePiece 'llama')")
        types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        specials = [AddedToken(t, special=True, normalized=False)
                    for t, ty in zip(tokens, types) if ty == CONTROL_TOKEN]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types) if ty == USER_DEFINED_TOKEN]
        backend.add_special_tokens(specials)
        if user:
            backend.add_tokens(user)
        eos_ids = [fields[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
                   if fields.get(k) is not None]
        return cls(backend, bos_id=fields.get("tokenizer.ggml.bos_token_id"),
                   eos_ids=list(dict.fromkeys(eos_ids)),
                   add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        """Load a `tokenizer.json` (HF format), with `arlm_meta` for BOS/EOS if we wrote it."""
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        try:
            return cls.from_json(text)
        except Exception as e:  # json's errors, AttributeError on a non-object, the tokenizers library's own
            raise TokenizerError(f"{path} is not a readable tokenizer.json ({e})") from None

    @classmethod
    def from_json(cls, text: str) -> "Tokenizer":
        """`to_json`'s inverse: HF `tokenizer.json` text, with `arlm_meta` for BOS/EOS if present."""
        data = json.loads(text)
        meta = data.pop("arlm_meta", {})  # HF's parser rejects keys it does not know
        backend = HFTokenizer.from_str(json.dumps(data))
        return cls(backend, meta.get("bos_id"), list(meta.get("eos_ids", [])), bool(meta.get("add_bos", False)))

    @classmethod
    def from_hf_dir(cls, directory: str | Path) -> "Tokenizer":
        """`tokenizer.json` plus BOS/EOS from `tokenizer_config.json`/`config.json` if present."""
        directory = Path(directory)
        backend = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        tok = cls(backend)
        cfg = {}
        for name in ("config.json", "generation_config.json"):
            if (directory / name).exists():
                cfg.update(json.loads((directory / name).read_text()))
        tok.bos_id = cfg.get("bos_token_id")
        eos = cfg.get("eos_token_id")
        tok.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        return tok

    def to_json(self) -> str:
        """Self-contained HF `tokenizer.json` text with our BOS/EOS metadata alongside."""
        data = json.loads(self.backend.to_str())
        _merges_as_strings(data)
        data["arlm_meta"] = {"bos_id": self.bos_id, "eos_ids": self.eos_ids, "add_bos": self.add_bos}
        return json.dumps(data, ensure_ascii=False)


def backend_json(backend: HFTokenizer) -> str:
    """HF `tokenizer.json` text of `backend` (`to_str()`), its BPE merges written "a b" where no
    piece holds a space: the same tokenizer (HF tokenizers reads both forms, and writes pairs only
    because a piece may hold a space), which it parses faster: Gemma 3's 515k merges 0.71x the time
    of the pairs (benchmarks/tokenizer_load.py; docs/benchmarks.md, 2026-12-06 22:35)."""
    text = backend.to_str()
    return _compacted(text) or text


def compact_file(path: Path) -> None:
    """Rewrites (atomically) a tokenizer.json whose merges `backend_json` would write as strings:
    caches written before it did."""
    if (text := _compacted(path.read_text(encoding="utf-8"))) is not None:
        atomic_write_text(path, text)


def _compacted(text: str) -> str | None:
    """tokenizer.json `text` with its merges as strings, or None where they stay as they are."""
    data = json.loads(text)
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")) if _merges_as_strings(data) else None


def _merges_as_strings(data: dict) -> bool:
    """Writes the merges of `data` (a parsed tokenizer.json) as "a b" strings where they are pairs
    of pieces without spaces; whether it did (not: none, already strings, or a piece with a space)."""
    merges = (data.get("model") or {}).get("merges")
    if not merges or not all(isinstance(m, list) and len(m) == 2 and " " not in m[0] + m[1] for m in merges):
        return False
    data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    return True


def _sentencepiece_bpe(fields: dict) -> HFTokenizer:
    """SentencePiece's BPE from a GGUF vocabulary: pieces with "▁" for a space, byte-fallback
    pieces <0xNN> for what the vocabulary lacks, no prefix space (`add_space_prefix` false, as
    Gemma's), and no merges in the file: they are recovered from the vocabulary. Each piece
    splits into every pair of pieces the vocabulary holds; a piece's pairs merge in the order of
    the piece in the file (the file lists Gemma's pieces in merge order; its scores do not follow
    it), longer left pieces first. transformers rebuilds Gemma's tokenizer from a GGUF the same
    way (tests/test_tokenizer.py holds the ids to it). A piece of spaces alone is stored with
    real spaces: respelled with "▁" as the text is normalized."""
    if fields.get("tokenizer.ggml.add_space_prefix", False):
        raise TokenizerError("SentencePiece with a prefix space (add_space_prefix) is not supported yet")
    tokens = ["\u2581" * len(t) if t and " " in t and not t.strip() else t for t in fields["tokenizer.ggml.tokens"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for t in tokens:
        pairs = [(t[:k], t[k:]) for k in range(len(t) - 1, 0, -1) if t[:k] in vocab and t[k:] in vocab]
        merges += pairs  # (in the file's order; within a piece, the longer left piece first)
    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                     unk_token=tokens[unk_id] if unk_id is not None else None)
    backend = HFTokenizer(bpe)
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level table, character -> byte: printable bytes stand for themselves, the
    others for the characters from U+0100 on, in order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_FIRST:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _REGEX_SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in _GPT2_FAMILY:
        return byte_level
    raise TokenizerError(f"unsupported GGUF pre-tokenizer {pre!r}")


# One `tokenizer.ggml.pre` name for each split `_pre_tokenizer` builds (the name llama.cpp's
# converter writes for it), for writing a GGUF vocabulary (arlm.export).
GGUF_PRE_NAMES = ("gpt-2", "smollm", "llama-bpe", "qwen2")


def _without_offsets(pre: dict) -> dict:
    """A pre-tokenizer's JSON less `trim_offsets` (it changes offsets, not ids)."""
    if "pretokenizers" in pre:
        return {**pre, "pretokenizers": [_without_offsets(p) for p in pre["pretokenizers"]]}
    return {k: v for k, v in pre.items() if k != "trim_offsets"}


def gguf_pre_name(tokenizer: Tokenizer) -> str | None:
    """The `tokenizer.ggml.pre` name of a byte-level BPE tokenizer's split (`from_gguf_fields`'s
    inverse), or None where its pre-tokenizer is none of `GGUF_PRE_NAMES`."""
    pre = json.loads(tokenizer.backend.to_str()).get("pre_tokenizer")
    if pre is None:
        return None
    for name in GGUF_PRE_NAMES:
        if _without_offsets(json.loads(_pre_tokenizer(name).__getstate__())) == _without_offsets(pre):
            return name
    return None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces, each valid UTF-8.

    Decodes only a short window (from `prefix_offset`) each step, and emits the new text once it
    no longer ends in U+FFFD, the mark of a character whose bytes are still arriving.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """Whatever is held back at the end (an incomplete character decodes as U+FFFD)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]
