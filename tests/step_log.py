"""The engine's steps, and the CPU time its threads spend, as clocks that do not follow the
machine's load.

Run as a script, `python tests/step_log.py LOG ARGS...` is `python -m arlm ARGS...` with every
engine of the process writing to LOG, one JSON line an event: a request's arrival
(`{"add": id, "at": steps done then, "prompt": digest of its token ids}`), each step
(`{"step": n, "cpu": the engine thread's CPU seconds since the step before, "ids": [the request
of each row]}`) and, once, the thread id of the event loop that serves HTTP (`{"http_tid": id}`).
`StepLog` reads that file as it grows.

A test that asks "was this request held back?" counts the engine steps from its arrival to its
end instead of seconds: on a loaded machine every step is slower, but the steps a request waits
and runs are the scheduler's decisions, the same at any load. One that asks "did it cost the
others time?" adds up the engine thread's CPU time over those steps (what the steps computed,
for the request and beside it), and one that asks "was the event loop held?" reads the loop
thread's CPU time (`thread_cpu`): a loaded machine stretches the wall time of both, not the CPU
time they take.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time


def digest(prompt_ids: list[int]) -> str:
    return hashlib.sha1(json.dumps(list(prompt_ids)).encode()).hexdigest()[:16]


def install(path: str) -> None:
    """Every `Engine` made from now on in this process logs its arrivals and steps to `path`."""
    from arlm.engine import engine as engine_module
    from arlm.engine.hooks import StepHook

    from arlm.engine.async_engine import AsyncEngine

    out = open(path, "w", buffering=1, encoding="utf-8")  # (a line at a time: the reader sees each event)
    lock = threading.Lock()  # (requests arrive on the HTTP loop's thread, steps run on the engine's)
    steps = [0]

    def write(record: dict) -> None:
        with lock:
            out.write(json.dumps(record) + "\n")

    class Log(StepHook):
        cpu = None  # the engine thread's CPU seconds at the last step's end (the first: its start)

        def scheduled(self, engine, batch) -> None:
            if self.cpu is None:
                self.cpu = time.thread_time()

        def stepped(self, engine, result) -> None:
            now = time.thread_time()  # (this thread's: the engine's, which runs every step)
            steps[0] += 1
            write({"step": steps[0], "cpu": now - self.cpu, "ids": [seq.request_id for seq in result.batch.seqs]})
            self.cpu = now

    cls = engine_module.Engine
    init, add_request = cls.__init__, cls.add_request

    def logged_init(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self.hooks.add(Log())

    post = AsyncEngine._post  # (called on the event loop's thread: each request's arrival and abort)
    seen = []

    def logged_post(self, item) -> None:
        if not seen:
            seen.append(threading.get_native_id())
            write({"http_tid": seen[0]})
        post(self, item)

    AsyncEngine._post = logged_post

    def logged_add_request(self, prompt_ids, *args, **kwargs):
        req = add_request(self, prompt_ids, *args, **kwargs)
        write({"add": req.request_id, "at": steps[0], "prompt": digest(prompt_ids)})
        return req

    cls.__init__, cls.add_request = logged_init, logged_add_request


def thread_cpu(pid: int, tid: int) -> float:
    """CPU seconds (user + system) a thread of process `pid` has run, from /proc (clock ticks)."""
    with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # (utime, stime: fields 14, 15)


class StepLog:
    """The log `install` writes, read incrementally (thread-safe): `steps` done so far, the
    engine thread's CPU seconds up to the end of each (`cpu_at`), for each request its arrival
    (`added`: id -> (steps done then, prompt digest)) and the last step that computed it
    (`last`), and the HTTP event loop's thread id (`http_tid`, None until a request came)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.steps = 0
        self.cpu_at: list[float] = [0.0]  # [n]: the engine thread's CPU seconds over steps 1..n
        self.http_tid: int | None = None
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
                elif "http_tid" in event:
                    self.http_tid = event["http_tid"]
                else:
                    self.steps = event["step"]
                    self.cpu_at.append(self.cpu_at[-1] + event["cpu"])
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

    def span_cpu(self, rids: list[str]) -> float:
        """The engine thread's CPU seconds over the steps from the first of the requests' arrivals
        to the last step that computed one of them (theirs and their neighbours')."""
        with self._lock:
            return (self.cpu_at[max(self.last[rid] for rid in rids)]
                    - self.cpu_at[min(self.added[rid][0] for rid in rids)])


if __name__ == "__main__":
    from arlm import prefer_huge_pages
    from arlm.__main__ import main

    prefer_huge_pages()  # (as `python -m arlm` does, before torch is imported; `main` finds it set)
    install(sys.argv[1])
    sys.argv = ["arlm", *sys.argv[2:]]
    main()
