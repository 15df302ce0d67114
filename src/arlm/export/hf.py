"""An arlm model as an HF transformers directory: config.json, model.safetensors, the tokenizer
(tokenizer.json, tokenizer_config.json with the chat template) and generation_config.json.

`arlm_to_hf` is `arlm.loading.hf.hf_to_arlm` inverted: the fused q/k/v and gate/up matrices split
back into their parts (their rows already in HF's order: arlm's RoPE rotates halves, as HF's
does), GPT-2's matrices transposed to its Conv1D [in, out] layout. A tied head is left out of the
weights (`tie_word_embeddings`), as transformers saves one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from ..files import atomic_write, atomic_write_text
from ..tokenizer import Tokenizer

ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _rope_parameters(theta: float, scaling: dict | None) -> dict:
    return {"rope_type": "default", "rope_theta": theta} if scaling is None else {**scaling, "rope_theta": theta}


def _pre_attn_scalar(c: ModelConfig) -> int | float:
    """Gemma's query_pre_attn_scalar (an int in transformers' config) from arlm's score scale."""
    scalar = (c.attn_scale or c.head_dim ** -0.5) ** -2
    return round(scalar) if abs(scalar - round(scalar)) <= 1e-6 * scalar else scalar


def hf_config(c: ModelConfig, model_type: str, dtype: torch.dtype, tokenizer: Tokenizer | None) -> dict:
    """config.json for `c` as `model_type`. RoPE is written both ways: transformers 5's
    `rope_parameters` and the `rope_theta` / `rope_scaling` (/ `rope_local_base_freq`) that
    earlier versions read."""
    special = {"bos_token_id": tokenizer.bos_id if tokenizer else None,
               "eos_token_id": tokenizer.eos_id if tokenizer else None}
    common = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type, "vocab_size": c.vocab_size,
              "tie_word_embeddings": c.tie_embeddings, "torch_dtype": str(dtype).removeprefix("torch."),
              "use_cache": True, **special}
    if model_type == "gpt2":
        return {**common, "n_embd": c.d_model, "n_layer": c.n_layer, "n_head": c.n_head, "n_inner": c.d_ff,
                "n_positions": c.max_seq_len, "n_ctx": c.max_seq_len, "layer_norm_epsilon": c.norm_eps,
                "activation_function": "gelu_new" if c.gelu_approximate == "tanh" else "gelu",
                "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout,
                "scale_attn_weights": True}
    out = {**common, "hidden_size": c.d_model, "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layer,
           "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
           "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps, "attention_dropout": c.dropout,
           "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling}
    if model_type == "gemma3_text":
        local = c.rope_local_theta if c.rope_local_theta is not None else c.rope_theta
        types = c.layer_types or ("full",) * c.n_layer
        return {**out, "hidden_activation": "gelu_pytorch_tanh" if c.gelu_approximate == "tanh" else "gelu",
                "query_pre_attn_scalar": _pre_attn_scalar(c),
                "sliding_window": c.sliding_window or None, "rope_local_base_freq": local,
                "layer_types": [f"{t}_attention" for t in types],
                "rope_parameters": {"full_attention": _rope_parameters(c.rope_theta, c.rope_scaling),
                                    "sliding_attention": _rope_parameters(local, None)},
                "attention_bias": False, "final_logit_softcapping": None, "attn_logit_softcapping": None}
    out = {**out, "hidden_act": "silu", "rope_parameters": _rope_parameters(c.rope_theta, c.rope_scaling)}
    if model_type == "llama":
        return {**out, "attention_bias": c.bias, "mlp_bias": c.bias}
    if model_type == "qwen2":
        return {**out, "use_sliding_window": False, "sliding_window": None, "layer_types": ["full_attention"] * c.n_layer}
    return {**out, "attention_bias": c.qkv_bias, "use_sliding_window": False, "sliding_window": None}  # qwen3


def _split_qkv(w: torch.Tensor, c: ModelConfig) -> list[torch.Tensor]:
    """The fused wqkv rows (or bias) split into q, k and v: [H * d, H_kv * d, H_kv * d]."""
    d = c.head_dim
    return list(w.split([c.n_head * d, c.n_kv_heads * d, c.n_kv_heads * d]))


def _repeat_kv(w: torch.Tensor, c: ModelConfig) -> torch.Tensor:
    """K or V rows (or bias) of H_kv heads repeated for the query heads each serves (query head h
    reads K/V head h // (H / H_kv), as SDPA's enable_gqa): GQA as multi-head attention."""
    return w.unflatten(0, (c.n_kv_heads, c.head_dim)).repeat_interleave(c.n_head // c.n_kv_heads, 0).flatten(0, 1)


def arlm_to_hf(state: dict[str, torch.Tensor], c: ModelConfig, model_type: str) -> dict[str, torch.Tensor]:
    """Our state dict in HF's names and layouts for `model_type` (biases arlm has not, where the HF
    model has them, as zeros)."""
    out: dict[str, torch.Tensor] = {}

    def bias(name: str, size: int) -> torch.Tensor:
        return state[name] if name in state else torch.zeros(size)

    if model_type == "gpt2":
        out["transformer.wte.weight"], out["transformer.wpe.weight"] = state["tok_emb.weight"], state["pos_emb.weight"]
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = state["norm.weight"], bias("norm.bias", c.d_model)
        for i in range(c.n_layer):
            o, h = f"blocks.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                out[h + f"{theirs}.weight"] = state[o + f"{ours}.weight"]
                out[h + f"{theirs}.bias"] = bias(o + f"{ours}.bias", c.d_model)
            parts = [_split_qkv(state[o + "attn.wqkv.weight"], c),
                     _split_qkv(bias(o + "attn.wqkv.bias", (c.n_head + 2 * c.n_kv_heads) * c.head_dim), c)]
            w, b = ([q, _repeat_kv(k, c), _repeat_kv(v, c)] for q, k, v in parts)
            out[h + "attn.c_attn.weight"], out[h + "attn.c_attn.bias"] = torch.cat(w).t(), torch.cat(b)
            for ours, theirs, size in (("attn.wo", "attn.c_proj", c.d_model), ("mlp.up", "mlp.c_fc", c.d_ff),
                                       ("mlp.down", "mlp.c_proj", c.d_model)):
                out[h + f"{theirs}.weight"] = state[o + f"{ours}.weight"].t()
                out[h + f"{theirs}.bias"] = bias(o + f"{ours}.bias", size)
    else:
        out["model.embed_tokens.weight"], out["model.norm.weight"] = state["tok_emb.weight"], state["norm.weight"]
        names = {"attn.wo": "self_attn.o_proj", "mlp.down": "mlp.down_proj", "attn.q_norm": "self_attn.q_norm",
                 "attn.k_norm": "self_attn.k_norm"}
        if model_type == "gemma3_text":
            names.update({"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                          "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"})
        else:
            names.update({"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"})
        for i in range(c.n_layer):
            o, h = f"blocks.{i}.", f"model.layers.{i}."
            for ours, theirs in names.items():
                for kind in ("weight", "bias"):
                    if f"{o}{ours}.{kind}" in state:
                        out[f"{h}{theirs}.{kind}"] = state[f"{o}{ours}.{kind}"]
            for kind in ("weight", "bias"):
                if f"{o}attn.wqkv.{kind}" in state:
                    for p, part in zip("qkv", _split_qkv(state[f"{o}attn.wqkv.{kind}"], c)):
                        out[f"{h}self_attn.{p}_proj.{kind}"] = part
                if f"{o}mlp.gate_up.{kind}" in state:
                    gate, up = state[f"{o}mlp.gate_up.{kind}"].chunk(2)
                    out[f"{h}mlp.gate_proj.{kind}"], out[f"{h}mlp.up_proj.{kind}"] = gate, up
            if model_type == "qwen3" and c.qkv_bias:  # (its attention_bias biases o too)
                out[h + "self_attn.o_proj.bias"] = torch.zeros(c.d_model)
    if not c.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return out


def tokenizer_files(tokenizer: Tokenizer, chat_template: str | None, max_len: int) -> dict[str, str]:
    """tokenizer.json (a BOS added by its post-processor where arlm's tokenizer adds one) and
    tokenizer_config.json (special tokens, chat template), as file name -> text."""
    data = json.loads(tokenizer.backend.to_str())
    tok = tokenizer.backend.id_to_token
    bos = tok(tokenizer.bos_id) if tokenizer.bos_id is not None else None
    if tokenizer.add_bos and bos is not None and data.get("post_processor") is None:
        data["post_processor"] = {"type": "TemplateProcessing",
                                  "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                             {"Sequence": {"id": "A", "type_id": 0}}],
                                  "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                           {"Sequence": {"id": "A", "type_id": 0}},
                                           {"SpecialToken": {"id": bos, "type_id": 1}},
                                           {"Sequence": {"id": "B", "type_id": 1}}],
                                  "special_tokens": {bos: {"id": bos, "ids": [tokenizer.bos_id], "tokens": [bos]}}}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
              "eos_token": tok(tokenizer.eos_id) if tokenizer.eos_id is not None else None,
              "add_bos_token": tokenizer.add_bos, "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "model_max_length": max_len}
    if chat_template:
        config["chat_template"] = chat_template
    return {"tokenizer.json": json.dumps(data, ensure_ascii=False),
            "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False)}


def generation_config(tokenizer: Tokenizer | None) -> dict:
    if tokenizer is None:
        return {}
    eos = tokenizer.eos_ids[0] if len(tokenizer.eos_ids) == 1 else (tokenizer.eos_ids or None)
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos}


def write_hf_dir(directory: Path, model: torch.nn.Module, model_type: str, dtype: torch.dtype,
                 tokenizer: Tokenizer | None, chat_template: str | None) -> list[str]:
    """The HF directory's files into `directory` (each written atomically); their names."""
    c = model.config
    state = {k: v.detach() for k, v in model.state_dict().items()}
    weights = {k: v.to(dtype).contiguous().clone() for k, v in arlm_to_hf(state, c, model_type).items()}
    atomic_write(directory / "model.safetensors", lambda tmp: save_file(weights, tmp, metadata={"format": "pt"}))
    del weights
    texts = {"config.json": json.dumps(hf_config(c, model_type, dtype, tokenizer), indent=2),
             "generation_config.json": json.dumps(generation_config(tokenizer), indent=2)}
    if tokenizer is not None:
        texts.update(tokenizer_files(tokenizer, chat_template, c.max_seq_len))
    for name, text in texts.items():
        atomic_write_text(directory / name, text + "\n")
    return ["model.safetensors", *texts]
