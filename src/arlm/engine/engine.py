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

from ..kv_cache import KVCache, check_head_dim, parse_kv_dtype
from ..model import Transformer
from ..runtime import Runtime
from ..runtime import runtime as default_runtime
from ..sampling import SamplingParams, top_logprobs
from ..structured import GrammarError
from .cache_layout import PoolLayout, contiguous_shape
from .config import EngineConfig
from .hooks import (StepClockHook, StepHooks, StepResult, StepStats, StepStatsHook, ThreadWidthHook,
                    WindowRopeHook)
from .request import FinishReason, Request, RequestOutput, RequestStatus
from .runner import ModelRunner
from .sampler import PrefetchedMasks, sample_step
from .scheduler import ScheduledBatch, Scheduler
from .speculative import Drafter, SpecRates, SpecState, StepCost, propose_drafts

log = logging.getLogger(__name__)

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
                 config: EngineConfig | None = None, runtime: Runtime | None = None) -> None:
        self.runner = model if isinstance(model, ModelRunner) else ModelRunner(model)
        self.model = self.runner.model
        self.config = config = config or EngineConfig()
        self.runtime = runtime or default_runtime()
        cfg = self.model.config
        param = next(self.model.parameters())
        self.device = param.device
        # The cache holds the activations' dtype (float32 unless the model runs in another float
        # type), or config.kv_dtype.
        self.kv_dtype = parse_kv_dtype(config.kv_dtype) if config.kv_dtype is not None else \
            (param.dtype if param.dtype.is_floating_point else torch.float32)
        check_head_dim(self.kv_dtype, cfg.head_dim)
        config.check()
        self.eos_ids = frozenset(eos_ids)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.last_step = StepStats()
        self.step_cost = StepCost()  # what a decode step costs here, by its size (speculation's rule)
        # arlm.structured.Grammars over the tokenizer: set by the front end (the engine speaks
        # token ids), needed by requests with SamplingParams.structured
        self.grammars = None
        self._next_id = 0
        self.hooks = StepHooks()  # what watches the steps (hooks.py); front ends add theirs after these
        if config.contiguous:
            self.cache: KVCache | None = None  # sized for each batch (`_fit_cache`)
            self.max_model_len = cfg.max_seq_len
            self.scheduler = Scheduler(1, cfg.max_seq_len, cfg.max_seq_len, config.max_num_seqs,
                                       config.max_num_batched_tokens, False, static_batches=True)
        else:
            self._make_pool()
        for hook in (ThreadWidthHook(self.runtime.threads), StepClockHook(), StepStatsHook()):
            self.hooks.add(hook)

    def _make_pool(self) -> None:
        """The paged pool `config` describes (cache_layout.PoolLayout), its scheduler, and a
        sliding window's bookkeeping (`config.kv_window`)."""
        config, cfg = self.config, self.model.config
        layout = PoolLayout.plan(config, cfg, self.kv_dtype, self.device)
        bs, n_blocks, window = layout.block_size, layout.n_blocks, layout.window
        self.cache = KVCache.pool(cfg, n_blocks, bs, self.kv_dtype, self.device, n_local_blocks=layout.n_local)
        self.max_model_len = layout.max_model_len
        self.scheduler = Scheduler(n_blocks, bs, self.max_model_len, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_prefix_caching and window is None,
                                   long_prefill_tokens=config.long_prefill_tokens, group_rows=config.group_rows)
        if layout.n_local:
            self.scheduler.split(layout.n_local, cfg.sliding_window)
        if window is not None:
            self.scheduler.window = window
            self.cache.set_window(*window, (self.model.rope_cos, self.model.rope_sin))
            self.hooks.add(WindowRopeHook())

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
                    prompt_logits: bool = False, drafter: Drafter | None = None, grammar=None,
                    group: str | None = None, embed: bool = False) -> Request:
        """Queue a request; it runs from the next `step`. context_shift: at a full context window
        it goes on from the window's last half instead of finishing with CONTEXT. prompt_logits:
        keep the float32 logits of every prompt position in `request.prompt_logits` [P, vocab]
        (whole once it has sampled its first token); the prompt is then computed in full, never
        taken from the prefix cache. drafter: decode it speculatively with this drafter
        (engine/speculative/); its tokens are those plain decoding gives (greedy: the same
        tokens; sampled: the same distribution). grammar: params.structured compiled already
        (`Grammars.submit`, off this thread: a server's requests wait for their grammar there,
        never in a step); without it the grammar is compiled here. group: the API call this
        request is one choice of (its choices share turns while others run: EngineConfig.group_rows).
        embed: an embedding request (`params` is ignored): its prompt runs as any other's, never
        from the prefix cache, and it ends at the prompt's end with `RequestOutput.embedding` (the
        mean of its tokens' final normed hidden states, L2-normalized) and no token."""
        if embed:  # one token's room: the prompt's last position samples, and that ends it
            params, drafter, prompt_logits = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True), None, False
            context_shift = False
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
        req.group = group
        req.embed = embed
        if params.structured is not None:
            if self.grammars is None:
                raise ValueError("structured outputs need the tokenizer's grammar engine (Engine.grammars)")
            compiled = grammar if grammar is not None else self.grammars.compile(params.structured)
            req.matcher = compiled.matcher()  # (GrammarError, a ValueError, if it cannot be enforced)
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
        the end of its window this step (more for a request whose draft was accepted). The
        hooks (`self.hooks`, hooks.py) watch each phase."""
        start = time.perf_counter()
        batch = self._schedule()
        if not batch:
            return []
        self.hooks.scheduled(self, batch)
        # the eager grammar rows' masks, on the grammar engine's thread while the forward pass runs
        masks = PrefetchedMasks.start(batch, self.grammars) if self.grammars is not None else None
        with torch.inference_mode():
            logits, rows = self.runner.execute(self.cache, batch, by_rows=self.config.contiguous)
            self.hooks.forwarded(self, batch)
            sampled, failed = sample_step(logits, rows, batch, self.grammars, self.hooks.reads_logits, masks)
        outputs = self._postprocess(batch, sampled, failed)
        self.hooks.stepped(self, StepResult(batch, logits, rows, sampled, outputs, time.perf_counter() - start))
        return outputs

    def _schedule(self) -> ScheduledBatch:
        """The step's batch: drafts first for the requests that speculate (they lengthen their
        rows), a contiguous cache fitted to a new static batch, then the scheduler's choice."""
        if self.config.contiguous and not self.scheduler.running and self.scheduler.waiting:
            self._fit_cache()
        drafted = propose_drafts(self.scheduler, self.config.max_num_batched_tokens, self.runner.exact_rows,
                                 self.step_cost, self.grammars)
        batch = self.scheduler.schedule()
        batch.drafted = drafted
        batch.prompt_tokens = sum(n for i, n in enumerate(batch.num_tokens) if not batch.decodes(i))
        return batch

    def _fit_cache(self) -> None:
        """A contiguous cache for the waiting batch (up to max_num_seqs requests):
        `cache_layout.contiguous_shape`."""
        waiting = list(self.scheduler.waiting)[:self.config.max_num_seqs]
        rows, length = contiguous_shape(waiting, self.model.config.max_seq_len)
        cache = self.cache
        if cache is None or cache.n_blocks != rows or cache.block_size != length:
            self.cache = None  # (free the old one first)
            self.cache = KVCache.contiguous(self.model.config, rows, length, self.kv_dtype, self.device)
        self.scheduler.resize(rows, length)

    def _postprocess(self, batch: ScheduledBatch, sampled: dict[int, list[int]],
                     failed: dict[int, Exception]) -> list[RequestOutput]:
        """Hand the sampled tokens to the scheduler (which appends them, rolls back rejected
        draft positions and finishes requests), count them, and make the step's outputs; a
        request whose sampling failed is aborted with its error."""
        for req in batch.drafted:  # (verified: the scheduler has the kept tokens from `sampled`)
            req.draft, req.draft_probs = [], None
        for i, toks in sampled.items():
            if batch.drafts[i]:  # a verification: k proposed, len(toks) - 1 of them kept
                self.stats.spec_proposed += len(batch.drafts[i])
                self.stats.spec_accepted += len(toks) - 1
                self.stats.spec_passes += 1
        outputs = []
        for req, new in self.scheduler.update(batch, sampled):
            if req.embed:  # no token: the vector (the one sampled only ended the request)
                outputs.append(RequestOutput(req.request_id, -1, 0, req.finish_reason, embedding=req.embedding))
                new = []
            self.stats.generation_tokens += len(new)
            count = req.num_output_tokens - len(new)
            if count == 0 and new and self.stats.on_first_token is not None:
                self.stats.on_first_token(req.first_token_time - req.arrival_time)
            for j, tok in enumerate(new):
                last = j == len(new) - 1
                out = RequestOutput(req.request_id, tok, count + j + 1, req.finish_reason if last else None,
                                    cached_tokens=req.num_cached_tokens)
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
            self.abort(req.request_id)
            if isinstance(e, GrammarError):  # the request's own input (a grammar past its limits): the client's error
                log.info("request %s failed: %s", req.request_id, e)
                outputs.append(RequestOutput(req.request_id, -1, req.num_output_tokens, FinishReason.ABORT,
                                             error=str(e), client_error=True))
                continue
            log.error("sampling failed for request %s: %s: %s", req.request_id, type(e).__name__, e)
            outputs.append(RequestOutput(req.request_id, -1, req.num_output_tokens, FinishReason.ABORT,
                                         error=f"sampling failed: {type(e).__name__}: {e}"))
        return outputs

    # -- offline ----------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 drafter: Drafter | None = None) -> list[list[int]]:
        """Run prompts to the end (all submitted at once); the output token ids of each, in order."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp, drafter=drafter) for p, sp in zip(prompts, params)]
        self.run_to_end(reqs)
        return [r.output_ids for r in reqs]

    def run_to_end(self, reqs: list[Request]) -> None:
        """Step until every request of `reqs` (added by the caller) is finished: RuntimeError on
        a request's error (GrammarError where its input caused it); each of them aborted on the way out, so an error or an interrupt
        leaves no blocks held (`abort` passes over the finished ones)."""
        try:
            while any(not r.finished for r in reqs):
                for out in self.step():
                    if out.error is not None:
                        raise (GrammarError if out.client_error else RuntimeError)(f"request {out.request_id}: {out.error}")
        finally:
            for r in reqs:
                self.abort(r.request_id)
