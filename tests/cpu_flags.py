"""What this machine's CPU and compiler offer, read without arlm or torch.

The policy tests compare the path arlm picks (packed kernels, bf16 prefill and autocast) with
what these raw readings say it must be. Asking the predicates the code itself branches on
(`kernels.packed_available()`, `torch.cpu.get_capabilities()`) could not catch a predicate that
is wrong for this CPU.
"""

from __future__ import annotations

import functools
import os
import subprocess

# The packed a8 kernels' build guard (ARLM_PACKED in src/arlm/kernels/a8_linear.cpp: AVX-512
# VNNI's kernels, else AVX2's), as the /proc/cpuinfo flag names and as the compiler macros -march
# defines for them: either set in full.
PACKED_FLAGS = (("avx512f", "avx512bw", "avx512_vnni", "avx512dq", "avx2", "fma"), ("avx2", "fma", "f16c"))
PACKED_MACROS = (("__AVX512F__", "__AVX512BW__", "__AVX512VNNI__", "__AVX512DQ__", "__AVX2__", "__FMA__"),
                 ("__AVX2__", "__FMA__", "__F16C__"))
VNNI_FLAGS, VNNI_MACROS = PACKED_FLAGS[0], PACKED_MACROS[0]
# Native bf16 matmuls, read at run time (not built in): AVX512-BF16 or AMX.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# The AMX tiles oneDNN multiplies bf16 on (Sapphire Rapids and later Xeons).
AMX_FLAGS = ("amx_tile", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The `flags` line of /proc/cpuinfo (the first CPU's; all of a machine's cores share them),
    or None where there is no such file (not Linux, not x86)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return None


@functools.cache
def march_macros(march: str) -> frozenset[str] | None:
    """The macros the C++ compiler predefines for -march=`march` (as the kernel build calls it:
    $CXX, else c++), or None where it cannot say (no compiler, an unknown -march)."""
    cxx = os.environ.get("CXX", "c++")
    try:
        # (a hang guard: a compiler that does not answer is an error, not "cannot say", which
        # would change what the tests expect)
        r = subprocess.run([cxx, f"-march={march}", "-dM", "-E", "-x", "c++", os.devnull],
                           capture_output=True, text=True, timeout=300)
    except OSError:
        return None
    if r.returncode != 0:
        return None
    return frozenset(line.split()[1] for line in r.stdout.splitlines() if line.startswith("#define "))


def native_kernels_expected() -> bool:
    """The native kernels are meant to build here: ARLM_NO_NATIVE turns them off on purpose
    (test_quant.test_native_kernel_builds fails where they do not build otherwise)."""
    return not os.environ.get("ARLM_NO_NATIVE")


def _built_for(flag_sets, macro_sets) -> bool:
    """Whether the kernels are built for one of these instruction sets: with the default
    ARLM_MARCH=native, where the CPU has every flag of one set; with another ARLM_MARCH, where
    that -march enables every macro of one (it builds for that CPU, not this one)."""
    if not native_kernels_expected():
        return False
    march = os.environ.get("ARLM_MARCH", "native")
    if march == "native":
        flags = cpu_flags()
        return flags is not None and any(all(f in flags for f in s) for s in flag_sets)
    macros = march_macros(march)
    if macros is None:
        raise RuntimeError(f"cannot ask the compiler what -march={march} enables (ARLM_MARCH)")
    return any(all(m in macros for m in s) for s in macro_sets)


def packed_expected() -> bool:
    """Whether the packed a8 kernels must be built: AVX-512 VNNI's or AVX2's (a8_linear.cpp)."""
    return _built_for(PACKED_FLAGS, PACKED_MACROS)


def vnni_expected() -> bool:
    """Whether the packed kernels are AVX-512 VNNI's (not AVX2's)."""
    return _built_for((VNNI_FLAGS,), (VNNI_MACROS,))


def native_bf16_expected() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16)."""
    flags = cpu_flags()
    return flags is not None and any(f in flags for f in BF16_FLAGS)


def attention_backward_expected() -> bool:
    """Whether training's attention backward (kernels/train_attention.cpp) must be built: the CPU
    (ARLM_MARCH=native) or the -march it builds for has AVX512-BF16 and AVX512BW."""
    if not native_kernels_expected():
        return False
    march = os.environ.get("ARLM_MARCH", "native")
    if march == "native":
        flags = cpu_flags()
        return flags is not None and {"avx512_bf16", "avx512bw"} <= flags
    macros = march_macros(march)
    if macros is None:
        raise RuntimeError(f"cannot ask the compiler what -march={march} enables (ARLM_MARCH)")
    return {"__AVX512BF16__", "__AVX512BW__"} <= macros


def amx_expected() -> bool:
    """Whether the CPU has the AMX tiles with bf16 (amx_tile and amx_bf16)."""
    flags = cpu_flags()
    return flags is not None and all(f in flags for f in AMX_FLAGS)


def amx_int8_expected() -> bool:
    """Whether the packed kernels take prompt rows on the AMX-INT8 tiles (a8_linear.cpp's amx_tile):
    built for this CPU or an -march with them (__AMX_INT8__, __AMX_TILE__), the CPU has them, and
    ARLM_AMX=1 turns them on (off by default; the suite's conftest turns them on)."""
    if not packed_expected() or os.environ.get("ARLM_AMX") != "1":
        return False
    flags = cpu_flags()
    if flags is None or not {"amx_tile", "amx_int8"} <= flags:
        return False
    march = os.environ.get("ARLM_MARCH", "native")
    return march == "native" or {"__AMX_INT8__", "__AMX_TILE__"} <= (march_macros(march) or frozenset())


def matmul_path_expected() -> str:
    """LLM.configure's matmul_path="auto" on CPU, for a quantized model (src/arlm/llm.py): the
    packed integer kernels where they are built, else bf16 copies where bf16 is native, else
    float32 copies."""
    return "vnni" if packed_expected() else "bf16" if native_bf16_expected() else "float32"
