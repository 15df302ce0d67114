"""Typed model configuration: one dataclass describes both the GPT-2 and the Llama family."""

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
    mlp: Literal["gelu", "swiglu"] = "gelu"
    gelu_approximate: Literal["none", "tanh"] = "tanh"  # GPT-2's "gelu_new" is the tanh form
    bias: bool = True
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_head
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        for name in ("vocab_size", "n_layer", "n_head", "n_kv_heads", "d_model", "d_ff", "max_seq_len"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ConfigError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_heads:
            raise ConfigError(f"n_head ({self.n_head}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.pos_embedding == "rope" and self.head_dim % 2:
            raise ConfigError("rotary embeddings need an even head dimension")
        for name, allowed in (("pos_embedding", ("learned", "rope")), ("norm", ("layernorm", "rmsnorm")),
                              ("mlp", ("gelu", "swiglu")), ("gelu_approximate", ("none", "tanh"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

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
