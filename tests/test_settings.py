"""The "auto" rules of arlm.settings, on every machine a CPU can be: the kernels' checks replaced."""

from __future__ import annotations

import pytest

from arlm import kernels, settings


@pytest.fixture
def machine(monkeypatch):
    def set_(native: bool, packed: bool, bf16: bool = False) -> None:
        monkeypatch.setattr(kernels, "native_available", lambda: native)
        monkeypatch.setattr(kernels, "packed_available", lambda: packed)
        monkeypatch.setattr(kernels, "cpu_has_native_bf16", lambda: bf16)
    return set_


@pytest.mark.parametrize("native,packed,generate,serve", [
    (False, False, None, None), (True, False, "auto", "int8"), (True, True, "auto", "auto")])
def test_auto_quantize_for_generate_and_serve(machine, native, packed, generate, serve):
    machine(native, packed)
    assert settings.auto_quantize("cpu") == generate
    assert settings.auto_quantize("cpu", serving=True) == serve
    assert settings.auto_quantize("cuda") is None and settings.auto_quantize("cuda", serving=True) is None


@pytest.mark.parametrize("native,packed,bf16,activations,generate,serve", [
    (True, True, False, "int8x2", "vnni", "vnni"),
    (True, True, False, "float32", "avx2", "avx2"),
    (True, False, True, "int8x2", "bf16", "avx2"),  # serving keeps every token on the integer kernels
    (True, False, False, "int8", "float32", "avx2"),
    (False, False, True, "int8x2", "bf16", "bf16"),  # no kernels: both take the machine's GEMMs
    (False, False, False, "int8x2", "float32", "float32"),
])
def test_auto_matmul_path_for_generate_and_serve(machine, native, packed, bf16, activations, generate, serve):
    machine(native, packed, bf16)
    assert settings.auto_matmul_path("cpu", activations) == generate
    assert settings.auto_matmul_path("cpu", activations, serving=True) == serve
    assert settings.auto_matmul_path("cuda", activations, serving=True) == "float32"


def test_auto_dtype():
    assert settings.auto_dtype("cuda:0") == "bfloat16" and settings.auto_dtype("cpu") == "float32"


def test_a_quantized_models_matmul_path_checked_and_the_older_names(machine):
    machine(True, True)
    assert settings.quantized_matmul_path("auto", "cpu", "float32") == "avx2"
    assert settings.quantized_matmul_path("bf16", "cpu", "int8x2") == "bf16"
    for path, device, activations in (("vnni", "cuda", "int8x2"), ("vnni", "cpu", "float32"), ("x", "cpu", "int8")):
        with pytest.raises(ValueError):
            settings.quantized_matmul_path(path, device, activations)
    assert settings.legacy_matmul_path("quantized", "auto") == "vnni"
    assert settings.legacy_matmul_path("bfloat16", "auto") == "bf16"
    with pytest.raises(ValueError, match="not both"):
        settings.legacy_matmul_path("float32", "avx2")
