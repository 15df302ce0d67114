"""Typed model configuration: one dataclass describes GPT-2 and the Llama-shaped families (Llama
2/3, Qwen 2/3, Gemma 3), each difference a switch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration that cannot describe a model (unknown key, inconsistent sizes)."""


@dataclass
class ModelConfig:
    """Architecture of a decoder-only transformer.

    The switches select the family: GPT-2 is learned positions + LayerNorm + GELU + biases + tied
    embeddings; Llama is RoPE + RMSNorm + SwiGLU + no biases, with GQA/MQA through `n_kv_heads`.
    Later families are Llama with a few more switches, each off by default: Qwen 2 (`qkv_bias`),
    Qwen 3 (`qk_norm`, `head_size`), Llama 3 (`rope_scaling`), Gemma 3 (`head_size`,
    `embed_scale`, `norm_plus_one`, `qk_norm`, `post_norms`, `mlp="geglu"`, `attn_scale`, and
    sliding-window layers: `layer_types`, `sliding_window`, `rope_local_theta`).
    """

    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_kv_heads: int | None = None  # None: multi-head attention (n_kv_heads == n_head)
    d_model: int = 768
    d_ff: int | None = None  # None: 4 * d_model
    max_seq_len: int = 1024  # context window (positions 0 .. max_seq_len - 1)
    pos_embedding: Literal["learned", "rope"] = "learned"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    mlp: Literal["gelu", "swiglu", "geglu"] = "gelu"
    gelu_approximate: Literal["none", "tanh"] = "tanh"  # GPT-2's "gelu_new" is the tanh form
    bias: bool = True
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dropout: float = 0.0
    # -- later families (module doc) ------------------------------------------------------------
    head_size: int | None = None  # None: d_model // n_head; else each head's width (q: n_head * head_size)
    qkv_bias: bool = False  # biases on the q, k and v projections alone (Qwen 2)
    qk_norm: bool = False  # an RMSNorm over each q and k head before RoPE (Qwen 3, Gemma 3)
    norm_plus_one: bool = False  # RMSNorm scales by (1 + w), its weights stored as w (Gemma)
    embed_scale: bool = False  # the embedding rows times sqrt(d_model) (Gemma)
    post_norms: bool = False  # a norm on the attention's and the MLP's outputs, before each residual add (Gemma 2/3)
    attn_scale: float | None = None  # attention's score scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    # Per layer, "full" or "sliding" (a query reads its last `sliding_window` positions, itself
    # included, with RoPE base `rope_local_theta`); None: every layer full.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int = 0
    rope_local_theta: float | None = None
    # RoPE frequency scaling of the full layers, as HF's rope_parameters: {"rope_type": "linear",
    # "factor"} or {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; or as a GGUF stores Llama 3's, {"rope_type":
    # "freq_factors", "factors": [head_dim / 2 divisors]}; None: plain RoPE.
    rope_scaling: dict | None = None

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_head
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        for name in ("vocab_size", "n_layer", "n_head", "n_kv_heads", "d_model", "d_ff", "max_seq_len"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.head_size is None and self.d_model % self.n_head:
            raise ConfigError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.head_size is not None and int(self.head_size) <= 0:
            raise ConfigError(f"head_size must be positive, got {self.head_size}")
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            if len(self.layer_types) != self.n_layer or not set(self.layer_types) <= {"full", "sliding"}:
                raise ConfigError(f"layer_types must give 'full' or 'sliding' for each of the {self.n_layer} layers")
            if "sliding" in self.layer_types and self.sliding_window < 1:
                raise ConfigError("sliding layers need sliding_window >= 1")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in ("linear", "llama3",
                                                                                      "freq_factors"):
            raise ConfigError(f"rope_scaling type {self.rope_scaling.get('rope_type')!r} is not supported "
                              "(linear, llama3, freq_factors)")
        if self.n_head % self.n_kv_heads:
            raise ConfigError(f"n_head ({self.n_head}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.pos_embedding == "rope" and self.head_dim % 2:
            raise ConfigError("rotary embeddings need an even head dimension")
        for name, allowed in (("pos_embedding", ("learned", "rope")), ("norm", ("layernorm", "rmsnorm")),
                              ("mlp", ("gelu", "swiglu", "geglu")), ("gelu_approximate", ("none", "tanh"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.d_model // self.n_head

    def sliding(self, layer: int) -> bool:
        """Whether `layer` is a sliding-window layer."""
        return self.layer_types is not None and self.layer_types[layer] == "sliding"

    @property
    def family(self) -> str:
        return "llama" if self.pos_embedding == "rope" else "gpt2"

    @classmethod
    def gpt2(cls, **overrides: Any) -> "ModelConfig":
        """GPT-2 family defaults (124M unless overridden)."""
        base = dict(vocab_size=50257, n_layer=12, n_head=12, d_model=768, max_seq_len=1024,
                    pos_embedding="learned", norm="layernorm", mlp="gelu", bias=True, tie_embeddings=True)
        return cls(**{**base, **overrides})

    @classmethod
    def llama(cls, **overrides: Any) -> "ModelConfig":
        """Llama family defaults (SmolLM2-135M's shape unless overridden)."""
        base = dict(vocab_size=49152, n_layer=30, n_head=9, n_kv_heads=3, d_model=576, d_ff=1536,
                    max_seq_len=8192, pos_embedding="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                    tie_embeddings=True, norm_eps=1e-5, rope_theta=100000.0)
        return cls(**{**base, **overrides})

    @classmethod
    def for_family(cls, family: str, **overrides: Any) -> "ModelConfig":
        if family not in ("gpt2", "llama"):
            raise ConfigError(f"unknown model family {family!r} (expected 'gpt2' or 'llama')")
        return cls.gpt2(**overrides) if family == "gpt2" else cls.llama(**overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown model config key(s): {', '.join(unknown)}")
        return cls(**data)
