"""LoRA adapters as a checkpoint holds them (the adapters themselves: arlm.train.lora).

The adapted model's state dict holds the base weights under their usual names and each adapter
as `<projection>.lora_A.<part>` / `<projection>.lora_B.<part>`, a part being one of a fused
projection's outputs (q, k, v of `attn.wqkv`; gate, up of `mlp.gate_up`); arlm.json records
`"lora": {"rank", "alpha", "targets"}`. `read_checkpoint` merges them on load (generation,
export, `merge_state`); training's resume keeps them apart (`split_state`).
"""

from __future__ import annotations

import torch

from ..config import ModelConfig


def projections(config: ModelConfig) -> dict[str, dict[str, slice]]:
    """Each adaptable projection of a block (its name under `blocks.<i>.`) -> its parts' output rows."""
    H, H_kv, hd = config.n_head, config.n_kv_heads, config.head_dim
    q, kv = H * hd, H_kv * hd
    out = {"attn.wqkv": {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)},
           "attn.wo": {"o": slice(0, config.d_model)}}
    if config.mlp == "gelu":
        out["mlp.up"] = {"up": slice(0, config.d_ff)}
    else:
        out["mlp.gate_up"] = {"gate": slice(0, config.d_ff), "up": slice(config.d_ff, 2 * config.d_ff)}
    out["mlp.down"] = {"down": slice(0, config.d_model)}
    return out


def is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def split_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint's state dict -> (base weights, adapters)."""
    base = {k: v for k, v in state.items() if not is_adapter_key(k)}
    return base, {k: v for k, v in state.items() if is_adapter_key(k)}


def merge_state(state: dict[str, torch.Tensor], config: ModelConfig, lora: dict) -> dict[str, torch.Tensor]:
    """A checkpoint's state dict with adapters -> plain weights with them merged in (float32)."""
    base, adapters = split_state(state)
    scale = float(lora["alpha"]) / int(lora["rank"])
    out = dict(base)
    for i in range(config.n_layer):
        for path, parts in projections(config).items():
            key = f"blocks.{i}.{path}"
            for name, rows in parts.items():
                a, b = adapters.get(f"{key}.lora_A.{name}"), adapters.get(f"{key}.lora_B.{name}")
                if a is not None:
                    if out[f"{key}.weight"] is base[f"{key}.weight"]:  # (copied before the first change)
                        out[f"{key}.weight"] = base[f"{key}.weight"].float().clone()
                    out[f"{key}.weight"][rows] += scale * (b.float() @ a.float())
    return out
