"""Weight-only int8 and 4-bit: the native kernels against float math, and the quantized model's quality.

References: float64 matmul of the same (dequantized) weights for the kernel; the float32 model's
perplexity on tiny Shakespeare's validation text for quality.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from arlm import kernels
from arlm.engine import Engine, EngineConfig, ModelRunner, decode_step, prefill
from arlm.kernels.llama import LayerWeight
from arlm.kv_cache import KVCache
from arlm.llm import LLM, ChatSession
from arlm.quant import (Int8Linear, Q4Linear, Q8Linear, QuantizedLinear, prepare, quantize, quantize_int8,
                        weight_bytes)
from arlm.sampling import SamplingParams
from cpu_flags import (amx_expected, amx_int8_expected, cpu_flags, matmul_path_expected, native_bf16_expected,
                       native_kernels_expected, packed_expected, vnni_expected)

ROOT = Path(__file__).resolve().parents[1]


def test_native_kernel_builds():
    # CI has gcc and ninja: the fast path must be the one tested, not the fallback (unless
    # ARLM_NO_NATIVE asks for the fallback).
    assert kernels.native_available() == native_kernels_expected()


@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 33])
@pytest.mark.parametrize("N,K", [(1536, 576), (1539, 576), (7, 24), (10, 13)])
def test_int8_linear_matches_float64(M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g)
    w = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    scale = torch.rand(N, generator=g) * 0.01 + 1e-3
    y = kernels.int8_linear(x, w, scale)
    ref = (x.double() @ (w.double() * scale.double()[:, None]).T)
    # float32 accumulation over K terms: relative error ~ sqrt(K) * 2^-24; 1e-5 of the scale of y.
    assert y.dtype == torch.float32 and y.shape == (M, N)
    assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("M", [1, 2, 3, 4, 33])
@pytest.mark.parametrize("N,K", [(1536, 576), (67, 96), (5, 32)])
def test_q4_linear_matches_float64(M, N, K):
    g = torch.Generator().manual_seed(M * 7 + N + K)
    x = torch.randn(M, K, generator=g)
    w = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    scale = (torch.rand(N, K // 32, generator=g) * 0.05).half()
    mins = (torch.randn(N, K // 32, generator=g) * 0.05).half()
    y = kernels.q4_linear(x, w, scale, mins)
    # Reference built independently of unpack_q4: element 32g + j is the low nibble of byte 16g + j
    # (j < 16) or the high nibble of byte 16g + j - 16.
    q = torch.empty(N, K, dtype=torch.float64)
    for k in range(K):
        grp, j = divmod(k, 32)
        byte = w[:, grp * 16 + j % 16].to(torch.int64)
        q[:, k] = (byte & 15 if j < 16 else byte >> 4).double()
    dense = q * scale.double().repeat_interleave(32, 1) + mins.double().repeat_interleave(32, 1)
    ref = x.double() @ dense.T
    assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_a8_kernels_propagate_nan():
    x = torch.randn(2, 64)
    x[1, 3] = float("nan")
    w = torch.randint(-127, 128, (8, 64), dtype=torch.int8)
    y = kernels.int8_linear_a8(x, w, torch.ones(8))
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()


def _q4_dense(w, scale, mins):
    """float64 [N, K] from packed 4-bit weights, built independently of unpack_q4."""
    N, K = w.shape[0], w.shape[1] * 2
    q = torch.empty(N, K, dtype=torch.float64)
    for k in range(K):
        grp, j = divmod(k, 32)
        byte = w[:, grp * 16 + j % 16].to(torch.int64)
        q[:, k] = (byte & 15 if j < 16 else byte >> 4).double()
    return q * scale.double().repeat_interleave(32, 1) + mins.double().repeat_interleave(32, 1)


def test_activation_quantization_bound():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 576, generator=g) * torch.rand(7, 576, generator=g) * 10
    x[0, :32] = 0  # an all-zero group: scale 0, codes 0
    q, d = kernels.quantize_activations(x)
    assert q.dtype == torch.int8 and d.shape == (7, 18) and q.abs().max() <= 127
    back = q.view(7, 18, 32).double() * d.double()[..., None]
    err = (back - x.view(7, 18, 32).double()).abs()
    assert (err <= d.double()[..., None] * 0.5 * (1 + 1e-6)).all()  # within half a step
    assert torch.equal(q[0, :32], torch.zeros(32, dtype=torch.int8))


def _dequantized_x(x):
    q, d = kernels.quantize_activations(x)
    return (q.view(*d.shape, 32).double() * d.double()[..., None]).view(x.shape)


def _assert_within_rounding_bound(y, x, dense):
    # Against the exact float product: each activation moved by at most half its group's step
    # (d / 2), so |y - x @ W.T| <= |W| @ (d / 2) row by row (+ float32 summation).
    _, d = kernels.quantize_activations(x)
    half_step = (d.double() / 2).repeat_interleave(32, 1)
    bound = half_step @ dense.abs().T
    err = (y.double() - x.double() @ dense.T).abs()
    assert (err <= bound * (1 + 1e-6) + 1e-5 * (x.double() @ dense.T).abs().max()).all()


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize("N,K", [(1536, 576), (1539, 576), (6, 64)])
def test_int8_linear_a8_matches_float64(M, N, K):
    # Integer path: exactly (quantized x) @ (int8 weights * scale), up to float32 summation.
    g = torch.Generator().manual_seed(M * 31 + N + K)
    x = torch.randn(M, K, generator=g) * 3
    w = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    scale = torch.rand(N, generator=g) * 0.01 + 1e-3
    y = kernels.int8_linear_a8(x, w, scale)
    ref = _dequantized_x(x) @ (w.double() * scale.double()[:, None]).T
    assert y.dtype == torch.float32 and y.shape == (M, N)
    assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    _assert_within_rounding_bound(y, x, w.double() * scale.double()[:, None])


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize("N,K", [(1536, 576), (67, 96), (5, 32)])
def test_q4_linear_a8_matches_float64(M, N, K):
    g = torch.Generator().manual_seed(M * 11 + N + K)
    x = torch.randn(M, K, generator=g) * 3
    w = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    scale = (torch.rand(N, K // 32, generator=g) * 0.05).half()
    mins = (torch.randn(N, K // 32, generator=g) * 0.05).half()
    y = kernels.q4_linear_a8(x, w, scale, mins)
    dense = _q4_dense(w, scale, mins)
    ref = _dequantized_x(x) @ dense.T
    assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    _assert_within_rounding_bound(y, x, dense)


def _packed_expected() -> bool:
    """Where the packed kernels must exist, from the CPU's flags and ARLM_MARCH (cpu_flags.py),
    not from the build itself: there a failed build fails these tests rather than skipping them."""
    return packed_expected()


def test_packed_kernels_are_built_where_the_cpu_has_vnni():
    # The packed layout is the fast path on AVX-512 VNNI CPUs (CI's among them); elsewhere the
    # layers keep the row-layout kernels and must not claim otherwise.
    assert kernels.packed_available() == packed_expected()
    layer = Int8Linear.from_float(torch.randn(32, 64))
    layer.int8_activations = True
    assert layer.packed == packed_expected()


def test_native_bf16_is_read_from_the_cpu():
    # bf16 prefill (LLM.configure) and bf16 autocast (training) are chosen where this holds.
    assert kernels.cpu_has_native_bf16() == native_bf16_expected()


def _packed_case(g, N, K):
    assert kernels.packed_available()  # builds and loads the ops, also when a packed test runs alone
    w8 = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    s8 = torch.rand(N, generator=g) * 0.01 + 1e-3
    w4 = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    s4 = (torch.rand(N, K // 32, generator=g) * 0.05).half()
    m4 = (torch.randn(N, K // 32, generator=g) * 0.05).half()
    return (w8, s8), (w4, s4, m4)


@pytest.mark.skipif(not _packed_expected(), reason="this CPU has no AVX-512 VNNI (or ARLM_MARCH built for one without)")
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize("N,K", [(1536, 576), (48, 1536), (16, 32)])
@pytest.mark.parametrize("offset", [0.0, 20.0])
def test_packed_kernels_match_float64(M, N, K, offset):
    # Same products as the row-layout kernels: (quantized x) @ dequantized weights, to float32 order.
    # offset: activations of one sign (the int8 layout's +128 must come off exactly, not in float).
    g = torch.Generator().manual_seed(M * 7 + N + K)
    x = torch.randn(M, K, generator=g) * 3 + offset
    (w8, s8), (w4, s4, m4) = _packed_case(g, N, K)
    xq = _dequantized_x(x)
    for y, dense in ((kernels.int8_linear_a8p(x, kernels.pack_int8(w8), s8), w8.double() * s8.double()[:, None]),
                     (kernels.q4_linear_a8p(x, *kernels.pack_q4(w4, s4, m4)), _q4_dense(w4, s4, m4))):
        ref = xq @ dense.T
        assert y.dtype == torch.float32 and y.shape == (M, N)
        assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
        _assert_within_rounding_bound(y, x, dense)


@pytest.mark.skipif(not _packed_expected(), reason="this CPU has no AVX-512 VNNI (or ARLM_MARCH built for one without)")
def test_packed_rows_are_independent_and_nan_stays_in_its_row():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(11, 576, generator=g)
    (w8, s8), (w4, s4, m4) = _packed_case(g, 96, 576)
    for op, args in ((kernels.int8_linear_a8p, (kernels.pack_int8(w8), s8)),
                     (kernels.q4_linear_a8p, kernels.pack_q4(w4, s4, m4))):
        together = op(x, *args)
        for i in range(11):  # blocks of 4, 2 and 1 rows: each row bitwise the same alone
            assert torch.equal(op(x[i:i + 1].contiguous(), *args)[0], together[i])
        bad = x.clone()
        bad[3, 100] = float("nan")
        y = op(bad, *args)
        assert torch.isnan(y[3]).all() and torch.equal(y[torch.arange(11) != 3], together[torch.arange(11) != 3])


def test_quantized_layers_use_the_packed_layout():
    # quantize() packs the int8-activation layers; their forward equals the row-layout kernel's
    # up to float32 summation order, and a layer whose width does not fit the packing keeps rows.
    g = torch.Generator().manual_seed(6)
    for cls in (Int8Linear, Q4Linear, Q8Linear):
        layer = cls.from_float(torch.randn(64, 96, generator=g))
        layer.int8_activations = True  # packs where it can
        assert layer.packed == packed_expected()
        x = torch.randn(3, 96, generator=g)
        y = layer(x)
        layer.unpack()
        torch.testing.assert_close(y, layer(x), rtol=0, atol=1e-6 * y.abs().max().item())
        odd = cls.from_float(torch.randn(40, 96, generator=g))
        odd.int8_activations = True
        assert not odd.packed


def test_a8_fallback_matches_native():
    # The pure-PyTorch fallback quantizes x bitwise like the kernel: same results to float32 order.
    assert kernels.native_available()  # else both sides below would be the fallback
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 576, generator=g)
    w8 = torch.randint(-127, 128, (40, 576), generator=g, dtype=torch.int8)
    s8 = torch.rand(40, generator=g) * 0.01
    w4 = torch.randint(0, 256, (40, 288), generator=g, dtype=torch.uint8)
    s4, m4 = (torch.rand(40, 18, generator=g) * 0.05).half(), (torch.randn(40, 18, generator=g) * 0.05).half()
    deq = kernels.dequantized_activations(x)
    for native, fallback in ((kernels.int8_linear_a8(x, w8, s8), kernels._fallback(deq, w8, s8)),
                             (kernels.q4_linear_a8(x, w4, s4, m4),
                              torch.nn.functional.linear(deq, kernels.unpack_q4(w4, s4, m4)))):
        # float32 sums in different orders: within 1e-6 of the outputs' scale
        torch.testing.assert_close(native, fallback, rtol=0, atol=1e-6 * fallback.abs().max().item())


def test_q4_round_trip_is_exact_on_4bit_values_and_bounded_otherwise():
    g = torch.Generator().manual_seed(3)
    # Values that are already Q4_1 (as a Q4_1 GGUF dequantizes to): every group has 16 levels
    # d * q + m with q = 0 and q = 15 present. Quantizing them again must change nothing.
    d = (torch.rand(40, 4, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = (torch.randn(40, 4, 1, generator=g) * 0.05).half().float()
    q = torch.randint(0, 16, (40, 4, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    w = (d * q + m).view(40, 128)
    assert torch.equal(Q4Linear.from_float(w).dequantize(), w)
    # Arbitrary float weights: within half a step (scale / 2) of each group, plus fp16 rounding.
    w = torch.randn(40, 128, generator=g)
    err = (Q4Linear.from_float(w).dequantize() - w).abs().view(40, 4, 32)
    step = (w.view(40, 4, 32).amax(-1) - w.view(40, 4, 32).amin(-1)) / 15
    assert (err.amax(-1) <= step * 0.5 * 1.01 + 1e-3).all()


@pytest.mark.parametrize("fmt", ["int8", "q4", "int8_a8", "q4_a8"])
def test_rows_are_independent(fmt):
    # Batching must not change a row's result, bitwise: a request decoded in a batch of 9 (or in
    # a continuous batch) must give exactly the tokens it gives alone.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 576, generator=g)
    if fmt.startswith("int8"):
        args = (torch.randint(-127, 128, (301, 576), generator=g, dtype=torch.int8), torch.rand(301, generator=g))
        op = kernels.int8_linear_a8 if fmt.endswith("a8") else kernels.int8_linear
    else:
        args = (torch.randint(0, 256, (301, 288), generator=g, dtype=torch.uint8),
                (torch.rand(301, 18, generator=g) * 0.05).half(), (torch.randn(301, 18, generator=g) * 0.05).half())
        op = kernels.q4_linear_a8 if fmt.endswith("a8") else kernels.q4_linear
    together = op(x, *args)
    for i in range(9):
        assert torch.equal(op(x[i:i + 1].contiguous(), *args)[0], together[i])
    assert torch.equal(op(x[2:5].contiguous(), *args), together[2:5])


def test_quantize_error_bounded_by_half_step():
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=g))
        lin.bias.copy_(torch.randn(48, generator=g))
    q = Int8Linear.from_float(lin.weight, lin.bias)
    step = lin.weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.dequantize() - lin.weight).abs() <= step / 2 + 1e-7).all()
    x = torch.randn(5, 3, 64, generator=g)
    ref = torch.nn.functional.linear(x.double(), q.dequantize().double(), lin.bias.double())
    assert torch.allclose(q(x).double(), ref, rtol=0, atol=1e-4)


def _quantized(smollm2, mode):
    llm = LLM(smollm2.loaded)
    llm.model = quantize(copy.deepcopy(smollm2.model), mode)
    llm.quantization = mode
    return llm


@pytest.fixture(scope="module")
def int8_smollm2(smollm2):
    return _quantized(smollm2, "int8")


@pytest.fixture(scope="module")
def auto_smollm2(smollm2):
    """The default CPU path: 4-bit for the Q4_1 blocks, Q8_0 for the Q8_0 head (both lossless)."""
    return _quantized(smollm2, "auto")


def _perplexity(model, ids: torch.Tensor, dense: bool = False) -> float:
    with torch.inference_mode():
        logits = model(ids, dense=dense)
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return nll.exp().item()


@pytest.fixture(scope="module")
def val_ids(smollm2):
    text = (ROOT / "data" / "tinyshakespeare.txt").read_text()
    val = text[int(0.9 * len(text)):]  # the usual validation split: last 10%
    return torch.tensor(smollm2.tokenizer.encode(val)[:4096]).view(4, 1024)


@pytest.fixture(scope="module")
def fp32_perplexity(smollm2, val_ids):
    return _perplexity(smollm2.model, val_ids)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["int8", "auto"])
def test_quantized_perplexity_within_one_percent(int8_smollm2, auto_smollm2, val_ids, fp32_perplexity, path):
    quantized = {"int8": int8_smollm2, "auto": auto_smollm2}[path]
    fp32, q = fp32_perplexity, _perplexity(quantized.model, val_ids)
    assert 5 < fp32 < 100  # a sane model on English text
    assert abs(q / fp32 - 1) <= 0.01, (fp32, q)


def test_auto_uses_lossless_4bit_for_smollm2_blocks(smollm2, auto_smollm2):
    layers = [m for m in auto_smollm2.model.modules() if isinstance(m, QuantizedLinear)]
    q4 = [m for m in layers if isinstance(m, Q4Linear)]
    assert len(q4) == 4 * smollm2.model.config.n_layer  # wqkv, wo, gate_up, down in every block
    assert isinstance(auto_smollm2.model.lm_head, Q8Linear)  # the Q8_0 head stays Q8_0 (exact)
    ref = dict(smollm2.model.named_modules())
    for name, m in auto_smollm2.model.named_modules():
        if isinstance(m, Q4Linear):
            assert torch.equal(m.dequantize(), ref[name].weight.detach()), name
    assert weight_bytes(auto_smollm2.model) < 0.18 * weight_bytes(smollm2.model)


def test_int8_weights_are_a_quarter(smollm2, int8_smollm2):
    fp32, int8 = weight_bytes(smollm2.model), weight_bytes(int8_smollm2.model)
    assert fp32 == 4 * 134_515_008  # every SmolLM2 weight (embedding counted once as the head)
    assert int8 < 0.26 * fp32


@pytest.mark.parametrize("path", ["int8", "auto"])
def test_quantized_generation_runs_the_same_engine(smollm2, int8_smollm2, auto_smollm2, path):
    # The quantized model goes through the same prefill + KV-cached decode; cached equals
    # uncached recomputation for it too. Without the float copies (keep_dense=False, as the
    # server runs) prefill takes the quantized kernels too, so both sides do the same arithmetic.
    # Float activations: 8-bit activations round differently on the float32 noise between cached
    # and uncached attention, which can flip a near-tie (their quality is held to perplexity).
    # (The module's quantized layers, set up again: what quantize(..., keep_dense=False,
    # activations="float32") makes, without quantizing SmolLM2 a second time.)
    llm = LLM(smollm2.loaded)
    quantized = {"int8": int8_smollm2, "auto": auto_smollm2}[path].model
    llm.model = prepare(copy.deepcopy(quantized), "float32", keep_dense=False)
    ids = llm.tokenizer.encode("The capital of France is")
    # The module path (decode_step); the native step is held to the same model in test_fused_decode.py.
    runner = ModelRunner(llm.model, decode_step)
    runner.native = None  # prefill through the modules too
    engine = Engine(runner, (), EngineConfig(block_size=None))
    tokens = engine.generate([ids], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))[0]
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(12):
            seq.append(int(llm.model(torch.tensor([seq]))[0, -1].argmax()))
    assert tokens == seq[len(ids):]


def test_prefill_uses_the_float_weights(smollm2, auto_smollm2):
    # Prefill is compute-bound: quantized layers multiply with their float originals there, so
    # the first token's logits are exactly the float model's.
    ids = smollm2.tokenizer.encode("The capital of France is")
    out = []
    for llm in (smollm2, auto_smollm2):
        cache = KVCache.contiguous(llm.model.config, 1, 32)
        with torch.inference_mode():
            out.append(prefill(llm.model, cache, torch.tensor([ids]), torch.arange(len(ids))[None],
                               torch.tensor([len(ids) - 1]), len(ids)))
    assert torch.equal(out[0], out[1])


@pytest.mark.slow
def test_bf16_prefill_quality(smollm2, val_ids, fp32_perplexity):
    # LLM.configure's choice on CPUs with native bf16 matmuls: prefill multiplies by bf16 copies
    # of the weights (float32 accumulation). Held to the same 1% perplexity bound as the
    # quantized decode path, over the prefill path itself (dense=True), and the prompts'
    # next tokens must agree with the float32 model's.
    model = quantize(copy.deepcopy(smollm2.model), "auto", prefill_dtype=torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert all(m.dense_weight.dtype == torch.bfloat16 for m in layers)
    # Without native bf16 torch emulates the GEMMs (131 s for the four rows on a Zen 3): one row of
    # 1,024 tokens there, against float32's perplexity on the same row.
    ids = val_ids if native_bf16_expected() else val_ids[:1]
    reference = fp32_perplexity if ids is val_ids else _perplexity(smollm2.model, ids)
    ppl = _perplexity(model, ids, dense=True)
    logits = model(val_ids[:, :64], dense=True)
    assert abs(ppl / reference - 1) <= 0.01, (reference, ppl)
    with torch.inference_mode():
        ref = smollm2.model(val_ids[:, :64])
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.95, agree


def _configured(smollm2, **kwargs):
    llm = LLM(smollm2.loaded)
    llm.model = copy.deepcopy(smollm2.model)
    llm.configure(quantize="auto", **kwargs)
    return llm, [m for m in llm.model.modules() if isinstance(m, QuantizedLinear)]


@pytest.mark.slow
def test_matmul_path_choices(smollm2):
    # "auto" is read from the CPU's flags (tests/cpu_flags.py, not the predicates the code
    # branches on); each path, forced, is the one that runs: the packed integer layout (vnni),
    # the row layout (avx2, even on an AVX-512 CPU), or dense bf16 / float32 copies for the
    # prompt beside the integer kernels for decode. A path the CPU lacks is one clear error.
    llm, layers = _configured(smollm2)
    assert llm.matmul_path == matmul_path_expected()
    if packed_expected():
        llm, layers = _configured(smollm2, matmul_path="vnni")
        isa = ("AVX512-VNNI+AMX-INT8" if amx_int8_expected()  # (prompt rows on the tiles)
               else "AVX512-VNNI" if vnni_expected() else "AVX2")
        assert llm.matmul_isa == isa and llm.runner.dense_prefill is False
        assert all(m.packed and m.dense_weight is None for m in layers if m.can_pack())
    else:
        with pytest.raises(ValueError, match="matmul path vnni needs the packed kernels"):
            _configured(smollm2, matmul_path="vnni")
    llm, layers = _configured(smollm2, matmul_path="avx2")
    assert llm.matmul_isa == "AVX2" and not any(m.packed or m.dense_weight is not None for m in layers)
    for path, dtype in (("bf16", torch.bfloat16), ("float32", torch.float32)):
        llm, layers = _configured(smollm2, matmul_path=path)
        assert llm.runner.dense_prefill and all(m.dense_weight.dtype == dtype for m in layers)
        assert all(m.packed for m in layers if m.can_pack())  # decode keeps the integer kernels' layout
    llm, _ = _configured(smollm2, prefill_dtype="bfloat16")  # the older name
    assert llm.matmul_path == "bf16" and llm.prefill_dtype == "bfloat16"
    with pytest.raises(ValueError, match="unknown matmul path"):
        _configured(smollm2, matmul_path="int4")
    with pytest.raises(ValueError, match="not both"):
        _configured(smollm2, matmul_path="bf16", prefill_dtype="float32")
    if packed_expected():  # float activations: the row kernels (avx2), never the packed ones
        with pytest.raises(ValueError, match="8-bit activations"):
            _configured(smollm2, matmul_path="vnni", activations="float32")
        assert _configured(smollm2, activations="float32")[0].matmul_path == "avx2"
    llm, layers = _configured(smollm2, matmul_path="avx2", activations="float32")
    assert not any(m.packed or m.int8_activations for m in layers)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["vnni", "avx2", "bf16"])
def test_paths_keep_batch_equal_alone(smollm2, path):
    # Forced on any CPU that has it: a prompt's greedy tokens alone == in a batch of prompts of
    # other lengths (every kernel of these paths computes a row whatever the rows beside it), and
    # == the float32 model's for the first tokens of a plain prompt.
    if path == "vnni" and not packed_expected():
        pytest.skip("this CPU has no AVX-512 VNNI (avx512_vnni not in /proc/cpuinfo flags): the vnni path cannot run")
    if path == "bf16" and not kernels.bf16_kernel_wanted():
        pytest.skip("no bf16_linear.cpp here (no AVX512-BF16, or AMX: torch's GEMM, whose rows depend on the batch)")
    llm, _ = _configured(smollm2, matmul_path=path)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far"]
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert [c.token_ids for c in llm.generate(prompts, params)] == alone
    assert alone[0] == smollm2.generate([prompts[0]], params)[0].token_ids


def _onednn_matmul_isa(code: str) -> set[str]:
    """The implementations oneDNN ran for the matmuls of `code` (ONEDNN_VERBOSE), in a subprocess."""
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ONEDNN_VERBOSE": "1"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return {line.split(",")[6] for line in r.stdout.splitlines()  # implementation, of the bf16 ones
            if line.startswith("onednn_verbose,") and ",exec,cpu,matmul," in line and ",src:bf16" in line}


_BF16_PROMPT = """
from arlm.llm import LLM
from arlm.sampling import SamplingParams
llm = LLM.load("smollm2", matmul_path="bf16")
llm.generate(["The capital of France is a city"], SamplingParams(max_new_tokens=2, temperature=0))
"""


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["amx", "avx512_bf16"])
def test_bf16_path_runs_on_the_cpus_bf16_units(isa):
    # The bf16 path's prompt GEMMs: on the AMX tiles where the CPU has them (torch's bf16 GEMM,
    # as oneDNN reports running it), else through bf16_linear.cpp's AVX512-BF16 kernel (float32
    # results; no oneDNN bf16 matmul at all). Each case runs only where the CPU has that unit.
    flags = cpu_flags() or frozenset()
    if isa == "amx" and not amx_expected():
        pytest.skip("this CPU has no AMX (amx_tile, amx_bf16 not in /proc/cpuinfo flags): checked on AMX Xeons")
    if isa == "avx512_bf16" and ("avx512_bf16" not in flags or amx_expected()):
        pytest.skip("this CPU has no AVX512-BF16, or has AMX (the amx case)")
    if isa == "avx512_bf16" and os.environ.get("ARLM_MARCH", "native") != "native":
        pytest.skip("kernels built for another ISA (ARLM_MARCH): torch's bf16 GEMM serves the bf16 path")
    impls = _onednn_matmul_isa(_BF16_PROMPT)
    if isa == "amx":
        assert impls and all("amx" in i for i in impls), impls
    else:
        assert not impls and torch.ops.arlm.bf16_kernel_available() and kernels.bf16_kernel_wanted(), impls
        llm = LLM.load("smollm2", matmul_path="bf16")
        assert llm.matmul_isa == "AVX512-BF16"
        assert all(kernels.unpack_bf16(m.dense_weight).shape == (m.out_features, m.in_features)
                   for m in llm.model.modules() if isinstance(m, QuantizedLinear))


@pytest.mark.parametrize("M,K,N", [(1, 64, 16), (7, 576, 960), (66, 1536, 48), (5, 34, 32)])
def test_bf16_kernel_matches_float64_and_keeps_rows_independent(M, K, N):
    # bf16_linear.cpp (the bf16 path's GEMMs where AVX512-BF16 is built): x rounded to bf16, each
    # product exact, float32 sums and result; a row's result whatever the rows beside it.
    if not torch.ops.arlm.bf16_kernel_available():
        assert "avx512_bf16" not in (cpu_flags() or ()) or os.environ.get("ARLM_MARCH", "native") != "native"
        pytest.skip("built without AVX512-BF16 (this CPU or ARLM_MARCH lacks it): torch's bf16 GEMM serves")
    g = torch.Generator().manual_seed(M * 1000 + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g).bfloat16()
    wp = kernels.pack_bf16(w)
    assert torch.equal(kernels.unpack_bf16(wp), w)
    y = kernels.bf16_linear(x, wp)
    ref = x.bfloat16().double() @ w.double().t()
    assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    for m in (0, M - 1):
        assert torch.equal(kernels.bf16_linear(x[m:m + 1], wp)[0], y[m])


@pytest.mark.slow
def test_kv_dtype_choices(smollm2):
    # "auto": a float16 cache where a quantized model decodes through the native step on CPU, the
    # model's dtype otherwise; the generation and chat caches take it.
    def configured(**kw):
        llm = LLM(smollm2.loaded)
        llm.model = copy.deepcopy(smollm2.model)
        llm.configure(**kw)
        return llm

    llm = configured(quantize="auto", kv_dtype="auto")
    assert llm.kv_dtype == (torch.float16 if native_kernels_expected() else torch.float32)
    llm.generate(["Hello"], SamplingParams(max_new_tokens=2, temperature=0))
    assert llm.engine.cache.k.dtype == llm.kv_dtype
    chat = ChatSession(llm, SamplingParams(max_new_tokens=2))
    assert chat.engine.cache.k.dtype == llm.kv_dtype
    assert configured(quantize=None, kv_dtype="auto").kv_dtype == torch.float32
    # a compiled step runs the modules, which would widen a float16 cache at every step
    assert configured(quantize="auto", kv_dtype="auto", compile=True).kv_dtype == torch.float32
    assert configured(quantize="auto", kv_dtype="float32").kv_dtype == torch.float32
    assert configured(quantize="auto", kv_dtype="int8").kv_dtype == "int8"
    with pytest.raises(ValueError, match="KV cache dtype"):
        configured(kv_dtype="int3")


@pytest.mark.slow
@pytest.mark.parametrize("path", ["bf16", "float32"])
def test_dense_prompt_runs_natively_as_the_modules_do(smollm2, path):
    # --matmul-path bf16 / float32: prompt tokens take the dense copies inside the native layer
    # stack (torch's GEMMs for the linears, the native attention), decode tokens the integer
    # kernels. The prompt's logits match the module path over the same dense copies (the
    # reference: Transformer.forward(dense=True)) to float32 summation order.
    llm, _ = _configured(smollm2, matmul_path=path)
    runner = llm.runner
    assert runner.dense_prefill and runner.native is not None and runner.native.dense_weights is not None
    assert all(w.dtype == (torch.bfloat16 if path == "bf16" else torch.float32)
               for w in runner.native.dense_weights[LayerWeight.WQKV::LayerWeight.COUNT])
    ids = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it runs into the woods.")
    n = len(ids)
    with torch.inference_mode():
        cache = KVCache.pool(llm.model.config, 4, 16, torch.float32)
        native = runner.forward_flat(cache, ids, list(range(n)), [0] * n, [[0, 1, 2, 3]], list(range(n)), dense=True)
        cache = KVCache.pool(llm.model.config, 4, 16, torch.float32)
        cache.set_batch(torch.tensor([[0, 1, 2, 3]]), torch.zeros(n, dtype=torch.long))
        ref = llm.model(torch.tensor([ids]), torch.arange(n)[None], kv_cache=cache,
                        output_index=torch.arange(n), dense=True)
        cache.set_batch(None, None)
    # the head: the native pass reads the quantized head (8-bit twice), the modules its dense copy
    tol = (2e-2 if path == "bf16" else 5e-3) * ref.abs().max().item()
    assert (native - ref).abs().max().item() <= tol
    assert (native.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
