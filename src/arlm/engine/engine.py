"""The engine: token ids in, token ids out, for one request or many at once.

`Engine.step` is one iteration: schedule (which tokens of which requests run now), forward (the
model runner), sample (each request with its own `SamplingParams` and generator), postprocess
(append the tokens, finish requests). Every front end runs on it: `LLM.generate/stream`,
`ChatSession`, `arlm generate/chat` and `arlm serve` (through `AsyncEngine`). It knows nothing
about text.

Two caches, one interface (`arlm.kv_cache.KVCache`):
- `block_size=None`: a contiguous cache, one block of a whole sequence per request, sized for the
  batch waiting when the engine is idle (static batches). Decode steps run by rows, the fastest
  path for a fixed batch (`LLM.generate`, the CLI).
- `block_size=16` (the default): a paged pool of `kv_cache_memory` bytes shared by every request,
  with prefix caching, chunked prefill, preemption and continuous batching (`arlm serve`, chat).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import kernels
from ..kv_cache import KVCache, KVDtype, check_head_dim, check_pool_fits, parse_kv_dtype
from ..model import Transformer
from ..sampling import SamplingParams, adjust_logits, sample_rows, top_logprobs
from .request import FinishReason, Request, RequestStatus
from .runner import ModelRunner
from .scheduler import Scheduler
from . import threads
from .speculative import Drafter, SpecRates, SpecState, StepCost, verify

log = logging.getLogger(__name__)

# A windowed engine's max_model_len: requests are not bounded by the model's context.
WINDOWED_MAX_LEN = 1 << 31


@dataclass
class EngineConfig:
    """The cache and the batch. A paged pool is `kv_cache_tokens` token slots if given, else as
    many blocks as `kv_cache_memory` bytes hold (K and V, every layer)."""

    block_size: int | None = 16  # token slots per block; None: a contiguous cache (see the module doc)
    kv_cache_memory: int = 1 << 30
    kv_cache_tokens: int | None = None
    max_num_seqs: int = 64  # running requests at most
    max_num_batched_tokens: int = 512  # tokens per forward pass (decodes + prompt chunks)
    enable_prefix_caching: bool = True
    # None: the model's; float16 halves a step's K/V reads, "int8" / "int4" quantize them (kv_cache.py)
    kv_dtype: KVDtype | None = None
    # A sliding window with attention sinks (StreamingLLM; KVCache.set_window): each token attends to
    # the first kv_sinks tokens and the last kv_window, and requests run past the model's context
    # with a bounded number of blocks each. 0: off. Paged pool only; no prefix caching, no drafts.
    kv_window: int = 0
    kv_sinks: int = 4

    @property
    def contiguous(self) -> bool:
        return self.block_size is None


@dataclass
class RequestOutput:
    """One new token of one request; `finish_reason` is set on its last."""

    request_id: str
    token_id: int
    num_output_tokens: int
    finish_reason: FinishReason | None = None
    error: str | None = None  # the request failed (token_id is -1): why
    # SamplingParams.logprobs: this token's log-probability and the top ones [(id, log-probability)]
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    # SamplingParams.prompt_logprobs, on a request's first output: prompt tokens 1 .. P-1's
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class StepStats:
    """What the last step did: prompt tokens computed (prefill), tokens sampled, wall time."""

    prompt_tokens: int = 0
    sampled: int = 0
    seconds: float = 0.0


@dataclass
class EngineStats(SpecRates):
    requests: int = 0  # accepted
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    steps: int = 0
    step_seconds: float = 0.0  # wall time inside `step` (the rest is idle or the front end)
    # speculative decoding: draft tokens verified, of those accepted, and rows that verified a
    # draft (one per request per target pass); each such row emits accepted + 1 tokens
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_passes: int = 0
    # called with each request's time to first token, in seconds (arlm serve's histogram)
    on_first_token: Callable[[float], None] | None = None


class Engine:
    """Schedules, runs and samples requests over one KV cache for one model."""

    def __init__(self, model: Transformer | ModelRunner, eos_ids: list[int] | tuple[int, ...] = (),
                 config: EngineConfig | None = None) -> None:
        self.runner = model if isinstance(model, ModelRunner) else ModelRunner(model)
        self.model = self.runner.model
        self.config = config = config or EngineConfig()
        cfg = self.model.config
        param = next(self.model.parameters())
        self.device = param.device
        # The cache holds the activations' dtype (float32 unless the model runs in another float
        # type), or config.kv_dtype.
        self.kv_dtype = parse_kv_dtype(config.kv_dtype) if config.kv_dtype is not None else \
            (param.dtype if param.dtype.is_floating_point else torch.float32)
        check_head_dim(self.kv_dtype, cfg.head_dim)
        if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.eos_ids = frozenset(eos_ids)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.last_step = StepStats()
        self.step_cost = StepCost()  # what a decode step costs here, by its size (speculation's rule)
        self.tracer = None  # an arlm.trace.Tracer records every step while set (arlm trace, serve --trace)
        # arlm.structured.Grammars over the tokenizer: set by the front end (the engine speaks
        # token ids), needed by requests with SamplingParams.structured
        self.grammars = None
        self._next_id = 0
        if config.contiguous:
            self.cache: KVCache | None = None  # sized for each batch (`_fit_cache`)
            self.max_model_len = cfg.max_seq_len
            self.scheduler = Scheduler(1, cfg.max_seq_len, cfg.max_seq_len, config.max_num_seqs,
                                       config.max_num_batched_tokens, False, static_batches=True)
            return
        bs = config.block_size
        if bs < 1:
            raise ValueError(f"block size must be >= 1, got {bs}")
        block_bytes = KVCache.bytes_per_block(cfg, bs, self.kv_dtype)
        if config.kv_cache_tokens is not None:
            n_blocks = -(-config.kv_cache_tokens // bs)
        else:
            n_blocks = config.kv_cache_memory // block_bytes
        if n_blocks < 2:
            raise ValueError(f"the KV cache budget holds {n_blocks} block(s) of {bs} tokens; it needs at least 2 "
                             f"({2 * block_bytes} bytes, {2 * bs} tokens)")
        check_pool_fits(n_blocks * block_bytes, self.device)
        window = self._window_blocks(n_blocks) if config.kv_window else None
        self.cache = KVCache.pool(cfg, n_blocks, bs, self.kv_dtype, self.device)
        # One block in reserve: copy-on-write takes a block before it gives one back.
        self.max_model_len = min(cfg.max_seq_len, (n_blocks - 1) * bs) if window is None else WINDOWED_MAX_LEN
        self.scheduler = Scheduler(n_blocks, bs, self.max_model_len, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_prefix_caching and window is None)
        if window is not None:
            self.scheduler.window = window
            self.cache.set_window(config.kv_window, config.kv_sinks, (self.model.rope_cos, self.model.rope_sin))

    def _window_blocks(self, n_blocks: int) -> tuple[int, int]:
        """Check a windowed pool (config.kv_window) and return (window, sinks)."""
        c, cfg = self.config, self.model.config
        if c.kv_window < 1 or c.kv_sinks < 0:
            raise ValueError(f"a KV window needs kv_window >= 1 and kv_sinks >= 0, got {c.kv_window}, {c.kv_sinks}")
        if cfg.pos_embedding != "rope":
            raise ValueError("a KV window needs a RoPE model (learned positions end at the context length)")
        bs = c.block_size
        live = -(-c.kv_sinks // bs) + -(-(c.kv_window + c.max_num_batched_tokens) // bs) + 1
        if n_blocks - 1 < live:
            raise ValueError(f"a window of {c.kv_window} tokens with {c.kv_sinks} sinks needs {live + 1} blocks of "
                             f"{bs} tokens for one sequence (steps of up to {c.max_num_batched_tokens} tokens); "
                             f"the pool has {n_blocks}")
        return c.kv_window, c.kv_sinks

    def _fit_rope(self, positions: int) -> None:
        """RoPE tables for positions 0 .. positions - 1 (a windowed request runs past the model's
        context): the model's own, grown (doubled) on demand; their first rows stay as they were."""
        from ..model import rope_table

        m = self.model
        if positions <= m.rope_cos.shape[0]:
            return
        n = max(positions, 2 * m.rope_cos.shape[0])
        cos, sin = rope_table(m.config.head_dim, n, m.config.rope_theta)
        m.rope_cos, m.rope_sin = cos.to(m.rope_cos.device), sin.to(m.rope_sin.device)
        self.cache.set_window(self.cache.window, self.cache.sinks, (m.rope_cos, m.rope_sin))

    # -- requests ---------------------------------------------------------------------------------

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never run (a pure check, safe from any thread).
        A request may ask for more tokens than the window holds: it stops with CONTEXT there (the
        HTTP edge refuses such a max_tokens up front, as OpenAI's API does)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"token id out of range for a vocabulary of {vocab}")
        params.validate()  # (a field set after construction is not checked otherwise)
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
            if any(t >= vocab for t in ids):
                raise ValueError(f"{name}: token id {max(ids)} out of range for a vocabulary of {vocab}")
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds the context window of "
                             f"{self.max_model_len} tokens")

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    arrival_time: float | None = None, context_shift: bool = False,
                    prompt_logits: bool = False, drafter: Drafter | None = None) -> Request:
        """Queue a request; it runs from the next `step`. context_shift: at a full context window
        it goes on from the window's last half instead of finishing with CONTEXT. prompt_logits:
        keep the float32 logits of every prompt position in `request.prompt_logits` [P, vocab]
        (whole once it has sampled its first token); the prompt is then computed in full, never
        taken from the prefix cache. drafter: decode it speculatively with this drafter
        (engine/speculative.py); its tokens are those plain decoding gives (greedy: the same
        tokens; sampled: the same distribution)."""
        self.check_request(prompt_ids, params)
        if request_id is None:
            self._next_id += 1
            request_id = f"request-{self._next_id}"
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if params.prompt_logprobs is not None and prompt_logits:
            raise ValueError("prompt_logprobs and prompt_logits are two uses of the same logits: ask for one")
        req = Request.create(request_id, prompt_ids, params, self.model.config.vocab_size, self.eos_ids,
                             self.device, context_shift, prompt_logits or params.prompt_logprobs is not None)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * (len(prompt_ids) - 1)
            req.logits_sink = self._prompt_logprobs_sink(req)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        if params.structured is not None:
            if self.grammars is None:
                raise ValueError("structured outputs need the tokenizer's grammar engine (Engine.grammars)")
            req.matcher = self.grammars.matcher(params.structured)  # (GrammarError: a ValueError)
        if drafter is not None and (params.prompt_logprobs is not None or params.adjusts_logits):
            # the acceptance test does not see the per-token adjustments (penalties, bias,
            # min_tokens), and prompt logprobs keep the prompt's logits: such requests decode
            # plainly. A grammar masks each verified position; logprobs come from its logits.
            drafter = None
        if drafter is not None:
            if self.config.kv_window:
                raise ValueError("speculative decoding does not run with a KV window (kv_window) yet")
            req.drafter, req.spec = drafter, SpecState()
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.stats.requests += 1
        self.stats.prompt_tokens += len(prompt_ids)
        return req

    @staticmethod
    def _prompt_logprobs_sink(req: Request):
        """A logits sink (`Request.logits_sink`) that keeps only the log-probabilities of each
        prompt token after the first, computed chunk by chunk: row j of a chunk at `start`
        predicts prompt token start + j + 1."""
        def sink(start: int, logits: torch.Tensor) -> None:
            n = min(logits.shape[0], req.num_prompt_tokens - 1 - start)
            if n > 0:
                req.prompt_logprobs[start:start + n] = top_logprobs(
                    logits[:n], req.token_ids[start + 1:start + 1 + n], req.params.prompt_logprobs)
        return sink

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """End a request now and free its blocks (unknown or finished ids are ignored)."""
        req = self.requests.pop(request_id, None)
        if req is not None and req.status != RequestStatus.FINISHED:
            self.scheduler.finish(req, reason)
            self._count_finished(req)
            self._release(req)

    def _release(self, req: Request) -> None:
        if req.drafter is not None:
            req.drafter.release(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def kv_cache_usage(self) -> float:
        return self.scheduler.pool.utilization

    def _count_finished(self, req: Request) -> None:
        self.stats.finished[req.finish_reason] = self.stats.finished.get(req.finish_reason, 0) + 1

    # -- one step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, forward, sample, postprocess: one new token for every request that reached
        the end of its window this step."""
        t0 = time.perf_counter()
        if self.config.contiguous and not self.scheduler.running and self.scheduler.waiting:
            self._fit_cache()
        drafting = self._propose()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        if self.config.kv_window:
            self._fit_rope(max(s.num_computed + n for s, n in zip(batch.seqs, batch.num_tokens)))
        tracer = self.tracer
        traced = tracer.before(self, batch) if tracer is not None else None
        with torch.inference_mode():
            logits, rows = self.runner.execute(self.cache, batch, by_rows=self.config.contiguous)
            threads.governor().observe()  # (the width of the steps that follow)
            sampled, failed = self._sample(logits, rows, batch)
        for req in drafting:
            req.draft, req.draft_probs = [], None
        prompt_tokens = sum(n for i, n in enumerate(batch.num_tokens) if not batch.decodes(i))
        outputs = self._postprocess(batch, sampled, failed)
        seconds = time.perf_counter() - t0
        if tracer is not None:
            with torch.inference_mode():
                tracer.after(self, traced, batch, logits, rows, sampled, seconds)
        if not prompt_tokens and (drafting or self.step_cost.times):  # where something speculates
            self.step_cost.observe(sum(batch.num_tokens), seconds)
        self.last_step = StepStats(prompt_tokens, len(outputs), seconds)
        self.stats.steps += 1
        self.stats.step_seconds += seconds
        return outputs

    def _fit_cache(self) -> None:
        """A contiguous cache for the waiting batch: a row per request (up to max_num_seqs), each
        as long as the longest request can grow (the whole window where one may shift)."""
        cfg = self.model.config
        waiting = list(self.scheduler.waiting)[:self.config.max_num_seqs]
        rows = len(waiting)
        length = max(cfg.max_seq_len if r.context_shift else
                     min(cfg.max_seq_len, r.num_tokens + r.params.max_new_tokens - r.num_output_tokens)
                     for r in waiting)
        cache = self.cache
        if cache is None or cache.n_blocks != rows or cache.block_size != length:
            self.cache = None  # (free the old one first)
            self.cache = KVCache.contiguous(cfg, rows, length, self.kv_dtype, self.device)
        self.scheduler.resize(rows, length)

    def _propose(self) -> list[Request]:
        """Drafts for the running requests that decode speculatively (`Request.draft`), as long
        as their drafter's rule finds worth it in a step of this size; returns those requests."""
        running = self.scheduler.running
        decoding = [r for r in running if r.num_tokens - r.num_computed == 1]
        spec = [r for r in decoding if r.drafter is not None]
        if not spec:
            return []
        # The step's tokens before drafts: a token per decode, and the prompt tokens it will take.
        prompts = sum(r.num_tokens - r.num_computed for r in running if r.num_tokens - r.num_computed > 1)
        if not self.scheduler.static_batches:  # (a static batch admits no one while it runs)
            prompts += sum(r.num_tokens for r in self.scheduler.waiting)
        step_tokens = min(self.config.max_num_batched_tokens, len(decoding) + prompts)
        spare = self.config.max_num_batched_tokens - len(decoding)
        if self.runner.exact_rows is not None:  # a bigger step would change the decode rows' arithmetic
            spare = min(spare, self.runner.exact_rows - step_tokens)
        by_drafter: dict[int, tuple[object, list[Request], list[int]]] = {}
        for r in spec:
            # Never past what may be emitted (max_new_tokens), nor past the context window:
            # the last draft position must have a slot, so a cut falls where plain decoding's does.
            cap = min(r.params.max_new_tokens - r.num_output_tokens - 1, self.scheduler.max_model_len - r.num_tokens,
                      spare)
            # Drafts by the measured step times, but for seeded sampling: its draws depend on
            # where drafts fall, so it drafts by the prior cost alone and reproduces run to run.
            timed = r.params.greedy or r.params.seed is None
            k = r.drafter.draft_length(r, cap, step_tokens, self.step_cost if timed else None)
            spare -= k
            step_tokens += k
            if k > 0:
                group = by_drafter.setdefault(id(r.drafter), (r.drafter, [], []))
                group[1].append(r)
                group[2].append(k)
        drafting = []
        for drafter, reqs, ks in by_drafter.values():
            for r, k, draft in zip(reqs, ks, drafter.propose_batch(reqs, ks)):
                r.draft = list(draft[:k])
                if r.matcher is not None:  # only what the grammar can take (it would reject the rest)
                    r.draft = r.draft[:self.grammars.valid_prefix(r.matcher, r.draft, r.eos_ids)]
                if r.draft_probs is not None:
                    r.draft_probs = r.draft_probs[:len(r.draft)]
                if r.draft:
                    drafting.append(r)
        return drafting

    def _sample(self, logits: torch.Tensor, rows: list[int], batch) -> tuple[dict[int, list[int]], dict[int, Exception]]:
        """The tokens of each sampling row as {batch row: token ids} (logits [len(rows), V]; a
        row that verifies a draft has its k + 1 logits rows in a run and gets the tokens
        `speculative.verify` keeps, any other one token), and the rows whose sampling raised,
        with the error.

        All rows are drawn in one `sample_rows`; if that raises, each row is drawn alone, so
        that a request whose parameters break sampling fails by itself instead of taking every
        request of the batch down with it. A row's draw does not depend on its batch (its own
        filters and generator), and the filters, where a bad parameter fails, run before any
        generator is drawn from: the rows that succeed alone get the tokens they would have."""
        if not rows:
            return {}, {}
        plain = [j for j, i in enumerate(rows) if not batch.drafts[i]]
        verifying = [j for j, i in enumerate(rows) if batch.drafts[i]]
        sampled, failed = self._sample_plain(logits, [rows[j] for j in plain], batch, plain)
        if verifying:
            vrows = list(dict.fromkeys(rows[j] for j in verifying))  # each verifying row once, in order
            raw = vlogits = logits[torch.tensor(verifying, device=logits.device)]
            guided, start = [], 0
            for i in vrows:
                if batch.seqs[i].matcher is not None:
                    guided.append((start, i))
                start += len(batch.drafts[i]) + 1
            if guided:  # each position's grammar mask: the matcher's, then after each draft token
                vlogits = vlogits.float().clone()
                for start, i in guided:
                    try:
                        bits = self.grammars.bitmask_along(batch.seqs[i].matcher, batch.drafts[i])
                    except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                        failed[i] = e
                        continue
                    kernels.mask_rows(vlogits, torch.arange(start, start + bits.shape[0]), bits)
            try:
                kept = verify(vlogits, [batch.seqs[i] for i in vrows], [batch.drafts[i] for i in vrows])
            except Exception:  # noqa: BLE001 - narrowed down to rows below
                kept = None
            start = 0
            for n, i in enumerate(vrows):
                k = len(batch.drafts[i])
                seq = batch.seqs[i]
                if i in failed:
                    start += k + 1
                    continue
                try:
                    toks = kept[n] if kept is not None else \
                        verify(vlogits[start:start + k + 1], [seq], [batch.drafts[i]])[0]
                    self._keep_logprobs(raw[start:start + len(toks)], [seq] * len(toks), toks)
                    bad = self._advance_grammars([seq] * len(toks), toks, [i] * len(toks))
                    if bad:
                        raise bad[i]
                except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                    failed[i] = e
                    start += k + 1
                    continue
                start += k + 1
                sampled[i] = toks
                seq.spec.record(k, len(toks) - 1)
                self.stats.spec_proposed += k
                self.stats.spec_accepted += len(toks) - 1
                self.stats.spec_passes += 1
        return sampled, failed

    def _sample_plain(self, logits: torch.Tensor, rows: list[int], batch,
                      at: list[int]) -> tuple[dict[int, list[int]], dict[int, Exception]]:
        """One token for each of `rows` (batch rows), from logits rows `at`."""
        if not rows:
            return {}, {}
        if len(at) != logits.shape[0]:
            logits = logits[torch.tensor(at, device=logits.device)]
        reqs = [batch.seqs[i] for i in rows]
        raw = logits
        guided = [j for j, r in enumerate(reqs) if r.matcher is not None]
        # Rows whose draw commutes with the mask (greedy, or temperature alone: no top-k/p, min-p
        # filter, which would see the unmasked distribution) draw first and compute the mask
        # only if the grammar refuses the token, then draw again from the masked row: the
        # argmax, or the masked distribution exactly (rejection sampling: P(t) = p(t) / p(A)).
        # llama.cpp's sampler does the same; most tokens of a model that follows its format
        # then cost a validation (~microseconds) instead of a mask (~0.1 ms a row).
        lazy = [j for j in guided if reqs[j].params.greedy or reqs[j].params.unfiltered]
        eager = [j for j in guided if j not in lazy]
        if guided or any(r.params.adjusts_logits for r in reqs):
            # changed in place; a copy where the raw logits are still read (logprobs, the tracer)
            logits = logits.float()
            if logits is raw and (self.tracer is not None or any(r.params.logprobs is not None for r in reqs)):
                logits = logits.clone()
            for j, r in enumerate(reqs):
                if r.params.adjusts_logits:
                    logits[j] = adjust_logits(logits[j], r.params, r.output_counts, r.num_output_tokens, r.end_ids)
            if eager:  # the grammar's mask, for the rows that have one
                self._mask(logits, [reqs[j] for j in eager], eager)
        try:
            next_ids = sample_rows(logits, [r.params for r in reqs], [r.generator for r in reqs],
                                   self._seen(reqs)).tolist()  # the step's one host sync
            if lazy:
                self._redraw_refused(logits, reqs, lazy, next_ids)
            self._keep_logprobs(raw, reqs, next_ids)
            failed = self._advance_grammars(reqs, next_ids, rows)
            return {i: [t] for i, t in zip(rows, next_ids) if i not in failed}, failed
        except Exception:  # noqa: BLE001 - narrowed down to rows below
            pass
        sampled, failed = {}, {}
        for j, (i, r) in enumerate(zip(rows, reqs)):
            try:
                if j in lazy:
                    self._mask(logits, [r], [j])
                sampled[i] = [sample_rows(logits[j:j + 1], [r.params], [r.generator], self._seen([r])).item()]
                self._keep_logprobs(raw[j:j + 1], [r], sampled[i])
                if self._advance_grammars([r], sampled[i], [i]):
                    raise ValueError(f"token {sampled[i][0]} breaks the grammar: {r.matcher.get_error()}")
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                failed[i] = e
        return sampled, failed

    def _redraw_refused(self, logits: torch.Tensor, reqs: list[Request], lazy: list[int], tokens: list[int]) -> None:
        """The lazy rows whose token their grammar refuses: masked, and drawn again (in place in
        `tokens`)."""
        redo = [j for j in lazy if not self.grammars.takes(reqs[j].matcher, tokens[j])]
        if redo:
            self._mask(logits, [reqs[j] for j in redo], redo)
            again = sample_rows(logits[torch.tensor(redo, device=logits.device)], [reqs[j].params for j in redo],
                                [reqs[j].generator for j in redo], self._seen([reqs[j] for j in redo])).tolist()
            for j, t in zip(redo, again):
                tokens[j] = t

    def _mask(self, logits: torch.Tensor, reqs: list[Request], at: list[int]) -> None:
        """In place: -inf in logits rows `at` for the tokens each request's grammar refuses next."""
        kernels.mask_rows(logits, torch.tensor(at), self.grammars.bitmask([r.matcher for r in reqs]))

    @staticmethod
    def _advance_grammars(reqs: list[Request], tokens: list[int], rows: list[int]) -> dict[int, Exception]:
        """Feed each sampled token to its request's grammar matcher; the rows whose token the
        grammar refused (it cannot happen with the mask applied) as failures."""
        failed = {}
        for r, tok, i in zip(reqs, tokens, rows):
            if r.matcher is not None and tok not in r.eos_ids and not r.matcher.consume_token(tok):
                failed[i] = RuntimeError(f"token {tok} breaks the grammar: {r.matcher.get_error()}")
        return failed

    @staticmethod
    def _keep_logprobs(logits: torch.Tensor, reqs: list[Request], tokens: list[int]) -> None:
        """The sampled tokens' log-probabilities for the requests that ask (`params.logprobs`),
        from the raw logits (before temperature and the filters), appended to `output_logprobs`."""
        want = [j for j, r in enumerate(reqs) if r.params.logprobs is not None]
        if not want:
            return
        k = max(reqs[j].params.logprobs for j in want)
        rows = logits[torch.tensor(want, device=logits.device)] if len(want) != len(reqs) else logits
        for j, (lp, top) in zip(want, top_logprobs(rows, [tokens[j] for j in want], k)):
            reqs[j].output_logprobs.append((lp, top[:reqs[j].params.logprobs]))

    def _seen(self, reqs: list[Request]) -> torch.Tensor | None:
        """[B, V] tokens seen so far, only when some row has a repetition penalty (the others'
        rows are ignored: a penalty of 1 changes nothing)."""
        masks = [r.seen for r in reqs]
        if all(m is None for m in masks):
            return None
        blank = next(m for m in masks if m is not None)
        return torch.stack([m if m is not None else blank for m in masks])

    def _postprocess(self, batch, sampled: dict[int, int], failed: dict[int, Exception]) -> list[RequestOutput]:
        outputs = []
        for req, new in self.scheduler.update(batch, sampled):
            self.stats.generation_tokens += len(new)
            count = req.num_output_tokens - len(new)
            if count == 0 and self.stats.on_first_token is not None:
                self.stats.on_first_token(req.first_token_time - req.arrival_time)
            for j, tok in enumerate(new):
                last = j == len(new) - 1
                out = RequestOutput(req.request_id, tok, count + j + 1, req.finish_reason if last else None)
                if req.params.logprobs is not None and count + j < len(req.output_logprobs):
                    out.logprob, out.top_logprobs = req.output_logprobs[count + j]
                if count + j == 0 and req.prompt_logprobs is not None:
                    out.prompt_logprobs = req.prompt_logprobs
                outputs.append(out)
            if req.status == RequestStatus.FINISHED:
                del self.requests[req.request_id]
                self._count_finished(req)
                self._release(req)
        for i, e in failed.items():  # (update took them for mid-prompt chunks: they are dropped now)
            req = batch.seqs[i]
            log.error("sampling failed for request %s: %s: %s", req.request_id, type(e).__name__, e)
            self.abort(req.request_id)
            outputs.append(RequestOutput(req.request_id, -1, req.num_output_tokens, FinishReason.ABORT,
                                         error=f"sampling failed: {type(e).__name__}: {e}"))
        return outputs

    # -- offline ----------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 drafter: Drafter | None = None) -> list[list[int]]:
        """Run prompts to the end (all submitted at once); the output token ids of each, in order."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp, drafter=drafter) for p, sp in zip(prompts, params)]
        try:
            while any(not r.finished for r in reqs):
                for out in self.step():
                    if out.error is not None:
                        raise RuntimeError(f"request {out.request_id}: {out.error}")
        finally:
            for r in reqs:
                self.abort(r.request_id)
        return [r.output_ids for r in reqs]
