"""SentencePiece's BPE (Gemma's tokenizer) for the bare start, from arrays numpy maps at once.

HF tokenizers takes 0.9-1.3 s to parse Gemma 3's tokenizer.json (262,144 pieces, 514,906 merges:
its vocabulary alone is ~0.5 s of Rust), longer than llama.cpp's whole start to a first token on
the 270M file; no form of it loads faster (docs/benchmarks.md). So where a tokenizer is exactly
SentencePiece's BPE as Gemma's is - added tokens cut out first (the longest at the leftmost
place, as HF's matcher does), each piece between them with " " written "▁", its characters (a
character the vocabulary lacks as its UTF-8 bytes' <0xNN> pieces) merged pair by pair, the
lowest rank first and the leftmost among equals; decoded with "▁" as " ", <0xNN> runs as UTF-8 -
the plan's writer (`write`) stores it here as arrays, checks it against HF's ids and text on
probe strings, and the bare start reads those (~0.1 s) instead of HF's JSON. Any other tokenizer
shape, and any probe that differs, leaves the bare start on HF tokenizers. tests/test_bare.py
holds it to HF tokenizers' ids and text on Gemma 3 270M's tokenizer and thousands of strings.

`PieceTokenizer` answers the calls arlm.tokenizer.Tokenizer makes of its HF backend.
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FILE = "bare-tokenizer.npz"
_SPACE = "\u2581"
_HEX = frozenset("0123456789abcdefABCDEF")
_SHIFT = 20  # a merge's key: left id << _SHIFT | right id (ids below 2**20)
_NORMALIZER = {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE}
_DECODER = {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": _SPACE}, "content": " "},
                                             {"type": "ByteFallback"}, {"type": "Fuse"}]}
# Strings the writer checks against HF before it stores anything: spaces, newlines, added tokens
# among text, characters the vocabulary lacks, combining marks, emoji, CJK
PROBES = ["The cat sat on the mat.", "  two  spaces\n\n\nand\tnewlines \n", "<start_of_turn>user\nHi!<end_of_turn>\n",
          "<bos><eos><unused0>x<unk>", "naïve café, déjà vu; e\u0301", "emoji 😀🎉👩‍👩‍👧 and 中文字符 日本語のテキスト",
          "\x00\x01\x7f control \ufffd", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "▁▁ literal ▁ marks", "",
          "def f(x):\n    return x ** 2  # squared\n", "Ω≈ç√∫˜µ≤≥÷ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0002a6d6 \U000e0001"]


def build(backend_json: str) -> dict[str, np.ndarray] | None:
    """The arrays of a tokenizer.json (HF's serialization) of exactly the shape the module doc
    names, else None."""
    data = json.loads(backend_json)
    model = data.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") is not None or model.get("ignore_merges") \
            or not model.get("byte_fallback") or model.get("continuing_subword_prefix") \
            or model.get("end_of_word_suffix") or data.get("normalizer") != _NORMALIZER \
            or data.get("pre_tokenizer") is not None or data.get("decoder") != _DECODER:
        return None
    vocab: dict[str, int] = model["vocab"]
    n = len(vocab)
    pieces = [""] * n
    for piece, i in vocab.items():
        if not 0 <= i < n or pieces[i] or not piece or "\0" in piece:
            return None  # (ids not dense, or a piece the blob cannot hold)
        pieces[i] = piece
    if n >= 1 << _SHIFT or any(f"<0x{b:02X}>" not in vocab for b in range(256)):
        return None  # (without every byte piece an unknown character would be <unk>: not handled)
    added = data.get("added_tokens") or []
    if any(a.get("normalized") or a.get("lstrip") or a.get("rstrip") or a.get("single_word")
           or vocab.get(a["content"]) != a["id"] for a in added):
        return None
    left, right, new = [], [], []
    for m in model["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a not in vocab or b not in vocab or a + b not in vocab:
            return None
        left.append(vocab[a])
        right.append(vocab[b])
        new.append(vocab[a + b])
    keys = np.array(left, dtype=np.int64) << _SHIFT | np.array(right, dtype=np.int64)
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    last = np.append(sorted_keys[1:] != sorted_keys[:-1], True)  # (a pair listed twice: its last rank, as HF)
    chosen = order[last]
    single = sorted((ord(p), i) for i, p in enumerate(pieces) if len(p) == 1)
    if not single:
        return None
    return {"keys": keys[chosen], "rank": chosen.astype(np.int32), "new": np.array(new, dtype=np.int32)[chosen],
            "char": np.array([c for c, _ in single], dtype=np.int32),
            "char_id": np.array([i for _, i in single], dtype=np.int32),
            "byte_id": np.array([vocab[f"<0x{b:02X}>"] for b in range(256)], dtype=np.int32),
            "added": np.array([a["id"] for a in added], dtype=np.int32),
            "special": np.array([a["id"] for a in added if a.get("special")], dtype=np.int32),
            "pieces": np.frombuffer("\0".join(pieces).encode("utf-8"), dtype=np.uint8)}


def same_as(tokenizer: "PieceTokenizer", backend, texts: list[str]) -> bool:
    """Whether `tokenizer` gives HF `backend`'s ids for each text, and its text back for them."""
    for text in texts:
        ids = backend.encode(text, add_special_tokens=False).ids
        if tokenizer.encode(text) != ids:
            return False
        for skip in (False, True):
            if tokenizer.decode(ids, skip) != backend.decode(ids, skip_special_tokens=skip):
                return False
    return True


@dataclass
class _Encoding:
    ids: list[int]


class PieceTokenizer:
    """The arrays of `build`, as the subset of HF tokenizers' Tokenizer that arlm's Tokenizer
    calls (encode_batch_fast, decode, id_to_token, token_to_id, get_vocab_size)."""

    def __init__(self, arrays) -> None:
        self.keys, self.rank, self.new = arrays["keys"], arrays["rank"], arrays["new"]
        self.char, self.char_id = arrays["char"], arrays["char_id"]
        self.byte_id = arrays["byte_id"].tolist()
        self.pieces = bytes(arrays["pieces"]).decode("utf-8").split("\0")
        self.special = set(arrays["special"].tolist())
        self.added = {self.pieces[i]: i for i in arrays["added"].tolist()}
        self.added_lengths: dict[str, list[int]] = {}  # first character -> the lengths of those starting with it
        for piece in self.added:
            self.added_lengths.setdefault(piece[0], []).append(len(piece))
        for lengths in self.added_lengths.values():
            lengths.sort(reverse=True)
        self._ids: dict[str, int] | None = None

    @classmethod
    def load(cls, path: Path) -> "PieceTokenizer":
        """OSError or ValueError where the file cannot be read as `build` wrote it."""
        try:
            with np.load(path, allow_pickle=False) as z:
                return cls({k: z[k] for k in z.files})
        except (KeyError, UnicodeDecodeError, EOFError) as e:
            raise ValueError(f"{path}: {e}") from None

    # -- HF's calls ----------------------------------------------------------------------------

    def encode_batch_fast(self, texts: list[str], add_special_tokens: bool = False) -> list[_Encoding]:
        return [_Encoding(self.encode(t)) for t in texts]

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self.pieces)

    def id_to_token(self, i: int) -> str | None:
        return self.pieces[i] if 0 <= i < len(self.pieces) else None

    def token_to_id(self, token: str) -> int | None:
        if self._ids is None:
            self._ids = {p: i for i, p in enumerate(self.pieces)}
        return self._ids.get(token)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """HF's decode: special tokens left out where asked, "▁" as " ", each run of <0xNN>
        pieces as its UTF-8 text (U+FFFD for each byte of a run that is not UTF-8)."""
        out, run = [], bytearray()
        for i in ids:
            if not 0 <= i < len(self.pieces) or (skip_special_tokens and i in self.special):
                continue
            piece = self.pieces[i]
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">") and _hex_byte(piece[3:5]):
                run.append(int(piece[3:5], 16))
                continue
            if run:
                out.append(_utf8(run))
            out.append(piece.replace(_SPACE, " "))
        if run:
            out.append(_utf8(run))
        return "".join(out)

    # -- encoding -----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        start = i = 0
        while i < len(text):  # (added tokens cut out: the longest at the leftmost place)
            for n in self.added_lengths.get(text[i], ()):
                if text[i:i + n] in self.added:
                    if start < i:
                        ids += self._merged(text[start:i].replace(" ", _SPACE))
                    ids.append(self.added[text[i:i + n]])
                    i = start = i + n
                    break
            else:
                i += 1
        if start < len(text):
            ids += self._merged(text[start:].replace(" ", _SPACE))
        return ids

    def _merge(self, left: int, right: int) -> tuple[int, int] | None:
        """(rank, new id) of the merge of this pair, None where there is none."""
        key = left << _SHIFT | right
        j = int(np.searchsorted(self.keys, key))
        return (int(self.rank[j]), int(self.new[j])) if j < len(self.keys) and self.keys[j] == key else None

    def _merged(self, word: str) -> list[int]:
        """HF's BPE of one piece of text: its characters' ids (or their bytes'), then a heap of
        mergeable neighbours, the lowest (rank, position) first; an entry whose pair has changed
        since it was pushed is passed over."""
        codes = np.fromiter(map(ord, word), dtype=np.int32, count=len(word))
        at = np.minimum(np.searchsorted(self.char, codes), len(self.char) - 1)
        known = self.char[at] == codes
        ids: list[int] = []
        for ch, k, j in zip(word, known.tolist(), self.char_id[at].tolist()):
            ids += [j] if k else [self.byte_id[b] for b in ch.encode("utf-8")]
        n = len(ids)
        nxt, prv, alive = list(range(1, n + 1)), list(range(-1, n - 1)), [True] * n
        heap = [(m[0], p, m[1]) for p in range(n - 1) if (m := self._merge(ids[p], ids[p + 1]))]
        heapq.heapify(heap)
        while heap:
            _, p, new = heapq.heappop(heap)
            q = nxt[p]
            if not alive[p] or q >= n or (m := self._merge(ids[p], ids[q])) is None or m[1] != new:
                continue
            ids[p], alive[q] = new, False
            nxt[p] = r = nxt[q]
            if r < n:
                prv[r] = p
                if m := self._merge(new, ids[r]):
                    heapq.heappush(heap, (m[0], p, m[1]))
            if prv[p] >= 0 and (m := self._merge(ids[prv[p]], new)):
                heapq.heappush(heap, (m[0], prv[p], m[1]))
        return [t for t, a in zip(ids, alive) if a]


def _hex_byte(s: str) -> bool:
    """Whether Rust's u8::from_str_radix(s, 16) reads these two characters, as HF's ByteFallback
    does (ASCII hex digits, a leading + allowed; Python's int would also take other scripts'
    digits and spaces)."""
    return all(c in _HEX for c in s[1:]) and (s[:1] in _HEX or s[:1] == "+")


def _utf8(run: bytearray) -> str:
    try:
        text = run.decode("utf-8")
    except UnicodeDecodeError:
        text = "\ufffd" * len(run)
    run.clear()
    return text
