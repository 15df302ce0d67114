"""HF-format model directories (config.json + *.safetensors): GPT-2, and the Llama-shaped
families (Llama 2/3, Qwen 2/2.5, Qwen 3, Gemma 3's text model).

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
    """Our ModelConfig from an HF `config.json` dict (model_type gpt2, or one of LLAMA_LIKE)."""
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
    if kind in LLAMA_LIKE:
        return _llama_like(kind, hf)
    raise LoadError(f"unsupported model_type {kind!r} (arlm loads {', '.join(('gpt2',) + LLAMA_LIKE)})")


# The Llama-shaped families config.json's `model_type` names, and what each switches on.
LLAMA_LIKE = ("llama", "qwen2", "qwen3", "gemma3_text")


def _rope(params: dict | None, kind: str) -> tuple[float, dict | None]:
    """(base, scaling) of one RoPE parameter set (HF's rope_parameters, or the older
    rope_theta / rope_scaling pair)."""
    params = params or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("default", None):
        return float(params.get("rope_theta", 10000.0)), None
    if rope_type not in ("linear", "llama3"):
        raise LoadError(f"{kind}: RoPE scaling {rope_type!r} is not supported (linear, llama3)")
    return float(params.get("rope_theta", 10000.0)), {k: v for k, v in params.items() if k != "rope_theta"}


def _llama_like(kind: str, hf: dict) -> ModelConfig:
    n_head = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_head
    if hf.get("mlp_bias"):
        raise LoadError(f"{kind} checkpoints with MLP biases are not supported")
    rope = hf.get("rope_parameters")
    if rope is None:  # (older configs: rope_theta and rope_scaling beside)
        rope = {"rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}
    extra: dict = {}
    if kind == "gemma3_text":
        if hf.get("final_logit_softcapping") or hf.get("attn_logit_softcapping"):
            raise LoadError("gemma3_text: logit soft-capping is not supported")
        if hf.get("use_bidirectional_attention"):
            raise LoadError("gemma3_text: bidirectional attention is not supported")
        if hf.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu"):
            raise LoadError(f"gemma3_text: activation {hf.get('hidden_activation')!r} is not supported")
        full, sliding = (rope.get("full_attention"), rope.get("sliding_attention")) if "full_attention" in rope \
            else (rope, {"rope_theta": hf.get("rope_local_base_freq", 10000.0)})
        theta, scaling = _rope(full, kind)
        local_theta, local_scaling = _rope(sliding, kind)
        if local_scaling is not None:
            raise LoadError("gemma3_text: scaled RoPE on the sliding layers is not supported")
        types = hf.get("layer_types") or [
            "full_attention" if (i + 1) % hf.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
            for i in range(hf["num_hidden_layers"])]
        extra = dict(mlp="geglu", gelu_approximate="tanh" if hf.get("hidden_activation") != "gelu" else "none",
                     qk_norm=True, norm_plus_one=True, embed_scale=True, post_norms=True,
                     attn_scale=float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5,
                     layer_types=tuple("sliding" if t == "sliding_attention" else "full" for t in types),
                     sliding_window=int(hf.get("sliding_window") or 0), rope_local_theta=local_theta,
                     tie_embeddings=hf.get("tie_word_embeddings", True))
    else:
        theta, scaling = _rope(rope, kind)
        if "sliding_attention" in (hf.get("layer_types") or ()) or hf.get("use_sliding_window"):
            raise LoadError(f"{kind}: sliding-window layers (use_sliding_window) are not supported")
        if kind in ("llama", "qwen3") and hf.get("attention_bias"):
            # (their output projection would carry one too: arlm's biases are q, k and v's alone)
            raise LoadError(f"{kind} checkpoints with attention biases are not supported")
        extra = dict(qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3",
                     tie_embeddings=hf.get("tie_word_embeddings", False))
    return ModelConfig.llama(
        vocab_size=hf["vocab_size"], n_layer=hf["num_hidden_layers"], n_head=n_head,
        n_kv_heads=hf.get("num_key_value_heads") or n_head, d_model=hf["hidden_size"],
        head_size=None if head_dim * n_head == hf["hidden_size"] else head_dim,
        d_ff=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
        norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling, **extra)


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
    names = {"self_attn.o_proj": "attn.wo", "mlp.down_proj": "mlp.down"}
    if config.post_norms:  # Gemma: a norm before and after each branch
        names.update({"input_layernorm": "attn_norm", "post_attention_layernorm": "attn_post_norm",
                      "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "mlp_post_norm"})
    else:
        names.update({"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"})
    if config.qk_norm:
        names.update({"self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm"})
    for i in range(config.n_layer):
        h, o = f"layers.{i}.", f"blocks.{i}."
        for theirs, ours in names.items():
            out[o + f"{ours}.weight"] = sd[h + f"{theirs}.weight"]
        out[o + "attn.wqkv.weight"] = torch.cat([sd[h + f"self_attn.{p}_proj.weight"] for p in "qkv"])
        if config.qkv_bias:
            out[o + "attn.wqkv.bias"] = torch.cat([sd[h + f"self_attn.{p}_proj.bias"] for p in "qkv"])
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
    try:
        hf_cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise LoadError(f"{cfg_path} is not valid JSON ({e})") from None
    try:  # (the config first: an architecture arlm does not read is the news, not missing weights)
        config = config_from_hf(hf_cfg)
    except KeyError as e:
        raise LoadError(f"{cfg_path} lacks the key {e}") from None
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{directory} has no *.safetensors weights")
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
