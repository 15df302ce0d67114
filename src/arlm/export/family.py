"""Which HF `model_type` and which GGUF architecture an arlm `ModelConfig` is, or why it has none.

The inverse of the loaders' readings (`arlm.loading.hf.config_from_hf`, `arlm.loading.gguf._config`):
a config is its base (positions, norm, MLP) and the switches it turns on (`switches`); each target
is a row of a table (`HF_TYPES`, `GGUF_ARCHITECTURES`) naming the base it has, the switches it
must have and those it may have. A config is the first row it fits; where none fits, the error
names what the closest row lacks. A new target is a row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ModelConfig

# What each format cannot express, in one line (the CLI's errors and the README say it).
CANNOT_EXPRESS = {
    "hf": "HF cannot express a GGUF's per-frequency RoPE divisors (rope_freqs: Llama 3.1+ .gguf files) "
          "or a mix no HF model_type has (e.g. RoPE with LayerNorm)",
    "gguf": "GGUF (as llama.cpp and arlm read it) cannot express the GPT-2 family (learned positions, "
            "LayerNorm), Llama-family models with biases (train --bias), Gemma 3, scaled RoPE outside "
            "llama, or a tokenizer that is not byte-level BPE (arlm prepare's default char tokenizer)",
}


class ExportError(ValueError):
    """A model that cannot be written in the format asked for, or an output that cannot be
    written; the message says why in one line."""


@dataclass(frozen=True)
class Target:
    """One model_type or architecture: its base (pos_embedding, norm, mlp), the switches a
    config must have on, and those it may."""

    name: str
    base: tuple[str, str, str]
    required: frozenset[str] = frozenset()
    allowed: frozenset[str] = frozenset()


LLAMA_BASE = ("rope", "rmsnorm", "swiglu")
SCALED = frozenset({"linear RoPE scaling", "llama3 RoPE scaling"})

# GPT-2 takes any biases (those arlm has not are written as zeros: the same function) and
# grouped K/V heads (each repeated for its query heads: the same attention).
HF_TYPES = (
    Target("gpt2", ("learned", "layernorm", "gelu"), allowed=frozenset({"bias", "qkv_bias", "gqa"})),
    Target("llama", LLAMA_BASE, allowed=frozenset({"bias", "gqa", "head_size"}) | SCALED),
    Target("qwen2", LLAMA_BASE, frozenset({"qkv_bias"}), frozenset({"gqa", "head_size"}) | SCALED),
    # (Qwen 3's attention_bias biases o too: written as zeros)
    Target("qwen3", LLAMA_BASE, frozenset({"qk_norm"}), frozenset({"qkv_bias", "gqa", "head_size"}) | SCALED),
    Target("gemma3_text", ("rope", "rmsnorm", "geglu"),
           frozenset({"qk_norm", "norm_plus_one", "embed_scale", "post_norms"}),
           frozenset({"gqa", "head_size", "sliding", "attn_scale"}) | SCALED),
)

# Scaled RoPE goes into llama's file as rope_freqs (one divisor per frequency, which arlm and
# llama.cpp read for llama); qwen2's and qwen3's readers take no rope_freqs.
GGUF_ARCHITECTURES = (
    Target("llama", LLAMA_BASE, allowed=frozenset({"gqa", "head_size", "freq_factors RoPE scaling"}) | SCALED),
    Target("qwen2", LLAMA_BASE, frozenset({"qkv_bias"}), frozenset({"gqa", "head_size"})),
    Target("qwen3", LLAMA_BASE, frozenset({"qk_norm"}), frozenset({"gqa", "head_size"})),
)

_SAYS = {"bias": "biases on every linear and norm (bias=True)", "qkv_bias": "q/k/v biases",
         "qk_norm": "q/k norms", "norm_plus_one": "(1 + w) norms", "embed_scale": "scaled embeddings",
         "post_norms": "post-branch norms", "sliding": "sliding-window layers",
         "attn_scale": "a non-default attention scale", "head_size": "a head size other than d_model / n_head",
         "freq_factors RoPE scaling": "per-frequency RoPE divisors (a GGUF's rope_freqs)"}
_BASE_SAYS = {"learned": "learned positions", "rope": "RoPE", "layernorm": "LayerNorm", "rmsnorm": "RMSNorm",
              "gelu": "a GELU MLP", "swiglu": "SwiGLU", "geglu": "GeGLU"}


def switches(c: ModelConfig) -> frozenset[str]:
    """The switches `c` turns on beyond its base, as the target tables name them."""
    on = set()
    if c.bias:
        on.add("bias")
    elif c.qkv_bias:
        on.add("qkv_bias")
    for name in ("qk_norm", "norm_plus_one", "embed_scale", "post_norms"):
        if getattr(c, name):
            on.add(name)
    if c.n_kv_heads != c.n_head:
        on.add("gqa")
    if c.layer_types is not None and "sliding" in c.layer_types:
        on.add("sliding")
    if c.attn_scale is not None and not math.isclose(c.attn_scale, c.head_dim ** -0.5, rel_tol=1e-6):
        on.add("attn_scale")
    if c.head_dim * c.n_head != c.d_model:
        on.add("head_size")
    if c.rope_scaling is not None:
        on.add(f"{c.rope_scaling['rope_type']} RoPE scaling")
    return frozenset(on)


def _target(c: ModelConfig, table: tuple[Target, ...], fmt: str) -> str:
    base = (c.pos_embedding, c.norm, c.mlp)
    on = switches(c)
    for t in table:
        if t.base == base and t.required <= on <= t.required | t.allowed:
            return t.name
    said = " + ".join(_BASE_SAYS[b] for b in base)
    same_base = [t for t in table if t.base == base]
    if not same_base:
        why = f"no {fmt} architecture has {said}"
    else:  # the row this config comes closest to: what it has that the row does not
        t = min(same_base, key=lambda t: len(on ^ t.required) - len(on & t.allowed))
        extra = sorted(on - t.required - t.allowed)
        why = f"{fmt} {t.name} has no {', '.join(_SAYS.get(s, s) for s in extra)}" if extra else \
            f"{fmt} {t.name} needs {', '.join(_SAYS.get(s, s) for s in sorted(t.required - on))}"
    raise ExportError(f"cannot export this model ({said}) to {fmt}: {why}. {CANNOT_EXPRESS[fmt.lower()]}")


def hf_model_type(c: ModelConfig) -> str:
    """config.json's `model_type` for `c` (gpt2, llama, qwen2, qwen3, gemma3_text); ExportError if none."""
    return _target(c, HF_TYPES, "HF")


def gguf_architecture(c: ModelConfig) -> str:
    """`general.architecture` for `c` (llama, qwen2, qwen3); ExportError if none."""
    return _target(c, GGUF_ARCHITECTURES, "GGUF")
