"""kernels.pack_gguf_blocks (gguf_pack.cpp: a file's Q4_K / Q6_K super-blocks and Q8_0, Q4_0, Q4_1
blocks straight into the packed layouts) equals the fields-then-pack path (k_quant_fields, then
pack_q4_k / pack_q6_k; Q8_0's values, then pack_int8 / pack_scales; Q4_0's and Q4_1's nibbles and
scales, then pack_q4) bit for bit, on random
blocks: every byte random but the float16 scales (finite values: the Python path widens them to
float32 and back, which keeps every finite value's bits); and the loader's layers
(gguf_layers._k_quant_layer, _block_layer: parts stacked, chunks across a part's end) hold the
same tensors with the native packing on and off."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arlm import kernels
from arlm.loading import gguf_layers
from arlm.loading.gguf_blocks import k_quant_fields

# (the op is in the native library: false only where no C++ compiler builds it, never in CI, which
# installs one; the rest of the suite skips the native paths alike there)
pytestmark = pytest.mark.skipif(not kernels.native_available(), reason="no C++ compiler built the native kernels")

BYTES = {"Q4_K": 144, "Q6_K": 210, "Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22}
BLOCK = {"Q4_K": 256, "Q6_K": 256, "Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32}


def random_blocks(kind: str, n: int, supers: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n, supers, BYTES[kind]), dtype=np.uint8)
    d = (rng.standard_normal((n, supers, 2)) * 1e-3).astype(np.float16).view(np.uint8).reshape(n, supers, 4)
    if kind in ("Q4_K", "Q4_1"):
        b[..., 0:4] = d  # d, dmin (Q4_1: d, m)
    elif kind in ("Q8_0", "Q4_0", "Q5_0"):
        b[..., 0:2] = d[..., 0:2]
    else:
        b[..., 208:210] = d[..., 0:2]
    return b


def python_path(b: np.ndarray, kind: str) -> tuple[torch.Tensor, ...]:
    if kind == "Q5_0":  # (the loader's fields path: gguf_layers.q5_0_layer's without the native packing)
        gguf_layers.NATIVE_PACKING = False
        try:
            return gguf_layers.q5_0_layer(b).tensors()
        finally:
            gguf_layers.NATIVE_PACKING = True
    if kind in ("Q4_0", "Q4_1"):  # (the rows the loader reads, then Q4Linear's packing)
        n, G, _ = b.shape
        d = torch.from_numpy(np.ascontiguousarray(b[..., 0:2]).view(np.float16).reshape(n, G))
        nib = 4 if kind == "Q4_1" else 2
        w = torch.from_numpy(np.ascontiguousarray(b[..., nib:]).reshape(n, 16 * G))
        m = torch.from_numpy(np.ascontiguousarray(b[..., 2:4]).view(np.float16).reshape(n, G)) if kind == "Q4_1" \
            else (d.float() * -8).half()
        wp, scale, mins = kernels.pack_q4(w, d, m)
        return wp, scale, mins if kind == "Q4_1" else torch.empty(0, dtype=torch.float16)
    if kind == "Q8_0":
        n, G, _ = b.shape
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, 32 * G))
        d = torch.from_numpy(np.ascontiguousarray(b[..., 0:2]).view(np.float16).reshape(n, G))
        return kernels.pack_int8(q), kernels.pack_scales(d)
    f = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in k_quant_fields(b, kind).items()}
    if kind == "Q4_K":
        return kernels.pack_q4_k(f["q"], f["sc"], f["m"], f["d"], f["dmin"])
    return kernels.pack_q6_k(f["q"], f["sc"], f["d"])


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0"])
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


@pytest.mark.parametrize("kind, parts", [("Q4_K", (48, 32)), ("Q6_K", (64,)), ("Q8_0", (48, 32)), ("Q8_0", (40, 17)),
                                         ("Q4_0", (48, 32)), ("Q4_1", (32, 16)), ("Q4_0", (40, 17)),
                                         ("Q5_0", (48, 32))])
def test_the_loader_packs_the_same_either_way(kind, parts, monkeypatch):
    """The hooks in gguf_layers: a fused weight's parts, converted 16 rows a chunk (chunks across
    the first part's end), natively and by the fields path: every tensor equal (57 rows: not
    packable, the row layout either way)."""
    supers = 2
    blocks = [random_blocks(kind, n, supers * 256 // BLOCK[kind], seed=n + i) for i, n in enumerate(parts)]
    monkeypatch.setattr(gguf_layers, "_CHUNK_WEIGHTS", 16 * 256 * supers)

    def layer(native: bool):
        monkeypatch.setattr(gguf_layers, "NATIVE_PACKING", native)
        stacked = gguf_layers._Stacked(blocks)
        if kind == "Q5_0":
            return gguf_layers.q5_0_layer(stacked)
        if kind in ("Q8_0", "Q4_0", "Q4_1"):
            return gguf_layers._block_layer(stacked, [kind] * len(parts))
        return gguf_layers._k_quant_layer(stacked, kind)

    native, fields = layer(True), layer(False)
    assert native.packed == fields.packed == (sum(parts) % 16 == 0)
    for got, want in zip(native.tensors(), fields.tensors(), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
