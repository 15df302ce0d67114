"""HF-format model directories (config.json + *.safetensors) of the GPT-2 and Llama families.

`hf_to_arlm` is also how the tests give HF transformers and arlm the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..config import ModelConfig
from .errors import LoadError


def config_from_hf(hf: dict) -> ModelConfig:
    """Our ModelConfig from an HF `config.json` dict (model_type gpt2 or llama)."""
    kind = hf.get("model_type")
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise LoadError(f"unsupported GPT-2 activation_function {act!r} (arlm has gelu and its tanh form)")
        return ModelConfig.gpt2(
            vocab_size=hf["vocab_size"], n_layer=hf["n_layer"], n_head=hf["n_head"], d_model=hf["n_embd"],
            d_ff=hf.get("n_inner") or 4 * hf["n_embd"], max_seq_len=hf.get("n_positions", 1024),
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            gelu_approximate="tanh" if act in ("gelu_new", "gelu_pytorch_tanh") else "none",
            tie_embeddings=hf.get("tie_word_embeddings", True))
    if kind == "llama":
        rope = hf.get("rope_parameters") or {}
        if (hf.get("rope_scaling") or {}).get("rope_type", "default") not in ("default", None) or \
                rope.get("rope_type", "default") != "default":
            raise LoadError("scaled RoPE (rope_scaling) is not supported")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        n_head = hf["num_attention_heads"]
        if hf.get("head_dim") not in (None, hf["hidden_size"] // n_head):
            raise LoadError("head_dim != hidden_size / num_attention_heads is not supported")
        if hf.get("mlp_bias") or hf.get("attention_bias"):
            raise LoadError("Llama checkpoints with biases are not supported")
        return ModelConfig.llama(
            vocab_size=hf["vocab_size"], n_layer=hf["num_hidden_layers"], n_head=n_head,
            n_kv_heads=hf.get("num_key_value_heads") or n_head, d_model=hf["hidden_size"],
            d_ff=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
            norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            tie_embeddings=hf.get("tie_word_embeddings", False))
    raise LoadError(f"unsupported model_type {kind!r} (arlm loads 'gpt2' and 'llama')")


def hf_to_arlm(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename an HF state dict into ours: Llama's q/k/v and gate/up are concatenated into our
    fused projections; GPT-2's Conv1D weights ([in, out]) are transposed to nn.Linear's [out, in]."""
    sd = {k.removeprefix("transformer.").removeprefix("model."): v for k, v in hf_state.items()}
    out: dict[str, torch.Tensor] = {}
    if config.family == "gpt2":
        out["tok_emb.weight"], out["pos_emb.weight"] = sd["wte.weight"], sd["wpe.weight"]
        out["norm.weight"], out["norm.bias"] = sd["ln_f.weight"], sd["ln_f.bias"]
        for i in range(config.n_layer):
            h, o = f"h.{i}.", f"blocks.{i}."
            # c_attn already holds q, k and v fused, like our wqkv.
            out[o + "attn.wqkv.weight"] = sd[h + "attn.c_attn.weight"].t().contiguous()
            out[o + "attn.wqkv.bias"] = sd[h + "attn.c_attn.bias"]
            pairs = {"ln_1": "attn_norm", "ln_2": "mlp_norm"}
            for theirs, ours in pairs.items():
                out[o + f"{ours}.weight"], out[o + f"{ours}.bias"] = sd[h + f"{theirs}.weight"], sd[h + f"{theirs}.bias"]
            for theirs, ours in (("attn.c_proj", "attn.wo"), ("mlp.c_fc", "mlp.up"), ("mlp.c_proj", "mlp.down")):
                out[o + f"{ours}.weight"] = sd[h + f"{theirs}.weight"].t().contiguous()
                out[o + f"{ours}.bias"] = sd[h + f"{theirs}.bias"]
        if not config.tie_embeddings:
            out["lm_head.weight"] = hf_state["lm_head.weight"]
        return out
    out["tok_emb.weight"], out["norm.weight"] = sd["embed_tokens.weight"], sd["norm.weight"]
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
             "self_attn.o_proj": "attn.wo", "mlp.down_proj": "mlp.down"}
    for i in range(config.n_layer):
        h, o = f"layers.{i}.", f"blocks.{i}."
        for theirs, ours in names.items():
            out[o + f"{ours}.weight"] = sd[h + f"{theirs}.weight"]
        out[o + "attn.wqkv.weight"] = torch.cat([sd[h + f"self_attn.{p}_proj.weight"] for p in "qkv"])
        out[o + "mlp.gate_up.weight"] = torch.cat([sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"]])
    if not config.tie_embeddings:
        out["lm_head.weight"] = hf_state["lm_head.weight"]
    return out


def read_hf_dir(directory: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        if (directory / "latest").is_dir():
            raise LoadError(f"{directory} is a training run, not a model: pass {directory / 'latest'} "
                            f"(or {directory / 'best'})")
        raise LoadError(f"{directory} has no config.json (expected an HF-format model directory)")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{directory} has no *.safetensors weights")
    try:
        hf_cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise LoadError(f"{cfg_path} is not valid JSON ({e})") from None
    try:
        config = config_from_hf(hf_cfg)
    except KeyError as e:
        raise LoadError(f"{cfg_path} lacks the key {e}") from None
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise LoadError(f"{f} is not a readable safetensors file ({e})") from None
    try:
        return config, {k: v.float() for k, v in hf_to_arlm(state, config).items()}
    except KeyError as e:
        raise LoadError(f"{directory}: weights lack the tensor {e}") from None
