"""The decode library without torch: decode.cpp's layer stacks and head built with ARLM_BARE
(kernels/bare_api.cpp), loaded with ctypes, called on numpy arrays.

The library is keyed, as the torch build is, by its sources and the CPU it is built for; this
module computes the key without importing torch (nothing under `arlm.kernels` is imported: that
package imports torch). The torch side builds it (`build`, from `arlm.bare.write`), in the
background where it may (a detached compiler, its output renamed into place), so no command
waits for it; until it is there, `arlm generate` takes the torch path.
"""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import zlib
from pathlib import Path

import numpy as np

from ..files import atomic_write_text, cache_home, create_tmp

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
SOURCES = ("bare_api.cpp", "decode.cpp", "a8_linear.cpp", "bf16_linear.cpp")
NAME = "libarlm_bare.so"
MAX_DIM = 6  # bare_api.cpp's kMaxDim

# ATen's scalar type numbers (bare_aten.h) of the numpy dtypes the plan's tensors come in
SCALAR_TYPES = {np.dtype(np.uint8): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2, np.dtype(np.int32): 3,
                np.dtype(np.int64): 4, np.dtype(np.float16): 5, np.dtype(np.float32): 6, np.dtype(np.float64): 7}
BFLOAT16 = 15  # (held as uint16 in numpy)


def _march() -> str:
    return os.environ.get("ARLM_MARCH", "native")


def _cpu() -> str:
    """The CPU's identity as the torch build keys it (its model and flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            return platform.processor() + f.read().split("flags", 1)[-1][:2000]
    except OSError:
        return platform.processor()


def key() -> str:
    """The library's key: its sources (and every header beside them), the layout constants'
    source (kernels/layout.py, rendered into arlm_layout.h), the CPU and ARLM_MARCH. (A CRC:
    it tells versions apart, nothing more; hashlib would map OpenSSL's ~3 MB into the process.)"""
    crc = 0
    for p in sorted([*(KERNELS / s for s in SOURCES), *KERNELS.glob("*.h"), KERNELS / "layout.py"]):
        crc = zlib.crc32(p.read_bytes(), zlib.crc32(p.name.encode() + b"\0", crc))
    crc = zlib.crc32((_cpu() + "\0" + _march()).encode(), crc)
    return f"{crc:08x}-{len(SOURCES)}"


def path() -> Path:
    return cache_home() / "kernels" / f"bare-{key()}" / NAME


def build(layout_header: str, wait: bool = False) -> Path | None:
    """Compile the library for this CPU where it is not built yet: the compiler the torch build
    uses ($CXX, else c++) with its -march, OpenMP, the layout constants' header (`layout_header`,
    kernels.layout.header()). wait=False: a detached compiler (~30 s), its output synced and
    renamed into place when done; None then, or where the compiler fails (the torch path stays).
    Returns the library's path once it is there."""
    import time

    lib = path()
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    busy = lib.parent / "building"
    try:  # one build at a time; a marker older than 10 minutes is a killed build's
        fd = os.open(busy, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.close(fd)
    except FileExistsError:
        if time.time() - busy.stat().st_mtime < 600 and not wait:
            return None
        busy.touch()
    header = lib.parent / "arlm_layout.h"
    if not header.exists() or header.read_text() != layout_header:  # (the same text for this key)
        atomic_write_text(header, layout_header)
    tmp = create_tmp(lib)
    cmd = [os.environ.get("CXX", "c++"), "-std=c++17", "-shared", "-fPIC", "-O3", f"-march={_march()}", "-fopenmp",
           "-DARLM_BARE", f"-I{lib.parent}", f"-I{KERNELS}", *(str(KERNELS / s) for s in SOURCES), "-o", tmp]
    q = _quote
    script = (f"{' '.join(q(c) for c in cmd)} 2> {q(str(lib.parent / 'build.log'))} && sync {q(tmp)} "
              f"&& mv -f {q(tmp)} {q(str(lib))}; rm -f {q(tmp)} {q(str(busy))}")
    try:
        if not wait:
            subprocess.Popen(["sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
            return None
        subprocess.run(["sh", "-c", script], check=False)
    except OSError:
        busy.unlink(missing_ok=True)
        Path(tmp).unlink(missing_ok=True)
        return None
    return lib if lib.exists() else None


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


class ArlmTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int64), ("dim", ctypes.c_int64),
                ("sizes", ctypes.c_int64 * MAX_DIM), ("strides", ctypes.c_int64 * MAX_DIM)]


def tensor(a: np.ndarray | None, scalar_type: int | None = None) -> ArlmTensor:
    """A view of `a` as bare_api.cpp takes it (None: an empty float32 tensor). scalar_type: ATen's
    number where the dtype does not say it (bfloat16, held as uint16)."""
    t = ArlmTensor()
    if a is None:
        t.data, t.dtype, t.dim = None, 6, 1
        t.sizes[0], t.strides[0] = 0, 1
        return t
    if a.ndim > MAX_DIM:
        raise ValueError(f"a tensor of {a.ndim} dimensions (at most {MAX_DIM})")
    t.data = a.ctypes.data
    t.dtype = SCALAR_TYPES[a.dtype] if scalar_type is None else scalar_type
    t.dim = a.ndim
    for i, (n, s) in enumerate(zip(a.shape, a.strides)):
        t.sizes[i], t.strides[i] = n, s // a.itemsize
    return t


def tensors(arrays: list[tuple[np.ndarray | None, int | None]]) -> ctypes.Array:
    out = (ArlmTensor * max(1, len(arrays)))()
    for i, (a, st) in enumerate(arrays):
        out[i] = tensor(a, st)
    return out


class Library:
    """The loaded library: its C functions, each raising RuntimeError with the kernel's message."""

    def __init__(self, lib_path: Path) -> None:
        self.lib = ctypes.CDLL(str(lib_path))
        P = ctypes.POINTER(ArlmTensor)
        i64, f64, c_int = ctypes.c_int64, ctypes.c_double, ctypes.c_int
        self.lib.arlm_bare_error.restype = ctypes.c_char_p
        self.lib.arlm_bare_packed.restype = c_int
        self.lib.arlm_bare_amx.restype = c_int
        self.lib.arlm_bare_decode.argtypes = [P, P, i64, P, P, P, P, P, i64, i64, i64, f64, c_int, i64, i64, c_int,
                                              f64, ctypes.POINTER(i64), i64, P, P]
        self.lib.arlm_bare_forward.argtypes = [P, P, i64, P, P, P, P, P, P, P, i64, i64, f64, c_int, i64, i64, i64,
                                               i64, c_int, f64, ctypes.POINTER(i64), i64, P, P, P, P, P]
        self.lib.arlm_bare_head.argtypes = [P, P, P, f64, c_int, c_int, P]
        self.lib.arlm_bare_argmax.argtypes = [ctypes.c_void_p, i64]
        self.lib.arlm_bare_argmax.restype = i64
        self.lib.arlm_bare_set_threads.argtypes = [c_int]

    def check(self, rc: int) -> None:
        if rc:
            raise RuntimeError(self.lib.arlm_bare_error().decode(errors="replace"))

    def packed(self) -> bool:
        return bool(self.lib.arlm_bare_packed())

    def packed_isa(self) -> str:
        """The instructions the packed kernels multiply with: AVX512-VNNI or AVX2."""
        return "AVX512-VNNI" if self.lib.arlm_bare_packed() == 2 else "AVX2"

    def amx(self) -> bool:
        """Prompt rows on the AMX tiles (ARLM_AMX=1 on a CPU with them: a8_linear.cpp's amx_tile)."""
        return bool(self.lib.arlm_bare_amx())

    def set_threads(self, n: int) -> None:
        self.lib.arlm_bare_set_threads(n)

    def argmax(self, row: np.ndarray) -> int:
        assert row.dtype == np.float32 and row.flags.c_contiguous
        return int(self.lib.arlm_bare_argmax(row.ctypes.data, row.size))


def load() -> Library | None:
    """The library where it is built for these sources and this CPU, else None. One that does
    not load (damaged, or without a function this arlm calls) is moved aside, silently: the
    torch path runs, and its next plan check builds the library again."""
    lib = path()
    if not lib.exists():
        return None
    try:
        return Library(lib)
    except (OSError, AttributeError):
        try:
            os.replace(lib, lib.with_suffix(".bad"))
        except OSError:
            pass
        return None
