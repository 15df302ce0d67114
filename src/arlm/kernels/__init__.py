"""Native CPU kernels, compiled on first use with the machine's C++ compiler for its own CPU.

`int8_linear(x, w, scale)` is the decode matmul for int8 weights. When the kernel cannot be built
(no compiler, a build error) the same op runs as a pure-PyTorch fallback: correct, slower.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("int8_linear.cpp")
_state: dict[str, bool] = {}


def _build_dir() -> Path:
    # Keyed by source, torch version and CPU: the build uses -march=native for this very CPU.
    cpu = platform.processor() + open("/proc/cpuinfo").read().split("flags", 1)[-1][:2000] \
        if os.path.exists("/proc/cpuinfo") else platform.processor()
    key = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode() + cpu.encode()).hexdigest()[:16]
    root = Path(os.environ.get("ARLM_CACHE", Path.home() / ".cache" / "arlm"))
    return root / "kernels" / key


def native_available() -> bool:
    """Build (once per machine, ~1 min) and load the native kernels; False if that fails."""
    if "native" not in _state:
        _state["native"] = False
        if os.environ.get("ARLM_NO_NATIVE"):
            return False
        try:
            from torch.utils.cpp_extension import load

            build = _build_dir()
            build.mkdir(parents=True, exist_ok=True)
            lib = build / "arlm_kernels.so"
            if lib.exists():
                torch.ops.load_library(str(lib))
            else:
                print("arlm: building the native int8 kernel for this CPU (once, ~1 min)...", file=sys.stderr)
                load(name="arlm_kernels", sources=[str(_SOURCE)], build_directory=str(build),
                     extra_cflags=["-O3", "-march=native", "-ffp-contract=fast"], is_python_module=False,
                     verbose=False)
            _state["native"] = hasattr(torch.ops.arlm, "int8_linear")
            if _state["native"]:
                _register_fake()
        except Exception as e:  # no compiler, no ninja, a build error: fall back, say so once
            log.warning("native kernels unavailable (%s); using the PyTorch fallback", e)
    return _state["native"]


def _register_fake() -> None:
    """Shape rule for torch.compile: it traces the op as an opaque call instead of breaking."""

    @torch.library.register_fake("arlm::int8_linear")
    def _(x, w, scale):
        return x.new_empty(x.shape[0], w.shape[0])


def _fallback(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w.to(x.dtype)) * scale


def int8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32, w [N, K] int8, scale [N] float32 -> [M, N] float32."""
    if x.device.type == "cpu" and native_available():
        return torch.ops.arlm.int8_linear(x.contiguous(), w, scale)
    return _fallback(x, w, scale)
