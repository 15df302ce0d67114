"""kernels.pack_k_blocks (gguf_pack.cpp: a file's Q4_K / Q6_K super-blocks straight into the packed
layouts) equals the fields-then-pack path (k_quant_fields, then pack_q4_k / pack_q6_k) bit for
bit, on random blocks: every byte random but the float16 d / dmin (finite values: the Python
path widens them to float32 and back, which keeps every finite value's bits)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arlm import kernels
from arlm.loading.gguf_blocks import k_quant_fields

pytestmark = pytest.mark.skipif(not kernels.native_available(), reason="native kernels not built")

BYTES = {"Q4_K": 144, "Q6_K": 210}


def random_blocks(kind: str, n: int, supers: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n, supers, BYTES[kind]), dtype=np.uint8)
    d = (rng.standard_normal((n, supers, 2)) * 1e-3).astype(np.float16).view(np.uint8).reshape(n, supers, 4)
    if kind == "Q4_K":
        b[..., 0:4] = d  # d, dmin
    else:
        b[..., 208:210] = d[..., 0:2]
    return b


def python_path(b: np.ndarray, kind: str) -> tuple[torch.Tensor, ...]:
    f = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in k_quant_fields(b, kind).items()}
    if kind == "Q4_K":
        return kernels.pack_q4_k(f["q"], f["sc"], f["m"], f["d"], f["dmin"])
    return kernels.pack_q6_k(f["q"], f["sc"], f["d"])


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("n, supers", [(16, 1), (48, 3), (32, 8)])
def test_native_packing_equals_the_fields_path(kind, n, supers):
    b = random_blocks(kind, n, supers, seed=n * 31 + supers + len(kind))
    want = python_path(b, kind)
    got = kernels.pack_k_blocks(torch.from_numpy(b), kind)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g.view(torch.uint8), w.contiguous().view(torch.uint8))


def test_bad_blocks_are_refused():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.pack_k_blocks(torch.zeros(8, 1, 144, dtype=torch.uint8), "Q4_K")
    with pytest.raises(RuntimeError, match="Q6_K's 210"):
        kernels.pack_k_blocks(torch.zeros(16, 1, 144, dtype=torch.uint8), "Q6_K")
