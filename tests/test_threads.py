"""The steps' thread width (arlm/threads.py): it follows the cores other processes leave
free, returns to full width when they go, stays put when pinned, shows in the stats, /metrics
and the stats line; and outputs never depend on it (widths forced to change every step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from arlm.runtime import runtime
from arlm.threads import ThreadGovernor, others_runnable
from arlm.sampling import SamplingParams

from conftest import run_arlm


@pytest.fixture
def restore_threads():
    gov = runtime().threads
    width = torch.get_num_threads()
    state = dict(vars(gov))
    yield
    vars(gov).update(state)
    torch.set_num_threads(width)


def test_width_is_the_cores_the_others_leave(restore_threads):
    """Neighbours runnable at every one of the last `window` samples narrow the width (to the
    cores they leave, at least 1, at most the widest); one now and then does not; a sample
    without them widens it again at once."""
    seen = iter([1, 1, 1, 0, 1, 1, 1, 1, 3, 3, 3, 0, 2, 2, 2])
    g = ThreadGovernor(widest=4, every=1, window=3, probe=lambda: next(seen))
    g.cores = 4
    widths = []
    for _ in range(15):
        g.observe()
        widths.append(g.width)
    assert widths == [4, 4, 3, 4, 4, 4, 3, 3, 3, 3, 1, 4, 4, 4, 2]
    assert torch.get_num_threads() == 2 and g.changes == 6
    g = ThreadGovernor(widest=2, every=4, window=2, probe=lambda: 1)
    g.cores = 2
    widths = []
    for _ in range(8):
        g.observe()
        widths.append(g.width)
    assert widths == [2, 1, 1, 1, 1, 1, 1, 1]  # the first window filled at once, then a sample every 4 steps
    pinned = ThreadGovernor(pinned=1, probe=lambda: 5)
    for _ in range(20):
        pinned.observe()
    assert pinned.width == 1 and not pinned.watching and torch.get_num_threads() == 1
    with pytest.raises(ValueError):
        ThreadGovernor(pinned=0)


def test_busy_neighbours_narrow_it_and_it_widens_when_they_go(restore_threads):
    """Real neighbours (spin loops): as many as the cores, and the width drops to 1 within a few
    samples; killed, it returns to the widest.

    Narrowing is read from the real probe (`others_runnable`): the two spin loops are runnable
    at every sample, so it counts at least two whatever else the machine runs. Widening is not:
    on a shared machine other processes may be runnable at every sample after the kill, and then
    the width rightly stays narrow. So after the kill the governor counts only the processes the
    test started (gone, reaped: none runnable), and one such sample must widen it at once."""
    assert others_runnable() is not None  # (Linux: /proc/stat and /proc/self/task)
    torch.set_num_threads(2)
    g = ThreadGovernor(every=1, window=3)
    g.cores = 2  # (the test's own view: two cores, two neighbours)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]

    def runnable(p) -> bool:  # state R in /proc/<pid>/stat, as the probe reads this process's threads
        try:
            with open(f"/proc/{p.pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # (reaped)
            return False
        return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] == b"R"

    try:
        time.sleep(0.3)
        for _ in range(30):
            g.observe()
            time.sleep(0.02)
            if g.width == 1:
                break
        assert g.width == 1, list(g.samples)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    g.probe = lambda: sum(runnable(p) for p in busy)
    g.observe()  # one sample without them widens it at once
    assert g.width == 2 and g.changes >= 2, list(g.samples)


def test_outputs_do_not_depend_on_the_width(smollm2_default, restore_threads):
    """SmolLM2 on its default path, a ragged batch greedy and seeded-sampled, the contiguous
    cache and the paged pool: the width forced to change at every step (1, 2, 1, ...) gives the
    tokens a pinned width gives."""
    from arlm.engine import Engine, EngineConfig

    llm = smollm2_default
    texts = ["The cat sat on the", "Once upon a time, in a land far", "def fib(n):"]
    prompts = [llm.tokenizer.encode(t) for t in texts]
    params = [SamplingParams(max_new_tokens=24, temperature=0), SamplingParams(max_new_tokens=16, temperature=0.9, seed=3),
              SamplingParams(max_new_tokens=30, temperature=0)]
    paged = Engine(llm.runner, llm.tokenizer.eos_ids, EngineConfig(block_size=16, kv_cache_tokens=1024))
    results = {}
    for mode in ("pinned 2", "pinned 1", "changing"):
        if mode == "changing":
            cycle = iter(range(10**6))
            g = runtime().threads
            g.pin(None)
            g.watching, g.every, g.widest, g.cores = True, 1, 2, 2
            g.probe = lambda: next(cycle) % 2  # busy, quiet, busy, ...: width 1, 2, 1, ...
            g.samples = type(g.samples)(maxlen=1)
        else:
            runtime().threads.pin(int(mode[-1]))
        got = [llm.engine.generate(prompts, params), paged.generate(prompts, params)]
        results[mode] = got
        if mode == "changing":
            assert runtime().threads.changes > 20
    assert results["changing"] == results["pinned 2"] == results["pinned 1"]


def test_stats_and_metrics_name_the_width(restore_threads, capfd):
    # (`arlm generate` through its main() in this process: the width is the process's, and the
    # fixture puts this process's back)
    r = run_arlm(capfd, "generate", "Hi", "--max-new-tokens", "4", "--threads", "1", "--json")
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)["stats"]["threads"]
    assert t["width"] == 1 and t["pinned"] is True and t["changes"] == 0
    runtime().threads.pin(None)  # unpinned, as a fresh process starts (the tests' own is pinned: conftest)
    torch.set_num_threads(2)
    r = run_arlm(capfd, "generate", "Hi", "--max-new-tokens", "4")
    assert r.returncode == 0 and "threads: " in r.stderr, r.stderr
    assert runtime().threads.pinned is None
