"""The engine on a thread of its own, for asyncio code (the HTTP server).

`AsyncEngine` runs `Engine.step` in a loop and hands each request's tokens to the event loop
through per-request queues.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import AsyncIterator

from ..sampling import SamplingParams
from ..structured import CompiledGrammar, StructuredOutput
from .engine import Engine, RequestOutput
from .request import FinishReason
from .speculative import Drafter

log = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    pass


class RequestFailed(RuntimeError):
    """A request ended in an error of its own (the other requests went on). client_error: its
    input caused it (a grammar past the server's limits): the edge answers with a 4xx."""

    def __init__(self, message: str, client_error: bool = False) -> None:
        super().__init__(message)
        self.client_error = client_error


class AsyncEngine:
    """Drives an `Engine` in a loop on its own thread; `generate` is an async iterator per request.

    Requests and aborts go to the engine's thread through an inbox (the scheduler is not
    thread-safe); each step's outputs come back to the event loop in one `call_soon_threadsafe`.
    A request whose consumer stops iterating (client disconnected, stop string seen) is aborted
    at once. `run` is the loop, for a thread of the caller's choosing (`arlm serve` gives it the
    main thread, see `serve.cli`); `start` runs it on a background thread instead.
    """

    def __init__(self, engine: Engine, stall_limit: float = 30.0) -> None:
        self.engine = engine
        # /health's bound: seconds without a completed step while work waits (`stalled`)
        self.stall_limit = stall_limit
        self.started = time.monotonic()
        self.last_step_end: float | None = None  # monotonic time the last step ended
        self._progress = time.monotonic()  # the last step's end, or when work came to an idle loop
        self._inbox: deque[tuple] = deque()
        self._wake = threading.Event()
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._next_id = 0
        self.dead: str | None = None  # why the engine loop stopped, if it did

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop that consumes the outputs (set before any request arrives)."""
        self._loop = loop

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Attach to `loop` and run the engine loop on a background thread."""
        self.attach(loop)
        self._thread = threading.Thread(target=self.run, name="arlm-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the loop (from any thread); requests still open fail with EngineDead."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + sum(1 for item in list(self._inbox) if item[0] == "add")

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def stalled(self) -> float:
        """Seconds the engine has had work without completing a step (0 while it has none): a
        wedged engine, or a step that never ends, is not one that can serve."""
        if not (self.num_running or self.num_waiting):
            return 0.0
        return time.monotonic() - self._progress

    def new_request_id(self, prefix: str) -> str:
        self._next_id += 1
        return f"{prefix}-{self._next_id}"

    async def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The spec's grammar, compiled on the grammar compiler's thread (never this loop's nor
        the engine's), or GrammarError: the compiler's reason, or its time limit passed."""
        grammars = self.engine.grammars
        if grammars is None:
            raise ValueError("structured outputs need the tokenizer's grammar engine (Engine.grammars)")
        future = grammars.submit(spec)
        try:
            # (shielded: the compilation is shared by every request of the same spec)
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), grammars.limits.timeout)
        except TimeoutError:
            raise grammars.timed_out(spec) from None

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       arrival_time: float | None = None, drafter: Drafter | None = None,
                       group: str | None = None, embed: bool = False) -> AsyncIterator[RequestOutput]:
        """Yield the request's tokens as they come; leaving early aborts it and frees its blocks.
        A request with a grammar waits here for its compilation, outside the engine's batch.
        embed: an embedding request (Engine.add_request): one output, with its `embedding`."""
        if self.dead:
            raise EngineDead(self.dead)
        self.engine.check_request(prompt_ids, params)
        arrival_time = arrival_time or time.monotonic()
        grammar = await self.compile(params.structured) if params.structured is not None else None
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._post(("add", request_id, prompt_ids, params, arrival_time, drafter, grammar, group, embed))
        finished = False
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            del self._queues[request_id]
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        self._post(("abort", request_id, reason))

    def _post(self, item: tuple) -> None:
        self._inbox.append(item)
        self._wake.set()

    def _deliver(self, request_id: str, item) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._deliver(out.request_id, out if out.error is None else RequestFailed(out.error, out.client_error))

    def run(self) -> None:
        """The engine loop: add and abort requests, step while there is work, sleep otherwise.
        Returns after `stop`; if it breaks, it says so on /health and fails the open requests."""
        try:
            self._loop_steps()
            self.dead = "the server is shutting down"
        except BaseException as e:
            log.exception("engine loop stopped")
            self.dead = f"{type(e).__name__}: {e}"
        if self._loop is not None and not self._loop.is_closed():
            for request_id in list(self._queues):
                self._loop.call_soon_threadsafe(self._deliver, request_id, EngineDead(self.dead))

    def _loop_steps(self) -> None:
        engine = self.engine
        while not self._stopping:
            while self._inbox:
                kind, request_id, *rest = self._inbox.popleft()
                if kind == "abort":
                    engine.abort(request_id, rest[0])
                    continue
                try:
                    prompt_ids, params, arrival_time, drafter, grammar, group, embed = rest
                    engine.add_request(prompt_ids, params, request_id, arrival_time, drafter=drafter, grammar=grammar,
                                       group=group, embed=embed)
                except ValueError as e:  # checked before; only a race could get here
                    self._loop.call_soon_threadsafe(self._deliver, request_id, e)
            if not engine.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                self._progress = time.monotonic()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - keep serving
                # What fails here is not one request's: sampling errors are caught per request in
                # `step` (engine/sampler.py), and the parameters were validated when the request
                # came in (`check_request`); the forward pass (a bug, out of memory) runs all the
                # batch's tokens as one, so every running request fails with it.
                log.exception("engine step failed; aborting %d request(s)", len(engine.requests))
                for request_id in list(engine.requests):
                    engine.abort(request_id)
                    self._loop.call_soon_threadsafe(self._deliver, request_id,
                                                    RuntimeError(f"engine error: {type(e).__name__}"))
                continue
            self.last_step_end = self._progress = time.monotonic()
            if outputs:
                self._loop.call_soon_threadsafe(self._dispatch, outputs)
