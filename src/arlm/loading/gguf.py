"""Read a GGUF file of a Llama-shaped architecture (llama, qwen2, qwen3, gemma3): config,
weights, tokenizer and chat template.

The file is opened once with `gguf.GGUFReader` (a memory map; a weight's pages are handed
back once it is converted, `GGUFFile.release`). Two ways to its weights:

- `quantized_model`: the file's Q4_1 and Q8_0 blocks go into arlm's quantized layers as they are
  (`arlm.quant.Q4Linear`, `Q8Linear`: the same bytes, split into weights and scales), block by
  block, without a float32 copy of the model; Q4_0 into Q4Linear (mins -8 d, exact); on CPUs
  with AVX-512 VNNI, Q5_0 into `Q5Linear` and the K-quants Q4_K, Q5_K, Q6_K into `KQuantLinear`
  (their integer fields and scales, the values not rounded again; elsewhere Q5_0 is widened to
  Q8_0 too, and the K-quants go into the row layout with float32 scales, their values exactly:
  Q4_K into `Q4Linear`, Q5_K into `Q8MinsLinear`, Q6_K into `Q8Linear`), and a fused weight whose parts differ
  in kind into `SplitLinear`, each part as it is stored; the token embedding is gathered from its
  quantized rows. F32, F16 and BF16 matrices are held in float32 (exactly). Tensors of other
  types are dequantized and re-quantized to int8 per row (see `requantized`: the one place arlm
  adds rounding the file did not have). One weight at a time, in file order (`keep`: the first
  load appends each to the kernel-layout cache as it comes, `arlm.loading.cache.Builder`), a
  matrix's blocks a few million weights at a time (`_by_rows`).
- `read_gguf`: every tensor dequantized to float32 (`--quantize none`, the reference path).

Dequantization is `gguf.quants.dequantize` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, the K-quants...);
nothing here parses GGUF by hand beyond splitting blocks into their values and scales
(`_as_q8_0`, `k_quant_fields`).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig
from ..model import Transformer
from .. import kernels
from ..quant import (Int8Linear, KQuantLinear, Q4Linear, Q5Linear, Q8Linear, Q8MinsLinear, QuantizedEmbedding,
                     QuantizedLinear, SplitLinear)
from .errors import LoadError

GGUF_MAGIC = b"GGUF"

_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "attn_output.weight": "attn.wo.weight",
    "ffn_norm.weight": "mlp_norm.weight",
    "ffn_down.weight": "mlp.down.weight",
    "attn_q_norm.weight": "attn.q_norm.weight",  # Qwen 3, Gemma 3
    "attn_k_norm.weight": "attn.k_norm.weight",
    "post_attention_norm.weight": "attn_post_norm.weight",  # Gemma 3
    "post_ffw_norm.weight": "mlp_post_norm.weight",
}
# Tensors that our model holds fused: (parts in order) -> our name.
_FUSED = {("attn_q.weight", "attn_k.weight", "attn_v.weight"): "attn.wqkv.weight",
          ("attn_q.bias", "attn_k.bias", "attn_v.bias"): "attn.wqkv.bias",  # Qwen 2
          ("ffn_gate.weight", "ffn_up.weight"): "mlp.gate_up.weight"}
# The architectures read (`general.architecture`): Llama's shape, with their switches (_config).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
_PART_OF = {part: (parts, ours) for parts, ours in _FUSED.items() for part in parts}
_GLOBAL_NAMES = {"token_embd.weight": "tok_emb.weight", "output_norm.weight": "norm.weight",
                 "output.weight": "lm_head.weight"}


@dataclass
class GGUFModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer_fields: dict
    chat_template: str | None
    name: str


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of attn_q/attn_k rows.

    The converter interleaves each head's two rotary halves (rows i and i + d/2 become 2i and
    2i + 1) to suit ggml's pairwise RoPE. Our RoPE rotates halves (HF's layout), so swap back.
    Rows are whole output channels, so this works on quantized rows (blocks) as well.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert-time permutation of attn_q/attn_k rows (`unpermute_rope_rows`'s
    inverse): each head's rows i and i + d/2 become rows 2i and 2i + 1 (arlm.export writes so)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


@dataclass
class GGUFFile:
    """An open GGUF file: its reader (tensors memory-mapped), config and metadata."""

    path: Path
    reader: object
    config: ModelConfig
    tokenizer_fields: dict
    chat_template: str | None
    name: str
    arch: str = "llama"

    def release(self, tensors) -> None:
        """Hand back the pages of `tensors` the map holds (read, they count in the process's RSS
        while mapped: the whole file by the end of a load). Harmless where read again: the pages
        come back from the file (the map is read-only)."""
        for t in tensors:
            self._advise(int(t.data_offset), int(t.n_bytes))

    def release_view(self, a: np.ndarray) -> None:
        """`release` for the bytes under `a`, where it is a contiguous view of the map (not a copy)."""
        start = a.__array_interface__["data"][0] - self.reader.data.__array_interface__["data"][0]
        if a.flags.c_contiguous and 0 <= start < len(self.reader.map):
            self._advise(start, a.nbytes)

    def _advise(self, start: int, n: int) -> None:
        page = mmap.PAGESIZE
        stop = min(start + n, len(self.reader.map))
        start = start // page * page
        if stop > start:
            self.reader.map.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def weight_bytes(self) -> int:
        """The file's bytes of the tensors arlm uses (a progress bar's total)."""
        return sum(int(t.n_bytes) for _, _, t in self.weights())

    def weights(self):
        """(our name, layer or None, GGUF tensor) for each tensor arlm uses, in file order."""
        for t in self.reader.tensors:
            layer, rest = None, t.name
            if t.name.startswith("blk."):
                _, layer, rest = t.name.split(".", 2)
            if t.name in _GLOBAL_NAMES or rest in _LAYER_NAMES or rest in _PART_OF:
                yield rest, layer, t  # others, e.g. rope_freqs for scaled RoPE, this family does not use


def _reader(path: Path):
    """gguf's reader over a plain ndarray of the file's read-only map, and that map (`.map`, whose
    pages `GGUFFile.release` hands back). gguf maps the file as an np.memmap, whose every slice
    (a field's each part: two per token of a vocabulary) goes through memmap's Python-level
    `__getitem__` and `__array_finalize__`: ~3x slower to parse a 262,144-token vocabulary."""
    import gguf

    class Reader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, memmap: np.ndarray) -> None:  # (the reader's first act: np.memmap(path))
            with open(path, "rb") as f:
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._data = np.frombuffer(self.map, np.uint8)

    return Reader(str(path))


def open_gguf(path: str | Path) -> GGUFFile:
    """Open and check a GGUF file; its config and metadata (the reader keeps its tensors, not its
    fields), tensors not read yet."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise LoadError(f"cannot read {path}: {e.strerror}") from None
    if magic != GGUF_MAGIC:
        raise LoadError(f"{path} is not a GGUF file (no GGUF magic bytes)")
    try:
        reader = _reader(path)  # (imports gguf: ~0.3 s that a load from arlm's model cache does without)
    except Exception as e:  # the reader raises many kinds on a damaged file
        raise LoadError(f"{path} is not a valid GGUF file: truncated or damaged ({type(e).__name__}: {e})") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise LoadError(f"{path} is truncated: tensor {t.name} runs past the end of the file")

    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise LoadError(f"{path}: unsupported GGUF architecture {arch!r} (arlm reads {', '.join(ARCHITECTURES)})")
    try:
        config = _config(reader, arch)
    except (TypeError, ValueError) as e:
        raise LoadError(f"{path}: incomplete or inconsistent {arch} metadata ({e})") from None
    rope_dims = _field(reader, f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != config.head_dim:
        raise LoadError(f"{path}: partial rotary embeddings ({rope_dims} of {config.head_dim} dims) unsupported")

    tok_fields = {k: _field(reader, k) for k in reader.fields if k.startswith("tokenizer.ggml.")}
    gf = GGUFFile(path, reader, config, tok_fields, _field(reader, "tokenizer.chat_template"),
                  _field(reader, "general.name") or path.stem, arch)
    reader.fields.clear()  # read: its parts (~200 MB of small arrays for a 262,144-token vocabulary) go
    return gf


def _config(reader, arch: str) -> ModelConfig:
    """The ModelConfig of an `arch` file's metadata (llama.cpp's keys; where a key is absent,
    the value llama.cpp and transformers assume)."""
    def meta(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    n_head = int(meta("attention.head_count"))
    d_model = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", d_model // n_head))
    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    n_layer = int(meta("block_count"))
    extra: dict = {}
    if arch == "qwen2":
        extra = dict(qkv_bias=True)
    elif arch == "qwen3":
        extra = dict(qk_norm=True)
    elif arch == "gemma3":
        # every n-th layer full (an integer), or a flag per layer (true: sliding)
        pattern = meta("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):
            if len(pattern) != n_layer:
                raise ValueError(f"sliding_window_pattern has {len(pattern)} flags for {n_layer} layers")
            types = tuple("sliding" if flag else "full" for flag in pattern)
        else:
            types = tuple("full" if (i + 1) % int(pattern) == 0 else "sliding" for i in range(n_layer))
        scaling = None
        if meta("rope.scaling.type") == "linear" and float(meta("rope.scaling.factor", 1.0)) != 1.0:
            scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
        extra = dict(mlp="geglu", gelu_approximate="tanh", qk_norm=True, norm_plus_one=True, embed_scale=True,
                     post_norms=True, sliding_window=int(meta("attention.sliding_window", 512)),
                     layer_types=types,
                     rope_local_theta=float(meta("rope.freq_base_swa", 10000.0)), rope_scaling=scaling,
                     # query_pre_attn_scalar is not in the file: head_dim, but d_model / n_head for the
                     # 27B (62 layers), as llama.cpp decides it
                     attn_scale=(d_model / n_head) ** -0.5 if n_layer == 62 else None)
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # Llama 3.1+: the converter's per-frequency divisors of its scaled RoPE
        extra["rope_scaling"] = {"rope_type": "freq_factors",
                                 "factors": [float(f) for f in np.asarray(freqs.data, dtype=np.float32).ravel()]}
    return ModelConfig.llama(
        vocab_size=int(meta("vocab_size", len(tokens))), n_layer=n_layer, n_head=n_head,
        n_kv_heads=int(meta("attention.head_count_kv", n_head)), d_model=d_model,
        head_size=None if head_dim * n_head == d_model else head_dim, d_ff=int(meta("feed_forward_length")),
        max_seq_len=int(meta("context_length", 2048)), norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)), tie_embeddings="output.weight" not in names, **extra)


def _dequantize(gf: GGUFFile, t) -> np.ndarray:
    import gguf  # (as in open_gguf)

    try:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise LoadError(f"{gf.path}: tensor {t.name} has GGML type {t.tensor_type.name}, "
                        "which gguf cannot dequantize") from None
    return np.asarray(w, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])


def _unpermute(rest: str, w: np.ndarray, gf: GGUFFile) -> np.ndarray:
    """A tensor as arlm holds it: q/k rows un-permuted where llama.cpp's converter permuted them
    (its Llama family; not Qwen's or Gemma's), and a Gemma norm's (1 + w) back to w (the
    converter adds the 1 for ggml's plain multiply)."""
    if gf.arch == "llama" and rest in ("attn_q.weight", "attn_k.weight"):
        return unpermute_rope_rows(w, gf.config.n_head if rest == "attn_q.weight" else gf.config.n_kv_heads)
    if gf.config.norm_plus_one and rest.endswith("norm.weight"):
        return w - np.float32(1.0)
    return w


def _converted(gf: GGUFFile, convert) -> Iterator[tuple[str, object, list]]:
    """(our name, convert(parts), parts) for each weight, in file order: parts the [(gguf short
    name, tensor)] of a fused weight, or one. The parts' pages of the file's map are handed back
    once the consumer is done with the weight (`GGUFFile.release`)."""
    pending: dict[str, object] = {}  # pieces of fused tensors, by GGUF name, until complete
    for rest, layer, t in gf.weights():
        if t.name in _GLOBAL_NAMES:
            name, parts = _GLOBAL_NAMES[t.name], [(rest, t)]
        elif rest in _LAYER_NAMES:
            name, parts = f"blocks.{layer}.{_LAYER_NAMES[rest]}", [(rest, t)]
        else:
            pending[t.name] = t
            group, ours = _PART_OF[rest]
            names = [f"blk.{layer}.{g}" for g in group]
            if not all(n in pending for n in names):
                continue
            name, parts = f"blocks.{layer}.{ours}", [(g, pending.pop(n)) for g, n in zip(group, names)]
        yield name, convert(parts), parts
        gf.release([t for _, t in parts])


def _tensors_by_name(gf: GGUFFile, convert) -> dict[str, object]:
    """Our name -> convert(parts) (`_converted`)."""
    return {name: value for name, value, _ in _converted(gf, convert)}


def read_gguf(path: str | Path) -> GGUFModel:
    """Parse `path` into a ModelConfig, our state dict (float32) and tokenizer metadata."""
    gf = open_gguf(path)

    def to_float(parts) -> torch.Tensor:
        if all(t.tensor_type.name in _BLOCK for _, t in parts) and len(parts[0][1].shape) == 2:
            # Straight into one preallocated array, a few thousand rows at a time: the weights are
            # held once (no per-tensor temporaries the size of the tensor, no concatenation).
            blocks = [_blocks(gf, rest, t) for rest, t in parts]
            out = np.empty((sum(b.shape[0] for b in blocks), 32 * blocks[0].shape[1]), np.float32)
            row = 0
            for (_, t), b in zip(parts, blocks):
                kind = t.tensor_type.name
                _dequantize_blocks(b, kind, out[row:row + b.shape[0]])
                row += b.shape[0]
            return torch.from_numpy(out)
        ws = [_unpermute(rest, _dequantize(gf, t), gf) for rest, t in parts]
        w = ws[0] if len(ws) == 1 else np.concatenate(ws)
        return torch.from_numpy(w if w.flags.writeable and w.flags.c_contiguous else w.copy())

    state = _tensors_by_name(gf, to_float)
    return GGUFModel(config=gf.config, state_dict=state, tokenizer_fields=gf.tokenizer_fields,
                     chat_template=gf.chat_template, name=gf.name)


# Bytes per block of 32, for the types loaded as they are: Q4_1 into Q4Linear, Q8_0 into
# Q8Linear, and Q5_0 / Q4_0 into Q8Linear too, their values widened to int8 (exactly: the same
# scale, the same d * q; `_as_q8_0`).
_BLOCK = {"Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q4_0": 18}
_AS_Q8 = ("Q8_0", "Q5_0", "Q4_0")
# Bytes per super-block of 256, for the K-quants read as they are (KQuantLinear).
_K_BLOCK = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _blocks(gf: GGUFFile, rest: str, t) -> np.ndarray:
    """A tensor's blocks [N, K/32 (K/256 for a K-quant), bytes per block] (a type of _BLOCK or
    _K_BLOCK), q/k rows un-permuted (a view of the memory map where nothing moves)."""
    kind = t.tensor_type.name
    data = np.asarray(t.data).reshape(int(t.shape[1]), -1, _BLOCK.get(kind) or _K_BLOCK[kind])
    return _unpermute(rest, data, gf)


def k_quant_fields(b: np.ndarray, kind: str) -> dict[str, np.ndarray]:
    """K-quant super-blocks [N, S, bytes] (S = K / 256) -> their integer fields and scales, rows
    [N, K] in element order (ggml's block layouts, as gguf.quants reads them):

    - Q4_K (d, dmin float16; 12 bytes of 6-bit scales and mins for 8 groups of 32; 128 bytes of
      nibbles, each 32 bytes holding two groups: low nibbles the first, high the second):
      q uint8 [N, K] 0..15, sc and m uint8 [N, K/32], d and dmin float32 [N, S];
      w = d sc q - dmin m.
    - Q5_K: Q4_K's with 32 bytes of 5th bits before the nibbles (bit g of byte j: element j of
      group g); q 0..31.
    - Q6_K (128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales, d float16): q int8
      [N, K] -32..31, sc int8 [N, K/16], d float32 [N, S]; w = d sc q.
    """
    N, S, _ = b.shape
    if kind in ("Q4_K", "Q5_K"):
        d = np.ascontiguousarray(b[..., 0:2]).view(np.float16).astype(np.float32)[..., 0]
        dmin = np.ascontiguousarray(b[..., 2:4]).view(np.float16).astype(np.float32)[..., 0]
        raw = b[..., 4:16].astype(np.uint8)  # [N, S, 12]
        lo6 = np.uint8(0x3F)
        sc = np.concatenate([raw[..., 0:4] & lo6, (raw[..., 8:12] & 0x0F) | ((raw[..., 0:4] >> 6) << 4)], axis=-1)
        m = np.concatenate([raw[..., 4:8] & lo6, (raw[..., 8:12] >> 4) | ((raw[..., 4:8] >> 6) << 4)], axis=-1)
        nibbles = b[..., 16:144] if kind == "Q4_K" else b[..., 48:176]
        qs = nibbles.reshape(N, S, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
        q = (qs & np.uint8(0x0F)).reshape(N, S, 8, 32)
        if kind == "Q5_K":
            qh = b[..., 16:48].reshape(N, S, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            q = q | ((qh & np.uint8(1)) << np.uint8(4))
        q = q.reshape(N, S * 256)
        return {"q": q, "sc": sc.reshape(N, S * 8), "m": m.reshape(N, S * 8), "d": d, "dmin": dmin}
    assert kind == "Q6_K", kind
    ql = b[..., 0:128].reshape(N, S, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(N, S, 2, 128)
    qh = b[..., 128:192].reshape(N, S, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    qh = (qh & np.uint8(0x03)).reshape(N, S, 2, 128)
    q = ((ql | (qh << np.uint8(4))) - np.uint8(32)).view(np.int8).reshape(N, S * 256)  # (0..63 - 32, wrapped)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(N, S * 16)
    d = np.ascontiguousarray(b[..., 208:210]).view(np.float16).astype(np.float32)[..., 0]
    return {"q": q, "sc": sc, "d": d}


@dataclass
class _Workers:
    """The threads a matrix's chunks are converted on (`_by_rows`): `pool`, of `n` threads."""

    pool: ThreadPoolExecutor
    n: int


class _Stacked:
    """A weight's blocks: its parts' [n, G, bytes] (views of the file's map, but where q/k rows had
    to move) stacked by rows, as a fused weight's rows are, N rows in all; the file whose map
    `release` hands pages back to, and the threads its rows are converted on (`_by_rows`)."""

    def __init__(self, parts: list[np.ndarray], gf: GGUFFile | None = None, workers: _Workers | None = None) -> None:
        self.parts, self.gf, self.workers = parts, gf, workers
        self.N, self.G = sum(b.shape[0] for b in parts), parts[0].shape[1]

    def _pieces(self, start: int, stop: int) -> Iterator[tuple[int, np.ndarray]]:
        offset = 0
        for i, b in enumerate(self.parts):
            lo, hi = max(start - offset, 0), min(stop - offset, b.shape[0])
            if lo < hi:
                yield i, b[lo:hi]
            offset += b.shape[0]

    def rows(self, start: int, stop: int, widen: Callable[[int, np.ndarray], np.ndarray] | None = None) -> np.ndarray:
        """Rows start:stop [stop - start, G, bytes] (a view where they lie in one part); widen(i,
        rows of part i), where given, applied to each part's rows first."""
        pieces = [b if widen is None else widen(i, b) for i, b in self._pieces(start, stop)]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def release(self, start: int, stop: int) -> None:
        """Rows start:stop read: the file's pages under them handed back (`GGUFFile.release_view`)."""
        if self.gf is not None:
            for _, b in self._pieces(start, stop):
                self.gf.release_view(b)


# Weights converted at a time (`_by_rows`): the numpy fields and the packing's temporaries are
# several bytes a weight (Q6_K's ~8), a few tens of MB a chunk whatever the matrix's size.
_CHUNK_WEIGHTS = 1 << 22


def _by_rows(make: Callable[[int, int], QuantizedLinear], layer: QuantizedLinear, blocks: _Stacked) -> QuantizedLinear:
    """`layer` (N output rows of K weights, on the meta device) given the tensors of make(start,
    stop) (a layer of rows start:stop of `blocks`), made `_CHUNK_WEIGHTS` weights' rows at a time (a
    multiple of 16: whole tiles of the packed layout; at least a chunk a thread) into tensors
    allocated once. Each chunk goes to the packed layout where the layer takes it (8-bit
    activations, as `prepare` leaves it: the layout the cache holds), so the matrix is never held
    twice (rows beside packed), and the file's pages under its rows are handed back as they are
    read. Rows are independent: the chunks' tensors stacked are the whole matrix's, bit for bit,
    whichever of `blocks.workers` made them."""
    N, K = layer.out_features, layer.in_features
    workers = blocks.workers.n if blocks.workers is not None else 1
    rows = max(16, -(-min(_CHUNK_WEIGHTS // K, -(-N // workers)) // 16) * 16)  # (every thread a share)
    a8 = N % 16 == 0 or N <= rows  # (else the last chunk would not pack as the others do)

    def convert(start: int) -> tuple[torch.Tensor, ...]:
        stop = min(N, start + rows)
        chunk = make(start, stop)
        chunk.int8_activations = a8  # (packs where the kernels take it)
        blocks.release(start, stop)
        return chunk.tensors()

    out = convert(0)
    if N > rows:
        first, out = out, tuple(torch.empty((t.shape[0] * N // rows, *t.shape[1:]), dtype=t.dtype) for t in out)

        def put(start: int, tensors: tuple[torch.Tensor, ...]) -> None:
            stop = min(N, start + rows)
            for o, t in zip(out, tensors, strict=True):
                lo, hi = start * o.shape[0] // N, stop * o.shape[0] // N
                if t.shape != (hi - lo, *o.shape[1:]) or t.dtype != o.dtype:
                    raise AssertionError(f"rows {start}:{stop} of {N} gave {tuple(t.shape)} {t.dtype} for "
                                         f"{tuple(o.shape)} {o.dtype}: a layout not stacked by rows")
                o[lo:hi] = t

        put(0, first)
        del first
        starts = range(rows, N, rows)
        for _ in (blocks.workers.pool.map if blocks.workers is not None else map)(lambda s: put(s, convert(s)), starts):
            pass
    layer._set(*out)
    layer.int8_activations = a8  # (packed already: nothing moves)
    return layer


def _k_fields(b: np.ndarray, kind: str) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in k_quant_fields(b, kind).items()}


def _k_quant_layer(blocks: _Stacked, kind: str) -> KQuantLinear:
    """A KQuantLinear from K-quant blocks of one kind (the parts' rows stacked: a fused weight)."""
    K = 256 * blocks.G

    def layer(n: int) -> KQuantLinear:
        with torch.device("meta"):
            return KQuantLinear(kind, K, n)

    def make(start: int, stop: int) -> KQuantLinear:
        f = _k_fields(blocks.rows(start, stop), kind)
        chunk = layer(stop - start)
        if kind != "Q6_K":
            chunk._set(*kernels.pack_q4_k(f["q"], f["sc"], f["m"], f["d"], f["dmin"], five_bit=kind == "Q5_K"))
        else:
            chunk._set(*kernels.pack_q6_k(f["q"], f["sc"], f["d"]))
        return chunk

    return _by_rows(make, layer(blocks.N), blocks)


# Float matrices: held in float32 as they are (F16 and BF16 widen exactly), never rounded again.
_FLOAT = ("F32", "F16", "BF16")

# The K-quants the row layout holds exactly (Q4_K as Q4Linear, Q6_K as Q8Linear, Q5_K as
# Q8MinsLinear: float32 scales), where the packed kernels are not built.
_ROW_K_BLOCK = ("Q4_K", "Q5_K", "Q6_K")


def _k_quant_rows(blocks: _Stacked, kind: str):
    """A K-quant weight in the row layout, its values exactly (`Q4Linear.from_q4_k`,
    `Q8MinsLinear.from_q5_k`, `Q8Linear.from_q6_k`): where the packed kernels are not built (AVX2 CPUs)."""
    def make(start: int, stop: int):
        f = _k_fields(blocks.rows(start, stop), kind)
        if kind == "Q4_K":
            return Q4Linear.from_q4_k(f["q"], f["sc"], f["m"], f["d"], f["dmin"])
        if kind == "Q5_K":
            return Q8MinsLinear.from_q5_k(f["q"], f["sc"], f["m"], f["d"], f["dmin"])
        return Q8Linear.from_q6_k(f["q"], f["sc"], f["d"])

    with torch.device("meta"):
        layer = {"Q4_K": Q4Linear, "Q5_K": Q8MinsLinear, "Q6_K": Q8Linear}[kind](256 * blocks.G, blocks.N)
    return _by_rows(make, layer, blocks)


def _as_q8_0(b: np.ndarray, kind: str) -> np.ndarray:
    """Q8_0 / Q5_0 / Q4_0 blocks [N, G, bytes] as Q8_0 blocks [N, G, 34]: the fp16 scale d as
    it is, each value q as an int8 (Q5_0: 4 low bits from qs, the 5th from the 32-bit qh,
    minus 16; Q4_0: a nibble minus 8; element j < 16 in the low nibble of qs[j], j + 16 in its
    high one). d * q is then gguf's dequantized value, bit for bit."""
    if kind not in ("Q5_0", "Q4_0"):
        assert kind == "Q8_0", kind
        return b
    out = np.empty((*b.shape[:2], 34), np.uint8)
    out[..., :2] = b[..., :2]
    qs = b[..., 6:22] if kind == "Q5_0" else b[..., 2:18]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)  # [N, G, 32]
    if kind == "Q5_0":
        qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")  # [N, G, 1]
        q |= (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int16)
        q -= 16
    else:
        q -= 8
    out[..., 2:] = q.astype(np.int8).view(np.uint8)
    return out


def _dequantize_blocks(b: np.ndarray, kind: str, out: np.ndarray, rows: int = 2048) -> None:
    """Blocks of a _BLOCK type [N, G, bytes] -> float32 out [N, 32 G], as gguf.quants.dequantize
    does (d * q (+ m) in float32: the same values, bit for bit), `rows` rows at a time."""
    for i in range(0, b.shape[0], rows):
        c = b[i:i + rows] if kind in ("Q4_1", "Q8_0") else _as_q8_0(b[i:i + rows], kind)
        n, G = c.shape[0], c.shape[1]
        d = np.ascontiguousarray(c[..., 0:2]).view(np.float16).astype(np.float32)  # [n, G, 1]
        if kind != "Q4_1":
            q = np.ascontiguousarray(c[..., 2:]).view(np.int8).astype(np.float32)
            out[i:i + n] = (d * q).reshape(n, 32 * G)
        else:
            m = np.ascontiguousarray(c[..., 2:4]).view(np.float16).astype(np.float32)
            qs = c[..., 4:]
            q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
            out[i:i + n] = (d * q + m).reshape(n, 32 * G)


def q5_0_layer(blocks: np.ndarray | _Stacked) -> Q5Linear | None:
    """A Q5Linear from Q5_0 blocks [N, K/32, 22] (or parts' blocks, stacked): q = the value + 16,
    scale d, mins -16 d (float16, exact); None where -16 d overflows float16 (then the caller
    widens to Q8_0)."""
    blocks = _Stacked([blocks]) if isinstance(blocks, np.ndarray) else blocks
    N, G = blocks.N, blocks.G
    d = torch.from_numpy(np.concatenate([b[..., 0:2] for b in blocks.parts]).view(np.float16).reshape(N, G))
    mins = (d.float() * -16.0).half()
    if not torch.isfinite(mins).all():
        return None

    def layer(n: int) -> Q5Linear:
        with torch.device("meta"):
            return Q5Linear(32 * G, n)

    def make(start: int, stop: int) -> Q5Linear:
        b = blocks.rows(start, stop, lambda _, rows: _as_q8_0(rows, "Q5_0"))
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(stop - start, 32 * G))
        chunk = layer(stop - start)
        chunk._set(kernels.pack_q5((q.to(torch.int16) + 16).to(torch.uint8)), kernels.pack_scales(d[start:stop]),
                   kernels.pack_scales(mins[start:stop]))
        return chunk

    return _by_rows(make, layer(N), blocks)


def _q4_0_fits(blocks: _Stacked) -> bool:
    """Q4_0's min -8 d is finite in float16 (|d| <= 8188) in every block: it can be a Q4Linear."""
    return all((np.abs(np.ascontiguousarray(b[..., 0:2]).view(np.float16)) <= 8188).all() for b in blocks.parts)


def q4_0_layer(blocks: np.ndarray) -> Q4Linear | None:
    """A Q4Linear from Q4_0 blocks [N, K/32, 18] (`_block_layer`), or None where -8 d overflows
    float16 (then the caller widens to Q8_0)."""
    stacked = _Stacked([blocks])
    return _block_layer(stacked, ["Q4_0"]) if _q4_0_fits(stacked) else None


def _block_layer(blocks: _Stacked, kinds: list[str], as_q8: bool = False) -> Q4Linear | Q8Linear:
    """Q4Linear from Q4_1 blocks (the file's bytes, split) or Q4_0 blocks (d and the nibbles as
    they are, mins -8 d: d q + m = d (q - 8) as gguf dequantizes it, bit for bit, in the file's 4.5
    bits a weight on the packed kernels, which keep no mins for it), or Q8Linear from Q8_0, Q5_0
    and Q4_0 blocks (their values exactly, `_as_q8_0`; as_q8: Q4_0 alone too), the parts of `kinds`
    stacked."""
    G = blocks.G
    q4_0 = set(kinds) == {"Q4_0"} and not as_q8
    q4 = q4_0 or set(kinds) == {"Q4_1"}
    cls = Q4Linear if q4 else Q8Linear

    def layer(n: int) -> Q4Linear | Q8Linear:
        with torch.device("meta"):
            return cls(32 * G, n)

    def make(start: int, stop: int) -> Q4Linear | Q8Linear:
        b = blocks.rows(start, stop, None if q4 else lambda i, rows: _as_q8_0(rows, kinds[i]))
        n = stop - start
        chunk = layer(n)
        scale = torch.from_numpy(np.ascontiguousarray(b[..., 0:2]).view(np.float16).reshape(n, G))
        if q4_0:
            chunk._set(torch.from_numpy(np.ascontiguousarray(b[..., 2:]).reshape(n, 16 * G)), scale,
                       (scale.float() * -8).half())
            chunk.q4_0 = True
        elif q4:
            mins = torch.from_numpy(np.ascontiguousarray(b[..., 2:4]).view(np.float16).reshape(n, G))
            chunk._set(torch.from_numpy(np.ascontiguousarray(b[..., 4:]).reshape(n, 16 * G)), scale, mins)
        else:
            chunk._set(torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, 32 * G)), scale)
        return chunk

    whole = layer(blocks.N)
    whole.q4_0 = q4_0
    return _by_rows(make, whole, blocks)


def _quantized_layer(gf: GGUFFile, parts, requantized: list[str], workers: _Workers | None = None):
    """A fused or single linear weight from its file tensors. On the packed kernels: parts of
    different kinds (not all widenable to Q8_0) each as their own layer (SplitLinear); a K-quant
    kind as KQuantLinear; Q5_0 as Q5Linear. Everywhere: Q4Linear where every part is Q4_1 (the
    file's bytes, split) or Q4_0 (mins -8 d), Q8Linear where every part is Q8_0, Q5_0 or a mix
    with Q4_0 (their values exactly, `_as_q8_0`), else int8 per row from the dequantized values
    (listed in `requantized`). workers:
    the threads a matrix's chunks are converted on (`_by_rows`), where given."""
    kinds = {t.tensor_type.name for _, t in parts}
    N = sum(int(t.shape[1]) for _, t in parts)
    packed = N % 16 == 0 and kernels.packed_available()
    if len(kinds) > 1 and not kinds <= set(_AS_Q8) and not kinds & set(_FLOAT) and (
            kernels.packed_available() or kinds & set(_ROW_K_BLOCK)):
        # parts of different kinds (Q4_K_M's Q6_K v beside Q4_K q and k): each as it is stored
        return SplitLinear([_quantized_layer(gf, [part], requantized, workers) for part in parts])

    def blocks() -> _Stacked:
        return _Stacked([_blocks(gf, rest, t) for rest, t in parts], gf, workers)

    if len(kinds) == 1 and kinds <= set(_K_BLOCK) and packed:
        return _k_quant_layer(blocks(), kinds.pop())
    if len(kinds) == 1 and kinds <= set(_ROW_K_BLOCK):  # the row layout's exact forms
        return _k_quant_rows(blocks(), kinds.pop())
    if kinds == {"Q5_0"} and packed and (layer := q5_0_layer(blocks())) is not None:
        return layer
    if kinds == {"Q4_1"} or kinds <= set(_AS_Q8):
        stacked = blocks()
        # (Q4_0 as 4 bits unless its min -8 d overflows float16: then widened to Q8_0 as a mix is)
        as_q8 = kinds == {"Q4_0"} and not _q4_0_fits(stacked)
        return _block_layer(stacked, [t.tensor_type.name for _, t in parts], as_q8)
    ws = [_unpermute(rest, _dequantize(gf, t), gf) for rest, t in parts]
    w = torch.from_numpy(np.concatenate(ws) if len(ws) > 1 else np.array(ws[0]))
    if kinds <= set(_FLOAT):  # float matrices: their values exactly, in float32 (the native stack's GEMMs)
        layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        layer.weight = torch.nn.Parameter(w, requires_grad=False)
        return layer
    requantized += [t.name for _, t in parts]
    return Int8Linear.from_float(w)


def _converted_weight(gf: GGUFFile, requantized: list[str], workers: _Workers, parts):
    """A weight from its parts [(GGUF short name, tensor)] as `quantized_model` holds it."""
    rest, t = parts[0]
    if len(t.shape) == 1:  # norms, and biases (q, k and v's concatenated)
        return torch.from_numpy(np.concatenate([_unpermute(r, _dequantize(gf, x), gf) for r, x in parts]))
    kind = t.tensor_type.name
    as_stored = kind in _BLOCK or kind in _ROW_K_BLOCK or (
        kind in _K_BLOCK and int(t.shape[1]) % 16 == 0 and kernels.packed_available())
    if len(parts) == 1 and rest == "token_embd.weight" and not as_stored:
        return torch.from_numpy(_dequantize(gf, t).copy())  # a float table, gathered as it is
    return _quantized_layer(gf, parts, requantized, workers)


def _parameter(t: torch.Tensor) -> torch.nn.Parameter:
    # (one `keep` made stays the same object: the cache's builder knows its record by it)
    return t if isinstance(t, torch.nn.Parameter) else torch.nn.Parameter(t, requires_grad=False)


def quantized_model(source: str | Path | GGUFFile, keep: Callable[[object], object] | None = None,
                    progress: Callable[[int], object] | None = None) -> tuple[GGUFFile, "torch.nn.Module", list[str]]:
    """The file's model with its quantized weights kept as they are stored (see the module doc):
    (the open file, the model, names of the tensors that had to be re-quantized).

    source: a path, or a file `open_gguf` opened. keep(weight) -> what the model holds of each
    weight (a layer, or a tensor: a norm's weight, a bias) as soon as it is converted, before the
    next is read; by default the weight itself. progress(n): after each weight, n the file's
    bytes it took."""
    gf = source if isinstance(source, GGUFFile) else open_gguf(source)
    requantized: list[str] = []

    # A matrix's chunks on as many threads as torch's width, each op on one thread: ops
    # parallelized within are slower here than on one thread as soon as a neighbour is busy (a
    # barrier per op waits out its time slice: arlm.threads), and numpy's never were.
    width = torch.get_num_threads()
    tensors = {}
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(width) as pool:
            convert = partial(_converted_weight, gf, requantized, _Workers(pool, width))
            for name, value, parts in _converted(gf, convert):
                tensors[name] = value if keep is None else keep(value)
                if progress is not None:
                    progress(sum(int(t.n_bytes) for _, t in parts))
    finally:
        torch.set_num_threads(width)
    return gf, _assembled(gf, tensors), requantized


def _assembled(gf: GGUFFile, tensors: dict[str, object]) -> Transformer:
    """The model of `tensors` (our name -> a layer, or a norm's weight or a bias); LoadError where
    the file left one of its tensors missing."""
    cfg = gf.config
    with torch.device("meta"):
        model = Transformer(cfg, init=False)
    model.set_rope_tables()
    # the model's own (meta) tensors, to tell those the file left missing (kept alive: ids stay theirs)
    unset = [t for t in list(model.parameters()) + list(model.buffers()) if t.is_meta]
    emb = tensors.pop("tok_emb.weight")
    # the quantized layers in place of the nn.Linears first, then the norms' weights and biases
    for name, value in sorted(tensors.items(), key=lambda kv: isinstance(kv[1], torch.Tensor)):
        owner_name, _, attr = name.rpartition(".")
        if isinstance(value, torch.Tensor):  # a norm's weight, a bias
            setattr(model.get_submodule(owner_name), attr, _parameter(value))
        else:  # a quantized layer in place of an nn.Linear
            parent, _, child = owner_name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, value)
    if isinstance(emb, torch.Tensor):
        model.tok_emb = torch.nn.Embedding(*emb.shape, device="meta")
        model.tok_emb.weight = _parameter(emb)  # (frozen: Embedding.from_pretrained's)
        if cfg.tie_embeddings:  # one float32 matrix for both (the file's values: nothing rounded again)
            model.lm_head = torch.nn.Linear(emb.shape[1], emb.shape[0], bias=False, device="meta")
            model.lm_head.weight = model.tok_emb.weight
    else:
        model.tok_emb = QuantizedEmbedding(emb)
        if cfg.tie_embeddings:  # one matrix for both: the head's rows are the table
            model.lm_head = emb
    unset_ids = {id(t) for t in unset}
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if id(t) in unset_ids]
    if missing:
        raise LoadError(f"{gf.path}: tensors missing from the file: {missing[:4]}")
    return model.eval()
