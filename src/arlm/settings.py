"""Settings shared by the Python API (`LLM`), the command line and the server: each default
written once, and the rules that turn an "auto" setting into a choice.

Two callers, one rule each: `LLM.load` / `LLM.configure` (and `arlm generate`, `arlm chat`)
take a setting's fastest choice for one batch; `arlm serve` takes the choice that keeps a
request's tokens the same however it is batched (`serving=True`). Where the two differ the
rule says so here, beside the other.

A leaf without torch at its top (`arlm serve --help` reads the defaults): the kernels' checks
are imported inside the rules that ask them.
"""

from __future__ import annotations

# The attention sinks of a sliding KV window (StreamingLLM: the first tokens every token attends to).
KV_SINKS = 4

# A quantized model's activation precisions (`arlm.quant.prepare`), the default first: 8 bits
# taken twice (~16 bits: float32's answers).
ACTIVATIONS = ("int8x2", "int8", "float32")
DEFAULT_ACTIVATIONS = ACTIVATIONS[0]

# The older `prefill_dtype` names of the matmul paths (None: the integer kernels, packed where built)
PREFILL_DTYPES = {"quantized": None, "bfloat16": "bf16", "float32": "float32"}

# Sampling temperatures below this are greedy (logits / temperature would overflow float32, and
# the draw is the argmax anyway), as vLLM treats them.
GREEDY_BELOW = 1e-5

# The largest request body the server reads (`--max-body-bytes`).
MAX_BODY_BYTES = 2 << 20

# Requests one server (a replica) takes at once; its engine queues what its batch cannot hold.
MAX_ONGOING_REQUESTS = 256


def auto_dtype(device: str) -> str:
    """`--dtype auto`: bfloat16 on a GPU, float32 elsewhere."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def auto_quantize(device: str, serving: bool = False) -> str | None:
    """`quantize="auto"` on `device` (a device type, "cpu", "cuda"): None (no quantization) off the
    native CPU kernels. With them, "auto": 4-bit for the matrices the file holds exactly (a Q4_1
    GGUF's), int8 for the rest. Serving without the packed kernels (AVX-512 VNNI or AVX2) takes int8
    everywhere: a served batch is compute-bound, and the row-layout kernels unpack int8 cheaper
    (docs/benchmarks.md, Serving)."""
    from . import kernels

    if device != "cpu" or not kernels.native_available():
        return None
    if serving and not kernels.packed_available():
        return "int8"
    return "auto"


def auto_matmul_path(device: str, activations: str, serving: bool = False) -> str:
    """A quantized model's `matmul_path="auto"` on `device` (a device type): float32 off the CPU.
    On the CPU the machine's fastest (`kernels.auto_matmul_path`), the row kernels ("avx2") where
    that is vnni but the activations are float32. Serving takes the integer kernels wherever they
    are built, so that a request's tokens do not depend on how its prompt was chunked or batched,
    or on a preemption (which recomputes generated tokens as a prompt)."""
    from . import kernels

    if device != "cpu":
        return "float32"
    if serving and kernels.native_available():
        return "vnni" if kernels.packed_available() and activations != "float32" else "avx2"
    path = kernels.auto_matmul_path()
    return "avx2" if path == "vnni" and activations == "float32" else path  # (the row kernels, float inputs)


def quantized_matmul_path(matmul_path: str, device: str, activations: str) -> str:
    """A quantized model's matmul path on `device` (a device type): "auto" as `auto_matmul_path`
    (generate's rule), else the path asked for, a ValueError saying why where it cannot run here."""
    from . import kernels

    if matmul_path == "auto":
        return auto_matmul_path(device, activations)
    if device != "cpu" and matmul_path in ("vnni", "avx2"):
        raise ValueError(f"matmul path {matmul_path} runs the CPU's integer kernels; on {device} take bf16 or float32")
    if (why := kernels.matmul_path_error(matmul_path)) is not None:
        raise ValueError(why)
    if activations == "float32" and matmul_path == "vnni":
        raise ValueError("matmul path vnni multiplies 8-bit activations; with float32 activations "
                         "take avx2 (the row kernels), bf16 or float32")
    return matmul_path


def legacy_matmul_path(prefill_dtype: str, matmul_path: str) -> str:
    """The matmul path the older `prefill_dtype` names (given with matmul_path "auto")."""
    from . import kernels

    if prefill_dtype not in PREFILL_DTYPES:
        raise ValueError(f"unknown prefill dtype {prefill_dtype!r} (expected auto, quantized, float32 or "
                         f"bfloat16; or a matmul path)")
    if matmul_path != "auto":
        raise ValueError("give matmul_path or the older prefill_dtype, not both")
    return PREFILL_DTYPES[prefill_dtype] or ("vnni" if kernels.packed_available() else "avx2")
