"""The serving engine: token ids in, token ids out, for many requests at once.

`Engine.step` is one iteration of continuous batching: ask the scheduler for this step's tokens,
run them through the model as one flattened batch `[1, N]` over the paged KV cache (decode tokens
and prompt chunks of different requests side by side, no padding), sample the next token of every
sequence that reached its end, each with its own `SamplingParams`, and retire finished ones.

`AsyncEngine` runs `step` in a loop on a background thread and hands each request's tokens to
asyncio code (the HTTP server) through per-request queues. The engine knows nothing about text.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch

from ..generate import native_head, native_layers
from ..model import Transformer
from ..sampling import SamplingParams, sample_rows
from .paged_cache import PagedKVCache
from .scheduler import ABORT, FINISHED, Scheduler, Sequence

log = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

# The share of the memory available that the KV pool may take: the rest is for the step's
# activations, the HTTP side and whatever else runs on the machine.
POOL_MEMORY_FRACTION = 0.9


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1TiB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (e.g. 2GiB, 512MiB, 1GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def available_memory(device: str | torch.device = "cpu") -> int | None:
    """Bytes a new allocation on `device` can take now: the host's MemAvailable (physical pages
    where there is no /proc/meminfo), a CUDA device's free memory; None where it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_pool_fits(nbytes: int, device: str | torch.device = "cpu", reserved: int = 0) -> None:
    """Raise ValueError if a KV pool of `nbytes` (plus `reserved` bytes still to be taken, such as
    the model's weights) would not fit in the memory `device` has available. Checked before the
    pool is allocated: a pool too large for the host gets the process OOM-killed without a word,
    or a failed allocation reported as an internal error."""
    free = available_memory(device)
    if free is not None and nbytes + reserved > POOL_MEMORY_FRACTION * free:
        model = f" beside the model (~{reserved / 2**30:.1f} GiB)" if reserved else ""
        raise ValueError(f"a KV pool of {nbytes / 2**30:.1f} GiB does not fit{model}: "
                         f"{torch.device(device).type} memory available is {free / 2**30:.1f} GiB, and the pool "
                         f"may take at most {POOL_MEMORY_FRACTION:.0%} of it")


@dataclass
class EngineConfig:
    """Sizes of the pool and the batch. The pool is `kv_cache_tokens` token slots if given, else
    as many blocks as `kv_cache_memory` bytes hold (K and V, every layer)."""

    block_size: int = 16  # token slots per block
    kv_cache_memory: int = 1 << 30
    kv_cache_tokens: int | None = None
    max_num_seqs: int = 64  # running sequences at most
    max_num_batched_tokens: int = 512  # tokens per forward pass (decodes + prompt chunks)
    enable_prefix_caching: bool = True
    kv_dtype: torch.dtype | None = None  # the pool's dtype; None: the model's (float16 halves a step's K/V reads)


@dataclass
class RequestOutput:
    """One new token of one request; `finish_reason` is set on its last."""

    request_id: str
    token_id: int
    num_output_tokens: int
    finish_reason: str | None = None
    error: str | None = None  # the request failed (token_id is -1): why


class Histogram:
    """Cumulative-bucket histogram, as Prometheus exposes one."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1


@dataclass
class EngineStats:
    requests: int = 0  # accepted
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    steps: int = 0
    step_seconds: float = 0.0  # wall time inside `step` (the rest is idle or the HTTP side)
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(
        (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)))


class Engine:
    """Continuous batching over a paged KV cache for one model."""

    def __init__(self, model: Transformer, eos_ids: list[int] | tuple[int, ...] = (),
                 config: EngineConfig | None = None) -> None:
        self.model = model
        self.config = config = config or EngineConfig()
        cfg = model.config
        param = next(model.parameters())
        self.device, dtype = param.device, param.dtype
        # The pool holds activations' dtype (float32 unless the model runs in another float type),
        # or config.kv_dtype (arlm serve: float16 where the native layer stack reads it).
        dtype = config.kv_dtype or (dtype if dtype.is_floating_point else torch.float32)
        bs = config.block_size
        if bs < 1:
            raise ValueError(f"block size must be >= 1, got {bs}")
        if config.kv_cache_tokens is not None:
            n_blocks = -(-config.kv_cache_tokens // bs)
        else:
            n_blocks = config.kv_cache_memory // PagedKVCache.bytes_per_block(cfg, bs, dtype)
        block_bytes = PagedKVCache.bytes_per_block(cfg, bs, dtype)
        if n_blocks < 2:
            raise ValueError(f"the KV cache budget holds {n_blocks} block(s) of {bs} tokens; it needs at least 2 "
                             f"({2 * block_bytes} bytes, {2 * bs} tokens)")
        check_pool_fits(n_blocks * block_bytes, self.device)
        self.cache = PagedKVCache.for_model(cfg, n_blocks, bs, dtype, self.device)
        # One block in reserve: copy-on-write takes a block before it gives one back.
        self.max_model_len = min(cfg.max_seq_len, (n_blocks - 1) * bs)
        self.scheduler = Scheduler(n_blocks, bs, self.max_model_len, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_prefix_caching)
        self.eos_ids = frozenset(eos_ids)
        # The native layer stack over the paged pool where it applies (Llama family on CPU with
        # the paged-attention kernel): one call a step instead of ~60 tensor ops a layer. The
        # weight list is taken now: re-quantizing the model later needs a new Engine.
        self.native = native_layers(model) if self.cache.use_kernel else None
        self.head = native_head(model)
        self.requests: dict[str, Sequence] = {}
        self.stats = EngineStats()

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, out_index: torch.Tensor) -> torch.Tensor:
        """Logits [K, vocab] at the flat indices out_index of the step's N tokens (after set_batch)."""
        model = self.model
        if self.native is None:
            return model(tokens[None], positions[None], kv_cache=self.cache, output_index=out_index)
        weights, int8_activations = self.native
        cfg, cache = model.config, self.cache
        x = model.tok_emb(tokens).float().contiguous()  # a fresh tensor: the layer stack runs in place on it
        torch.ops.arlm.forward_llama_paged(
            x, weights, cache.k, cache.v, cache.block_table, cache.seq_index, positions,
            model.rope_cos, model.rope_sin, cfg.n_head, cfg.n_kv_heads, cfg.norm_eps, int8_activations)
        return self.head(x[out_index])

    # -- requests ---------------------------------------------------------------------------------

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never run (a pure check, safe from any thread)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"token id out of range for a vocabulary of {vocab}")
        params.validate()  # (a field set after construction is not checked otherwise)
        if len(prompt_ids) + params.max_new_tokens > self.max_model_len:
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_new_tokens}) "
                             f"exceeds the context window of {self.max_model_len} tokens")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        self.check_request(prompt_ids, params)
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        seq = Sequence(request_id, list(prompt_ids), len(prompt_ids), params,
                       frozenset() if params.ignore_eos else self.eos_ids, generator)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self.stats.requests += 1
        self.stats.prompt_tokens += len(prompt_ids)

    def abort(self, request_id: str, reason: str = ABORT) -> None:
        """End a request now and free its blocks (unknown or finished ids are ignored)."""
        seq = self.requests.pop(request_id, None)
        if seq is not None and seq.status != FINISHED:
            self.scheduler.finish(seq, reason)
            self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def kv_cache_usage(self) -> float:
        return self.scheduler.pool.utilization

    # -- one step of continuous batching ----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        for src, dst in batch.copies:
            self.cache.copy_block(src, dst)
        # Flatten: the tokens to compute of every scheduled sequence, one after another.
        tokens: list[int] = []
        positions: list[int] = []
        seq_index: list[int] = []
        out_index: list[int] = []  # flat position of each sequence's last token, if it samples
        out_rows: list[int] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start = seq.num_computed
            tokens += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            seq_index += [i] * n
            if start + n == len(seq.token_ids):
                out_index.append(len(tokens) - 1)
                out_rows.append(i)
        width = max(len(s.blocks) for s in batch.seqs)
        table = [s.blocks + [0] * (width - len(s.blocks)) for s in batch.seqs]
        dev = self.device
        self.cache.set_batch(torch.tensor(table, device=dev), torch.tensor(seq_index, device=dev))
        sampled: dict[int, int] = {}
        failed: dict[int, Exception] = {}
        with torch.inference_mode():
            logits = self._forward(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev),
                                   torch.tensor(out_index or [0], device=dev))
            if out_rows:
                sampled, failed = self._sample(logits, out_rows, [batch.seqs[i] for i in out_rows])
        outputs = []
        for seq in self.scheduler.update(batch, sampled):
            self.stats.generation_tokens += 1
            if seq.num_output_tokens == 1:
                self.stats.time_to_first_token.observe(seq.first_token_time - seq.arrival_time)
            outputs.append(RequestOutput(seq.request_id, seq.token_ids[-1], seq.num_output_tokens, seq.finish_reason))
            if seq.status == FINISHED:
                del self.requests[seq.request_id]
                self.stats.finished[seq.finish_reason] = self.stats.finished.get(seq.finish_reason, 0) + 1
        for i, e in failed.items():  # (update took them for mid-prompt chunks: they are dropped now)
            seq = batch.seqs[i]
            log.error("sampling failed for request %s: %s: %s", seq.request_id, type(e).__name__, e)
            self.abort(seq.request_id)
            outputs.append(RequestOutput(seq.request_id, -1, seq.num_output_tokens, ABORT,
                                         error=f"sampling failed: {type(e).__name__}: {e}"))
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - t0
        return outputs

    def _sample(self, logits: torch.Tensor, rows: list[int],
                seqs: list[Sequence]) -> tuple[dict[int, int], dict[int, Exception]]:
        """The next token of each sequence (logits [len(seqs), V]) as {batch row: token id}, and
        the rows whose sampling raised, with the error.

        All rows are drawn in one `sample_rows`; if that raises, each row is drawn alone, so
        that a request whose parameters break sampling fails by itself instead of taking every
        request of the batch down with it. A row's draw does not depend on its batch (its own
        filters and generator), and the filters, where a bad parameter fails, run before any
        generator is drawn from: the rows that succeed alone get the tokens they would have."""
        try:
            next_ids = sample_rows(logits, [s.params for s in seqs], [s.generator for s in seqs],
                                   self._seen(seqs)).tolist()  # the step's one host sync
            return dict(zip(rows, next_ids)), {}
        except Exception:  # noqa: BLE001 - narrowed down to rows below
            pass
        sampled, failed = {}, {}
        for j, (i, s) in enumerate(zip(rows, seqs)):
            try:
                sampled[i] = sample_rows(logits[j:j + 1], [s.params], [s.generator], self._seen([s])).item()
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                failed[i] = e
        return sampled, failed

    def _seen(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """[B, V] tokens seen so far, only when some row has a repetition penalty."""
        if all(s.params.repetition_penalty == 1.0 for s in seqs):
            return None
        seen = torch.zeros(len(seqs), self.model.config.vocab_size, dtype=torch.bool, device=self.device)
        for b, s in enumerate(seqs):
            if s.params.repetition_penalty != 1.0:
                seen[b, torch.tensor(s.token_ids, device=self.device)] = True
        return seen

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to the end (all submitted at once); the output token ids of each, in order."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, params):
            self.add_request(rid, p, sp)
        outputs: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self.requests for rid in ids):
            for out in self.step():
                if out.error is not None:
                    for rid in ids:
                        self.abort(rid)
                    raise RuntimeError(f"request {out.request_id}: {out.error}")
                outputs[out.request_id].append(out.token_id)
        return [outputs[rid] for rid in ids]


class EngineDead(RuntimeError):
    pass


class AsyncEngine:
    """Drives an `Engine` in a loop on its own thread; `generate` is an async iterator per request.

    Requests and aborts go to the engine's thread through an inbox (the scheduler is not
    thread-safe); each step's outputs come back to the event loop in one `call_soon_threadsafe`.
    A request whose consumer stops iterating (client disconnected, stop string seen) is aborted
    at once. `run` is the loop, for a thread of the caller's choosing (`arlm serve` gives it the
    main thread, see `serve.cli`); `start` runs it on a background thread instead.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
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

    def new_request_id(self, prefix: str) -> str:
        self._next_id += 1
        return f"{prefix}-{self._next_id}"

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's tokens as they come; leaving early aborts it and frees its blocks."""
        if self.dead:
            raise EngineDead(self.dead)
        self.engine.check_request(prompt_ids, params)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._post(("add", request_id, prompt_ids, params, arrival_time or time.monotonic()))
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

    def abort(self, request_id: str, reason: str = ABORT) -> None:
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
            self._deliver(out.request_id, out if out.error is None else RuntimeError(out.error))

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
                    engine.add_request(request_id, *rest)
                except ValueError as e:  # checked before; only a race could get here
                    self._loop.call_soon_threadsafe(self._deliver, request_id, e)
            if not engine.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - keep serving
                # What fails here is not one request's: sampling errors are caught per request in
                # `step` (`Engine._sample`), and the parameters were validated when the request
                # came in (`check_request`); the forward pass (a bug, out of memory) runs all the
                # batch's tokens as one, so every running request fails with it.
                log.exception("engine step failed; aborting %d request(s)", len(engine.requests))
                for request_id in list(engine.requests):
                    engine.abort(request_id)
                    self._loop.call_soon_threadsafe(self._deliver, request_id,
                                                    RuntimeError(f"engine error: {type(e).__name__}"))
                continue
            if outputs:
                self._loop.call_soon_threadsafe(self._dispatch, outputs)
