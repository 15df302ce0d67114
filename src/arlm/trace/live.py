"""`arlm serve --trace`: the engine followed live at `/trace` (a page) and `/trace/events`
(server-sent events): running and waiting requests, their blocks in the pool, prefix-cache hits,
the batch composition of each step, tokens/s.

`LiveTrace` is a step hook (`Engine.hooks`, as `arlm trace`'s `Tracer`), lighter: it
records each step's batch (which request, which phase, how many tokens) on the engine thread and,
at most every `interval` seconds and whenever the engine goes idle, a snapshot of the scheduler
and the pool, handed to the HTTP loop for every subscriber. No token text leaves the engine: the
page shows request ids and counts. Off (the default), the server has no such routes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from pathlib import Path

from ..engine.hooks import StepHook, StepResult
from .tracer import phase

HERE = Path(__file__).parent
KEEPALIVE = 15.0  # seconds between SSE comments on an idle stream


class LiveTrace(StepHook):
    def __init__(self, engine, interval: float = 0.1, history: int = 200) -> None:
        self.engine = engine
        self.interval = interval
        self.steps: deque[dict] = deque(maxlen=history)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.subscribers: set[asyncio.Queue] = set()
        self.last: str | None = None  # the latest snapshot, JSON (what a new subscriber gets first)
        self._published = 0.0
        self._count = 0
        self._t0 = time.monotonic()
        self.last = json.dumps(self.snapshot(self._t0))  # (before the engine runs: the empty pool)

    # -- the engine hook (engine thread) ---------------------------------------------------------------

    def scheduled(self, engine, batch) -> None:
        # (the phases now: the step's postprocessing moves each request on)
        self._batch = [{"id": seq.request_id, "phase": phase(batch, i), "tokens": batch.num_tokens[i]}
                       for i, seq in enumerate(batch.seqs)]

    def stepped(self, engine, result: StepResult) -> None:
        now = time.monotonic()
        self.steps.append({"step": self._count, "t": round(now - self._t0, 4), "seconds": round(result.seconds, 5),
                           "sampled": sum(len(v) for v in result.sampled.values()), "batch": self._batch})
        self._count += 1
        if now - self._published >= self.interval or not engine.scheduler.running:
            self.publish(now)

    def snapshot(self, now: float) -> dict:
        engine = self.engine
        sched = engine.scheduler
        pool = sched.pool
        recent = [s for s in self.steps if s["t"] >= now - self._t0 - 2.0]  # the last two seconds
        span = (recent[-1]["t"] - recent[0]["t"] + recent[0]["seconds"]) if recent else 0.0
        def request(r, running: bool) -> dict:
            out = {"id": r.request_id, "prompt_tokens": r.num_prompt_tokens, "output_tokens": r.num_output_tokens,
                   "cached_tokens": r.num_cached_tokens}
            if running:
                out.update(computed=r.num_computed, blocks=[int(b) for b in r.blocks])
            return out
        return {
            "t": round(now - self._t0, 4), "steps_total": self._count,
            "running": [request(r, True) for r in sched.running],
            "waiting": [request(r, False) for r in sched.waiting],
            "pool": {"blocks": pool.n_blocks, "block_size": sched.block_size, "used": pool.num_used,
                     "cached_free": sum(1 for b in pool.free if pool.hash_of[b] is not None),
                     "bytes_per_token": engine.cache.bytes_per_token},
            "prefix_cache": {"queries": sched.stats.prefix_queries, "hits": sched.stats.prefix_hits},
            "tokens_per_s": round(sum(s["sampled"] for s in recent) / span, 2) if span > 0 else 0.0,
            "requests_finished": sum(engine.stats.finished.values()),
            "steps": list(self.steps)[-60:],
        }

    def publish(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._published = now
        data = json.dumps(self.snapshot(now))
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._fanout, data)

    # -- the HTTP side (its event loop) ------------------------------------------------------------------

    def _fanout(self, data: str) -> None:
        self.last = data
        for q in self.subscribers:
            if q.qsize() < 8:  # a slow reader misses snapshots, never holds the engine up
                q.put_nowait(data)

    async def events(self):
        """An SSE stream: `data: <snapshot JSON>` events, comments to keep an idle stream open."""
        q: asyncio.Queue = asyncio.Queue()
        self.subscribers.add(q)
        try:
            if self.last is not None:
                yield f"data: {self.last}\n\n"
            while True:
                try:
                    data = await asyncio.wait_for(q.get(), KEEPALIVE)
                except asyncio.TimeoutError:
                    yield ": keepalive\n\n"
                    continue
                yield f"data: {data}\n\n"
        finally:
            self.subscribers.discard(q)


def live_page() -> str:
    return (HERE / "live.html").read_text(encoding="utf-8")
