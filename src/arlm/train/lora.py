"""Low-rank adapters (LoRA): fine-tune r x d matrices beside frozen weights, then merge them in.

A targeted projection W [out, in] computes W x + (alpha / r) * B (A x), with A [r, in] random
(Kaiming-uniform, as nn.Linear's own init) and B [out, r] zero, so the adapted model starts out
as the base model exactly. Only A and B train: the base weights have requires_grad False, get no
gradients and no optimizer state. `merge` folds W + (alpha / r) * B A into the weights and leaves
a plain `Transformer`.

arlm fuses q, k and v into one projection (`attn.wqkv`) and gate and up into another
(`mlp.gate_up`); each of those parts gets an adapter of its own (PEFT's q_proj, k_proj, ...),
over its rows of the fused output.

In a checkpoint the adapted model's state dict holds the base weights under their usual names and
each adapter as `<projection>.lora_A.<part>` / `<projection>.lora_B.<part>`; arlm.json records
`"lora": {"rank", "alpha", "targets"}`. `read_checkpoint` merges them on load (generation, export);
training's resume keeps them apart (`split_state`, `load_adapters`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ConfigError, ModelConfig
from ..model import compute_weight
from .config import LORA_TARGETS as TARGETS


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


def parse_targets(targets: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    names = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else list(targets)
    bad = [t for t in names if t not in TARGETS]
    if bad or not names:
        raise ConfigError(f"lora_targets: {', '.join(bad) or '(none)'} not among {', '.join(TARGETS)}")
    return tuple(t for t in TARGETS if t in names)  # a fixed order, whatever the spelling


class LoRALinear(nn.Linear):
    """A frozen nn.Linear with an adapter on some of its output parts (see the module's doc)."""

    def __init__(self, base: nn.Linear, parts: dict[str, slice], rank: int, alpha: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same tensors: nothing copied
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.parts, self.rank, self.scale = dict(parts), rank, alpha / rank
        device = base.weight.device
        self.lora_A = nn.ParameterDict({n: nn.Parameter(torch.empty(rank, self.in_features, device=device))
                                        for n in parts})
        self.lora_B = nn.ParameterDict({n: nn.Parameter(torch.zeros(s.stop - s.start, rank, device=device))
                                        for n, s in parts.items()})
        for a in self.lora_A.values():
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # nn.Linear's init (and PEFT's for A)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All parts' adapters as one pair: A [P*r, in] (the parts' A stacked) and B [out, P*r]
        (each part's B in its own rows and its own r columns, zero elsewhere), scaled, so that
        B @ A holds each part's scale * B_p A_p in its rows."""
        names = list(self.parts)
        A = torch.cat([self.lora_A[n] for n in names]) if len(names) > 1 else self.lora_A[names[0]]
        if len(names) == 1 and self.parts[names[0]] == slice(0, self.out_features):
            return A, self.lora_B[names[0]] * self.scale
        B = A.new_zeros(self.out_features, len(names) * self.rank)
        for i, n in enumerate(names):
            B[self.parts[n], i * self.rank:(i + 1) * self.rank] = self.lora_B[n] * self.scale
        return A, B

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # W x + B (A x): two thin products for all the parts at once (a fused projection's parts
        # through B's block structure), one add.
        A, B = self.stacked()
        shadow = compute_weight(self, x)  # (the frozen weight's bf16 copy under autocast, made once)
        return F.linear(x, self.weight if shadow is None else shadow, self.bias) + F.linear(F.linear(x, A), B)

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """A plain nn.Linear holding W + scale * B A (a new weight tensor: W itself is not changed)."""
        layer = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                          device=self.weight.device, dtype=self.weight.dtype)
        weight = self.weight.detach().clone()
        for name, rows in self.parts.items():
            weight[rows] += (self.scale * (self.lora_B[name].float() @ self.lora_A[name].float())).to(weight.dtype)
        layer.weight = nn.Parameter(weight)
        if self.bias is not None:
            layer.bias = nn.Parameter(self.bias.detach().clone())
        return layer


def apply(model: nn.Module, rank: int, alpha: float | None = None,
          targets: str | list[str] | tuple[str, ...] = TARGETS) -> nn.Module:
    """Freeze every weight of `model` (an arlm Transformer) and add rank-`rank` adapters to the
    `targets` projections of every block that it has, in place; alpha defaults to 2 * rank.
    Returns the model."""
    if rank <= 0:
        raise ConfigError(f"lora_rank must be positive, got {rank}")
    alpha = float(2 * rank if alpha is None else alpha)
    present = {n for parts in projections(model.config).values() for n in parts}
    chosen = tuple(t for t in parse_targets(targets) if t in present)  # (GPT-2's MLP has no gate)
    if not chosen:
        raise ConfigError(f"lora_targets: this model has no projection {targets!r} (it has {', '.join(sorted(present))})")
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.blocks:
        for path, parts in projections(model.config).items():
            wanted = {n: s for n, s in parts.items() if n in chosen}
            if not wanted:
                continue
            owner, attr = block.get_submodule(path.rsplit(".", 1)[0]), path.rsplit(".", 1)[1]
            setattr(owner, attr, LoRALinear(getattr(owner, attr), wanted, rank, alpha))
    model.lora = {"rank": rank, "alpha": alpha, "targets": list(chosen)}
    return model


def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight (W + alpha / r * B A): `model` becomes a plain Transformer
    (in place, and returned) whose logits equal the adapted model's to float32 rounding."""
    for block in model.blocks:
        for path in projections(model.config):
            owner, attr = block.get_submodule(path.rsplit(".", 1)[0]), path.rsplit(".", 1)[1]
            layer = getattr(owner, attr)
            if isinstance(layer, LoRALinear):
                setattr(owner, attr, layer.merged())
    if hasattr(model, "lora"):
        del model.lora
    return model


def checkpoint_meta(model: nn.Module) -> dict:
    """What arlm.json records of the adapters (nothing for a model without any)."""
    return {"lora": dict(model.lora)} if getattr(model, "lora", None) else {}


def is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def split_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint's state dict -> (base weights, adapters)."""
    base = {k: v for k, v in state.items() if not is_adapter_key(k)}
    return base, {k: v for k, v in state.items() if is_adapter_key(k)}


def load_adapters(model: nn.Module, adapters: dict[str, torch.Tensor]) -> None:
    """Set the adapters of an `apply`-ed model from a checkpoint's (every one, shapes checked)."""
    own = {k: v for k, v in model.state_dict().items() if is_adapter_key(k)}
    if own.keys() != adapters.keys():
        missing, unexpected = sorted(own.keys() - adapters.keys()), sorted(adapters.keys() - own.keys())
        raise ConfigError(f"the checkpoint's adapters do not match: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        for k, v in adapters.items():
            own[k].copy_(v)


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
