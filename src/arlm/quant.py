"""Weight-only quantization for decode: int8 per output channel, and 4-bit in groups of 32.

Decode reads every weight once per step, so its speed is bytes of weights / memory bandwidth:
int8 weights (1 byte + a float scale per output row) move 4x fewer bytes than float32, 4-bit ones
(Q4_1's layout: a float16 scale and min per 32 weights) 6.4x fewer. Activations stay float32 and
the matmuls accumulate in float32 (`arlm.kernels`), so the only error is the weights' rounding.

With activations="int8" (the default for decode), each layer also quantizes its input to 8 bits
per group of 32, as llama.cpp does, and the kernels multiply in integers (one VNNI instruction per
32 weights): 4-bit decode then runs at memory speed instead of being bound by widening every
weight to float. The extra error is measured with the rest (perplexity, tests/test_quant.py).
On CPUs with AVX-512 VNNI the layers also keep their weights in the kernels' packed layout (16
output channels to a vector, `arlm.kernels.pack_int8` / `pack_q4`), which multiplies several rows
2-3x faster than the row layout: batched decode and serving. The row layout stays beside it (the
state dict, `dequantize`, float-activation kernels): the quantized bytes are held twice (~95 MB
for SmolLM2-135M), while a decode step reads only the packed copy.

`quantize(model, "auto")` keeps that error where it already is: a matrix whose values are exactly
4-bit grouped values (a model that came from a Q4_1 GGUF, like SmolLM2's) goes to 4-bit without
any loss; every other matrix goes to int8.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import kernels
from .model import Transformer


_mode = threading.local()


@contextmanager
def dense_weights():
    """Inside this block, quantized layers multiply with their original float weights.

    Prefill runs hundreds of rows against each weight: compute-bound, where the float GEMM is
    fastest and the bytes saved by quantization do not matter. Decode (a row per sequence) stays
    on the quantized kernels. The engine's prompt tokens use it (arlm.engine.runner).
    """
    previous = getattr(_mode, "dense", False)
    _mode.dense = True
    try:
        yield
    finally:
        _mode.dense = previous


def _dense_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    if getattr(_mode, "dense", False) and layer.dense_weight is not None:
        w = layer.dense_weight  # float32, or a bfloat16 copy where bf16 GEMMs are faster (quantize)
        y = F.linear(x.to(w.dtype), w).to(x.dtype)
        return y if layer.bias is None else y + layer.bias
    return None


class Int8Linear(nn.Module):
    """y = x @ (scale[:, None] * w).T + bias, with w int8 [out, in] and scale float32 [out]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.dense_weight: torch.Tensor | None = None  # the float original, for prefill (see dense_weights)
        self.int8_activations = False  # quantize x per group of 32 and multiply in integers
        self.packed: torch.Tensor | None = None  # weight in pack_int8's layout (see pack)

    def pack(self) -> None:
        """Keep a copy of the weight in the packed kernels' layout, where they are built and the
        shape allows (out_features % 16 == 0, in_features % 32 == 0); call again after changing
        the weight. Used with int8 activations."""
        if (self.out_features % 16 == 0 and self.in_features % 32 == 0 and self.weight.device.type == "cpu"
                and kernels.packed_available()):
            self.packed = kernels.pack_int8(self.weight)

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
        if (y := _dense_forward(self, x)) is not None:
            return y
        x2 = x.reshape(-1, self.in_features).float()
        if self.int8_activations and self.packed is not None and x2.device.type == "cpu":
            y = kernels.int8_linear_a8p(x2, self.packed, self.scale)
        elif self.int8_activations and self.in_features % 32 == 0:
            y = kernels.int8_linear_a8(x2, self.weight, self.scale)
        else:
            y = kernels.int8_linear(x2, self.weight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        acts = "int8" if self.int8_activations else "float32"
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, {acts} activations"


class Q4Linear(nn.Module):
    """y = x @ W.T + bias, W[n, k] = scale[n, k // 32] * q[n, k] + mins[n, k // 32], q in 0..15."""

    GROUP = 32

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        if in_features % self.GROUP:
            raise ValueError(f"4-bit layers need in_features divisible by {self.GROUP}, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        groups = in_features // self.GROUP
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scale", torch.zeros(out_features, groups, dtype=torch.float16))
        self.register_buffer("mins", torch.zeros(out_features, groups, dtype=torch.float16))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.dense_weight: torch.Tensor | None = None  # the float original, for prefill (see dense_weights)
        self.int8_activations = False  # quantize x per group of 32 and multiply in integers
        self.packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # pack_q4's layout

    def pack(self) -> None:
        """As `Int8Linear.pack`: (weight, scale, mins) in the packed kernels' layout."""
        if self.out_features % 16 == 0 and self.weight.device.type == "cpu" and kernels.packed_available():
            self.packed = kernels.pack_q4(self.weight, self.scale, self.mins)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Q4Linear":
        """Asymmetric 4-bit quantization per group of 32 (Q4_1): min and (max - min) / 15."""
        w = weight.detach().float()
        N, K = w.shape
        layer = cls(K, N, bias is not None).to(weight.device)
        g = w.view(N, K // cls.GROUP, cls.GROUP)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        scale = ((hi - lo) / 15).half()
        mins = lo.half()
        step = scale.float().clamp_min(1e-30)[..., None]
        q = torch.round((g - mins.float()[..., None]) / step).clamp_(0, 15).to(torch.uint8)  # [N, G, 32]
        layer.weight.copy_((q[..., :16] | (q[..., 16:] << 4)).view(N, K // 2))
        layer.scale.copy_(scale)
        layer.mins.copy_(mins)
        if bias is not None:
            layer.bias.data.copy_(bias.detach().float())
        return layer

    def dequantize(self) -> torch.Tensor:
        return kernels.unpack_q4(self.weight, self.scale, self.mins)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (y := _dense_forward(self, x)) is not None:
            return y
        x2 = x.reshape(-1, self.in_features).float()
        if self.int8_activations and self.packed is not None and x2.device.type == "cpu":
            y = kernels.q4_linear_a8p(x2, *self.packed)
        else:
            op = kernels.q4_linear_a8 if self.int8_activations else kernels.q4_linear
            y = op(x2, self.weight, self.scale, self.mins)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        acts = "int8" if self.int8_activations else "float32"
        return f"in_features={self.in_features}, out_features={self.out_features}, 4-bit groups of 32, {acts} activations"


def quantize(model: Transformer, mode: str = "auto", keep_dense: bool = True,
             activations: str = "int8", prefill_dtype: torch.dtype | None = None) -> Transformer:
    """Replace every nn.Linear (attention, MLP, LM head) with a quantized layer, in place.

    mode "int8": all int8. "q4": 4-bit where in_features allows, else int8. "auto": 4-bit for
    matrices that 4-bit represents exactly (the round trip changes no weight by more than 1e-6 of
    its largest), int8 for the rest. A tied LM head gets its own copy; the embedding table stays
    float for the lookup (it is gathered one row per token, not streamed). keep_dense keeps each
    layer's float weight beside it for prefill (`dense_weights`): more memory, faster prefill.
    activations: "int8" (integer-dot kernels, faster) or "float32" (weight-only, exact products).
    prefill_dtype: None keeps the float weight itself for prefill; torch.bfloat16 keeps a bf16
    copy instead (half the memory; on CPUs with AVX512-BF16 or AMX, GEMMs ~2.4x faster than
    float32, with float32 accumulation), `LLM.configure`'s choice where the CPU has them.
    """
    if mode not in ("auto", "int8", "q4"):
        raise ValueError(f"unknown quantization {mode!r} (expected auto, int8 or q4)")
    if activations not in ("int8", "float32"):
        raise ValueError(f"unknown activation precision {activations!r} (expected int8 or float32)")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            layer: nn.Module = Int8Linear.from_float(child.weight, child.bias)
            if mode != "int8" and child.in_features % Q4Linear.GROUP == 0:
                q4 = Q4Linear.from_float(child.weight, child.bias)
                err = (q4.dequantize() - child.weight.detach().float()).abs().max()
                if mode == "q4" or err <= 1e-6 * child.weight.detach().abs().max():
                    layer = q4
            layer.int8_activations = activations == "int8"
            if layer.int8_activations:
                layer.pack()
            if keep_dense:
                dense = child.weight.detach()  # shared with the float model, no copy
                layer.dense_weight = dense if prefill_dtype in (None, dense.dtype) else dense.to(prefill_dtype)
            setattr(module, name, layer)
    return model


def quantize_int8(model: Transformer) -> Transformer:
    """All nn.Linear layers to int8 (see `quantize`)."""
    return quantize(model, "int8")


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
