"""How many threads a step gets: all the cores while the machine is quiet, fewer while other
processes want them.

OpenMP threads meet at a barrier a few hundred times a decode step; when the OS takes a core
from one of them for a neighbour, every barrier waits out the neighbour's time slice, and a
2-thread decode beside one busy process kept ~0.3 of its quiet speed, where one thread keeps
~0.8 (decode is bandwidth-bound; benchmarks/shared.py). No fixed setting serves both cases
(docs/benchmarks.md), so the engine watches: every 4 steps (~0.1 ms a sample) it counts the runnable tasks of
the machine that are not its own (`/proc/stat`'s procs_running less this process's threads in
state R), and runs the next steps on the cores that the tasks runnable at each of its last few
samples leave free, at least one and at most the width it started with. Narrowing and widening need no restart: `torch.set_num_threads`
between steps, which the native kernels (`at::parallel_for`) and torch's own ops follow. Every
kernel gives the same result at any width (rows and split-K chunks never depend on the thread
count), so outputs do not change with the width.

One governor per process (`arlm.runtime.Runtime.threads`), as torch's thread pool is one per
process: every engine's step reports to it (`ThreadWidthHook`). `--threads N` (`pin`) fixes the
width (no watching); the widest is torch's width when the governor is made (`OMP_NUM_THREADS`,
else the cores). The width in effect is in the generation stats (`--json`, the stats line) and
`/metrics`.
"""

from __future__ import annotations

import os
from collections import deque

import torch


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _runnable_machine() -> int | None:
    """Runnable tasks on the machine now (procs_running), or None where /proc/stat is missing."""
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"procs_running"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _runnable_here() -> int:
    """This process's threads in state R (running or runnable), this one included."""
    n = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # (a thread that just ended)
            continue
        if stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] == b"R":
            n += 1
    return max(n, 1)


def others_runnable() -> int | None:
    """Runnable tasks on the machine that are not this process's threads, or None (no /proc).

    This process's threads are counted first: between steps its OpenMP workers only go from
    running (spinning after the last parallel region) to sleeping, never back, so the count
    taken first is at least what the machine's count then includes; the other order would
    count a worker that fell asleep between the two reads as a neighbour."""
    here = _runnable_here()
    machine = _runnable_machine()
    if machine is None:
        return None
    return max(0, machine - here)


class ThreadGovernor:
    """The thread width of the engine's steps. pinned: a fixed width (--threads), never changed;
    else up to `widest` (torch's width when made), narrowed to the cores left free by the
    machine's other tasks that were runnable at each of the last `window` samples (one every
    `every` steps)."""

    def __init__(self, pinned: int | None = None, widest: int | None = None, every: int = 4,
                 window: int = 5, probe=others_runnable) -> None:
        self.free_widest = widest or torch.get_num_threads()  # the widest while not pinned
        self.cores = _cores()
        self.every, self.window = every, window
        self.probe = probe
        self.pinned: int | None = None
        self.pin(pinned)

    def pin(self, threads: int | None) -> None:
        """Fix the width of every step at `threads` (`--threads`; no watching), or with None
        follow the machine again, up to `free_widest`. Counts start again."""
        if threads is not None and threads < 1:
            raise ValueError("threads must be >= 1")
        was_pinned, self.pinned = self.pinned is not None, threads
        self.widest = threads or self.free_widest
        self.width = self.widest
        self.samples: deque[int] = deque(maxlen=self.window)
        self.changes = 0  # widths set since the start (narrowed or widened)
        self._steps = 0
        self.watching = threads is None and self.widest > 1 and (self.probe is not others_runnable
                                                                  or _runnable_machine() is not None)
        if threads is not None or was_pinned:  # (unpinned: the steps widen back to free_widest now)
            self._apply(self.width)

    def observe(self) -> None:
        """Called once a step, after its forward pass: every `every` steps a sample, and the
        width of the steps that follow. (Then, not between steps: a client of the server is
        runnable right after a step, reading the tokens it sent, and asleep by the end of the
        next forward pass; a busy neighbour is runnable at any time.)"""
        if not self.watching:
            return
        self._steps += 1
        if self._steps % self.every and len(self.samples) == self.samples.maxlen:
            return  # (until the first window is full, a sample every step: a neighbour there from
            # the start narrows the width within `window` steps)
        others = self.probe()
        if others is None:
            return
        self.samples.append(others)
        # Neighbours runnable at every one of the last `window` samples: a spin loop, a build, a
        # second server. One that is runnable now and then (a client reading the server's
        # streams) costs this process less than a narrower step would (measured:
        # docs/benchmarks.md), so it does not count; and one sample without it widens at once.
        busy = min(self.samples) if len(self.samples) == self.samples.maxlen else 0
        self._set(max(1, min(self.widest, self.cores - busy)))

    def _set(self, width: int) -> None:
        if width != self.width:
            self.width = width
            self.changes += 1
            self._apply(width)

    @staticmethod
    def _apply(width: int) -> None:
        if torch.get_num_threads() != width:
            torch.set_num_threads(width)

    def describe(self) -> str:
        """For the stats line: "2 threads" / "1 of 2 threads (busy machine)" / "2 threads (pinned)"."""
        if self.pinned is not None:
            return f"{self.width} thread{'s' if self.width > 1 else ''} (pinned)"
        if self.width < self.widest:
            return f"{self.width} of {self.widest} threads (others busy)"
        return f"{self.width} thread{'s' if self.width > 1 else ''}"

