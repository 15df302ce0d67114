"""The engine's steps as a clock that does not follow the machine's load.

Run as a script, `python tests/step_log.py LOG ARGS...` is `python -m arlm ARGS...` with every
engine of the process writing to LOG, one JSON line an event: a request's arrival
(`{"add": id, "at": steps done then, "prompt": digest of its token ids}`) and each step
(`{"step": n, "ids": [the request of each row]}`). `StepLog` reads that file as it grows.

A test that asks "was this request held back?" counts the engine steps from its arrival to its
end instead of seconds: on a loaded machine every step is slower, but the steps a request waits
and runs are the scheduler's decisions, the same at any load.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading


def digest(prompt_ids: list[int]) -> str:
    return hashlib.sha1(json.dumps(list(prompt_ids)).encode()).hexdigest()[:16]


def install(path: str) -> None:
    """Every `Engine` made from now on in this process logs its arrivals and steps to `path`."""
    from arlm.engine import engine as engine_module
    from arlm.engine.hooks import StepHook

    out = open(path, "w", buffering=1, encoding="utf-8")  # (a line at a time: the reader sees each event)
    lock = threading.Lock()  # (requests arrive on the HTTP loop's thread, steps run on the engine's)
    steps = [0]

    def write(record: dict) -> None:
        with lock:
            out.write(json.dumps(record) + "\n")

    class Log(StepHook):
        def stepped(self, engine, result) -> None:
            steps[0] += 1
            write({"step": steps[0], "ids": [seq.request_id for seq in result.batch.seqs]})

    cls = engine_module.Engine
    init, add_request = cls.__init__, cls.add_request

    def logged_init(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self.hooks.add(Log())

    def logged_add_request(self, prompt_ids, *args, **kwargs):
        req = add_request(self, prompt_ids, *args, **kwargs)
        write({"add": req.request_id, "at": steps[0], "prompt": digest(prompt_ids)})
        return req

    cls.__init__, cls.add_request = logged_init, logged_add_request


class StepLog:
    """The log `install` writes, read incrementally (thread-safe): `steps` done so far, and for
    each request its arrival (`added`: id -> (steps done then, prompt digest)) and the last step
    that computed it (`last`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.steps = 0
        self.added: dict[str, tuple[int, str]] = {}
        self.last: dict[str, int] = {}
        self._offset = 0
        self._partial = b""
        self._lock = threading.Lock()

    def read(self) -> int:
        """Take in what the server wrote since the last read; the steps done so far."""
        with self._lock:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = self._partial + f.read()
                self._offset = f.tell()
            *lines, self._partial = data.split(b"\n")
            for line in lines:
                event = json.loads(line)
                if "add" in event:
                    self.added[event["add"]] = (event["at"], event["prompt"])
                else:
                    self.steps = event["step"]
                    for rid in event["ids"]:
                        self.last[rid] = event["step"]
            return self.steps

    def arrivals(self, since: int) -> dict[str, str]:
        """Requests that arrived after the first `since` arrivals: id -> prompt digest, in order."""
        with self._lock:
            return {rid: prompt for rid, (_, prompt) in list(self.added.items())[since:]}

    def span(self, rid: str) -> int:
        """Steps from the request's arrival to the last step that computed it."""
        with self._lock:
            return self.last[rid] - self.added[rid][0]


if __name__ == "__main__":
    from arlm import prefer_huge_pages
    from arlm.__main__ import main

    prefer_huge_pages()  # (as `python -m arlm` does, before torch is imported; `main` finds it set)
    install(sys.argv[1])
    sys.argv = ["arlm", *sys.argv[2:]]
    main()
