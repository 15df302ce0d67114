"""Training's optimizer: AdamW, and AdamW over bf16 shadow weights.

Under bf16 autocast every step casts each float32 matrix to bf16 for the forward pass (autocast's
cast), and casts each bf16 weight gradient the products give back to float32 (the cast's backward),
before clipping and AdamW read them: two passes over every weight a step that change nothing
(benchmarks/train_speed.py --profile: 8.5% of a context-256 step of SmolLM2-135M on CPU).

`ShadowAdamW` keeps a bf16 copy of each trained matrix beside its float32 master (`layer.shadow`,
the "shadow"), which the forward pass multiplies with instead (`arlm.model.compute_weight`), and
writes it itself: its step is one native pass per parameter (kernels/train.cpp, `adamw_`) that
reads the gradient, updates the master and the moments, and writes the new bf16 copy. The block
matrices' shadows are autograd leaves: their gradients arrive in bf16 straight from the products
and the step reads them there. The values are autocast's: the shadow is the master rounded to
nearest even (autocast's cast), a bf16 gradient widened to float32 is exact, and the step is torch's
fused AdamW's arithmetic on the clipped gradient (tests/test_train_fast.py). Other parameters (the
norms, the embedding and a tied head, which take float32 gradients) take the same pass without a
gradient shadow; the LM head's shadow is a compute copy its float32 gradient does not go through
(arlm.train.loss). Frozen matrices (LoRA's bases) get a copy made once.

Where it does not apply, the trainer uses `AdamW` (torch's, with the same clipping method): other
devices or dtypes, several processes (DDP and FSDP reduce the masters' gradients), gradient
accumulation (bf16 gradients would accumulate in bf16), torch.compile, no native kernels.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class AdamW(torch.optim.AdamW):
    """torch's AdamW with the trainer's clipping as a method (the interface ShadowAdamW shares)."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global norm is at most max_norm (clip_grad_norm_)."""
        return torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], max_norm)


class ShadowAdamW(AdamW):
    """AdamW over float32 masters that writes the bf16 copies the forward pass uses (module doc).

    Its state is torch's AdamW's (per parameter `step` float32 scalar, `exp_avg`, `exp_avg_sq`,
    float32; the same param_groups), so a checkpoint from either optimizer resumes in the other.
    """

    def __init__(self, model: nn.Module, groups: list[dict], **kwargs) -> None:
        super().__init__(groups, **kwargs)
        self.grad_shadows = attach_shadows(model)  # master -> its bf16 leaf (the block matrices)
        emb, head = getattr(model, "tok_emb", None), getattr(model, "lm_head", None)
        if emb is not None and head is not None and emb.weight is head.weight and emb.weight.requires_grad:
            # A tied embedding's gradient as its rows (sparse) instead of a dense [V, d] zero-fill
            # and add: the head's dense gradient joins it, so the sum the step reads is dense.
            emb.sparse = True
        self.copies = {id(p): s for p, s in _compute_copies(model)}  # id(master) -> bf16 copy to rewrite
        self._grad_scale = 1.0

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        shadow = self.grad_shadows.get(p)
        return shadow.grad if shadow is not None else p.grad

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """clip_grad_norm_'s norm and coefficient (norms in float32, bf16 gradients included); the
        multiply is left to the step, which scales each gradient as it reads it."""
        grads = [g for group in self.param_groups for p in group["params"] if (g := self._grad(p)) is not None]
        if not grads:
            return torch.zeros(())
        # (each tensor's norm natively: torch's, asked for float32, first widens every bf16 gradient)
        total = torch.linalg.vector_norm(torch.ops.arlm_train.norms(grads))
        self._grad_scale = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "ShadowAdamW takes no closure"
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                grad = self._grad(p)
                if grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                shadow = self.grad_shadows.get(p)
                shadow = shadow if shadow is not None else self.copies.get(id(p))
                torch.ops.arlm_train.adamw_(p, grad, state["exp_avg"], state["exp_avg_sq"], state["step"],
                                            None if shadow is None else shadow.detach(), float(group["lr"]),
                                            beta1, beta2, group["weight_decay"], group["eps"], self._grad_scale)
        self._grad_scale = 1.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for shadow in self.grad_shadows.values():
            shadow.grad = None


def _linears(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.dtype == torch.float32
            and m.weight.is_contiguous()]


def attach_shadows(model: nn.Module) -> dict[torch.Tensor, torch.Tensor]:
    """Give each float32 Linear of `model` a bf16 `shadow` of its weight; return {master: shadow}
    for those whose gradient goes through the shadow (trained plain Linears; not the LM head, whose
    float32 gradient the fused loss takes itself, nor frozen weights, whose copy never changes)."""
    head = getattr(model, "lm_head", None)
    through = {}
    for layer in _linears(model):
        w = layer.weight
        shadow = w.detach().to(torch.bfloat16)
        if w.requires_grad and type(layer) is nn.Linear and layer is not head:
            shadow.requires_grad_()
            through[w] = shadow
        layer.shadow = shadow
    return through


def _compute_copies(model: nn.Module):
    """(master, shadow) of the trained weights whose shadow is a copy only (the LM head)."""
    return [(m.weight, m.shadow) for m in _linears(model)
            if getattr(m, "shadow", None) is not None and not m.shadow.requires_grad and m.weight.requires_grad]


def detach_shadows(model: nn.Module) -> None:
    """Remove the shadows (the model multiplies with its float32 weights under autocast again)."""
    for m in model.modules():
        m.__dict__.pop("shadow", None)
