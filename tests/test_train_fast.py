"""The fused LM head + cross-entropy (arlm.train.loss) against the plain path it replaces.

References and tolerances, on fresh random inputs each run (seeded from the clock, printed on failure):
- float32: loss and both gradients against F.cross_entropy over the full float64 logits: 1e-5
  relative (the chunks sum in another order; float32 rounding only);
- bf16 autocast: against the plain path under the same autocast (full bf16 logits, cast to float32):
  the loss within 1e-5; the gradients no further from float64 (on the same bf16-rounded
  operands) than the plain path's are, x1.25 (both round the softmax's gradient to bf16 for the
  products; the weight's is summed over chunks in float32 where the plain path rounds the whole
  sum to bf16 once);
- targets of -100 take no part (as F.cross_entropy's ignore_index), and evaluation (no grad) gives
  the same loss.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from arlm.train.loss import IGNORE_INDEX, linear_cross_entropy, reference_cross_entropy


def random_case(seed: int, N: int = 300, d: int = 48, V: int = 1000, ignored: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, d, generator=g)
    weight = torch.randn(V, d, generator=g) / d ** 0.5 * 3  # logits O(3): a softmax far from uniform
    targets = torch.randint(0, V, (N,), generator=g)
    if ignored:
        targets[torch.randperm(N, generator=g)[:ignored]] = IGNORE_INDEX
    return hidden, weight, targets


def loss_and_grads(fn, hidden, weight, targets, dtype=None, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = fn(h, w, targets, **kw)
    (loss * 0.5).backward()  # a grad_output other than 1 (grad_accum divides the loss)
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_rows", [64, 77, 300, 4096])
@pytest.mark.parametrize("ignored", [0, 40])
def test_chunked_loss_equals_cross_entropy_float32(chunk_rows, ignored, backend):
    seed = time.time_ns() % 2**31
    hidden, weight, targets = random_case(seed, ignored=ignored)
    loss, gh, gw = loss_and_grads(linear_cross_entropy, hidden, weight, targets, chunk_rows=chunk_rows)
    ref_loss, ref_gh, ref_gw = loss_and_grads(
        lambda h, w, t: F.cross_entropy((h.double() @ w.double().T), t, ignore_index=IGNORE_INDEX),
        hidden, weight, targets)
    assert loss.dtype == torch.float32
    msg = f"seed {seed}"
    torch.testing.assert_close(loss, ref_loss.float(), rtol=1e-5, atol=0, msg=msg)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-5, atol=1e-7, msg=msg)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-5, atol=1e-7, msg=msg)
    assert gh[targets == IGNORE_INDEX].abs().max().item() == 0.0 if ignored else True


@pytest.mark.parametrize("chunk_rows", [100, 300])
def test_chunked_loss_equals_cross_entropy_bf16_autocast(chunk_rows, backend):
    seed = time.time_ns() % 2**31
    hidden, weight, targets = random_case(seed)
    loss, gh, gw = loss_and_grads(linear_cross_entropy, hidden, weight, targets, torch.bfloat16, chunk_rows=chunk_rows)
    ref_loss, ref_gh, ref_gw = loss_and_grads(reference_cross_entropy, hidden, weight, targets, torch.bfloat16)
    msg = f"seed {seed}"
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0, msg=msg)
    assert gh.dtype == gw.dtype == torch.float32
    # The truth: float64 from the same bf16-rounded operands. Both paths round their products to
    # bf16; the chunked one may be no further from it than the plain one (x1.25, and 1e-7).
    _, true_gh, true_gw = loss_and_grads(
        lambda h, w, t: F.cross_entropy(h.bfloat16().double() @ w.bfloat16().double().T, t), hidden, weight, targets)
    for ours, plain, truth in ((gh, ref_gh, true_gh), (gw, ref_gw, true_gw)):
        err, plain_err = (ours - truth).abs().max().item(), (plain - truth).abs().max().item()
        assert err <= 1.25 * plain_err + 1e-7, (msg, err, plain_err)
        assert plain_err < 0.02 * truth.abs().max().item(), msg  # (both near the truth at all)


def test_only_the_gradients_wanted_are_taken_and_no_grad_gives_the_loss(backend):
    hidden, weight, targets = random_case(1, ignored=10)
    ref = reference_cross_entropy(hidden, weight, targets)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, targets, chunk_rows=64), ref)
    h = hidden.clone().requires_grad_()  # a frozen head (LoRA): no weight gradient is made
    linear_cross_entropy(h, weight, targets, chunk_rows=64).backward()
    h_ref = hidden.clone().requires_grad_()
    reference_cross_entropy(h_ref, weight, targets).backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=1e-7)
    assert weight.grad is None


# -- RMSNorm and RoPE with hand-written backward passes (arlm.fused) ---------------------------------

@pytest.fixture(params=["torch", "native"])
def backend(request, monkeypatch):
    """arlm.fused's torch Functions, or kernels/train.cpp's passes (where they are built)."""
    from arlm import kernels

    if request.param == "torch":
        monkeypatch.setattr(kernels, "train_kernels_available", lambda: False)
    elif not kernels.train_kernels_available():
        pytest.skip("the native training kernels are not built here")
    return request.param


def test_fused_rms_norm_equals_autograd_through_the_pieces(backend):
    """Forward: the inference path's values (exactly for the torch Function, to float32 rounding
    natively: its sum of squares adds in another order); backward: float64 autograd within 1e-5."""
    from arlm.fused import plain_rms_norm, rms_norm

    seed = time.time_ns() % 2**31
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 7, 600, generator=g) * 3  # (a width that leaves a vector tail)
    w = 1 + 0.3 * torch.randn(600, generator=g)
    go = torch.randn(3, 7, 600, generator=g)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = rms_norm(xa, wa, 1e-5)
    y.backward(go)
    msg = f"seed {seed}"
    if backend == "torch":
        assert torch.equal(y, plain_rms_norm(x, w, 1e-5)), msg
    else:
        torch.testing.assert_close(y, plain_rms_norm(x, w, 1e-5), rtol=1e-6, atol=1e-6, msg=msg)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    plain_rms_norm(xr, wr, 1e-5).backward(go.double())
    torch.testing.assert_close(xa.grad, xr.grad.float(), rtol=1e-5, atol=1e-6, msg=msg)
    torch.testing.assert_close(wa.grad, wr.grad.float(), rtol=1e-5, atol=1e-5, msg=msg)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the output in autocast's dtype: the same values, rounded
        yb = rms_norm(x.clone().requires_grad_(), w, 1e-5)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), y.detach().bfloat16().float(), rtol=2 ** -8, atol=0, msg=msg)
    xb = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rms_norm(xb, w, 1e-5).backward(go.bfloat16())  # a bf16 gradient arriving: float32 out
    assert xb.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_equals_apply_rope(dtype, backend):
    """Forward: apply_rope's values (exactly for the torch Function; natively within one rounding
    of the dtype); backward: float64 autograd through apply_rope. q/k as the model passes them: a
    strided view of the fused projection."""
    from arlm.fused import rope
    from arlm.model import apply_rope, rope_table

    seed = time.time_ns() % 2**31
    g = torch.Generator().manual_seed(seed)
    B, T, H, d = 2, 9, 3, 80  # (half = 40: a vector and a tail)
    cos, sin = rope_table(d, T, 10000.0)
    cos, sin = cos[None, :, None].expand(B, T, 1, d), sin[None, :, None].expand(B, T, 1, d)
    x = torch.randn(B, T, H + 2, d, generator=g).to(dtype)[:, :, :H]
    go = torch.randn(B, T, H, d, generator=g).to(dtype)
    xa = x.clone().requires_grad_()
    y = rope(xa, cos, sin)
    y.backward(go)
    msg = f"seed {seed}"
    if backend == "torch":
        assert torch.equal(y, apply_rope(x, cos, sin)), msg
    else:
        one = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
        torch.testing.assert_close(y, apply_rope(x, cos, sin), msg=msg, **one)
    xr = x.double().requires_grad_()
    apply_rope(xr, cos.double(), sin.double()).backward(go.double())
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-2)
    torch.testing.assert_close(xa.grad, xr.grad.to(dtype), msg=msg, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_cross_entropy_gradient_equals_the_torch_passes(dtype, monkeypatch):
    """kernels/train.cpp's in-place softmax gradient against the torch ops it replaces: the loss
    within 1e-5 (sums in another order), the gradient within 1e-5 relative in float32 (the row sum
    it divides by is summed in another order) and one rounding in bf16."""
    from arlm import kernels
    from arlm.train.loss import softmax_xent_

    if not kernels.train_kernels_available():
        pytest.skip("the native training kernels are not built here")
    seed = time.time_ns() % 2**31
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(37, 1003, generator=g) * 4).to(dtype)  # (a width that leaves a vector tail)
    targets = torch.randint(0, 1003, (37,), generator=g)
    scale = torch.rand(37, generator=g)
    loss, grad = softmax_xent_(logits.clone(), targets, scale)
    monkeypatch.setattr(kernels, "train_kernels_available", lambda: False)
    ref_loss, ref_grad = softmax_xent_(logits.clone(), targets, scale)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    rtol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps  # (bf16: one rounding apart at most)
    torch.testing.assert_close(grad.float(), ref_grad.to(dtype).float(), rtol=rtol, atol=1e-7, msg=f"seed {seed}")


def test_native_swiglu_equals_torchs_ops():
    """silu(gate) * up over bf16 (the autocast path) and its backward, natively, against torch's
    ops on the same bf16 values: within two bf16 roundings (each side rounds after the silu and
    after the product; sigmoid's float32 formula differs in its last bits)."""
    from arlm import kernels
    from arlm.fused import swiglu

    if not kernels.train_kernels_available():
        pytest.skip("the native training kernels are not built here")
    seed = time.time_ns() % 2**31
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(2, 5, 2 * 200, generator=g) * 3).bfloat16()  # (F = 200: vectors and a tail)
    go = torch.randn(2, 5, 200, generator=g).bfloat16()
    a = gate_up.clone().requires_grad_()
    out = swiglu(a)
    out.backward(go)
    b = gate_up.clone().requires_grad_()
    gate, up = b.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    ref.backward(go)
    msg = f"seed {seed}"
    assert out.grad_fn is not None and "Native" in type(out.grad_fn).__name__
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-3, msg=msg)
    torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=2 ** -6, atol=1e-2, msg=msg)
