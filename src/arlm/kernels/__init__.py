"""Native CPU kernels, compiled on first use with the machine's C++ compiler for its own CPU.

`int8_linear(x, w, scale)` and `q4_linear(x, w, scale, mins)` are the decode matmuls for int8 and
4-bit weights with float32 activations; `int8_linear_a8` and `q4_linear_a8` quantize the
activations to 8 bits in groups of 32 (`quantize_activations`) and multiply in integers, the
faster path decode uses by default. On CPUs with AVX-512 VNNI or AVX2, `pack_int8` / `pack_q4` lay the
same weights out 16 output channels to a vector (`int8_linear_a8p`, `q4_linear_a8p`: the same
products, 2-3x faster with several rows; a8_linear.cpp). When the kernels cannot be built (no
compiler, a build error) the ops run as pure-PyTorch fallbacks: correct, slower.

ARLM_MARCH (default "native") is the compiler's -march: e.g. ARLM_MARCH=znver3 builds the AVX2
paths on an AVX-512 machine, to test what a CPU without AVX-512 runs. decode.cpp's per-pass
timer is in every build, off until `torch.ops.arlm.decode_profile(True)` (benchmarks/phases.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

import torch

from ..files import cache_home, locked
from ..runtime import runtime
from . import layout

log = logging.getLogger(__name__)
_SOURCES = [Path(__file__).with_name(name) for name in ("int8_linear.cpp", "q4_linear.cpp", "a8_linear.cpp",
                                                         "bf16_linear.cpp", "decode.cpp", "paged_attention.cpp",
                                                         "gguf_pack.cpp")]
_LAYOUT_HEADER = "arlm_layout.h"  # written into the build directory from layout.header()
_LIBRARY = "arlm_kernels"  # (the runtime's name for the process's one build of them, normal or profiling)


def _build_dir(name: str, sources: list[Path], defines: tuple[str, ...] = ()) -> Path:
    # Keyed by source, generated header, defines, torch version and CPU: the build uses
    # -march=native for this very CPU.
    cpu = platform.processor() + open("/proc/cpuinfo").read().split("flags", 1)[-1][:2000] \
        if os.path.exists("/proc/cpuinfo") else platform.processor()
    # included by the sources: the headers beside them
    headers = sorted({h for p in [*sources, Path(__file__)] for h in p.parent.glob("*.h")})
    source = (b"".join(p.read_bytes() for p in [*sources, *headers]) + layout.header().encode() + b"-fopenmp"
              + "".join(f" -D{d}" for d in defines).encode())
    key = hashlib.sha256(source + torch.__version__.encode() + cpu.encode() + _march().encode()).hexdigest()[:16]
    return cache_home() / "kernels" / f"{name}-{key}"


def _march() -> str:
    return os.environ.get("ARLM_MARCH", "native")


def load_native(name: str, sources: list[Path], what: str, defines: tuple[str, ...] = ()) -> bool:
    """Build (once per machine and source version) and load a library of torch ops, with
    `layout.header()` as arlm_layout.h on its include path and each of `defines` defined.

    Returns False, with one warning, when it cannot be built (no compiler, no ninja, a build
    error) or ARLM_NO_NATIVE is set; callers then use their PyTorch fallbacks.
    """
    if os.environ.get("ARLM_NO_NATIVE"):
        return False
    try:
        build = _build_dir(name, sources, defines)
        build.mkdir(parents=True, exist_ok=True)
        lib = build / f"{name}.so"
        # (the linker writes lib in place: a build in another process ends before this one looks;
        # not "lock", the name of torch's own baton file there)
        with locked(build / "arlm-build.lock"):
            _load_or_build(name, sources, what, defines, build, lib)
        return True
    except Exception as e:  # noqa: BLE001 - any build failure means: use the fallback
        log.warning("%s unavailable (%s); using the PyTorch fallback", what, e)
        return False


def _load_or_build(name: str, sources: list[Path], what: str, defines: tuple[str, ...], build: Path, lib: Path) -> None:
    if lib.exists():
        torch.ops.load_library(str(lib))
    else:
        from torch.utils.cpp_extension import load  # ~0.15 s (setuptools): only to build

        print(f"arlm: building the {what} for this CPU (once, ~1 min)...", file=sys.stderr)
        (build / _LAYOUT_HEADER).write_text(layout.header())
        load(name=name, sources=[str(p) for p in sources], build_directory=str(build),
             extra_include_paths=[str(build)],
             # -fopenmp: at::parallel_for is an OpenMP pragma in a header; without the flag it
             # silently runs on one thread. libgomp.so.1 resolves to torch's own copy.
             extra_cflags=["-O3", f"-march={_march()}", "-fopenmp", *(f"-D{d}" for d in defines)],
             extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: native bf16 matmuls (prefill on them: docs/benchmarks.md)."""
    caps = runtime().cpu
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


# The matrix paths of a quantized model's compute-bound passes (prompt tokens): the integer
# kernels in the packed layout (AVX-512 VNNI or AVX2) or the row layout, or a dense bf16 / float32
# copy of each weight through torch's GEMMs (oneDNN: AMX tiles where the CPU has them).
MATMUL_PATHS = ("vnni", "avx2", "bf16", "float32")


def matmul_path_error(path: str) -> str | None:
    """Why this machine cannot run `path` (one line), or None where it can."""
    if path not in MATMUL_PATHS:
        return f"unknown matmul path {path!r} (expected auto, {', '.join(MATMUL_PATHS)})"
    if path == "vnni" and not packed_available():
        return ("matmul path vnni needs the packed kernels: a CPU with AVX-512 VNNI (avx512f, avx512bw, "
                "avx512dq, avx512_vnni) or AVX2 (avx2, fma, f16c) and the native kernels built for it; "
                "try avx2, bf16 or float32")
    if path == "avx2" and not native_available():
        return "matmul path avx2 needs the native kernels, which are not built here; try bf16 or float32"
    return None


def bf16_kernel_wanted() -> bool:
    """The bf16 path's GEMMs through bf16_linear.cpp (float32 results): where it is built
    (AVX512-BF16) and the CPU has no AMX (there torch's bf16 GEMM takes the tiles, results rounded
    to bf16: faster, less faithful)."""
    caps = runtime().cpu
    return native_available() and torch.ops.arlm.bf16_kernel_available() and not caps.get("amx_bf16")


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """bf16 w [N, K] (N a multiple of 16, K even) -> [N/16, K/2, 32]: for each block of 16 output
    channels and each pair of K-values, the 16 channels' pairs side by side (`bf16_linear`)."""
    N, K = w.shape
    return w.contiguous().view(N // 16, 16, K // 2, 2).permute(0, 2, 1, 3).contiguous().view(N // 16, K // 2, 32)


def unpack_bf16(wp: torch.Tensor) -> torch.Tensor:
    """`pack_bf16`'s inverse."""
    NB, P, _ = wp.shape
    return wp.view(NB, P, 16, 2).permute(0, 2, 1, 3).reshape(NB * 16, 2 * P)


def bf16_linear(x: torch.Tensor, wp: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 times `pack_bf16`'s weights: x rounded to bf16, float32 sums and result."""
    return torch.ops.arlm.bf16_linear(x.contiguous(), wp)


def auto_matmul_path() -> str:
    """The path `--matmul-path auto` takes on this CPU, from its flags (read once at load): the
    packed integer kernels where they are built (AVX-512 VNNI or AVX2: faster than bf16 GEMMs on a Zen 4 and
    float32's answers, docs/benchmarks.md), else bf16 copies where the CPU multiplies bf16 natively
    (AVX512-BF16 or AMX), else float32 copies."""
    return "vnni" if packed_available() else "bf16" if cpu_has_native_bf16() else "float32"


def amx_active() -> bool:
    """Whether the packed kernels take the prompt's rows 16 at a time on the AMX tiles: built with
    AMX-INT8, granted the tiles by Linux, and turned on (ARLM_AMX=1; off by default: they did not
    pay here). Each row's result is the one AVX512-VNNI gives it, bit for bit."""
    return packed_available() and torch.ops.arlm.amx_active()


def matmul_isa(path: str) -> str:
    """The instructions `path` multiplies with on this CPU, for stats: e.g. "AVX512-VNNI", "AMX"."""
    if path == "vnni":  # prompt rows on the AMX tiles where the CPU has them (a8_linear.cpp's amx_tile)
        return "AVX512-VNNI+AMX-INT8" if amx_active() else packed_isa()
    if path == "avx2":
        return "AVX2"
    caps = runtime().cpu
    if path == "bf16":  # torch's GEMM on the AMX tiles, else bf16_linear.cpp, else torch's GEMM emulating bf16
        return "AMX" if caps.get("amx_bf16") else "AVX512-BF16" if caps.get("avx512_bf16") else "emulated"
    return {"AVX512": "AVX512", "AVX2": "AVX2"}.get(torch.backends.cpu.get_cpu_capability(), "default")


def native_available() -> bool:
    """The native kernels (linears, the layer stack, paged attention) are built and loaded."""
    return runtime().library(_LIBRARY, _load_kernels)


def train_kernels_available() -> bool:
    """Training's native passes (train.cpp: the cross-entropy gradient over a block of logits, in
    place) are built and loaded; a library of their own, so a change to them rebuilds nothing else."""
    def load() -> bool:
        sources = [Path(__file__).with_name(n) for n in ("train.cpp", "train_attention.cpp")]
        return (load_native("arlm_train_kernels", sources, "native training kernels")
                and hasattr(torch.ops.arlm_train, "softmax_xent_"))

    return runtime().library("arlm_train_kernels", load)


def attention_backward_supported() -> bool:
    """Training's native attention backward (train_attention.cpp) is built for this CPU (AVX512-BF16)."""
    return train_kernels_available() and torch.ops.arlm_train.attention_backward_supported()


def _load_kernels() -> bool:
    loaded = (load_native(_LIBRARY, _SOURCES, "native int8/4-bit kernels")
              and all(hasattr(torch.ops.arlm, op) for op in
                      ("int8_linear", "q4_linear", "int8_linear_a8", "q4_linear_a8", "decode_llama",
                       "paged_attention")))
    if loaded:
        _register_fake()
    return loaded


def _register_fake() -> None:
    """Shape rule for torch.compile: it traces the op as an opaque call instead of breaking."""

    for op in ("int8_linear", "q4_linear", "int8_linear_a8", "q4_linear_a8"):  # all [M, K] x [N, .] -> [M, N]
        torch.library.register_fake(f"arlm::{op}")(lambda x, w, *scales: x.new_empty(x.shape[0], w.shape[0]))
    torch.library.register_fake("arlm::argmax_rows")(lambda x: x.new_empty(x.shape[0], dtype=torch.long))
    for op in ("int8_linear_a8p", "q4_linear_a8p", "kquant_linear_a8p"):  # packed: [M, K] x [N / 16, ., 64] -> [M, N]
        torch.library.register_fake(f"arlm::{op}")(lambda x, w, *scales: x.new_empty(x.shape[0], 16 * w.shape[0]))


def _fallback(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if scale.dim() == 2:  # Q8_0: a scale per group of 32 (per 16: Q6_K's d sc)
        return torch.nn.functional.linear(x, (w.float().view(*scale.shape, -1) * scale.float()[..., None]).view(w.shape))
    return torch.nn.functional.linear(x, w.to(x.dtype)) * scale


def unpack_q4(w: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Packed 4-bit weights (see q4_linear.cpp for the layout) -> float32 [N, K]."""
    N = w.shape[0]
    groups = w.view(N, -1, 16)  # [N, G, 16]: byte j holds elements j (low) and 16 + j (high)
    q = torch.cat([groups & 0x0F, groups >> 4], dim=-1).float()  # [N, G, 32]
    return (q * scale.float()[..., None] + mins.float()[..., None]).view(N, -1)


def q4_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32, w [N, K/2] uint8, scale and mins [N, K/32] float16 (or float32: Q4_K's
    d sc and -dmin m) -> [M, N] float32."""
    if x.device.type == "cpu" and native_available():
        return torch.ops.arlm.q4_linear(x.contiguous(), w, scale, mins)
    return torch.nn.functional.linear(x, unpack_q4(w, scale, mins).to(x.dtype))


def int8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32, w [N, K] int8, scale [N] float32 (per row), [N, K/32] float16 (Q8_0, per
    group of 32) or float32 [N, K/32] or [N, K/16] (Q6_K's d sc, per 16) -> [M, N] float32."""
    if x.device.type == "cpu" and native_available():
        return torch.ops.arlm.int8_linear(x.contiguous(), w, scale)
    return _fallback(x, w, scale)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 (K a multiple of 32) -> (q int8 [M, K], scale [M, K/32]) with
    x ~= q * scale per group of 32: scale = max|x| / 127, q = round-half-even(x * (1 / scale)).
    The same float32 operations as the native kernels, so both quantize bitwise alike."""
    M, K = x.shape
    g = x.float().reshape(M, K // 32, 32)
    d = g.abs().amax(dim=-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(g * inv[..., None]).to(torch.int8)
    return q.view(M, K), d


def dequantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the integer kernels read it: int8 per group of 32 (`quantize_activations`),
    back in float32."""
    q, d = quantize_activations(x)
    return (q.view(*d.shape, 32).float() * d[..., None]).view(q.shape)


def q4_linear_a8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Like `q4_linear`, with x quantized to 8 bits per group of 32 first (integer dot products)."""
    if x.device.type == "cpu" and native_available():
        return torch.ops.arlm.q4_linear_a8(x.contiguous(), w, scale, mins)
    return torch.nn.functional.linear(dequantized_activations(x), unpack_q4(w, scale, mins))


def int8_linear_a8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Like `int8_linear`, with x quantized to 8 bits per group of 32 first (K a multiple of 32)."""
    if x.device.type == "cpu" and native_available():
        return torch.ops.arlm.int8_linear_a8(x.contiguous(), w, scale)
    return _fallback(dequantized_activations(x), w, scale)


def packed_available() -> bool:
    """The packed a8 kernels are built: AVX-512 VNNI's, else AVX2's (with FMA and F16C), the same
    layouts and products (a8_linear.cpp); elsewhere the row-layout kernels serve."""
    return native_available() and torch.ops.arlm.packed_a8_available()


def packed_isa() -> str:
    """The instructions the packed kernels multiply with: "AVX512-VNNI" or "AVX2" ("" unbuilt)."""
    return torch.ops.arlm.packed_a8_isa() if native_available() else ""


def pack_int8(w: torch.Tensor) -> torch.Tensor:
    """int8 w [N, K] (N a multiple of 16) -> uint8 [N/16, K/4, 64]: for each block of 16 output
    channels and each 4 K-values, the 16 channels' 4 bytes side by side, offset to unsigned
    (w XOR 0x80): the operand layout of `int8_linear_a8p` (a8_linear.cpp)."""
    N, K = w.shape
    u = (w.contiguous().view(torch.uint8) ^ 0x80).view(N // 16, 16, K // 4, 4)
    return u.permute(0, 2, 1, 3).contiguous().view(N // 16, K // 4, 64)


def unpack_int8(wp: torch.Tensor) -> torch.Tensor:
    """`pack_int8`'s inverse: uint8 [N/16, K/4, 64] -> int8 [N, K]."""
    NB, C, _ = wp.shape
    return (wp.view(NB, C, 16, 4).permute(0, 2, 1, 3).reshape(NB * 16, C * 4) ^ 0x80).view(torch.int8)


def pack_scales(s: torch.Tensor) -> torch.Tensor:
    """Per-group scales [N, G] -> [N/16, G, 16]: the 16 channels of a packed block side by side."""
    N, G = s.shape
    return s.reshape(N // 16, 16, G).transpose(1, 2).contiguous()


def unpack_scales(s: torch.Tensor) -> torch.Tensor:
    """`pack_scales`' inverse: [N/16, G, 16] -> [N, G]."""
    NB, G, _ = s.shape
    return s.transpose(1, 2).reshape(NB * 16, G)


def unpack_packed_q4(wp: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`pack_q4`'s inverse: the packed 4-bit layout -> the row layout (w, scale, mins; mins empty
    where the packed layer stores none: Q4_0's -8 scale)."""
    NB, C, _ = wp.shape  # C = K / 8
    b = wp.view(NB, C, 16, 4).permute(0, 2, 1, 3)  # [NB, 16, K/8, 4]
    q = torch.stack([b & 0x0F, b >> 4], dim=3).reshape(NB * 16, C * 8 // 32, 32)  # [N, G, 32]
    w = (q[..., :16] | (q[..., 16:] << 4)).reshape(NB * 16, C * 4)
    return w, unpack_scales(scale), unpack_scales(mins) if mins.numel() else mins


def pack_q4(w: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Row-layout 4-bit weights (q4_linear.cpp) -> the layout of `q4_linear_a8p`: uint8
    [N/16, K/8, 64] (for 16 channels, 8 K-values each: the first 4 in the low nibbles, the next 4
    in the high ones) and scale, mins float16 [N/16, K/32, 16] (16 channels' scales side by side)."""
    N, G = scale.shape
    K = 32 * G
    groups = w.view(N, G, 16)
    q = torch.cat([groups & 0x0F, groups >> 4], dim=-1).view(N // 16, 16, K // 8, 2, 4)
    packed = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous().view(N // 16, K // 8, 64)

    return packed, pack_scales(scale), pack_scales(mins)


def pack_q4_k(q: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor,
              dmin: torch.Tensor, five_bit: bool = False) -> tuple[torch.Tensor, ...]:
    """Q4_K's fields (w = d sc q - dmin m: q uint8 [N, K] in 0..15; sc, m uint8 [N, K/32], the
    6-bit scale and min of each group of 32; d, dmin [N, K/256], each super-block's float16 values)
    -> a8_linear.cpp's Q4_K layout: the 4-bit packed weights of `pack_q4` [N/16, K/8, 64], scale
    uint8 [N/16, K/256, 192] (`pack_kscales`: the file's 12 bytes a channel and super-block) and
    supers float16 [N/16, K/256, 32] (d, then dmin: the file's float16 values, exactly).
    five_bit: Q5_K's, q in 0..31, in `pack_q5`'s layout."""
    N, K = q.shape
    if five_bit:
        wp = pack_q5(q)
    else:
        qq = q.view(N // 16, 16, K // 8, 2, 4)
        wp = (qq[:, :, :, 0] | (qq[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous().view(N // 16, K // 8, 64)
    return (wp, pack_kscales(sc, m),
            torch.cat([pack_scales(d.half()), pack_scales(dmin.half())], dim=2).contiguous())


def pack_kscales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_K's / Q5_K's 6-bit sc and m (uint8 [N, K/32]) -> uint8 [N/16, K/256, 192], per block of 16
    channels and super-block (a8_linear.cpp's KScales): bytes 16 j + c = the low 4 bits of channel
    c's sc | those of its m << 4, for the 8 groups j; then bytes 128 + 16 k + c = the top 2 bits
    of group k's sc | its m's << 2, in the low nibble, and group k + 4's in the high (k < 4)."""
    N, G = sc.shape
    sc, m = (t.to(torch.uint8).view(N // 16, 16, G // 8, 8).permute(0, 2, 3, 1) for t in (sc, m))  # [NB, S, j, c]
    low = (sc & 15) | ((m & 15) << 4)
    top = (sc >> 4) | ((m >> 4) << 2)  # 4 bits each
    return torch.cat([low.reshape(N // 16, G // 8, 128),
                      (top[:, :, :4] | (top[:, :, 4:] << 4)).reshape(N // 16, G // 8, 64)], dim=2).contiguous()


def kscale_rows(scale: torch.Tensor, lane: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_kscales`' inverse for some channels: scale uint8 [T, K/256, 192] (each row its channel's
    block), lane [T] (the channel in its block) -> sc, m uint8 [T, K/32]."""
    T, S = scale.shape[0], scale.shape[1]
    rows = torch.arange(T)
    low = scale[:, :, :128].view(T, S, 8, 16)[rows, :, :, lane]  # [T, S, 8]
    pairs = scale[:, :, 128:].view(T, S, 4, 16)[rows, :, :, lane]  # [T, S, 4]: groups k, k + 4
    top = torch.cat([pairs & 15, pairs >> 4], dim=-1)
    sc = (low & 15) | ((top & 3) << 4)
    m = (low >> 4) | ((top >> 2) << 4)
    return sc.reshape(T, 8 * S), m.reshape(T, 8 * S)


def pack_gguf_blocks(blocks: torch.Tensor, kind: str) -> tuple[torch.Tensor, ...]:
    """A GGUF file's Q4_K, Q6_K, Q8_0, Q4_0, Q4_1 or Q5_0 blocks, uint8 [N, K / block, bytes] (N a
    multiple of 16) -> the packed layout of them, bit for bit `pack_q4_k`'s / `pack_q6_k`'s (of their
    fields), `pack_int8` + `pack_scales`' (of Q8_0's values and scales), `pack_q4`'s (of Q4_0's and
    Q4_1's nibbles and scales; Q4_0's mins empty, as its packed layer keeps them) and `pack_q5`'s (of
    Q5_0's values + 16, with d and -16 d as scales and mins), natively (gguf_pack.cpp: the file's
    bytes moved once; the fields-then-pack path takes 20-40x longer on a matrix). Only where
    native_available() holds (it loads the kernels)."""
    codes = {"Q4_K": 4, "Q6_K": 6, "Q8_0": 8, "Q4_0": 40, "Q4_1": 41, "Q5_0": 50}
    return tuple(torch.ops.arlm.pack_gguf_blocks(blocks.contiguous(), codes[kind]))


def pack_q5(q: torch.Tensor) -> torch.Tensor:
    """5-bit values q uint8 [N, K] (0..31) -> a8_linear.cpp's 5-bit layout [N/16, K/8, 80]: per 8
    K-values of 16 channels, `pack_q4`'s 64 bytes of their low 4 bits, then two 64-bit masks
    (little-endian) of their 5th bits, bit i for byte i of the low-nibble vector, then of the high."""
    N, K = q.shape
    qq = (q & 0x0F).view(N // 16, 16, K // 8, 2, 4)
    low = (qq[:, :, :, 0] | (qq[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(N // 16, K // 8, 64)
    bits = (q >> 4).view(N // 16, 16, K // 8, 2, 4).permute(0, 2, 3, 1, 4).reshape(N // 16, K // 8, 2, 8, 8)
    masks = (bits.to(torch.int32) << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8)
    return torch.cat([low, masks.view(N // 16, K // 8, 16)], dim=2).contiguous()


def unpack_q5_rows(wp: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Output rows `index` [T] of `pack_q5`'s layout as their values, uint8 [T, K]."""
    NB, C, _ = wp.shape
    b, lane = index // 16, index % 16
    nib = wp[:, :, :64].reshape(NB, C, 16, 4)[b, :, lane, :]  # [T, K/8, 4]
    bits = ((wp[b, :, 64:].reshape(len(index), C, 2, 8, 1) >> torch.arange(8, dtype=torch.uint8)) & 1)
    bits = bits.reshape(len(index), C, 2, 64)
    at = (lane[:, None] * 4 + torch.arange(4))[:, None, None, :].expand(len(index), C, 2, 4)
    high = torch.gather(bits, 3, at)  # [T, K/8, 2, 4]
    return (torch.stack([nib & 0x0F, nib >> 4], dim=2) | (high << 4)).reshape(len(index), C * 8)


# Q6_K's top two bits (a8_linear.cpp load_q6): byte c of a 32-bit word of the stored 16 bytes,
# rotated right by 2L in the vector's 128-bit lane L, holds at bits 4-5 the top bits of the
# vector's byte 16L + 4w + c. So stored byte (w, c) carries: bits 0-1 lane 2's byte (w, c - 1),
# bits 2-3 lane 3's (w, c - 1), bits 4-5 lane 0's (w, c), bits 6-7 lane 1's (w, c) (c - 1 mod 4).
_Q6_LANE_AT_SHIFT = (2, 3, 0, 1)  # the lane whose bits sit at bits 0-1, 2-3, 4-5, 6-7
_Q6_BYTE_OFFSET = (1, 1, 0, 0)    # ... and from which neighbouring byte (c - offset)


def pack_q6_k(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q6_K's fields (w = d sc q: q int8 [N, K] in -32..31, sc int8 [N, K/16], d [N, K/256], the
    file's float16 values) -> a8_linear.cpp's Q6_K layout: wp uint8 [N/16, K/8, 96] (u = q + 32:
    `pack_q4`'s 64 bytes of its low 4 bits per 8 K-values, then 16 + 16 bytes of its top 2 bits for
    the low- and high-nibble vectors, where load_q6's rotation finds them), scale int8
    [N/16, K/16, 16], supers float16 [N/16, K/256, 16]: 6.5625 bits a weight, as the file."""
    N, K = q.shape
    u = (q.to(torch.int16) + 32).to(torch.uint8)
    uu = (u & 0x0F).view(N // 16, 16, K // 8, 2, 4)
    low = (uu[:, :, :, 0] | (uu[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(N // 16, K // 8, 64)
    # top bits by vector byte: [N/16, K/8, 2 (low / high nibbles), 4 (lane), 4 (word), 4 (byte)]
    top = (u >> 4).view(N // 16, 16, K // 8, 2, 4).permute(0, 2, 3, 1, 4).reshape(N // 16, K // 8, 2, 4, 4, 4)
    packed = torch.zeros(N // 16, K // 8, 2, 4, 4, dtype=torch.uint8)
    for slot, (lane, offset) in enumerate(zip(_Q6_LANE_AT_SHIFT, _Q6_BYTE_OFFSET)):
        packed |= torch.roll(top[:, :, :, lane], shifts=offset, dims=-1) << (2 * slot)
    wp = torch.cat([low, packed.view(N // 16, K // 8, 32)], dim=2).contiguous()
    return wp, pack_scales(sc), pack_scales(d.half())


def packed_rows(wp: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, index: torch.Tensor,
                in_features: int) -> torch.Tensor:
    """Rows `index` [T] of a packed Q8_0 layer (`pack_int8`'s codes, `pack_scales`' float16 scale
    per 32; mins empty) or Q6_K layer (`pack_q6_k`'s) as float32 [T, in_features], natively: the
    values `quant`'s layers give (Q8Linear, KQuantLinear's Q6_K), bit for bit, in one pass (an
    embedding's lookup, each decode step)."""
    return torch.ops.arlm.packed_rows(wp, scale, mins, index.contiguous(), in_features)


def kquant_linear_a8p(x: torch.Tensor, wp: torch.Tensor, scale: torch.Tensor, supers: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 times a Q4_K, Q5_K or Q6_K layer in its packed layout (`pack_q4_k`, `pack_q6_k`),
    x quantized to 8 bits per group of 32. Only where packed_available() holds (it loads the kernels)."""
    if not packed_available():
        raise RuntimeError("K-quant layers need the packed kernels (a CPU with AVX-512 VNNI or AVX2)")
    return torch.ops.arlm.kquant_linear_a8p(x.contiguous(), wp, scale, supers)


def int8_linear_a8p(x: torch.Tensor, wp: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`int8_linear_a8` over `pack_int8`'s layout (packed_available() must hold); scale [N] float32,
    or Q8_0's per-group scales as `pack_scales` lays them out, [N/16, K/32, 16] float16."""
    return torch.ops.arlm.int8_linear_a8p(x.contiguous(), wp, scale)


def q4_linear_a8p(x: torch.Tensor, wp: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """`q4_linear_a8` over `pack_q4`'s layout (packed_available() must hold)."""
    return torch.ops.arlm.q4_linear_a8p(x.contiguous(), wp, scale, mins)


def linear_a8p_residual(x: torch.Tensor, wp: torch.Tensor, scale: torch.Tensor,
                        mins: torch.Tensor | None = None) -> torch.Tensor:
    """A packed layer (`int8_linear_a8p` / `q4_linear_a8p`'s operands) with its 8-bit activations
    taken twice: x quantized to 16 bits per group of 32 (step max|x| / 32512) and split into two
    bytes, 256 hi + lo, each multiplied in integers (a8_linear.cpp, x16p_block). packed_available()
    must hold."""
    return torch.ops.arlm.linear_a8p_residual(x.contiguous(), wp, scale, torch.empty(0) if mins is None else mins)


def linear_a8p_residual_parts(x: torch.Tensor, layers: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """`linear_a8p_residual` of several packed layers (each its `tensors()`) on the same x, their
    outputs side by side: what the native layer stack runs for a projection held in parts
    (q, k, v of different block types), x quantized once and a decode step's rows in one pass
    of the thread pool. Each output is the part's own call's, bit for bit."""
    flat = [t for wp, scale, *mins in layers for t in (wp, scale, mins[0] if mins and mins[0] is not None
                                                        else torch.empty(0))]
    return torch.ops.arlm.linear_a8p_residual_parts(x.contiguous(), flat)


def mask_rows(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf wherever bit t of bits[i] is 0 (llguidance's token
    bitmask, [n, ceil(V / 32)] int32: bit t % 32 of word t / 32), and past the mask's words. On
    CPU a native kernel that skips the all-allowed words (no [n, V] bool mask is built)."""
    if (logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype == torch.float32
            and logits.is_contiguous() and native_available()):
        torch.ops.arlm.mask_rows(logits, rows.long().contiguous(), bits.int().contiguous())
        return
    V = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits.to(logits.device)[:, :, None] >> shifts) & 1).flatten(1).bool()[:, :V]
    if allowed.shape[1] < V:
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]), value=False)
    index = rows.to(logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for [B, V] logits (the same index: first maximum, or first NaN); on CPU a
    native kernel (torch's index reductions are slow there: 1.3 ms for [32, 49152])."""
    if (x.device.type == "cpu" and x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] > 0
            and native_available()):
        return torch.ops.arlm.argmax_rows(x.contiguous())
    return x.argmax(dim=-1)
