"""Training's causal attention (arlm.fused.causal_attention: torch's flash forward, the backward
pass of kernels/train_attention.cpp) against float64 and against torch's own backward.

References and tolerances, on fresh random bf16 inputs each run (seeded from the clock, printed on
failure):
- the forward is torch's flash kernel's: equal to F.scaled_dot_product_attention's bit for bit;
- each gradient's largest error against float64 SDPA (on the same bf16 operands), relative to that
  gradient's largest value, at most torch's bf16 backward's x1.25 + 1e-3: both round P and dS to bf16
  for their products (torch's grouped-query k/v gradients also sum the groups in bf16: ours is then
  the more exact) and the results to bf16 once;
- the AVX512-BF16 products (a process with ARLM_ATTENTION_AMX=0 beside this one) keep the same
  bound on every head size and mask, and agree with the AMX tiles to bf16 rounding where there are
  tiles;
- a mask in which each query reads one run of keys ending at itself (a packed row's documents, a
  sliding window) is served with the same bound; any other mask is left to SDPA;
- in the model: a training step's loss and gradients match the SDPA path's (bf16 autocast), packed
  rows included, and dropout keeps SDPA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from arlm import fused, kernels
from cpu_flags import amx_expected, attention_backward_expected

# From the CPU's flags and ARLM_MARCH, not from the build: a failed build fails these tests.
pytestmark = pytest.mark.skipif(not attention_backward_expected(),
                                reason="the native attention backward needs AVX512-BF16 (torch's is used)")

def test_built_where_the_cpu_has_avx512_bf16():
    assert kernels.attention_backward_supported()


SHAPES = [  # B, H, H_kv, T, d: grouped queries, lengths off the 64-block, every head size served
    (2, 6, 2, 100, 64),
    (1, 4, 4, 64, 64),
    (2, 9, 3, 256, 64),
    (1, 4, 2, 130, 128),
    (1, 2, 1, 33, 32),
    (1, 3, 1, 1, 96),
]


def inputs(seed: int, B: int, H: int, H_kv: int, T: int, d: int, strided: bool = False):
    g = torch.Generator().manual_seed(seed)
    if strided:  # q, k, v as the model makes them: [B, T, H, d] in memory, viewed as [B, H, T, d]
        q = torch.randn(B, T, H, d, generator=g).to(torch.bfloat16).transpose(1, 2)
        k = torch.randn(B, T, H_kv, d, generator=g).to(torch.bfloat16).transpose(1, 2)
        v = torch.randn(B, T, H_kv, d, generator=g).to(torch.bfloat16).transpose(1, 2)
    else:
        q = torch.randn(B, H, T, d, generator=g).to(torch.bfloat16)
        k = torch.randn(B, H_kv, T, d, generator=g).to(torch.bfloat16)
        v = torch.randn(B, H_kv, T, d, generator=g).to(torch.bfloat16)
    grad = torch.randn(B, H, T, d, generator=g).to(torch.bfloat16)
    return q, k, v, grad


def grads(fn, q, k, v, grad, dtype=None):
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_gradients_as_close_to_float64_as_torchs(shape, strided):
    seed = time.time_ns() % 2**31
    q, k, v, grad = inputs(seed, *shape, strided=strided)
    out, ours = grads(fused.causal_attention, q, k, v, grad)
    torch_out, theirs = grads(sdpa, q, k, v, grad)
    _, exact = grads(sdpa, q, k, v, grad, dtype=torch.float64)
    assert torch.equal(out, torch_out), f"seed {seed}: the forward is torch's flash kernel's"
    for name, o, t, r in zip("qkv", ours, theirs, exact):
        assert o.dtype == torch.bfloat16 and o.shape == r.shape
        top = r.abs().max().item() or 1.0  # (one position: k's gradient is zero)
        err, torch_err = ((x.double() - r).abs().max().item() / top for x in (o, t))
        assert err <= 1.25 * torch_err + 1e-3, f"seed {seed}, d{name}: {err:.2e} against torch's {torch_err:.2e}"


def runs_mask(B: int, T: int, seed: int, window: int = 0) -> torch.Tensor:
    """[B, 1, T, T]: packed documents of random lengths (each query reads its own document's keys up
    to itself), within a sliding window where given."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.cumsum(torch.rand(B, T, generator=g) < 0.03, dim=1)
    pos = torch.arange(T)
    visible = (pos[None, None, :] <= pos[None, :, None]) & (doc[:, None, :] == doc[:, :, None])
    if window:
        visible &= pos[None, None, :] > pos[None, :, None] - window
    return visible.unsqueeze(1)


@pytest.mark.parametrize("window", [0, 37])
def test_packed_documents_and_windows_as_close_to_float64_as_torchs(window):
    seed = time.time_ns() % 2**31
    q, k, v, grad = inputs(seed, 2, 6, 2, 200, 64, strided=True)
    mask = runs_mask(2, 200, seed, window)

    def masked(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    out, ours = grads(lambda q, k, v: fused.causal_attention(q, k, v, mask), q, k, v, grad)
    torch_out, theirs = grads(masked, q, k, v, grad)
    _, exact = grads(masked, q, k, v, grad, dtype=torch.float64)
    assert (out.float() - torch_out.float()).abs().max().item() <= 1e-2 * torch_out.float().abs().max().item()
    for name, o, t, r in zip("qkv", ours, theirs, exact):
        top = r.abs().max().item()
        err, torch_err = ((x.double() - r).abs().max().item() / top for x in (o, t))
        assert err <= 1.25 * torch_err + 1e-3, f"seed {seed}, d{name}: {err:.2e} against torch's {torch_err:.2e}"


def test_a_mask_that_is_not_one_run_of_keys_is_left_to_sdpa():
    q, k, v, _ = inputs(3, 1, 2, 1, 40, 64)
    q.requires_grad_()
    mask = runs_mask(1, 40, 3).clone()
    mask[0, 0, 30, 5] = not mask[0, 0, 30, 5]  # a hole (or an island) in query 30's keys
    assert fused.causal_attention(q, k, v, mask) is None
    assert fused.causal_attention(q, k, v, runs_mask(1, 40, 3)) is not None


def test_the_gradients_land_in_the_projections_layout():
    q, k, v, grad = inputs(1, 2, 4, 2, 70, 64, strided=True)
    _, (dq, dk, dv) = grads(fused.causal_attention, q, k, v, grad)
    for g in (dq, dk, dv):  # [B, T, heads, d] in memory: the transpose back is free
        assert g.transpose(1, 2).is_contiguous()


VECTOR_PATH = """
import sys, torch
from arlm import fused
cases = torch.load(sys.argv[1])
results = []
for q, k, v, g, mask in cases:
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = fused.causal_attention(*leaves, mask)
    out.backward(g)
    results.append([out.detach()] + [t.grad for t in leaves])
torch.save(results, sys.argv[2])
"""


def test_the_vector_products_where_the_tiles_serve(tmp_path):
    """On a CPU with AMX the in-process tests run the tiles; here the AVX512-BF16 products (a process
    with ARLM_ATTENTION_AMX=0) on every head size, masks included, against float64, and against
    the tiles where there are any."""
    seed = time.time_ns() % 2**31
    cases = []
    for i, (B, H, H_kv, T, d) in enumerate(SHAPES):
        q, k, v, grad = inputs(seed + i, B, H, H_kv, T, d, strided=i % 2 == 1)
        cases.append((q, k, v, grad, runs_mask(B, T, seed + i, window=40 * (i % 2)) if i >= 2 else None))
    torch.save(cases, tmp_path / "in.pt")
    subprocess.run([sys.executable, "-c", VECTOR_PATH, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                   env=dict(os.environ, ARLM_ATTENTION_AMX="0"), check=True)
    for (q, k, v, grad, mask), vector in zip(cases, torch.load(tmp_path / "out.pt")):
        def reference(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                  enable_gqa=k.shape[1] != q.shape[1])
        exact_out, exact = grads(reference, q, k, v, grad, dtype=torch.float64)
        _, theirs = grads(reference, q, k, v, grad)
        tiles_out, tiles = grads(lambda q, k, v: fused.causal_attention(q, k, v, mask), q, k, v, grad)
        for name, x, r, t in zip(["dq", "dk", "dv"], vector[1:], exact, theirs):
            top = r.abs().max().item() or 1.0
            err, torch_err = ((y.double() - r).abs().max().item() / top for y in (x, t))
            assert err <= 1.25 * torch_err + 1e-3, f"seed {seed}, {tuple(q.shape)}, {name}: {err:.2e} ({torch_err:.2e})"
        if amx_expected():  # the same sums in another order, rounded to bf16
            for name, a, b, r in zip(["out", "dq", "dk", "dv"], [tiles_out] + tiles, vector, [exact_out] + exact):
                top = r.abs().max().item() or 1.0  # (one position: k's gradient is zero, up to rounding)
                assert (a.float() - b.float()).abs().max().item() <= 1e-2 * top, f"seed {seed}: {name}"


def test_odd_steps_between_positions():
    """Rows are read in 32-bit pairs: a q whose positions lie an odd number of values apart is left to
    SDPA, and a gradient sliced out of a wider one is copied first (both gave wrong gradients)."""
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(1, 2, 100, 65, generator=g).to(torch.bfloat16)
    q = wide[..., :64]
    k, v = (torch.randn(1, 1, 100, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    assert fused.causal_attention(q.requires_grad_(), k, v) is None
    weight = torch.randn(1, 2, 100, 65, generator=g)

    def through_a_cat(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        wider = torch.cat([fn(*leaves), torch.zeros(1, 2, 100, 1, dtype=torch.bfloat16)], dim=-1)
        (wider.float() * weight).sum().backward()  # its gradient reaches fn sliced: positions 65 apart
        return [t.grad for t in leaves]

    for ours, theirs in zip(through_a_cat(lambda *t: fused.causal_attention(*(x.contiguous() for x in t))),
                            through_a_cat(sdpa)):
        assert (ours.float() - theirs.float()).abs().max() <= 0.02 * theirs.float().abs().max()


def test_a_mask_shared_by_the_batch_is_left_to_sdpa():
    q, k, v, _ = inputs(6, 2, 2, 1, 40, 64)
    q.requires_grad_()
    assert fused.causal_attention(q, k, v, runs_mask(1, 40, 6)) is None  # [1, 1, T, T] for B = 2
    assert fused.causal_attention(q, k, v, runs_mask(2, 40, 6)) is not None


def test_the_op_rejects_starts_outside_each_querys_past():
    assert kernels.attention_backward_supported()
    q, k, v, grad = inputs(7, 1, 2, 1, 10, 64)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    for bad in (torch.full((1, 10), -1, dtype=torch.int32), torch.arange(1, 11, dtype=torch.int32)[None]):
        with pytest.raises(RuntimeError, match="start"):
            torch.ops.arlm_train.attention_backward(q, k, v, out, grad, lse, bad, 0.125)


def test_served_only_where_it_applies():
    q, k, v, _ = inputs(2, 1, 2, 1, 40, 64)
    assert fused.causal_attention(q, k, v) is None  # no gradient wanted: SDPA
    q.requires_grad_()
    assert fused.causal_attention(q.float(), k.float(), v.float()) is None  # float32: SDPA
    assert fused.causal_attention(q[..., :48], k[..., :48], v[..., :48]) is None  # head size 48
    assert fused.causal_attention(q, k, v) is not None


def tiny_model(dropout: float = 0.0):
    from arlm.config import ModelConfig
    from arlm.model import Transformer

    config = ModelConfig(vocab_size=96, max_seq_len=160, d_model=128, n_layer=2, n_head=4, n_kv_heads=2,
                         norm="rmsnorm", mlp="swiglu", d_ff=256, pos_embedding="rope", bias=False,
                         tie_embeddings=True, dropout=dropout)
    torch.manual_seed(0)
    return Transformer(config).train()


def step(model, idx, doc_ids, native: bool, monkeypatch):
    """One training step's loss and gradients, attention native or (native=False) SDPA's."""
    model.zero_grad(set_to_none=True)
    with monkeypatch.context() as patch:
        if not native:
            patch.setattr(fused, "causal_attention", lambda *args: None)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(idx[:, :-1], doc_ids=doc_ids)
        loss = F.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("packed", [False, True])
def test_a_training_step_through_the_model_matches_sdpa(packed, monkeypatch):
    model = tiny_model()
    g = torch.Generator().manual_seed(time.time_ns() % 2**31)
    idx = torch.randint(0, 96, (2, 150), generator=g)
    doc_ids = torch.cumsum(torch.rand(2, 149, generator=g) < 0.05, dim=1) if packed else None
    loss, ours = step(model, idx, doc_ids, True, monkeypatch)
    ref_loss, theirs = step(model, idx, doc_ids, False, monkeypatch)
    # the forward: torch's flash kernel on both sides (with the mask as 0 / -inf on ours, as a bool on SDPA's)
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss)
    for name, grad in theirs.items():
        assert (ours[name] - grad).abs().max().item() <= 0.03 * grad.abs().max().item() + 1e-6, name


def test_the_model_takes_the_native_path_packed_rows_included_and_keeps_sdpa_for_dropout():
    def backward_nodes(model, doc_ids=None):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randint(0, 96, (1, 65)), doc_ids=doc_ids).float().sum()
        seen, todo = set(), [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions)
        return {type(n).__name__ for n in seen}

    assert "NativeCausalAttentionBackward" in backward_nodes(tiny_model())
    assert "NativeCausalAttentionBackward" in backward_nodes(tiny_model(), doc_ids=torch.arange(65)[None] // 20)
    assert "NativeCausalAttentionBackward" not in backward_nodes(tiny_model(dropout=0.1))
