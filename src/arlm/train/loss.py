"""The training loss: the LM head and next-token cross-entropy in one pass, a chunk of rows at a time.

The plain way (`F.cross_entropy(model(idx).flatten(0, 1), targets)`) holds the [N, V] logits
(N = B * T rows, V = 49,152 for SmolLM2) several times over: the head's product, its float32
copy, log_softmax's output, and in the backward pass the gradient of each: at N = 4,096 that is
~0.8 GB apiece, each written and read back once a step. `linear_cross_entropy` holds one chunk's
logits, in the product's dtype (bf16 under autocast), and nothing else of that size. For each
chunk of rows it multiplies the chunk's logits, then turns them in place into the loss's gradient
with respect to them, (softmax - one_hot) / n, taking each row's loss on the way (kernels/train.cpp:
a row read three times while it is in cache and written once; torch ops where that is not built),
and multiplies that back into the gradients of the hidden states and of the head's weight. The
backward pass only scales those by the incoming gradient (a scalar), so the head costs the plain
way's three matrix products and no recomputation (Liger-Kernel's fused linear cross-entropy;
torchtune's chunked loss recomputes instead).

The products are the plain path's: under autocast the same bf16 product of the same operands, the
softmax in float32, its gradient rounded to bf16 for the two backward products. The weight's
gradient is summed over chunks in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels

IGNORE_INDEX = -100  # a target that takes no part in the loss (F.cross_entropy's default)
CHUNK_BYTES = 1 << 29  # logits per chunk: 512 MB, 5,461 rows of a 49,152-token vocabulary in bf16


def default_chunk_rows(vocab_size: int, dtype: torch.dtype) -> int:
    return max(1, CHUNK_BYTES // (dtype.itemsize * vocab_size))


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype autocast would multiply in on `device` here (float32 outside autocast)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return torch.float32


def row_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logsumexp(logits) - logits[target] per row of logits [C, V] (float32 [C]); `logits` may be
    overwritten (the native kernel's pass writes a gradient over it, here scaled by zero)."""
    if logits.device.type == "cpu" and kernels.train_kernels_available():
        return torch.ops.arlm_train.softmax_xent_(logits, targets, torch.zeros(len(targets), device=logits.device))
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - logits.gather(1, targets[:, None]).squeeze(1)


def softmax_xent_(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of logits [C, V]: the loss logsumexp - logit[target] [C] (float32), and the loss's
    gradient (softmax - one_hot(target)) * scale [C, V], written over `logits` where the native
    kernel does it (kernels/train.cpp: one pass through memory), else in float32 torch ops (a
    pass each: the row max, exp(logits - max), the row sums, the scale, the target's -scale)."""
    if logits.device.type == "cpu" and kernels.train_kernels_available():
        return torch.ops.arlm_train.softmax_xent_(logits, targets, scale), logits
    peak = logits.amax(-1, keepdim=True).float()  # (exact in any dtype)
    p = torch.sub(logits, peak, out=torch.empty(logits.shape, device=logits.device)).exp_()
    total = p.sum(-1, keepdim=True)
    row_loss = (peak + total.log()).squeeze(1) - logits.gather(1, targets[:, None]).squeeze(1).float()
    grad = p.mul_(scale[:, None] / total)
    grad.scatter_add_(1, targets[:, None], -scale[:, None])
    return row_loss, grad


class LinearCrossEntropy(torch.autograd.Function):
    """mean over valid rows of cross_entropy(hidden @ weight.T, targets); see the module's doc."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk_rows: int, dtype: torch.dtype, weight_lowp: torch.Tensor | None) -> torch.Tensor:
        N = hidden.shape[0]
        valid = targets != IGNORE_INDEX
        safe_targets = targets.masked_fill(~valid, 0)
        valid_f = valid.float()
        n = valid_f.sum()
        h = hidden.to(dtype)  # the operands autocast would cast to, once
        w = weight_lowp if weight_lowp is not None and weight_lowp.dtype == dtype else weight.to(dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None  # [N, d], in the product's dtype
        grad_w = None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        scale = valid_f / n  # each valid row's share of the mean
        for start in range(0, N, chunk_rows):
            rows = slice(start, min(start + chunk_rows, N))
            logits = h[rows] @ w.T  # [C, V], in the product's dtype
            if not (need_h or need_w):
                loss += (row_losses(logits, safe_targets[rows]) * valid_f[rows]).sum()
                continue
            # d loss / d logits = (softmax - one_hot) * scale, over the logits in place
            row_loss, grad = softmax_xent_(logits, safe_targets[rows], scale[rows])
            loss += (row_loss * valid_f[rows]).sum()
            grad = grad.to(dtype)
            if need_h:
                torch.mm(grad, w, out=grad_h[rows])
            if need_w:  # (summed in float32 over the chunks)
                part = (grad.T @ h[rows]).float()
                grad_w = part if grad_w is None else grad_w.add_(part)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.hidden_dtype = hidden.dtype
        return loss / n

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        # The gradients were taken for d(loss) = 1; the caller's is a scalar (1 / grad_accum).
        one = grad_loss.item() == 1.0
        if grad_h is not None:
            grad_h = (grad_h if one else grad_h * grad_loss).to(ctx.hidden_dtype)
        if grad_w is not None and not one:
            grad_w = grad_w * grad_loss
        return grad_h, grad_w, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_rows: int | None = None, weight_lowp: torch.Tensor | None = None) -> torch.Tensor:
    """F.cross_entropy(hidden @ weight.T, targets) (mean over targets != IGNORE_INDEX) without the
    [N, V] logits: hidden [N, d], weight [V, d], targets [N] int64. Products in autocast's dtype
    where autocast is on (as a Linear layer's would be), float32 otherwise. A float32 scalar.
    weight_lowp: weight already in that dtype (a training shadow, arlm.train.optim), multiplied
    with instead of casting `weight`; the gradient still goes to `weight`, in float32."""
    dtype = compute_dtype(hidden.device)
    chunk_rows = chunk_rows or default_chunk_rows(weight.shape[0], dtype)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        with torch.autocast(hidden.device.type, enabled=False):  # (dtypes chosen above, by hand)
            return LinearCrossEntropy.apply(hidden, weight, targets, chunk_rows, dtype, weight_lowp)
    # no gradient wanted (evaluation): the loss alone, chunk by chunk
    valid = targets != IGNORE_INDEX
    safe_targets, valid_f = targets.masked_fill(~valid, 0), valid.float()
    h = hidden.to(dtype)
    w = weight_lowp if weight_lowp is not None and weight_lowp.dtype == dtype else weight.to(dtype)
    total = sum((row_losses(h[i:i + chunk_rows] @ w.T, safe_targets[i:i + chunk_rows]) * valid_f[i:i + chunk_rows]).sum()
                for i in range(0, hidden.shape[0], chunk_rows))
    return total / valid_f.sum()


def reference_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The plain path `linear_cross_entropy` replaces: full logits, then F.cross_entropy (tests, benchmarks)."""
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=IGNORE_INDEX)
