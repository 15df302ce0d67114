"""The constants the native kernels share with Python, defined here once.

The kernel build (`kernels.load_native`) renders them as C++ (`header()`) into `arlm_layout.h`
in its build directory, which decode.cpp and attention.h include; the rendered text is part of
the build's key, so a change here rebuilds the kernels. Each name becomes "k" + its words
capitalized (`LayerWeight.GATE_UP` -> kGateUp, `EXACT_ROWS` -> kExactRows); an enum's COUNT
becomes "k" + the enum's name + "s" (`LayerWeight.COUNT` -> kLayerWeights), and an enum's type
is int64_t, as torch passes an `int` to an op.
"""

from __future__ import annotations

from enum import IntEnum


class LayerWeight(IntEnum):
    """Where each of a layer's weights sits in its slice of the weight list the layer stack takes
    (`kernels.llama.layer_weights`, decode.cpp): a norm is one tensor, a linear three, (w, scale,
    mins). The later families' extras are empty tensors where a model has none (as are WK, WV, UP
    where a projection is one matrix): the per-head
    q/k norms [head_dim] (Qwen 3, Gemma 3), the norms on the attention's and the MLP's outputs
    (Gemma), the q/k/v biases [(H + 2 H_kv) head_dim] (Qwen 2)."""

    ATTN_NORM = 0
    WQKV = 1
    WO = 4
    MLP_NORM = 7
    GATE_UP = 8
    DOWN = 11
    Q_NORM = 14
    K_NORM = 15
    ATTN_POST_NORM = 16
    MLP_POST_NORM = 17
    QKV_BIAS = 18
    # A fused projection whose parts the file stores in different block types (`quant.SplitLinear`):
    # q in WQKV, k and v here; gate in GATE_UP, up here. Empty where the projection is one matrix.
    WK = 19
    WV = 22
    UP = 25
    COUNT = 28  # tensors per layer


class KVFormat(IntEnum):
    """A KV cache's element format as the attention ops take it (`kv_format`, attention.h):
    float32 or float16 rows (told apart by dtype), or quantized rows (arlm.kv_cache)."""

    FLOAT = 0
    INT8 = 1
    INT4 = 2


# Rows of x up to which decode.cpp's float32 matmul (f32_linear_into) runs its own kernel, which
# sums each row in one fixed order whatever the other rows; with more rows a GEMM takes the whole
# matrix and sums in an order of its own. So with float32 matrices a row's result on the native
# stack does not depend on its batch up to this many rows a step (ModelRunner.exact_rows). The
# quantized kernels have no such bound.
EXACT_ROWS = 4

_ENUMS: tuple[type[IntEnum], ...] = (LayerWeight, KVFormat)
_CONSTANTS = {"EXACT_ROWS": EXACT_ROWS}


def cpp_name(name: str, enum: type[IntEnum] | None = None) -> str:
    """A constant's C++ name (see the module docstring): "k" + CamelCase; an enum's COUNT,
    "k" + the enum's name + "s"."""
    if enum is not None and name == "COUNT":
        return f"k{enum.__name__}s"
    return "k" + "".join(word.title() for word in name.split("_"))


def header() -> str:
    """The C++ header `arlm_layout.h`: every constant above in namespace arlm_layout."""
    lines = ["// Generated from arlm/kernels/layout.py by the kernel build (arlm.kernels.load_native):",
             "// the constants the kernels share with Python. Edit them there.",
             "#pragma once", "", "#include <cstdint>", "", "namespace arlm_layout {", ""]
    for enum in _ENUMS:
        lines.append(f"enum {enum.__name__} : int64_t {{")
        lines += [f"  {cpp_name(m.name, enum)} = {int(m)}," for m in enum]
        lines += ["};", ""]
    lines += [f"constexpr int64_t {cpp_name(name)} = {value};" for name, value in _CONSTANTS.items()]
    lines += ["", "}  // namespace arlm_layout", ""]
    return "\n".join(lines)
