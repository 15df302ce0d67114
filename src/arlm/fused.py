"""Training's RMSNorm, RoPE and SwiGLU as autograd Functions with hand-written backward passes.

Autograd differentiates `F.rms_norm` through its pieces (pow, mean, add, rsqrt, two products, the
dtype casts): ~30 operator calls a norm, forward and backward, each a pass over the activations.
The backward of RMSNorm has a closed form, and so has RoPE's (a rotation: its transpose rotates
back), so each is a handful of passes here. On a CPU a training step is hundreds of such small
passes a layer, and on a shared machine each costs a wait for both threads besides its memory
traffic: fewer is faster either way (benchmarks/train_speed.py).

The forward passes compute what the model's inference path computes (`RMSNorm.forward`,
`apply_rope`): operation for operation in the torch versions, to float32 rounding (sums in another
order) in the native ones (kernels/train.cpp: each direction one pass through memory), which serve
where they are built. The model takes them where gradients are wanted.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None


def native(x: torch.Tensor) -> bool:
    """kernels/train.cpp's passes serve `x` (a CPU tensor, where they are built; not under
    torch.compile, which fuses the torch versions itself and cannot trace the native ops)."""
    from . import kernels  # (deferred: the model module imports this one)

    return x.device.type == "cpu" and not torch.compiler.is_compiling() and kernels.train_kernels_available()


class NativeRMSNorm(torch.autograd.Function):
    """RMSNormFunction's arithmetic in one pass each way (kernels/train.cpp)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
        y, rstd = torch.ops.arlm_train.rms_norm(x, weight, eps, out_dtype == torch.bfloat16)
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        dx, dw = torch.ops.arlm_train.rms_norm_backward(grad, x, rstd, weight)
        return dx, dw if ctx.needs_input_grad[1] else None, None, None


class NativeRope(torch.autograd.Function):
    """RopeFunction's arithmetic in one pass each way (kernels/train.cpp)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return torch.ops.arlm_train.rope(x, cos, sin, False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return torch.ops.arlm_train.rope(grad, cos, sin, True), None, None


class RMSNormFunction(torch.autograd.Function):
    """y = w * (x / rms(x)), in float32 (x is float32: the residual stream), then in `out_dtype`.

    Backward, with n = x / rms(x) and g the incoming gradient:
        dw = sum over rows of g * n
        dx = (g * w - n * mean(g * w * n)) / rms(x)
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))  # [..., 1]
        normed = x * rstd
        ctx.save_for_backward(normed, rstd, weight)
        return (weight * normed).to(out_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        normed, rstd, weight = ctx.saved_tensors
        grad = grad.float()
        gw = grad * weight
        dot = (gw * normed).mean(-1, keepdim=True)
        dx = gw.sub_(normed * dot).mul_(rstd)
        dw = (grad * normed).flatten(0, -2).sum(0) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of a float32 x [..., d] for training. Under autocast the output is already in
    autocast's dtype (the projection it feeds would cast it so), otherwise float32."""
    out_dtype = autocast_dtype(x) or x.dtype
    if out_dtype in (torch.bfloat16, torch.float32) and native(x):
        return NativeRMSNorm.apply(x, weight, eps, out_dtype)
    return RMSNormFunction.apply(x, weight, eps, out_dtype)


class NativeAddRMSNorm(torch.autograd.Function):
    """(x + h, rms_norm(x + h)) in one native pass each way (kernels/train.cpp): the backward pass
    adds the residual stream's gradient to the norm's and writes the branch's in h's dtype, where
    autograd would add the two and cast."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype):
        s, y, rstd = torch.ops.arlm_train.add_rms_norm(x, h, weight, eps, out_dtype == torch.bfloat16)
        ctx.save_for_backward(s, rstd, weight)
        ctx.h_bf16 = h.dtype == torch.bfloat16
        return s, y

    @staticmethod
    def backward(ctx, gs: torch.Tensor, gy: torch.Tensor):
        s, rstd, weight = ctx.saved_tensors
        dx, dh, dw = torch.ops.arlm_train.add_rms_norm_backward(gs, gy, s, rstd, weight, ctx.h_bf16)
        return dx, dh, dw if ctx.needs_input_grad[2] else None, None, None


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + h, RMSNorm of it) for training, x float32 (the residual stream), h bf16 or float32
    (a branch's output): the native pass where it serves, else None (the caller adds, then norms).
    The norm's output is `rms_norm`'s: in autocast's dtype under autocast, else float32."""
    out_dtype = autocast_dtype(x) or x.dtype
    if x.dtype == torch.float32 and h.dtype in (torch.bfloat16, torch.float32) and h.shape == x.shape \
            and out_dtype in (torch.bfloat16, torch.float32) and torch.is_grad_enabled() \
            and (x.requires_grad or h.requires_grad or weight.requires_grad) and native(x):
        return NativeAddRMSNorm.apply(x, h, weight, eps, out_dtype)
    return None


def rope_sin_signed(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) * sin == roll(x, d/2) * this."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


class RopeFunction(torch.autograd.Function):
    """y = x * cos + rotate_half(x) * sin, in float32, cast back to x's dtype.

    rotate_half(x) = cat(-x2, x1) = roll(x, d/2) * s with s = (-1 .. -1, 1 .. 1), so y is a
    rotation R x; its gradient is R^T g = g * cos + roll(g * sin * s, d/2) (rolling by half the
    length is its own inverse).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin_signed)
        xf = x.float()
        return (xf * cos).add_(xf.roll(x.shape[-1] // 2, -1) * sin_signed).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin_signed = ctx.saved_tensors
        gf = grad.float()
        return (gf * cos).add_((gf * sin_signed).roll(grad.shape[-1] // 2, -1)).to(grad.dtype), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE for training: x [B, T, H, d]; cos, sin [B, T, 1, d] float32."""
    if x.dtype in (torch.bfloat16, torch.float32) and x.stride(-1) == 1 and native(x):
        return NativeRope.apply(x, cos, sin)
    return RopeFunction.apply(x, cos, rope_sin_signed(sin))


class NativeQKVRope(torch.autograd.Function):
    """q, k, v out of the fused q/k/v projection, q and k rotated, in one pass each way
    (kernels/train.cpp): the backward pass writes the projection's gradient directly, where split,
    rope and cat would take a rope pass and two cats."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv_heads: int):
        ctx.save_for_backward(cos, sin)
        return torch.ops.arlm_train.rope_qkv(qkv, cos, sin, n_head, n_kv_heads)

    @staticmethod
    def backward(ctx, gq: torch.Tensor | None, gk: torch.Tensor | None, gv: torch.Tensor | None):
        cos, sin = ctx.saved_tensors  # (an unused output's gradient arrives as zeros: materialized)
        return torch.ops.arlm_train.rope_qkv_backward(gq, gk, gv, cos, sin), None, None, None, None


def qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int,
             n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q [B, T, n_head, d], k, v [B, T, n_kv_heads, d]) from qkv [B, T, n_head + 2 n_kv_heads, d]
    with q and k rotated (cos, sin [B, T, 1, d] float32): the native pass where it serves (training
    on CPU, bf16 or float32), else None (the caller splits and rotates)."""
    if qkv.dtype in (torch.bfloat16, torch.float32) and qkv.stride(-1) == 1 and torch.is_grad_enabled() \
            and qkv.requires_grad and native(qkv):
        return NativeQKVRope.apply(qkv, cos, sin, n_head, n_kv_heads)
    return None


class NativeSwiGLU(torch.autograd.Function):
    """silu(gate) * up over the fused gate/up projection's output (bf16), one pass each way
    (kernels/train.cpp); its backward writes the fused projection's gradient directly (no cat)."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        return torch.ops.arlm_train.swiglu(gate_up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        return torch.ops.arlm_train.swiglu_backward(grad, gate_up)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2F] (the halves): natively for bf16 where it is built and
    gradients are wanted, else torch's ops (the same roundings)."""
    if gate_up.dtype == torch.bfloat16 and torch.is_grad_enabled() and gate_up.requires_grad and native(gate_up):
        return NativeSwiGLU.apply(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class NativeCausalAttention(torch.autograd.Function):
    """Causal attention: torch's CPU flash forward (which gives each query's log-sum-exp), and the
    backward pass in kernels/train_attention.cpp (torch's flash backward takes 5-9x its forward).
    start: each query's first readable key ([B, T] int32; None: 0), with `additive` the same mask as
    the forward kernel takes it ([B, 1, T, T], 0 or -inf)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor | None,
                additive: torch.Tensor | None) -> torch.Tensor:
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = flash(q, k, v, 0.0, True) if start is None else flash(q, k, v, 0.0, False, attn_mask=additive)
        ctx.save_for_backward(q, k, v, out, lse, start)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse, start = ctx.saved_tensors
        if grad.stride(-1) != 1 or grad.stride(2) % 2:  # (a sum's expanded ones; a slice of a wider one)
            grad = grad.contiguous()
        dq, dk, dv = torch.ops.arlm_train.attention_backward(q, k, v, out, grad, lse, start, q.shape[-1] ** -0.5)
        return dq, dk, dv, None, None


_ranges: tuple = (None, None, None)  # (weakref to the last mask, its start, its additive form)


def _key_ranges(mask: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a mask [B, 1, T, T] (True: the query reads the key) in which every query reads one run of
    keys ending at itself (causal; a packed row's documents; a sliding window): (start [B, T] int32,
    the first key each query reads; the mask as 0 / -inf in `dtype`), else None. Kept for the last
    mask seen: a forward pass hands every layer the same one (a mask changed in place after its first
    use is not seen again)."""
    global _ranges
    ref, start, additive = _ranges
    if ref is not None and ref() is mask and additive.dtype == dtype:
        return start, additive
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != mask.shape[3] \
            or mask.shape[3] == 0:
        return None
    visible = mask[:, 0]
    T = visible.shape[-1]
    first = visible.int().argmax(dim=-1)  # [B, T]: the first key each query reads
    keys = torch.arange(T, device=mask.device)
    if not torch.equal(visible, (keys >= first[..., None]) & (keys <= keys[:, None])):
        return None
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    start = first.to(torch.int32).contiguous()
    _ranges = (weakref.ref(mask), start, additive)
    return start, additive


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """softmax(q k^T / sqrt(d), causal) v for q [B, H, T, d], k and v [B, H_kv, T, d] (H a multiple
    of H_kv), within `mask` ([B, 1, T, T] bool) where given, with the native backward pass where it
    serves (training on a CPU with AVX512-BF16, bf16 q/k/v, d a multiple of 32 up to 128, a mask
    whose every query reads one run of keys ending at itself), else None (the caller runs SDPA)."""
    d = q.shape[-1]
    if not (q.dtype == k.dtype == v.dtype == torch.bfloat16 and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad)
            and d % 32 == 0 and d <= 128 and q.shape[1] % k.shape[1] == 0
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and q.stride(2) % 2 == 0 and native(q)):
        return None
    from . import kernels

    if not kernels.attention_backward_supported():
        return None
    if mask is None:
        return NativeCausalAttention.apply(q, k, v, None, None)
    if mask.shape[0] != q.shape[0]:  # (one mask for the whole batch: SDPA broadcasts it)
        return None
    ranges = _key_ranges(mask, q.dtype)
    return None if ranges is None else NativeCausalAttention.apply(q, k, v, *ranges)


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The autograd-through-the-pieces reference (tests)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
