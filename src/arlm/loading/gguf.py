"""Read a Llama-family GGUF file: config, dequantized weights, tokenizer and chat template.

The file is opened once with `gguf.GGUFReader` (a memory map; ~3-5 s for SmolLM2) and every
tensor is dequantized once with `gguf.quants.dequantize` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, the
K-quants...). Nothing here parses GGUF by hand.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig
from .errors import LoadError

GGUF_MAGIC = b"GGUF"

_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "attn_output.weight": "attn.wo.weight",
    "ffn_norm.weight": "mlp_norm.weight",
    "ffn_down.weight": "mlp.down.weight",
}
# Tensors that our model holds fused: (parts in order) -> our name.
_FUSED = {("attn_q.weight", "attn_k.weight", "attn_v.weight"): "attn.wqkv.weight",
          ("ffn_gate.weight", "ffn_up.weight"): "mlp.gate_up.weight"}
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
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_gguf(path: str | Path) -> GGUFModel:
    """Parse `path` into a ModelConfig, our state dict (float32) and tokenizer metadata."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise LoadError(f"cannot read {path}: {e.strerror}") from None
    if magic != GGUF_MAGIC:
        raise LoadError(f"{path} is not a GGUF file (no GGUF magic bytes)")
    import gguf  # deferred: importing gguf costs ~0.3 s that `arlm --help` should not pay

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises many kinds on a damaged file
        raise LoadError(f"{path} is not a valid GGUF file: truncated or damaged ({type(e).__name__}: {e})") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise LoadError(f"{path} is truncated: tensor {t.name} runs past the end of the file")

    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise LoadError(f"{path}: unsupported GGUF architecture {arch!r} (arlm reads 'llama' GGUFs)")

    def meta(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    n_head = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_head))
    d_model = int(meta("embedding_length"))
    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    vocab_size = int(meta("vocab_size", len(tokens)))
    try:
        config = ModelConfig.llama(
            vocab_size=vocab_size, n_layer=int(meta("block_count")), n_head=n_head, n_kv_heads=n_kv,
            d_model=d_model, d_ff=int(meta("feed_forward_length")),
            max_seq_len=int(meta("context_length", 2048)),
            norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(meta("rope.freq_base", 10000.0)),
            tie_embeddings="output.weight" not in names)
    except (TypeError, ValueError) as e:
        raise LoadError(f"{path}: incomplete or inconsistent llama metadata ({e})") from None
    rope_dims = meta("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != config.head_dim:
        raise LoadError(f"{path}: partial rotary embeddings ({rope_dims} of {config.head_dim} dims) unsupported")

    state: dict[str, torch.Tensor] = {}
    parts: dict[str, np.ndarray] = {}  # pieces of fused tensors, by GGUF name, until complete
    for t in reader.tensors:
        layer, rest = None, t.name
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
        if t.name not in _GLOBAL_NAMES and rest not in _LAYER_NAMES and rest not in _PART_OF:
            continue  # e.g. rope_freqs for scaled RoPE, which this model family does not use
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise LoadError(f"{path}: tensor {t.name} has GGML type {t.tensor_type.name}, "
                            "which gguf cannot dequantize") from None
        w = np.asarray(w, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
        if rest == "attn_q.weight":
            w = unpermute_rope_rows(w, n_head)
        elif rest == "attn_k.weight":
            w = unpermute_rope_rows(w, n_kv)
        if t.name in _GLOBAL_NAMES:
            state[_GLOBAL_NAMES[t.name]] = torch.from_numpy(w if w.flags.writeable and w.flags.c_contiguous else w.copy())
        elif rest in _LAYER_NAMES:
            state[f"blocks.{layer}.{_LAYER_NAMES[rest]}"] = torch.from_numpy(w.copy())
        else:
            parts[t.name] = w
            group, ours = _PART_OF[rest]
            names = [f"blk.{layer}.{g}" for g in group]
            if all(n in parts for n in names):
                state[f"blocks.{layer}.{ours}"] = torch.from_numpy(np.concatenate([parts.pop(n) for n in names]))

    tok_fields = {k: _field(reader, k) for k in reader.fields if k.startswith("tokenizer.ggml.")}
    return GGUFModel(config=config, state_dict=state, tokenizer_fields=tok_fields,
                     chat_template=_field(reader, "tokenizer.chat_template"),
                     name=_field(reader, "general.name") or path.stem)
