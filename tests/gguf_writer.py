"""Write an HF model's weights as a GGUF file the way llama.cpp's converter does, for tests: the
architectures no GGUF on PyPI covers (qwen2, qwen3, llama with GQA, gemma3), their metadata
keys, tensor names and layouts (Llama's q/k rows permuted for ggml's RoPE, Gemma's norms stored
as 1 + w), through `gguf`'s own writer. The tokenizer is a byte-level stand-in (the model's
weights are what these files test): byte tokens, then filler, as many as the vocabulary has.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "llama": "llama", "gemma3_text": "gemma3"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (rows i and i + d/2 of each head become 2i and 2i + 1)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random K-quant blocks (Q4_K, Q5_K, Q6_K) for a [rows, cols] matrix, as raw bytes [rows,
    cols / 256 * bytes]: every byte random but the float16 scales, small enough for weights of
    ~0.1 (gguf cannot quantize to these types, so a test's K-quant matrices are random)."""
    from arlm.loading.gguf_blocks import K_BLOCK_BYTES

    rng = np.random.default_rng(seed)
    S = cols // 256
    b = rng.integers(0, 256, (rows, S, K_BLOCK_BYTES[kind]), dtype=np.uint8)
    scales = rng.uniform(1e-5, 1e-4 if kind == "Q6_K" else 2e-4, (rows, S, 2)).astype(np.float16)
    halves = scales.view(np.uint8).reshape(rows, S, 2, 2)
    if kind == "Q6_K":
        b[..., 208:210] = halves[:, :, 0]
    else:
        b[..., 0:2], b[..., 2:4] = halves[:, :, 0], halves[:, :, 1]
    return b.reshape(rows, -1)


def write_gguf(hf_model, path: Path, quantize: set[str] = frozenset(), kquant: dict[str, str] | None = None) -> Path:
    """`hf_model` (transformers, float32) as a GGUF file at `path`; matrices whose GGUF name
    ends with one of `quantize` stored as Q8_0 (the rest F32); those ending with a key of
    `kquant` stored in its type: a K-quant's replaced by random blocks (`random_k_blocks`), any
    other type gguf quantizes to (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) quantized by gguf."""
    import gguf

    from arlm.tokenizer import _byte_decoder

    c = hf_model.config
    kind = c.model_type
    arch = GGUF_ARCH[kind]
    n_head, n_kv = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    if kind == "gemma3_text":
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_sliding_window(c.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    else:
        w.add_rope_freq_base(rope["rope_theta"])
    scaled = kind == "llama" and rope.get("rope_type") == "llama3"
    byte_tokens = list(_byte_decoder())  # (GPT-2's byte-level characters)
    tokens = (byte_tokens + [f"<filler_{i}>" for i in range(max(0, c.vocab_size - len(byte_tokens)))])[:c.vocab_size]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    sd = {k.removeprefix("model."): v.detach().float().numpy() for k, v in hf_model.state_dict().items()}

    def add(name: str, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        kind = next((k for suffix, k in (kquant or {}).items() if name.endswith(suffix)), None)
        if a.ndim == 2 and kind is not None and kind.endswith("_K"):
            w.add_tensor(name, random_k_blocks(kind, *a.shape, seed=sum(map(ord, name))),
                         raw_dtype=gguf.GGMLQuantizationType[kind])
        elif a.ndim == 2 and kind is not None:
            w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType[kind]),
                         raw_dtype=gguf.GGMLQuantizationType[kind])
        elif a.ndim == 2 and any(name.endswith(q) for q in quantize):
            w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a)

    def norm(a: np.ndarray) -> np.ndarray:
        return a + 1.0 if kind == "gemma3_text" else a  # (the converter folds Gemma's 1 + w in)

    if scaled:  # as llama.cpp's converter writes Llama 3's scaled RoPE: a divisor per frequency
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](c, "cpu")
        plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        add("rope_freqs.weight", (plain / scaled_freq).numpy())
    add("token_embd.weight", sd["embed_tokens.weight"])
    add("output_norm.weight", norm(sd["norm.weight"]))
    if not c.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm"}
    if kind == "gemma3_text":
        names.update({"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"})
    else:
        names["post_attention_layernorm"] = "ffn_norm"
    for i in range(c.num_hidden_layers):
        h = f"layers.{i}."
        for ours, theirs in names.items():
            if h + ours + ".weight" in sd:
                a = sd[h + ours + ".weight"]
                add(f"blk.{i}.{theirs}.weight", norm(a) if a.ndim == 1 else a)
        for p, n in (("q", n_head), ("k", n_kv), ("v", None)):
            a = sd[h + f"self_attn.{p}_proj.weight"]
            add(f"blk.{i}.attn_{p}.weight", _permute(a, n) if kind == "llama" and n else a)
            if h + f"self_attn.{p}_proj.bias" in sd:
                b = sd[h + f"self_attn.{p}_proj.bias"]
                add(f"blk.{i}.attn_{p}.bias", _permute(b, n) if kind == "llama" and n else b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids).logits.float()
