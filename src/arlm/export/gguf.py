"""An arlm model as a GGUF file, written as llama.cpp's convert_hf_to_gguf.py writes one, through
`gguf`'s own writer: the converter's metadata keys (general.*, the architecture's hyperparameters,
tokenizer.ggml.* with a byte-level BPE vocabulary, the chat template), its tensor names (the
inverse of `arlm.loading.gguf`'s tables), Llama's q/k rows permuted for ggml's RoPE
(`permute_rope_rows`, which the loader's `unpermute_rope_rows` undoes), and its tensor types:
norms, biases and RoPE divisors F32, every matrix in the file's type (`TYPES`), F16 where a row
does not split into the type's blocks (the converter's fallback).

Tensors are converted and written one at a time (`gguf.GGUFWriter`'s tensor infos first, then
each tensor's data): memory holds the model and one converted tensor, not a second model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..config import ModelConfig
from ..loading.gguf import FUSED, GLOBAL_NAMES, LAYER_NAMES, permute_rope_rows
from ..model import rope_frequencies
from ..tokenizer import CONTROL_TOKEN, USER_DEFINED_TOKEN, Tokenizer, gguf_pre_name
from .family import ExportError

NORMAL_TOKEN, UNUSED_TOKEN = 1, 5  # llama.cpp token types (CONTROL_TOKEN 3, USER_DEFINED_TOKEN 4: arlm.tokenizer)

# --type -> (general.file_type, the matrices' GGML type), by the names of gguf's enums.
TYPES = {"f16": ("MOSTLY_F16", "F16"), "q8_0": ("MOSTLY_Q8_0", "Q8_0"), "f32": ("ALL_F32", "F32")}

_OUR_GLOBAL = {ours: theirs for theirs, ours in GLOBAL_NAMES.items()}
_OUR_LAYER = {ours: theirs for theirs, ours in LAYER_NAMES.items()}
_OUR_FUSED = {ours: parts for parts, ours in FUSED.items()}  # our fused name -> the file's parts in order


@dataclass
class Vocab:
    """A byte-level BPE vocabulary as tokenizer.ggml.* holds it."""

    pre: str
    tokens: list[str]
    types: list[int]
    merges: list[str]


def byte_level_vocab(tokenizer: Tokenizer | None, vocab_size: int) -> Vocab:
    """`tokenizer` as llama.cpp's "gpt2" vocabulary, padded to the model's `vocab_size` with
    unused `[PAD<i>]` tokens (as the converter pads); ExportError where it is not byte-level BPE
    or has no `tokenizer.ggml.pre` name arlm knows."""
    if tokenizer is None:
        raise ExportError("cannot export to GGUF: the model has no tokenizer (llama.cpp needs one in the file)")
    data = json.loads(tokenizer.backend.to_str())
    model, decoder = data["model"], data.get("decoder") or {}
    if model.get("type") != "BPE" or decoder.get("type") != "ByteLevel":
        raise ExportError("cannot export to GGUF: its tokenizer is not byte-level BPE (tokenizer.ggml.model gpt2), "
                          "e.g. arlm prepare's char tokenizer; train on `arlm prepare --tokenizer bpe` data "
                          "(or export --to hf)")
    pre = gguf_pre_name(tokenizer)
    if pre is None:
        raise ExportError("cannot export to GGUF: its tokenizer's pre-tokenizer is none that llama.cpp names "
                          "(GPT-2's, SmolLM's, llama-bpe, qwen2)")
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    if max(vocab.values()) >= vocab_size:
        raise ExportError(f"cannot export to GGUF: the tokenizer has ids up to {max(vocab.values())}, "
                          f"past the model's vocabulary of {vocab_size}")
    added = tokenizer.backend.get_added_tokens_decoder()
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [UNUSED_TOKEN] * vocab_size
    for token, i in vocab.items():
        tokens[i] = token
        types[i] = NORMAL_TOKEN if i not in added else CONTROL_TOKEN if added[i].special else USER_DEFINED_TOKEN
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return Vocab(pre, tokens, types, merges)


@dataclass
class Tensor:
    """One tensor of the file: its GGUF name, its float32 values (made when written) and GGML type."""

    name: str
    shape: tuple[int, ...]
    make: Callable[[], np.ndarray]
    qtype: str


def rope_divisors(c: ModelConfig) -> np.ndarray:
    """Scaled RoPE as rope_freqs: the divisor of each frequency [head_dim / 2] (the converter's
    Llama 3 factors; a linear factor for every frequency), arlm's own frequencies divided out."""
    if c.rope_scaling["rope_type"] == "freq_factors":  # (read from a GGUF: as they were)
        return np.asarray(c.rope_scaling["factors"], dtype=np.float32)
    plain = rope_frequencies(c.head_dim, c.rope_theta)
    return (plain / rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)).numpy()


def _tensors(model: torch.nn.Module, arch: str, matrix_type: str) -> Iterator[Tensor]:
    """The file's tensors in the converter's order (rope_freqs, token_embd, each layer, output_norm,
    output), each made from our weights when written."""
    import gguf

    c = model.config
    state = model.state_dict()

    def tensor(name: str, w: torch.Tensor, permute_heads: int | None = None) -> Tensor:
        def make() -> np.ndarray:
            a = w.detach().float().numpy()
            return permute_rope_rows(a, permute_heads) if permute_heads else a
        # norms, biases 1-D: F32; a matrix in the file's type, F16 where its rows do not split into blocks
        qtype = "F32" if w.ndim == 1 else matrix_type
        if w.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]:
            qtype = "F16"
        return Tensor(name, tuple(w.shape), make, qtype)

    if c.rope_scaling is not None:
        divisors = torch.from_numpy(rope_divisors(c))
        yield Tensor("rope_freqs.weight", tuple(divisors.shape), lambda: divisors.numpy(), "F32")
    yield tensor("token_embd.weight", state["tok_emb.weight"])
    for i in range(c.n_layer):
        prefix = f"blocks.{i}."
        for name, w in state.items():
            if not name.startswith(prefix):
                continue
            ours = name.removeprefix(prefix)
            if ours in _OUR_LAYER:
                yield tensor(f"blk.{i}.{_OUR_LAYER[ours]}", w)
            elif ours in _OUR_FUSED:
                parts = _OUR_FUSED[ours]
                heads = (c.n_head, c.n_kv_heads, c.n_kv_heads) if len(parts) == 3 else (None, None)
                sizes = [h * c.head_dim for h in heads] if len(parts) == 3 else [c.d_ff, c.d_ff]
                for part, piece, h in zip(parts, w.split(sizes), heads):
                    # llama's q and k rows permuted for ggml's RoPE (qwen's are not: the converter's)
                    permute = h if arch == "llama" and part.startswith(("attn_q.", "attn_k.")) else None
                    yield tensor(f"blk.{i}.{part}", piece, permute)
            else:
                raise ExportError(f"cannot export to GGUF: no GGUF tensor for {name}")
    yield tensor(_OUR_GLOBAL["norm.weight"], state["norm.weight"])
    if not c.tie_embeddings:
        yield tensor(_OUR_GLOBAL["lm_head.weight"], state["lm_head.weight"])


def _metadata(w, c: ModelConfig, arch: str, file_type: str, name: str, n_params: int) -> None:
    """general.* and the architecture's keys, as the converter writes them (TextModel's and
    LlamaModel's set_gguf_parameters)."""
    import gguf

    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    w.add_size_label(gguf.size_label(n_params, 0, 0, 0))
    w.add_block_count(c.n_layer)
    w.add_context_length(c.max_seq_len)
    w.add_embedding_length(c.d_model)
    w.add_feed_forward_length(c.d_ff)
    w.add_head_count(c.n_head)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_file_type(gguf.LlamaFileType[file_type])
    if c.head_size is not None:  # (the converter writes these where config.json states head_dim)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if arch == "llama":
        w.add_vocab_size(c.vocab_size)
        w.add_rope_dimension_count(c.head_dim)


def _tokenizer_metadata(w, vocab: Vocab, tokenizer: Tokenizer, chat_template: str | None) -> None:
    """tokenizer.ggml.* and the chat template, as the converter's _set_vocab_gpt2 and SpecialVocab
    write them."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    if tokenizer.bos_id is not None:
        w.add_bos_token_id(tokenizer.bos_id)
    if tokenizer.eos_ids:
        w.add_eos_token_id(tokenizer.eos_ids[0])
    if len(tokenizer.eos_ids) > 1:  # (an end-of-turn token beside the end of text: arlm stops at both)
        w.add_eot_token_id(tokenizer.eos_ids[1])
    w.add_add_bos_token(tokenizer.add_bos)
    if chat_template:
        w.add_chat_template(chat_template)


def write_gguf(path: str, model: torch.nn.Module, arch: str, kind: str, vocab: Vocab, tokenizer: Tokenizer,
               chat_template: str | None, name: str) -> int:
    """The file at `path` (the caller's temp file: arlm.files.atomic_write); its tensor count."""
    import gguf

    c = model.config
    file_type, matrix_type = TYPES[kind]
    plan = list(_tensors(model, arch, matrix_type))
    w = gguf.GGUFWriter(path, arch)
    _metadata(w, c, arch, file_type, name, sum(math.prod(t.shape) for t in plan if t.name != "rope_freqs.weight"))
    _tokenizer_metadata(w, vocab, tokenizer, chat_template)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for t in plan:
        qtype = gguf.GGMLQuantizationType[t.qtype]
        if t.qtype in ("F32", "F16"):
            dtype, shape = np.dtype(np.float32 if t.qtype == "F32" else np.float16), t.shape
            nbytes = math.prod(shape) * dtype.itemsize
        else:
            dtype, shape = np.dtype(np.uint8), gguf.quants.quant_shape_to_byte_shape(t.shape, qtype)
            nbytes = math.prod(shape)
        w.add_tensor_info(t.name, shape, dtype, nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in plan:  # one converted tensor in memory at a time
        w.write_tensor_data(gguf.quants.quantize(np.ascontiguousarray(t.make(), dtype=np.float32),
                                                 gguf.GGMLQuantizationType[t.qtype]))
    w.close()
    return len(plan)
