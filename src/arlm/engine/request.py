"""One request's state, in one place: its tokens, sampling parameters, random stream, penalty
mask, status and finish reason. The engine, the scheduler and the edges (Python API, CLI, HTTP)
all read it from here."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Callable

import torch

from ..sampling import SamplingParams


class RequestStatus(StrEnum):
    WAITING = "waiting"  # queued, or preempted and queued again (its K/V will be recomputed)
    RUNNING = "running"  # holds blocks; prefilling or decoding
    FINISHED = "finished"


class FinishReason(StrEnum):
    """Why a request stopped. The OpenAI-style "stop"/"length" pair loses which limit was hit, so
    the engine keeps five and the HTTP edge maps them (`openai_finish_reason`)."""

    EOS = "eos"  # sampled an end-of-sequence token
    STOP = "stop"  # a stop string appeared in the text (decided at the text edge)
    LENGTH = "length"  # max_new_tokens reached
    CONTEXT = "context"  # no slot left in the context window for the token just sampled
    ABORT = "abort"  # cancelled by the caller (client gone, a failure)

    @property
    def openai(self) -> str | None:
        """The OpenAI API's finish_reason: eos/stop -> "stop", length/context -> "length" (an
        aborted request has none: it has no response to finish)."""
        return {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}.get(self.value)


@dataclass(eq=False)
class Request:
    """A prompt and everything generated for it so far, and its place in the KV cache.

    `token_ids` holds the prompt, then every token generated. The model sees the window
    `token_ids[num_dropped:]` at positions 0.. (num_dropped > 0 only after a context shift); of
    that window `num_computed` tokens have their K/V in `blocks`. A step computes the next `n`
    window tokens and, if that reaches the end, samples one more.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    eos_ids: frozenset[int] = frozenset()
    context_shift: bool = False  # at a full window, go on from its last half instead of CONTEXT
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None  # its own random stream when seeded
    seen: torch.Tensor | None = None  # [vocab] bool: tokens in the prompt or generated (repetition penalty)
    output_counts: torch.Tensor | None = None  # [vocab] float32: each token's count in the output (presence/frequency)
    end_ids: frozenset[int] = frozenset()  # what min_tokens holds back: the EOS ids and stop_token_ids
    matcher: Any = None  # params.structured's llguidance matcher (arlm.structured), fed each token
    group: str | None = None  # the requests of one API call (its n choices): they share its turns (Scheduler)
    blocks: list[int] = field(default_factory=list)  # block table: block ids in position order
    block_hashes: list[bytes] = field(default_factory=list)  # content hashes of the window's full blocks
    num_registered: int = 0  # leading blocks known to the prefix cache (hit, or registered once full)
    # A split pool's sliding-window layers' blocks (BlockTables.sliding_window), in position order as
    # `blocks`; those wholly behind the window are given back (FREED), and the leading
    # num_local_registered are known to that pool's prefix cache (or FREED)
    local_blocks: list[int] = field(default_factory=list)
    num_local_registered: int = 0
    num_local_freed: int = 0  # leading local_blocks given back (FREED)
    num_computed: int = 0  # window tokens whose K/V are in `blocks`
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache at the last admission
    num_dropped: int = 0  # tokens before the window (context shift)
    keep_prompt_logits: bool = False
    prompt_logits: torch.Tensor | None = None  # [P, vocab] float32 (keep_prompt_logits)
    # An embedding request (Engine.add_request(embed=True)): its prompt runs as any prompt (chunked,
    # batched with other requests), the final normed hidden state of each of its tokens summed
    # (float64) as they are computed; it ends at the prompt's end (`embedding`)
    embed: bool = False
    hidden_sum: torch.Tensor | None = None
    hidden_count: int = 0
    # Instead of prompt_logits: called with (start, logits [n, vocab]) for each computed chunk of
    # prompt positions start .. start + n - 1 (a stream too long to hold its logits: perplexity)
    logits_sink: Callable[[int, torch.Tensor], None] | None = None
    # params.logprobs / prompt_logprobs: (log-probability, top [(id, log-probability)]) of each
    # output token, in order; of prompt tokens 1 .. P-1 (filled as the prompt is computed)
    output_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    # Speculative decoding (engine/speculative/): who drafts for it (a `Drafter`), this step's
    # draft (tokens proposed after the window, not yet verified) and the drafter's distributions
    # [k, vocab] for them (None: deterministic proposals), its acceptance estimate and counts (a
    # `SpecState`). (Typed Any: the speculative package imports this module.)
    drafter: Any = None
    draft: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    spec: Any = None

    @classmethod
    def create(cls, request_id: str, prompt_ids: list[int], params: SamplingParams, vocab_size: int,
               eos_ids: frozenset[int] = frozenset(), device: torch.device | str = "cpu",
               context_shift: bool = False, prompt_logits: bool = False) -> "Request":
        """A new request; seeds its generator (a seeded request samples the same in any batch, as
        vLLM seeds each request) and builds its penalty mask from the prompt when it needs one."""
        stops = frozenset(params.stop_token_ids)
        req = cls(request_id, list(prompt_ids), len(prompt_ids), params,
                  (frozenset() if params.ignore_eos else frozenset(eos_ids)) | stops, context_shift,
                  keep_prompt_logits=prompt_logits)
        req.end_ids = frozenset(eos_ids) | stops
        if params.presence_penalty or params.frequency_penalty:
            req.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if params.seed is not None:
            req.generator = torch.Generator(device=device).manual_seed(params.seed)
        if params.repetition_penalty != 1.0:
            req.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            req.seen[torch.tensor(req.token_ids, device=device)] = True
        return req

    @property
    def num_tokens(self) -> int:
        """Tokens in the window the model sees."""
        return len(self.token_ids) - self.num_dropped

    def window(self, start: int, end: int) -> list[int]:
        """Window tokens start .. end - 1 (at positions start .. end - 1)."""
        return self.token_ids[self.num_dropped + start:self.num_dropped + end]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def wants_logits(self) -> bool:
        """Whether the logits of every token this request computes now are kept: it keeps its
        prompt's and has not sampled yet (so every token it computes is a prompt token, at its own
        position: no context shift happens before the first token)."""
        return self.keep_prompt_logits and self.num_output_tokens == 0

    def keep_logits(self, start: int, logits: torch.Tensor) -> None:
        """Prompt positions start .. start + n - 1 computed: their logits [n, vocab] float32. A
        whole prompt in one pass is kept as it is (a view of the step's logits); chunks are
        copied into place (a recomputed chunk, after a preemption, overwrites its rows)."""
        n = logits.shape[0]
        if self.logits_sink is not None:
            self.logits_sink(start, logits)
            return
        if start == 0 and n == self.num_prompt_tokens:
            self.prompt_logits = logits
            return
        if self.prompt_logits is None or self.prompt_logits.shape[0] != self.num_prompt_tokens:
            self.prompt_logits = logits.new_empty(self.num_prompt_tokens, logits.shape[1])
        self.prompt_logits[start:start + n] = logits

    def add_hidden(self, start: int, hidden: torch.Tensor) -> None:
        """Prompt positions start .. start + n - 1 computed: their final normed hidden states
        [n, d_model] (a recomputation from 0, after a preemption, starts the sum again)."""
        total = hidden.double().sum(0)
        if start == 0 or self.hidden_sum is None:
            self.hidden_sum, self.hidden_count = total, 0
        else:
            self.hidden_sum += total
        self.hidden_count = start + hidden.shape[0]

    @property
    def embedding(self) -> torch.Tensor:
        """The mean of the prompt tokens' final normed hidden states, L2-normalized: float32 [d_model]."""
        mean = self.hidden_sum / self.hidden_count
        return (mean / mean.norm().clamp_min(1e-12)).float()

    def append(self, token: int) -> None:
        """Take a sampled token."""
        self.token_ids.append(token)
        if self.seen is not None:
            self.seen[token] = True
        if self.output_counts is not None:
            self.output_counts[token] += 1
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()


@dataclass
class RequestOutput:
    """One new token of one request; `finish_reason` is set on its last."""

    request_id: str
    token_id: int
    num_output_tokens: int
    finish_reason: FinishReason | None = None
    error: str | None = None  # the request failed (token_id is -1): why
    client_error: bool = False  # ... because of its own input (a grammar past the server's limits): a 4xx
    # SamplingParams.logprobs: this token's log-probability and the top ones [(id, log-probability)]
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    # SamplingParams.prompt_logprobs, on a request's first output: prompt tokens 1 .. P-1's
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    embedding: torch.Tensor | None = None  # an embedding request's vector (Request.embedding), on its last
    cached_tokens: int = 0  # prompt tokens the request took from the prefix cache (its last admission)
