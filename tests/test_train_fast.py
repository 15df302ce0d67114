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

import copy
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
    # bf16; the chunked one may be no further from it than the plain one (x1.25, and 1e-7), but
    # for the weight gradient it sums one bf16 product a chunk where the plain path rounds one
    # product of all rows: each extra chunk may add a bf16 unit roundoff (2^-8) of the largest
    # value (seeds 571614681 and 162 went 1.36x and 1.62x the plain error with 3 chunks).
    _, true_gh, true_gw = loss_and_grads(
        lambda h, w, t: F.cross_entropy(h.bfloat16().double() @ w.bfloat16().double().T, t), hidden, weight, targets)
    extra_chunks = -(-len(targets) // chunk_rows) - 1
    for ours, plain, truth, sums in ((gh, ref_gh, true_gh, False), (gw, ref_gw, true_gw, True)):
        err, plain_err = (ours - truth).abs().max().item(), (plain - truth).abs().max().item()
        rounding = extra_chunks * 2**-8 * truth.abs().max().item() if sums else 0.0
        assert err <= 1.25 * plain_err + rounding + 1e-7, (msg, err, plain_err)
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


def test_native_qkv_rope_equals_split_and_apply_rope():
    """q, k, v out of the fused projection in one native pass (q, k rotated) against split + apply_rope
    in float64, and its backward (one pass writing the projection's gradient) against float64 autograd
    through split + apply_rope: float32 within 1e-6 (one rounding of a rotation), bf16 within one bf16
    rounding (forward: rtol 2^-7; backward: the float64 truth rounded once, rtol 2^-7, atol 1e-2 near 0)."""
    from arlm import kernels
    from arlm.fused import qkv_rope
    from arlm.model import apply_rope, rope_table

    if not kernels.train_kernels_available():
        pytest.skip("the native training kernels are not built here")
    for dtype in (torch.float32, torch.bfloat16):
        seed = time.time_ns() % 2**31
        g = torch.Generator().manual_seed(seed)
        B, T, H, H_kv, d = 2, 9, 6, 2, 80  # (half = 40: a vector and a tail)
        cos, sin = rope_table(d, T, 10000.0)
        cos, sin = cos[None, :, None].expand(B, T, 1, d), sin[None, :, None].expand(B, T, 1, d)
        qkv = torch.randn(B, T, H + 2 * H_kv, d, generator=g).to(dtype)
        # the gradients as attention hands them back: [B, H, T, d] views of [B, T, H, d] memory
        grads = [torch.randn(B, T, h, d, generator=g).to(dtype).transpose(1, 2) for h in (H, H_kv, H_kv)]
        a = qkv.clone().requires_grad_()
        out = qkv_rope(a, cos, sin, H, H_kv)
        assert out is not None and "Native" in type(out[0].grad_fn).__name__
        torch.autograd.backward([t.transpose(1, 2) for t in out], grads)
        r = qkv.double().requires_grad_()
        rq, rk, rv = r.split([H, H_kv, H_kv], dim=2)
        ref = apply_rope(rq, cos.double(), sin.double()), apply_rope(rk, cos.double(), sin.double()), rv
        torch.autograd.backward([t.transpose(1, 2) for t in ref], [t.double() for t in grads])
        msg = f"seed {seed}, {dtype}"
        tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-2)
        for ours, truth in zip(out, ref):
            torch.testing.assert_close(ours, truth.to(dtype), msg=msg, **tol)
        assert torch.equal(out[2], qkv[:, :, H + H_kv:]), msg  # v: copied
        torch.testing.assert_close(a.grad, r.grad.to(dtype), msg=msg, **tol)
        assert torch.equal(a.grad[:, :, H + H_kv:], grads[2].transpose(1, 2)), msg


# -- AdamW over bf16 shadow weights (arlm.train.optim) ------------------------------------------------

@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_native_adamw_equals_torchs_fused_adamw(grad_dtype):
    """kernels/train.cpp's adamw_ against torch's fused CPU AdamW over 4 steps (weight decay on, the
    gradient scaled by a clipping coefficient first, as clip_grad_norm_ scales it): the same
    arithmetic, so within 1e-6 relative (a contraction into an FMA may differ in the last bit); the
    shadow is the new weight rounded to bf16 exactly (autocast's cast)."""
    from arlm import kernels

    if not kernels.train_kernels_available():
        pytest.skip("the native training kernels are not built here")
    seed = time.time_ns() % 2**31
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(1000 + 7, generator=g)  # (a tail after the vectors)
    ref = p0.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    p, m, v, step = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0), torch.zeros(())
    shadow = torch.empty(p0.shape, dtype=torch.bfloat16)
    for i in range(4):
        grad = (torch.randn(p0.shape, generator=g) * 3).to(grad_dtype)
        scale = 0.5 if i % 2 else 1.0
        ref.grad = grad.float() * scale
        opt.step()
        torch.ops.arlm_train.adamw_(p, grad, m, v, step, shadow, 1e-2, 0.9, 0.95, 0.1, 1e-8, scale)
        msg = f"seed {seed}, step {i + 1}"
        torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7, msg=msg)
        torch.testing.assert_close(m, opt.state[ref]["exp_avg"], rtol=1e-6, atol=1e-8, msg=msg)
        torch.testing.assert_close(v, opt.state[ref]["exp_avg_sq"], rtol=1e-6, atol=1e-10, msg=msg)
        assert torch.equal(shadow, p.bfloat16()), msg
    assert step.item() == 4.0 == opt.state[ref]["step"].item()


def tiny_llama(seed: int, tie: bool = True):
    from arlm.config import ModelConfig
    from arlm.model import Transformer

    torch.manual_seed(seed)
    return Transformer(ModelConfig.for_family("llama", vocab_size=97, n_layer=2, n_head=4, n_kv_heads=2, d_model=64,
                                              d_ff=96, max_seq_len=48, tie_embeddings=tie)).train()


def train_steps(model, optimizer, batches, clip: float = 0.05):
    """Steps as the trainer takes them (bf16 autocast, the fused loss, clipping), their losses."""
    from arlm.train.trainer import next_token_loss

    losses = []
    for idx, targets in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = next_token_loss(model, idx, targets)
        loss.backward()
        optimizer.clip_grad_norm_(clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("tie", [True, False])
def test_shadow_weights_train_as_autocast_does(tie):
    """ShadowAdamW's steps against autocast over float32 weights with torch's fused AdamW, from the
    same weights on the same batches. Unclipped: the forward multiplies the same bf16 values (the
    shadow is autocast's cast), the gradients are the same bf16 products, the step the same
    arithmetic: losses within 1e-6 and weights within 1e-5 relative after 4 steps (bit for bit here).
    Tied, the embedding's gradient (sparse rows added to the head's) sums in another order, and
    clipped, the global norm is
    summed in another order (natively, in double), so the coefficient differs in its last bits and
    a weight's bf16 rounding may flip, and Adam turns a changed gradient near zero into a whole step
    (single weights then differ by up to a step): the losses within 1e-4 relative (bf16 rounds the
    loss at 4e-3; a step moves it by 1e-2 here). Its state resumes under torch's AdamW."""
    from arlm import kernels
    from arlm.train.config import TrainConfig
    from arlm.train.optim import ShadowAdamW
    from arlm.train.trainer import configure_optimizer

    if not kernels.train_kernels_available():
        pytest.skip("the native training kernels are not built here")
    seed = time.time_ns() % 2**31
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randint(0, 97, (2, 40), generator=g), torch.randint(0, 97, (2, 40), generator=g))
               for _ in range(6)]
    cfg = TrainConfig(lr=3e-3, weight_decay=0.1)
    loose = (dict(rtol=1e-4, atol=0), None)
    strict = loose if tie else (dict(rtol=1e-6, atol=0), dict(rtol=1e-5, atol=1e-7))
    for clip, (loss_tol, weight_tol) in ((1e9, strict), (0.05, loose)):
        plain, shadowed = tiny_llama(seed, tie), tiny_llama(seed, tie)
        opt_plain = configure_optimizer(plain, cfg, torch.device("cpu"))
        opt_shadow = configure_optimizer(shadowed, cfg, torch.device("cpu"), shadow_weights=True)
        assert isinstance(opt_shadow, ShadowAdamW) and len(opt_shadow.grad_shadows) == 2 * 4  # the blocks' matrices
        msg = f"seed {seed}, clip {clip}"
        torch.testing.assert_close(train_steps(shadowed, opt_shadow, batches[:4], clip),
                                   train_steps(plain, opt_plain, batches[:4], clip), msg=msg, **loss_tol)
        for (name, a), b in zip(shadowed.state_dict().items(), plain.state_dict().values()):
            if weight_tol is not None:
                torch.testing.assert_close(a, b, msg=f"{msg}: {name}", **weight_tol)
        assert all(torch.equal(m.shadow, m.weight.bfloat16()) for m in shadowed.modules() if hasattr(m, "shadow"))
    # a checkpoint of ShadowAdamW's (weights, optimizer state) resumes under torch's AdamW
    plain.load_state_dict(copy.deepcopy(shadowed.state_dict()))
    opt_plain.load_state_dict(copy.deepcopy(opt_shadow.state_dict()))
    torch.testing.assert_close(train_steps(plain, opt_plain, batches[4:], 1e9),
                               train_steps(shadowed, opt_shadow, batches[4:], 1e9), msg=msg, **loose[0])


def test_lora_trains_through_frozen_shadows():
    """Under LoRA the frozen bases and head multiply through bf16 copies made once (no cast a step):
    the adapters train as they do under autocast over the float32 bases, and the bases are
    untouched. The first loss is equal bit for bit (the copies are the casts autocast makes); the
    later ones within 5e-5: the adapters' AdamW updates by the native step and by torch's round
    differently in float32, and a value one float32 unit apart can round to another bf16 in the
    next forward, which AdamW's early, sign-like steps carry on (up to 1.25e-6 over 360 seeds;
    seed 1483145368: 1.24e-5, its adapters 6e-4 apart after 3 steps of lr 3e-3, the other 41
    seeds of that run under 2e-6)."""
    from arlm import kernels
    from arlm.train import lora
    from arlm.train.config import TrainConfig
    from arlm.train.trainer import configure_optimizer

    if not kernels.train_kernels_available():
        pytest.skip("the native training kernels are not built here")
    seed = time.time_ns() % 2**31
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randint(0, 97, (2, 40), generator=g), torch.randint(0, 97, (2, 40), generator=g))
               for _ in range(3)]
    models = [lora.apply(tiny_llama(seed), rank=4) for _ in range(2)]
    for m in models:  # (B starts at zero: move it, so the adapters matter from the first step)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)
    cfg = TrainConfig(lr=3e-3)
    frozen = {k: v.clone() for k, v in models[1].state_dict().items() if not lora.is_adapter_key(k)}
    opt_plain = configure_optimizer(models[0], cfg, torch.device("cpu"))
    opt_shadow = configure_optimizer(models[1], cfg, torch.device("cpu"), shadow_weights=True)
    assert not opt_shadow.grad_shadows and sum(hasattr(m, "shadow") for m in models[1].modules()) == 2 * 4 + 1
    shadow, plain = train_steps(models[1], opt_shadow, batches), train_steps(models[0], opt_plain, batches)
    assert shadow[0] == plain[0], f"seed {seed}"
    torch.testing.assert_close(shadow, plain, rtol=5e-5, atol=0, msg=f"seed {seed}")
    after = models[1].state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen.items())


@pytest.mark.parametrize("h_dtype", [torch.float32, torch.bfloat16])
def test_native_add_rms_norm_equals_add_then_norm(h_dtype):
    """(x + h, RMSNorm(x + h)) in one native pass against add-then-plain_rms_norm in float64, and its
    backward (the residual stream's gradient added, the branch's written in h's dtype) against
    float64 autograd: the sum exact where h is bf16 (a bf16 value widened and added once, as torch's
    add rounds it), the norm within 1e-6 (float32), the gradients within 1e-5 (float32) and one
    rounding of h's dtype for the branch's."""
    from arlm import kernels
    from arlm.fused import add_rms_norm, plain_rms_norm

    if not kernels.train_kernels_available():
        pytest.skip("the native training kernels are not built here")
    seed = time.time_ns() % 2**31
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 7, 600, generator=g) * 3  # (a width that leaves a vector tail)
    h = torch.randn(3, 7, 600, generator=g).to(h_dtype)
    w = 1 + 0.3 * torch.randn(600, generator=g)
    gs, gy = torch.randn(3, 7, 600, generator=g), torch.randn(3, 7, 600, generator=g)
    xa, ha, wa = x.clone().requires_grad_(), h.clone().requires_grad_(), w.clone().requires_grad_()
    s, y = add_rms_norm(xa, ha, wa, 1e-5)
    torch.autograd.backward([s, y], [gs, gy])
    msg = f"seed {seed}"
    assert torch.equal(s, x + h), msg
    xr, hr, wr = x.double().requires_grad_(), h.double().requires_grad_(), w.double().requires_grad_()
    sr = xr + hr
    yr = plain_rms_norm(sr, wr, 1e-5)
    torch.autograd.backward([sr, yr], [gs.double(), gy.double()])
    torch.testing.assert_close(y, yr.float(), rtol=1e-6, atol=1e-6, msg=msg)
    torch.testing.assert_close(xa.grad, xr.grad.float(), rtol=1e-5, atol=1e-5, msg=msg)
    # (bf16: the kernel rounds its float32 value, the reference its float64 one: near a rounding
    # boundary they differ by one bf16 step, up to 2^-7 of the value)
    tol = dict(rtol=1e-5, atol=1e-5) if h_dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-5)
    assert ha.grad.dtype == h_dtype
    torch.testing.assert_close(ha.grad, hr.grad.to(h_dtype), msg=msg, **tol)
    torch.testing.assert_close(wa.grad, wr.grad.float(), rtol=1e-5, atol=1e-4, msg=msg)


def test_native_norms_equal_torchs():
    """Each tensor's 2-norm natively (clipping's, bf16 gradients read as they are) against torch's
    in float64 on the same values: within 2e-6 relative (float32 lanes folded into double every 64
    vectors)."""
    from arlm import kernels

    if not kernels.train_kernels_available():
        pytest.skip("the native training kernels are not built here")
    seed = time.time_ns() % 2**31
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(n, generator=g).to(dt) * 10 ** e
               for n, dt, e in ((7, torch.float32, 0), (100_003, torch.bfloat16, -3), (2_000_001, torch.float32, 2))]
    ours = torch.ops.arlm_train.norms(tensors)
    truth = torch.stack([t.double().norm() for t in tensors]).float()
    torch.testing.assert_close(ours, truth, rtol=2e-6, atol=0, msg=f"seed {seed}")


def test_native_training_path_equals_the_torch_path_float32(monkeypatch):
    """A whole float32 forward and backward of a small Llama through the native passes (q/k/v RoPE,
    the residual adds inside the norms, each block's MLP output added in the next norm's pass)
    against the torch path (no native kernels: adds, norms, split/rope/cat as written): the same
    loss within 1e-6 and every gradient within 1e-5 of its largest value."""
    from arlm import kernels
    from arlm.train.trainer import next_token_loss

    if not kernels.train_kernels_available():
        pytest.skip("the native training kernels are not built here")
    seed = time.time_ns() % 2**31
    g = torch.Generator().manual_seed(seed)
    native, plain = tiny_llama(seed), tiny_llama(seed)
    idx, targets = torch.randint(0, 97, (2, 40), generator=g), torch.randint(0, 97, (2, 40), generator=g)
    loss = next_token_loss(native, idx, targets)
    loss.backward()
    monkeypatch.setattr(kernels, "train_kernels_available", lambda: False)
    ref = next_token_loss(plain, idx, targets)
    ref.backward()
    msg = f"seed {seed}"
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0, msg=msg)
    for (name, a), b in zip(native.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-5 * b.grad.abs().max().item(), msg=f"{msg}: {name}")
