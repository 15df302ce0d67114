"""A gate that holds a server's engine at a known point, for tests of what happens meanwhile
(test_cluster.py's drain: streams still running when SIGTERM comes, whatever the machine's speed).

On PYTHONPATH, Python imports this module at start-up in every process of the server: with Ray
Serve, its replicas' worker processes too (they inherit the server's environment). Where
ARLM_TEST_ENGINE_GATE names a directory, each `AsyncEngine` made in the process gets a `Gate`;
elsewhere nothing happens (and nothing is imported).

While the file `hold` exists in that directory, an engine stops before a step once every request
it holds has its first token out and no new one waits in its inbox: every request it serves is
running, held at a known point. `release-<pid>` (the replica's process id) lets that process's
engine go on; removing `hold` lets every engine go on.
"""

from __future__ import annotations

import os
import sys

GATE_DIR = os.environ.get("ARLM_TEST_ENGINE_GATE")


def install(module) -> None:
    """Each AsyncEngine of `module` (arlm.engine.async_engine) made from now on gets a Gate."""
    import time
    from pathlib import Path

    from arlm.engine.hooks import StepHook

    gate = Path(GATE_DIR)

    class Gate(StepHook):
        def __init__(self, async_engine) -> None:
            self.async_engine = async_engine

        def holding(self, engine) -> bool:
            reqs = list(engine.requests.values())
            return ((gate / "hold").exists() and not (gate / f"release-{os.getpid()}").exists()
                    and not self.async_engine._inbox and bool(reqs) and all(r.output_ids for r in reqs))

        def scheduled(self, engine, batch) -> None:
            while self.holding(engine):
                time.sleep(0.05)

    cls = module.AsyncEngine
    init = cls.__init__

    def gated_init(self, engine, *args, **kwargs) -> None:
        init(self, engine, *args, **kwargs)
        engine.hooks.add(Gate(self))

    cls.__init__ = gated_init


if GATE_DIR:
    import importlib.abc
    import importlib.util

    class _Patch(importlib.abc.MetaPathFinder):
        """Installs the gate when arlm.engine.async_engine is first imported (not before: it
        imports torch)."""

        def find_spec(self, name, path, target=None):
            if name != "arlm.engine.async_engine":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def exec_and_install(module) -> None:
                exec_module(module)
                install(module)

            spec.loader.exec_module = exec_and_install
            return spec

    sys.meta_path.insert(0, _Patch())
