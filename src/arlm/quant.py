"""Weight-only int8 quantization for decode.

Decode reads every weight once per step, so its speed is bytes of weights / memory bandwidth:
int8 weights (1 byte + a float scale per output row) move 4x fewer bytes than float32. Activations
stay float32 and the matmul accumulates in float32 (`arlm.kernels.int8_linear`), so the only
error is the rounding of each weight to 1/127 of its row's largest magnitude.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from . import kernels
from .model import Transformer


class Int8Linear(nn.Module):
    """y = x @ (scale[:, None] * w).T + bias, with w int8 [out, in] and scale float32 [out]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        """Symmetric per-output-channel quantization of a float weight [out, in]."""
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        layer = cls(w.shape[1], w.shape[0], bias is not None).to(weight.device)
        layer.weight.copy_(q)
        layer.scale.copy_(scale)
        if bias is not None:
            layer.bias.data.copy_(bias.detach().float())
        return layer

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = kernels.int8_linear(x.reshape(-1, self.in_features).float(), self.weight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def quantize_int8(model: Transformer) -> Transformer:
    """Replace every nn.Linear (attention, MLP, LM head) with Int8Linear, in place.

    A tied LM head gets its own int8 copy of the embedding; the embedding table stays float for
    the lookup (it is gathered, one row per token, not streamed).
    """
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear.from_float(child.weight, child.bias))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes one decode step streams for weights (every parameter and buffer but the embedding
    table, whose rows are gathered, and the RoPE tables)."""
    total = 0
    seen: set[int] = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("tok_emb") or name.startswith("pos_emb") or "rope" in name or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    if getattr(model.config, "tie_embeddings", False) and isinstance(model.lm_head, nn.Linear):
        total += model.tok_emb.weight.numel() * model.tok_emb.weight.element_size()
    return total
