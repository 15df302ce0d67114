"""Weight-only int8: the native kernel against float math, and the quantized model's quality.

References: float64 matmul of the same (dequantized) weights for the kernel; the float32 model's
perplexity on tiny Shakespeare's validation text for quality.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from arlm import kernels
from arlm.generate import Generation
from arlm.llm import LLM
from arlm.quant import Int8Linear, quantize_int8, weight_bytes
from arlm.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def test_native_kernel_builds():
    # CI has gcc and ninja: the fast path must be the one tested, not the fallback.
    assert kernels.native_available()


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


def test_int8_linear_rows_are_independent():
    # Batching must not change a row's result (continuous batching relies on it): bitwise.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 576, generator=g)
    w = torch.randint(-127, 128, (300, 576), generator=g, dtype=torch.int8)
    s = torch.rand(300, generator=g)
    together = kernels.int8_linear(x, w, s)
    for i in range(9):
        assert torch.equal(kernels.int8_linear(x[i:i + 1].contiguous(), w, s)[0], together[i])


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


@pytest.fixture(scope="module")
def int8_smollm2(smollm2):
    llm = LLM(smollm2.loaded)
    llm.model = quantize_int8(copy.deepcopy(smollm2.model))
    llm.quantization = "int8"
    return llm


def _perplexity(model, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        logits = model(ids)
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return nll.exp().item()


def test_int8_perplexity_within_one_percent(smollm2, int8_smollm2):
    text = (ROOT / "data" / "tinyshakespeare.txt").read_text()
    val = text[int(0.9 * len(text)):]  # the usual validation split: last 10%
    ids = torch.tensor(smollm2.tokenizer.encode(val)[:4096]).view(4, 1024)
    fp32, int8 = _perplexity(smollm2.model, ids), _perplexity(int8_smollm2.model, ids)
    assert 5 < fp32 < 100  # a sane model on English text
    assert abs(int8 / fp32 - 1) <= 0.01, (fp32, int8)


def test_int8_weights_are_a_quarter(smollm2, int8_smollm2):
    fp32, int8 = weight_bytes(smollm2.model), weight_bytes(int8_smollm2.model)
    assert fp32 == 4 * 134_515_008  # every SmolLM2 weight (embedding counted once as the head)
    assert int8 < 0.26 * fp32


def test_int8_generation_runs_the_same_engine(int8_smollm2):
    # The quantized model goes through the same prefill + KV-cached decode; cached equals
    # uncached recomputation for it too.
    ids = int8_smollm2.tokenizer.encode("The capital of France is")
    gen = Generation(int8_smollm2.model, [ids], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    for _ in gen:
        pass
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(12):
            seq.append(int(int8_smollm2.model(torch.tensor([seq]))[0, -1].argmax()))
    assert gen.completions[0] == seq[len(ids):]
