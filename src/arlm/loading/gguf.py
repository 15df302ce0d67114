"""Read a GGUF file of a Llama-shaped architecture (llama, qwen2, qwen3, gemma3): config,
weights, tokenizer and chat template.

The file is opened once with `gguf.GGUFReader` (a memory map; a weight's pages are handed
back once it is converted, `GGUFFile.release`). Two ways to its weights:

- `quantized_model` (gguf_layers.py): the file's Q4_1 and Q8_0 blocks go into arlm's quantized layers as they are
  (`arlm.quant.Q4Linear`, `Q8Linear`: the same bytes, split into weights and scales), block by
  block, without a float32 copy of the model; Q4_0 into Q4Linear (mins -8 d, exact); on CPUs
  with AVX-512 VNNI or AVX2, Q5_0 into `Q5Linear` and the K-quants Q4_K, Q5_K, Q6_K into `KQuantLinear`
  (their integer fields and scales, the values not rounded again; elsewhere Q5_0 is widened to
  Q8_0 too, and the K-quants go into the row layout with float32 scales, their values exactly:
  Q4_K into `Q4Linear`, Q5_K into `Q8MinsLinear`, Q6_K into `Q8Linear`), and a fused weight whose parts differ
  in kind into `SplitLinear`, each part as it is stored; the token embedding is gathered from its
  quantized rows. F32, F16 and BF16 matrices are held in float32 (exactly). Tensors of other
  types are dequantized and re-quantized to int8 per row (see `requantized`: the one place arlm
  adds rounding the file did not have). One weight at a time, in file order (`keep`: the first
  load appends each to the kernel-layout cache as it comes, `arlm.loading.cache.Builder`), a
  matrix's blocks a few million weights at a time (`gguf_layers._by_rows`).
- `read_gguf`: every tensor dequantized to float32 (`--quantize none`, the reference path).

Dequantization is `gguf.quants.dequantize` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, the K-quants...);
nothing parses GGUF by hand beyond splitting blocks into their values and scales
(gguf_blocks.py: `as_q8_0`, `k_quant_fields`). This module is the file: its tensor names,
`GGUFFile`, the config, each weight's parts in file order (`converted`) and the float path.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig
from .errors import LoadError
from .gguf_blocks import BLOCK_BYTES, K_BLOCK_BYTES, dequantize_blocks

GGUF_MAGIC = b"GGUF"

LAYER_NAMES = {
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
FUSED = {("attn_q.weight", "attn_k.weight", "attn_v.weight"): "attn.wqkv.weight",
         ("attn_q.bias", "attn_k.bias", "attn_v.bias"): "attn.wqkv.bias",  # Qwen 2
         ("ffn_gate.weight", "ffn_up.weight"): "mlp.gate_up.weight"}
# The architectures read (`general.architecture`): Llama's shape, with their switches (_config).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
_PART_OF = {part: (parts, ours) for parts, ours in FUSED.items() for part in parts}
GLOBAL_NAMES = {"token_embd.weight": "tok_emb.weight", "output_norm.weight": "norm.weight",
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
            if t.name in GLOBAL_NAMES or rest in LAYER_NAMES or rest in _PART_OF:
                yield rest, layer, t  # others, e.g. rope_freqs for scaled RoPE, this family does not use


def _reader(path: Path):
    """gguf's reader over a plain ndarray of the file's read-only map, and that map (`.map`, whose
    pages `GGUFFile.release` hands back). gguf maps the file as an np.memmap, whose every slice
    (a field's each part: two per token of a vocabulary) goes through memmap's Python-level
    `__getitem__` and `__array_finalize__`: ~3x slower to parse a 262,144-token vocabulary.

    Arrays of strings and numbers (the vocabulary, its merges, scores and token types) are read in
    bulk into the same parts `ReaderField.contents()` reads: gguf's reader takes each element as a
    field of its own (~3 us each: 1.3 s of a first load for Llama 3's 128,256 tokens and 280,147
    merges). A string element's part is a memoryview of the map where gguf's is an ndarray view
    (both have `tobytes()`, all `contents()` asks of it); a number array is one part. Files of the
    other byte order, and arrays of arrays, go through gguf's own code."""
    import gguf

    value = gguf.GGUFValueType

    class Reader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, memmap: np.ndarray) -> None:  # (the reader's first act: np.memmap(path))
            with open(path, "rb") as f:
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._data = np.frombuffer(self.map, np.uint8)

        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if raw_type != value.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            itype, n = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            offs = orig_offs + 12
            if itype[0] == value.STRING:
                view, parts = memoryview(self.map), [itype, n]
                for _ in range(int(n[0])):
                    length = int.from_bytes(self.map[offs:offs + 8], "little")
                    if offs + 8 + length > len(self.map):
                        raise ValueError(f"a string at byte {offs} runs past the end of the file")
                    parts.append(view[offs + 8:offs + 8 + length])
                    offs += 8 + length
                return offs - orig_offs, parts, list(range(2, len(parts))), [value.ARRAY, value.STRING]
            nptype = self.gguf_scalar_to_np.get(value(int(itype[0])))
            if nptype is None:  # (an array of arrays)
                return super()._get_field_parts(orig_offs, raw_type)
            values = self._get(offs, nptype, int(n[0]))
            if len(values) != int(n[0]):
                raise ValueError(f"an array at byte {offs} runs past the end of the file")
            return 12 + int(values.nbytes), [itype, n, values], [2], [value.ARRAY, value(int(itype[0]))]

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


def dequantize(gf: GGUFFile, t) -> np.ndarray:
    import gguf  # (as in open_gguf)

    try:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise LoadError(f"{gf.path}: tensor {t.name} has GGML type {t.tensor_type.name}, "
                        "which gguf cannot dequantize") from None
    return np.asarray(w, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])


def as_held(rest: str, w: np.ndarray, gf: GGUFFile) -> np.ndarray:
    """A tensor as arlm holds it: q/k rows un-permuted where llama.cpp's converter permuted them
    (its Llama family; not Qwen's or Gemma's), and a Gemma norm's (1 + w) back to w (the
    converter adds the 1 for ggml's plain multiply)."""
    if gf.arch == "llama" and rest in ("attn_q.weight", "attn_k.weight"):
        return unpermute_rope_rows(w, gf.config.n_head if rest == "attn_q.weight" else gf.config.n_kv_heads)
    if gf.config.norm_plus_one and rest.endswith("norm.weight"):
        return w - np.float32(1.0)
    return w


def converted(gf: GGUFFile, convert) -> Iterator[tuple[str, object, list]]:
    """(our name, convert(parts), parts) for each weight, in file order: parts the [(gguf short
    name, tensor)] of a fused weight, or one. The parts' pages of the file's map are handed back
    once the consumer is done with the weight (`GGUFFile.release`)."""
    pending: dict[str, object] = {}  # pieces of fused tensors, by GGUF name, until complete
    for rest, layer, t in gf.weights():
        if t.name in GLOBAL_NAMES:
            name, parts = GLOBAL_NAMES[t.name], [(rest, t)]
        elif rest in LAYER_NAMES:
            name, parts = f"blocks.{layer}.{LAYER_NAMES[rest]}", [(rest, t)]
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
    """Our name -> convert(parts) (`converted`)."""
    return {name: value for name, value, _ in converted(gf, convert)}


def read_gguf(path: str | Path) -> GGUFModel:
    """Parse `path` into a ModelConfig, our state dict (float32) and tokenizer metadata."""
    gf = open_gguf(path)

    def to_float(parts) -> torch.Tensor:
        if all(t.tensor_type.name in BLOCK_BYTES for _, t in parts) and len(parts[0][1].shape) == 2:
            # Straight into one preallocated array, a few thousand rows at a time: the weights are
            # held once (no per-tensor temporaries the size of the tensor, no concatenation).
            blocks = [tensor_blocks(gf, rest, t) for rest, t in parts]
            out = np.empty((sum(b.shape[0] for b in blocks), 32 * blocks[0].shape[1]), np.float32)
            row = 0
            for (_, t), b in zip(parts, blocks):
                kind = t.tensor_type.name
                dequantize_blocks(b, kind, out[row:row + b.shape[0]])
                row += b.shape[0]
            return torch.from_numpy(out)
        ws = [as_held(rest, dequantize(gf, t), gf) for rest, t in parts]
        w = ws[0] if len(ws) == 1 else np.concatenate(ws)
        return torch.from_numpy(w if w.flags.writeable and w.flags.c_contiguous else w.copy())

    state = _tensors_by_name(gf, to_float)
    return GGUFModel(config=gf.config, state_dict=state, tokenizer_fields=gf.tokenizer_fields,
                     chat_template=gf.chat_template, name=gf.name)


def tensor_blocks(gf: GGUFFile, rest: str, t) -> np.ndarray:
    """A tensor's blocks [N, K/32 (K/256 for a K-quant), bytes per block] (a type of BLOCK_BYTES or
    K_BLOCK_BYTES), q/k rows un-permuted (a view of the memory map where nothing moves)."""
    kind = t.tensor_type.name
    data = np.asarray(t.data).reshape(int(t.shape[1]), -1, BLOCK_BYTES.get(kind) or K_BLOCK_BYTES[kind])
    return as_held(rest, data, gf)
