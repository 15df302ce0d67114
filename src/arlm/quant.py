"""Quantized weights for decode: the file's own blocks (4-bit Q4_1, 8-bit Q8_0; on AVX-512 VNNI
or AVX2 CPUs 5-bit Q5_0 and the K-quants Q4_K, Q5_K, Q6_K), or int8 per row.

Decode reads every weight once per step, so its speed is bytes of weights / memory bandwidth:
int8 weights move 4x fewer bytes than float32, 4-bit ones (Q4_1: a float16 scale and min per 32
weights) 6.4x fewer. A GGUF file's Q4_1 and Q8_0 tensors are loaded as they are stored
(`arlm.loading.gguf`, no float32 copy and no second rounding): `Q4Linear`, `Q8Linear`, on the
packed kernels `Q5Linear` and `KQuantLinear` (a fused weight of mixed kinds in parts:
`SplitLinear`), and for a tied model the token embedding gathered from the head's rows
(`QuantizedEmbedding`).

With 8-bit activations each layer also quantizes its input per group of 32, as llama.cpp does,
and the kernels multiply in integers (one VNNI instruction per 32 weights): 4-bit decode then runs
at memory speed instead of being bound by widening every weight to float. By default the input
is taken twice ("int8x2", `prepare`): 16 bits split into two bytes on the packed (AVX-512 VNNI or
AVX2) kernels, 8 bits and then 8 more for what the first pass rounded away on the row kernels, which
leaves the next-token distributions within 1e-5 KL of float32 (`arlm perplexity
--kl-divergence`, docs/benchmarks.md).
On CPUs with AVX-512 VNNI or AVX2 the layers hold their weights in the kernels' packed layout instead of
the row layout (16 output channels to a vector, `arlm.kernels.pack_int8` / `pack_q4`), which
multiplies several rows 2-3x faster: batched decode and serving. One copy either way.

`quantize(model, "auto")` does the same from a float model (HF directories, checkpoints, tests):
a matrix whose values are exactly Q4_1 or Q8_0 values goes to that layout without any loss;
every other matrix goes to int8 per row.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import kernels
from .model import Transformer
from .settings import ACTIVATIONS, DEFAULT_ACTIVATIONS


class QuantizedLinear(nn.Module, ABC):
    """What the quantized layers share: y = x @ W.T + bias with W held quantized, in one layout at
    a time: the row layout (one output row after another, as the file stores it) or, after
    `pack()`, the packed kernels' layout (16 output channels to a vector, AVX-512 VNNI or AVX2 CPUs, 8-bit
    activations). One copy of the matrix either way; `rows()` gives the row layout back when it is
    needed (dequantizing, the embedding's gather, the float-activation kernels)."""

    GROUP = 32
    weight: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.dense_weight: torch.Tensor | None = None  # a float copy for prefill (forward's dense)
        self._a8 = False
        # With 8-bit activations: take them twice (16 bits split into two bytes on the packed
        # kernels; the first pass's rounding error quantized again on the row kernels), ~15-16 bits
        # for ~2x the integer products and one pass over the weights (prepare).
        self.residual_activations = False
        self.allow_packed = True  # False: the row layout even where the packed kernels are built (prepare)

    @property
    def int8_activations(self) -> bool:
        """Quantize x per group of 32 and multiply in integers. Setting it also sets the layout:
        packed where the packed kernels take the layer (8-bit activations only), else rows."""
        return self._a8

    @int8_activations.setter
    def int8_activations(self, on: bool) -> None:
        self._a8 = bool(on)
        if self._a8 and self.can_pack():
            self.pack()
        else:
            self.unpack()

    @property
    def packed(self) -> bool:
        return self.weight.dim() == 3

    def can_pack(self) -> bool:
        return (self.allow_packed and self.out_features % 16 == 0 and self.in_features % 32 == 0
                and self.weight.device.type == "cpu" and kernels.packed_available())

    def pack(self) -> None:
        """To the packed kernels' layout, where they are built and the shape allows
        (out_features % 16 == 0, in_features % 32 == 0). With int8 activations only."""
        if self._a8 and not self.packed and self.can_pack():
            self._set(*self._pack(self.tensors()))

    def unpack(self) -> None:
        if self.packed:
            self._set(*self.rows())

    FIELDS: tuple[str, ...] = ("weight", "scale")  # the buffers that hold the matrix, in the kernels' order

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The weight as the kernels take it, in its current layout: (weight, scale[, mins])."""
        return tuple(getattr(self, name) for name in self.FIELDS)

    def _set(self, *tensors: torch.Tensor) -> None:
        for name, t in zip(self.FIELDS, tensors, strict=True):
            setattr(self, name, t)

    def _copy_bias(self, bias: torch.Tensor | None) -> None:
        if bias is not None:
            self.bias.data.copy_(bias.detach().float())

    @abstractmethod
    def rows(self) -> tuple[torch.Tensor, ...]:
        """The weight in the row layout (a fresh copy where it is packed)."""

    @abstractmethod
    def dequantize_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Float32 rows `index` [T] of W: [T, in_features] (an embedding table's gather)."""

    def dequantize(self) -> torch.Tensor:
        return self.dequantize_rows(torch.arange(self.out_features, device=self.weight.device))

    @abstractmethod
    def _pack(self, rows: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The row layout's tensors -> the packed layout's."""

    @abstractmethod
    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> x W^T [M, N] float32, on the kernel for the layer's layout."""

    def forward(self, x: torch.Tensor, dense: bool = False) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features]. dense: multiply with the float copy
        (`dense_weight`) where the layer keeps one - prompt tokens: hundreds of rows against each
        weight are compute-bound, where the float GEMM is fastest and the bytes quantization
        saves do not matter (`Transformer.forward(dense=True)`, arlm.engine.runner) - else
        with the quantized weights, as decode does."""
        if dense and self.dense_weight is not None:
            return self._dense_forward(x)
        x2 = x.reshape(-1, self.in_features).float()
        if not (self.residual_activations and self._a8 and self.in_features % 32 == 0):
            y = self._matmul(x2)
        elif self.packed:
            y = kernels.linear_a8p_residual(x2, *self.tensors())
        else:  # each row and its residual as two rows of x, then their products added
            M = x2.shape[0]
            pairs = torch.stack([x2, x2 - kernels.dequantized_activations(x2)], 1).view(2 * M, -1)
            y = self._matmul(pairs).view(M, 2, -1).sum(1)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def _dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.dense_weight  # float32, or a bfloat16 copy where bf16 GEMMs are faster (quantize)
        if w.dim() == 3:  # bf16_linear's layout: float32 results
            y = kernels.bf16_linear(x.reshape(-1, x.shape[-1]).float(), w).view(*x.shape[:-1], -1).to(x.dtype)
        else:
            y = F.linear(x.to(w.dtype), w).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        acts = "int8" if self.int8_activations else "float32"
        layout = "packed" if self.packed else "rows"
        return f"in_features={self.in_features}, out_features={self.out_features}, {acts} activations, {layout}"


def _packed_rows(wp: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Output rows `index` [T] of a packed weight [N/16, C, 64] (16 channels by 4 bytes): [T, C, 4]."""
    NB, C, _ = wp.shape
    return wp.view(NB, C, 16, 4)[index // 16, :, index % 16, :]


class Int8Linear(QuantizedLinear):
    """y = x @ (scale[:, None] * w).T + bias, with w int8 [out, in] and scale float32 [out]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32))

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        """Symmetric per-output-channel quantization of a float weight [out, in]."""
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        layer = cls(w.shape[1], w.shape[0], bias is not None).to(weight.device)
        layer.weight.copy_(q)
        layer.scale.copy_(scale)
        layer._copy_bias(bias)
        return layer

    def _pack(self, rows):
        return kernels.pack_int8(rows[0]), rows[1]

    def rows(self):
        return (kernels.unpack_int8(self.weight) if self.packed else self.weight), self.scale

    def dequantize_rows(self, index):
        q = (_packed_rows(self.weight, index).reshape(len(index), -1) ^ 0x80).view(torch.int8) \
            if self.packed else self.weight[index]
        return q.float() * self.scale[index, None]

    def _matmul(self, x):
        if self.packed:  # packed implies int8 activations (pack)
            return kernels.int8_linear_a8p(x, self.weight, self.scale)
        if self.int8_activations and self.in_features % 32 == 0:
            return kernels.int8_linear_a8(x, self.weight, self.scale)
        return kernels.int8_linear(x, self.weight, self.scale)


class Q8Linear(QuantizedLinear):
    """Q8_0, as a GGUF file stores it: W[n, k] = scale[n, k // 32] * w[n, k], w int8 [out, in],
    scale float16 [out, in / 32]. A scale per 32 weights, not per row: what a Q8_0 tensor (SmolLM2's
    token embedding and tied head) holds, kept as it is. In the row layout the scale may also be
    float32 [out, in / 32] or [out, in / 16] (`from_q6_k`: a Q6_K matrix's values exactly, where
    the packed kernels are not built)."""

    @classmethod
    def from_q6_k(cls, q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> "Q8Linear":
        """Q6_K's fields (`loading.gguf_blocks.k_quant_fields`: q int8 [N, K] -32..31, sc int8 [N, K/16],
        d float32 [N, K/256]) as int8 rows with a float32 scale d sc per 16, exact (an 11-bit
        float16 times a 7-bit integer): gguf's values, bit for bit. 10 bits a weight (the file's 6.6)."""
        N, K = q.shape
        with torch.device("meta"):
            layer = cls(K, N)
        layer._set(q.contiguous(), (d.repeat_interleave(16, dim=1) * sc.float()).contiguous())
        return layer

    def can_pack(self) -> bool:
        return self.scale.dtype == torch.float16 and super().can_pack()

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)
        if in_features % self.GROUP:
            raise ValueError(f"Q8_0 layers need in_features divisible by {self.GROUP}, got {in_features}")
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.zeros(out_features, in_features // self.GROUP, dtype=torch.float16))

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Q8Linear":
        """Q8_0 quantization (llama.cpp's): per group of 32, d = max|w| / 127 as float16,
        q = round(w / d). Values that already are Q8_0 come back unchanged."""
        w = weight.detach().float()
        N, K = w.shape
        g = w.view(N, K // cls.GROUP, cls.GROUP)
        d = (g.abs().amax(dim=-1) / 127).half()
        inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
        layer = cls(K, N, bias is not None).to(weight.device)
        layer.weight.copy_(torch.round(g * inv[..., None]).clamp_(-127, 127).to(torch.int8).view(N, K))
        layer.scale.copy_(d)
        layer._copy_bias(bias)
        return layer

    def _pack(self, rows):
        return kernels.pack_int8(rows[0]), kernels.pack_scales(rows[1])

    def rows(self):
        if not self.packed:
            return self.weight, self.scale
        return kernels.unpack_int8(self.weight), kernels.unpack_scales(self.scale)

    def dequantize_rows(self, index):
        T, K = len(index), self.in_features
        if self.packed:  # (natively: an embedding's lookup, each decode step)
            return kernels.packed_rows(self.weight, self.scale, torch.empty(0), index, K)
        q, d = self.weight[index], self.scale[index]
        return (q.float().view(T, d.shape[1], -1) * d.float()[..., None]).view(T, K)

    def _matmul(self, x):
        if self.packed:
            return kernels.int8_linear_a8p(x, self.weight, self.scale)
        if self.int8_activations:
            return kernels.int8_linear_a8(x, self.weight, self.scale)
        return kernels.int8_linear(x, self.weight, self.scale)


class Q8MinsLinear(Q8Linear):
    """Int8 codes with a float32 scale and a float32 minimum per group of 32, in the row layout:
    W[n, k] = scale[n, k // 32] w[n, k] + mins[n, k // 32]. A Q5_K matrix (`from_q5_k`: codes
    0..31, d sc and -dmin m) where the packed kernels are not built: gguf's values exactly, 10 bits
    a weight (the file's 5.5). The minimum's term is the group sums of the activations the codes
    multiply (8-bit ones: their dequantized values) times mins (decode.cpp's `linear_into` alike)."""

    FIELDS = ("weight", "scale", "mins")

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)
        self.scale = torch.zeros(out_features, in_features // self.GROUP, dtype=torch.float32)
        self.register_buffer("mins", torch.zeros(out_features, in_features // self.GROUP, dtype=torch.float32))

    @classmethod
    def from_q5_k(cls, q: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor,
                  dmin: torch.Tensor) -> "Q8MinsLinear":
        """Q5_K's fields (`loading.gguf_blocks.k_quant_fields`: q uint8 [N, K] 0..31, sc and m uint8
        [N, K/32], d and dmin float32 [N, K/256]); gguf's d sc q - dmin m bit for bit (d sc q is
        exact in float32)."""
        N, K = q.shape
        with torch.device("meta"):
            layer = cls(K, N)
        layer._set(q.to(torch.int8).contiguous(), (d.repeat_interleave(8, dim=1) * sc.float()).contiguous(),
                   (-(dmin.repeat_interleave(8, dim=1) * m.float())).contiguous())
        return layer

    def can_pack(self) -> bool:
        return False

    def rows(self):
        return self.tensors()

    def dequantize_rows(self, index):
        T, K = len(index), self.in_features
        q, d, m = self.weight[index].float().view(T, -1, self.GROUP), self.scale[index], self.mins[index]
        return (q * d[..., None] + m[..., None]).view(T, K)

    def _matmul(self, x):
        a = kernels.dequantized_activations(x) if self.int8_activations else x
        sums = a.view(x.shape[0], -1, self.GROUP).sum(-1)
        # row by row (a matrix-vector product each): a row's result does not depend on its batch
        return super()._matmul(x) + torch.stack([self.mins @ s for s in sums])


class Q4Linear(QuantizedLinear):
    """y = x @ W.T + bias, W[n, k] = scale[n, k // 32] * q[n, k] + mins[n, k // 32], q in 0..15
    (Q4_1's blocks: byte j of a group holds q[j] in its low nibble and q[16 + j] in its high)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)
        if in_features % self.GROUP:
            raise ValueError(f"4-bit layers need in_features divisible by {self.GROUP}, got {in_features}")
        groups = in_features // self.GROUP
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scale", torch.zeros(out_features, groups, dtype=torch.float16))
        self.register_buffer("mins", torch.zeros(out_features, groups, dtype=torch.float16))

    FIELDS = ("weight", "scale", "mins")

    def can_pack(self) -> bool:
        return (self.allow_packed and self.out_features % 16 == 0 and self.weight.device.type == "cpu"
                and self.scale.dtype == torch.float16 and kernels.packed_available())

    @classmethod
    def from_q4_k(cls, q: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor,
                  dmin: torch.Tensor) -> "Q4Linear":
        """Q4_K's fields (`loading.gguf_blocks.k_quant_fields`: q uint8 [N, K] 0..15, sc and m uint8
        [N, K/32], d and dmin float32 [N, K/256]) in the row layout with float32 scale d sc and
        mins -dmin m per group of 32, exact: gguf's values, bit for bit (its d sc q - dmin m; d sc
        q is exact in float32). 6 bits a weight (the file's 4.5), where the packed kernels are
        not built."""
        N, K = q.shape
        g = q.view(N, K // cls.GROUP, cls.GROUP)
        with torch.device("meta"):
            layer = cls(K, N)
        layer._set((g[..., :16] | (g[..., 16:] << 4)).reshape(N, K // 2).contiguous(),
                   (d.repeat_interleave(8, dim=1) * sc.float()).contiguous(),
                   (-(dmin.repeat_interleave(8, dim=1) * m.float())).contiguous())
        return layer

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
        layer._copy_bias(bias)
        return layer

    # A Q4_0 file's matrix (loading.gguf): mins = -8 scale, which the packed layout does not store
    # (its kernels take m = -8 d: the file's 4.5 bits a weight); the row layout holds them.
    q4_0 = False

    def _pack(self, rows):
        wp, scale, mins = kernels.pack_q4(*rows)
        return wp, scale, torch.empty(0, dtype=torch.float16) if self.q4_0 else mins

    def rows(self):
        if not self.packed:
            return self.tensors()
        w, scale, mins = kernels.unpack_packed_q4(*self.tensors())
        if mins.numel():
            return w, scale, mins
        self.q4_0 = True  # (one loaded packed, from the cache)
        return w, scale, (scale.float() * -8).half()

    def dequantize_rows(self, index):
        T, K = len(index), self.in_features
        if self.packed:
            b = _packed_rows(self.weight, index)  # [T, K/8, 4]: q[8p + t] low, q[8p + 4 + t] high
            q = torch.stack([b & 0x0F, b >> 4], dim=2).view(T, K)
            d = self.scale[index // 16, :, index % 16]
            m = self.mins[index // 16, :, index % 16] if self.mins.numel() else (d.float() * -8).half()
            return (q.float().view(T, -1, self.GROUP) * d.float()[..., None] + m.float()[..., None]).view(T, K)
        return kernels.unpack_q4(self.weight[index], self.scale[index], self.mins[index])

    def _matmul(self, x):
        if self.packed:
            return kernels.q4_linear_a8p(x, self.weight, self.scale, self.mins)
        op = kernels.q4_linear_a8 if self.int8_activations else kernels.q4_linear
        return op(x, self.weight, self.scale, self.mins)


class PackedOnlyLinear(QuantizedLinear):
    """A layer whose matrix has one layout, the packed kernels' (AVX-512 VNNI or AVX2, 8-bit
    activations), where a file's block type has no row-layout kernel: the loader makes these only
    where the packed kernels are built. With float32 activations, or where the kernels are not
    built, it multiplies by its dequantized matrix (slow: every call dequantizes it)."""

    packed_only = True  # (kernels.llama: the layer stack takes it only packed, with 8-bit activations)

    @property
    def packed(self) -> bool:
        return kernels.packed_available()  # its one layout, where the kernels that read it exist

    def pack(self) -> None:
        pass

    def unpack(self) -> None:
        pass

    def rows(self):
        return self.tensors()

    def _pack(self, rows):
        return rows

    def _matmul(self, x):
        if self._a8 and kernels.packed_available():
            return self._packed_matmul(x)
        return F.linear(x, self.dequantize())

    @abstractmethod
    def _packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> [M, N] on the packed kernel, 8-bit activations."""


class Q5Linear(PackedOnlyLinear):
    """GGUF's Q5_0: 5-bit weights per group of 32, W[n, k] = scale[n, k // 32] (q[n, k] - 16), q in
    0..31, in `kernels.pack_q5`'s layout [N/16, K/8, 80] with scale float16 [N/16, K/32, 16] and
    no mins (the kernels take -16 scale, exact): the file's 5.5 bits a weight, its values bit for
    bit as gguf dequantizes them."""

    FIELDS = ("weight", "scale", "mins")

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)
        if in_features % self.GROUP or out_features % 16:
            raise ValueError("5-bit layers need in_features divisible by 32 and out_features by 16")
        NB, G = out_features // 16, in_features // self.GROUP
        self.register_buffer("weight", torch.zeros(NB, in_features // 8, 80, dtype=torch.uint8))
        self.register_buffer("scale", torch.zeros(NB, G, 16, dtype=torch.float16))
        self.register_buffer("mins", torch.zeros(0, dtype=torch.float16))  # (none: -16 scale)

    def dequantize_rows(self, index):
        T, K = len(index), self.in_features
        q = kernels.unpack_q5_rows(self.weight, index).view(T, -1, self.GROUP).float()
        d = self.scale[index // 16, :, index % 16].float()
        return (q * d[..., None] + (d * -16)[..., None]).view(T, K)

    def _packed_matmul(self, x):
        return kernels.q4_linear_a8p(x, *self.tensors())


class KQuantLinear(PackedOnlyLinear):
    """A GGUF K-quant matrix (Q4_K, Q5_K or Q6_K: super-blocks of 256 weights) in the packed
    kernels' layout (a8_linear.cpp, `kernels.pack_q4_k` / `pack_q6_k`): the file's values with
    their own scales, not rounded again, in the file's bytes (Q4_K 4.5 bits a weight, Q5_K 5.5,
    Q6_K 6.5625: the 6-bit sc and m as the file holds them, 12 bytes a super-block, `pack_kscales`).

    Q4_K, Q5_K: W[n, k] = d[n, k // 256] sc[n, k // 32] q[n, k] - dmin[n, k // 256] m[n, k // 32];
    Q6_K: W[n, k] = d[n, k // 256] sc[n, k // 16] q[n, k] (gguf's dequantization, bit for bit:
    `dequantize`)."""

    FIELDS = ("weight", "scale", "supers")
    KINDS = ("Q4_K", "Q5_K", "Q6_K")

    def __init__(self, kind: str, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)
        if kind not in self.KINDS:
            raise ValueError(f"unknown K-quant kind {kind!r} (expected {', '.join(self.KINDS)})")
        if in_features % 256 or out_features % 16:
            raise ValueError(f"{kind} layers need in_features divisible by 256 and out_features by 16")
        self.kind = kind
        NB, G, S = out_features // 16, in_features // 32, in_features // 256
        q6 = kind == "Q6_K"
        chunk = {"Q4_K": 64, "Q5_K": 80, "Q6_K": 96}[kind]  # bytes per 8 K-values of 16 channels
        self.register_buffer("weight", torch.zeros(NB, in_features // 8, chunk, dtype=torch.uint8))
        self.register_buffer("scale", torch.zeros(NB, 2 * G, 16, dtype=torch.int8) if q6
                             else torch.zeros(NB, S, 192, dtype=torch.uint8))
        self.register_buffer("supers", torch.zeros(NB, S, 16 if q6 else 32, dtype=torch.float16))

    def dequantize_rows(self, index):
        T, K = len(index), self.in_features
        b, lane = index // 16, index % 16
        if self.kind == "Q5_K":  # (Q4_K and Q6_K natively: kernels.packed_rows)
            q = kernels.unpack_q5_rows(self.weight, index).view(T, K // 32, 32).float()
            sc, m = (t.float() for t in kernels.kscale_rows(self.scale[b], lane))  # [T, K/32]
            d, dmin = (self.supers[b, :, lane + o].float().repeat_interleave(8, dim=1) for o in (0, 16))
            return ((d * sc)[..., None] * q - (dmin * m)[..., None]).view(T, K)
        return kernels.packed_rows(self.weight, self.scale, self.supers, index, K)

    def _packed_matmul(self, x):
        return kernels.kquant_linear_a8p(x, *self.tensors())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.kind}"


class SplitLinear(nn.Module):
    """A fused projection (q/k/v, gate/up) whose parts a file stores in different block types
    (Q4_K_M's Q6_K attn_v beside Q4_K q and k): each part its own quantized layer, as stored, their
    outputs side by side, then the fused bias (Qwen 2's). The native layer stack takes the parts
    as they are (kernels.layout.LayerWeight's WK, WV, UP); prompt tokens take the quantized parts
    too (no dense copies for prefill's GEMMs on the bf16 / float32 matrix paths)."""

    def __init__(self, parts: list[nn.Module], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor, dense: bool = False) -> torch.Tensor:
        y = torch.cat([p(x, dense=dense) for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


class QuantizedEmbedding(nn.Module):
    """A token embedding gathered from a quantized matrix's rows, dequantized as they are looked
    up: the tied LM head's own weights (one copy of the matrix for both), or a table of its own."""

    def __init__(self, table: QuantizedLinear) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table.dequantize_rows(idx.reshape(-1)).view(*idx.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of {type(self.table).__name__}"


def _exact(layer: QuantizedLinear, weight: torch.Tensor) -> bool:
    """The quantized layer represents `weight` without loss (to 1e-6 of its largest value)."""
    return bool((layer.dequantize() - weight.detach().float()).abs().max() <= 1e-6 * weight.detach().abs().max())




def prepare(model: Transformer, activations: str = DEFAULT_ACTIVATIONS, keep_dense: bool = False,
            prefill_dtype: torch.dtype | None = None, packed: bool = True) -> Transformer:
    """Set every quantized layer's activation precision and layout, and its dense copy for prefill.

    activations, the measured choice per layer type (docs/benchmarks.md, "Fidelity"):
    - "int8x2": every linear takes its input as 8 bits twice (`residual_activations`: 16 bits
      split into two bytes on the packed kernels, the first pass's rounding error quantized
      again on the row kernels): ~15-16-bit activations, next-token
      distributions within 1e-5 KL of float32 (the answers float32 gives); batch-1 decode as
      fast as "int8", batched decode ~1.3x and prefill ~1.5x slower on a Zen 4 CPU
      (docs/benchmarks.md, "Prefill against the machine's matrix peak");
    - "int8": one 8-bit pass (llama.cpp's choice), except the LM head, which takes two: it
      removes ~30% of the single pass's KL divergence for no measurable time;
    - "float32": weight-only quantization, float activations (the row-layout kernels: slow).
    The integer paths use the packed layout where it is built (and `packed`; False: the row
    layout, the AVX2 kernels, on every CPU: `--matmul-path avx2`). keep_dense: a float copy of each
    weight for prefill's GEMMs (`QuantizedLinear.forward(dense=True)`), in prefill_dtype (default float32) - made from
    the quantized values, or shared with a float original the caller set as `dense_weight`.
    """
    if activations not in ACTIVATIONS:
        raise ValueError(f"unknown activation precision {activations!r} (expected {', '.join(ACTIVATIONS)})")
    head = getattr(model, "lm_head", None)
    # a SplitLinear's parts keep no dense copy: its prompt tokens take the quantized parts
    parts = {id(p) for m in model.modules() if isinstance(m, SplitLinear) for p in m.parts}
    for layer in model.modules():
        if not isinstance(layer, QuantizedLinear):
            continue
        layer.allow_packed = packed
        layer.int8_activations = activations != "float32"  # and the layout with it
        layer.residual_activations = activations == "int8x2" or (activations == "int8" and layer is head)
        if not keep_dense or id(layer) in parts:
            layer.dense_weight = None
            continue
        dtype = prefill_dtype or torch.float32
        dense = layer.dense_weight if layer.dense_weight is not None else layer.dequantize()
        if dense.dim() == 3:  # bf16_linear's layout, from an earlier prepare
            dense = kernels.unpack_bf16(dense)
        dense = dense if dense.dtype == dtype else dense.to(dtype)
        if dtype == torch.bfloat16 and dense.shape[0] % 16 == 0 and dense.shape[1] % 2 == 0 \
                and dense.device.type == "cpu" and kernels.bf16_kernel_wanted():
            dense = kernels.pack_bf16(dense)  # float32 results (bf16_linear.cpp)
        layer.dense_weight = dense
    return model


def quantize(model: Transformer, mode: str = "auto", keep_dense: bool = True,
             activations: str = DEFAULT_ACTIVATIONS, prefill_dtype: torch.dtype | None = None,
             packed: bool = True) -> Transformer:
    """Replace every nn.Linear of a float model (attention, MLP, LM head) with a quantized layer,
    in place.

    mode "int8": all int8 per output row. "q4": 4-bit where in_features allows, else int8.
    "auto": no new rounding where the weights allow it: 4-bit for matrices that are exactly 4-bit
    grouped values (a Q4_1 file's), Q8_0 for those that are exactly Q8_0 values (a Q8_0 file's),
    int8 per row for the rest. A tied LM head gets its own copy; the embedding table stays float
    for the lookup. keep_dense keeps each layer's float weight beside it for prefill
    (`QuantizedLinear.forward(dense=True)`), shared with the float model (no copy) or as a prefill_dtype copy (bf16:
    half the memory; on CPUs with AVX512-BF16 or AMX, GEMMs ~2.4x faster than float32).
    activations: see `prepare`. A model loaded quantized from its file (`arlm.loading`) needs none of this: `prepare` only.
    """
    if mode not in ("auto", "int8", "q4"):
        raise ValueError(f"unknown quantization {mode!r} (expected auto, int8 or q4)")
    if activations not in ACTIVATIONS:
        raise ValueError(f"unknown activation precision {activations!r} (expected {', '.join(ACTIVATIONS)})")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            layer: QuantizedLinear = Int8Linear.from_float(child.weight, child.bias)
            if child.in_features % QuantizedLinear.GROUP == 0:
                if mode == "q4":
                    layer = Q4Linear.from_float(child.weight, child.bias)
                elif mode == "auto":
                    for cls in (Q4Linear, Q8Linear):
                        candidate = cls.from_float(child.weight, child.bias)
                        if _exact(candidate, child.weight):
                            layer = candidate
                            break
            if keep_dense:
                layer.dense_weight = child.weight.detach()  # shared with the float model, no copy
            setattr(module, name, layer)
    return prepare(model, activations, keep_dense, prefill_dtype, packed)


def quantize_int8(model: Transformer) -> Transformer:
    """All nn.Linear layers to int8 (see `quantize`)."""
    return quantize(model, "int8")


def weight_bytes(model: nn.Module) -> int:
    """Bytes one decode step streams for weights (every parameter and buffer but the embedding
    table, whose rows are gathered, and the RoPE tables)."""
    total = 0
    seen: set[int] = set()
    # A head tied to a quantized embedding (QuantizedEmbedding) holds the table: it is streamed.
    head = {id(t) for t in list(model.lm_head.parameters()) + list(model.lm_head.buffers())}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if (name.startswith("tok_emb") and id(t) not in head) or name.startswith("pos_emb") or "rope" in name \
                or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    if getattr(model.config, "tie_embeddings", False) and isinstance(model.lm_head, nn.Linear) \
            and id(model.tok_emb.weight) not in seen:
        total += model.tok_emb.weight.numel() * model.tok_emb.weight.element_size()
    return total
