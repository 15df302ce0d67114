"""The process's runtime: the state arlm keeps once per process, in one object.

A few things exist once per process whatever arlm does, and so are not any engine's to own:

- torch's thread pool: every engine's steps run on it, so one `ThreadGovernor` sets its width
  (`threads`; `--threads N` pins it);
- the native kernels: a library of torch ops is built once per machine and loaded once per
  process, its ops registered process-wide (`library`, which `arlm.kernels` asks);
- the CPU's capabilities, read once (`cpu`): which matrix paths this machine runs.

`runtime()` is the process's `Runtime`, made on first use. Front ends take it and pass it on
(`Engine(..., runtime=...)`, the stats, `/metrics`). The one other mutable state at module level
is serve/router_stats.py's: the cluster routers' counts, kept in a module of their own because
Ray ships those classes to their process by value (a global beside them would be two objects).
(Memos of pure functions aside: a compiled chat template, GPT-2's byte table, a Hadamard scale
hold the same value whoever asks first.)
"""

from __future__ import annotations

from functools import cached_property
from typing import Callable

import torch

from .threads import ThreadGovernor


class Runtime:
    """The thread governor, the native libraries loaded, the CPU's capabilities (module doc)."""

    def __init__(self, threads: ThreadGovernor | None = None) -> None:
        self._threads = threads
        self._libraries: dict[str, bool] = {}  # name -> loaded (False: unavailable, fallbacks serve)

    @property
    def threads(self) -> ThreadGovernor:
        """The governor of the steps' width, made on first use at torch's width then (after the
        front end has set torch's threads, e.g. from OMP_NUM_THREADS)."""
        if self._threads is None:
            self._threads = ThreadGovernor()
        return self._threads

    def library(self, name: str, load: Callable[[], bool]) -> bool:
        """Whether the native library `name` is loaded: `load()` on the first ask (a build, or a
        warning and False), the answer kept for the process (a library cannot be unloaded)."""
        if name not in self._libraries:
            self._libraries[name] = load()
        return self._libraries[name]

    def has_library(self, name: str) -> bool:
        """Whether `library(name, ...)` has been asked (loaded, or found unavailable)."""
        return name in self._libraries

    @cached_property
    def cpu(self) -> dict[str, bool]:
        """The CPU's capabilities as torch reads them (`avx512_bf16`, `amx_bf16`, ...)."""
        return dict(getattr(torch.cpu, "get_capabilities", dict)())


_RUNTIME = Runtime()


def runtime() -> Runtime:
    """The process's runtime."""
    return _RUNTIME
