"""Next-token sampling: repetition penalty, temperature, top-k, top-p, min-p, seeded draws.

Everything works on a whole batch of logits `[B, vocab]` with tensor ops: no Python loop over
rows or tokens, no host sync (the draw is an inverse CDF in tensor ops, not `torch.multinomial`).
`sample` takes one `SamplingParams` for the batch; `sample_rows` one per row, for a server's
batch of unrelated requests (each filter takes a per-row `[B, 1]` tensor as well as a number).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from . import kernels
from .settings import GREEDY_BELOW  # (arlm.bare samples without torch by the same bound)
from .structured import StructuredOutput

MAX_LOGPROBS = 20  # the most top log-probabilities a token reports (OpenAI's cap)


def top_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """For logits rows [n, vocab] and the token each row chose: (that token's log-probability,
    the k most likely [(token id, log-probability)], best first), the model's log-softmax in
    float32."""
    lp = torch.log_softmax(logits.float(), -1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if k == 0:
        return [(c, []) for c in chosen]
    top = torch.topk(lp, k)
    return [(c, list(zip(ids, vals))) for c, ids, vals in zip(chosen, top.indices.tolist(), top.values.tolist())]


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop (the names vLLM and HF users know).

    temperature 0 is greedy. top_k 0, top_p 1 and min_p 0 disable those filters;
    repetition_penalty 1 disables the penalty (HF semantics: divide positive logits of tokens
    already seen, multiply negative ones). `seed` makes sampling reproducible.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # Log-probabilities (the model's log-softmax, before any sampling transform, as vLLM's
    # default): logprobs=k returns each sampled token's and the top k (0: the sampled token's
    # alone); prompt_logprobs=k the same for every prompt token but the first. None: off.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # OpenAI's penalties over the tokens generated so far: logit -= frequency_penalty * count +
    # presence_penalty * (count > 0). logit_bias: {token id: bias} added to the logits (clamped
    # to [-100, 100]). min_tokens: no end-of-sequence (or stop_token_ids) token before that many.
    # stop_token_ids: tokens that end the request as EOS does (even with ignore_eos).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    # The output must match this (arlm.structured.StructuredOutput: JSON, a JSON schema, a regex,
    # a choice, a grammar), enforced token by token; None: free text.
    structured: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if self.logit_bias:  # clamped as OpenAI's API documents
            self.logit_bias = {t: min(100.0, max(-100.0, float(b))) for t, b in self.logit_bias.items()}
        self.validate()

    def bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """logit_bias as (ids, biases) tensors, built once (a bias of 40,000 entries is ~10 ms of
        Python a step otherwise; a logit_bias replaced by another dict is seen)."""
        key = id(self.logit_bias), len(self.logit_bias)
        if getattr(self, "_bias_key", None) != key:
            self._bias_key = key
            self._bias = (torch.tensor(list(self.logit_bias), dtype=torch.long),
                          torch.tensor(list(self.logit_bias.values()), dtype=torch.float32))
        return self._bias

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"invalid {name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", "must be an integer >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 is greedy)")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**31:
            raise bad("top_k", "must be an integer in [0, 2**31) (0 disables it)")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "must be in [0, 1]")
        if not math.isfinite(self.repetition_penalty) or not 0.01 <= self.repetition_penalty <= 100:
            raise bad("repetition_penalty", "must be in [0.01, 100] (1 disables it)")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64):
            raise bad("seed", "must be an integer in [-2**63, 2**64)")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be True or False")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise bad(name, "must be in [-2, 2] (0 disables it)")
        if self.logit_bias is not None and (not isinstance(self.logit_bias, dict) or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 or not math.isfinite(b)
                for t, b in self.logit_bias.items())):
            raise bad("logit_bias", "must map token ids (integers >= 0) to finite numbers")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if not isinstance(self.stop_token_ids, list) or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be token ids (integers >= 0)")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise bad("structured", "must be an arlm.structured.StructuredOutput")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}] or None")

    @property
    def adjusts_logits(self) -> bool:
        """Whether the engine changes this request's logits before sampling (penalties over its
        output, a bias, a minimum length): `adjust_logits`."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias or self.min_tokens)

    @property
    def unfiltered(self) -> bool:
        """No top-k, top-p or min-p filter: the draw is from the (tempered) distribution itself."""
        return self.top_k == 0 and self.top_p == 1.0 and self.min_p == 0.0

    @property
    def greedy(self) -> bool:
        # Below GREEDY_BELOW, logits / temperature overflows float32 (and the draw is the argmax
        # anyway): such temperatures are greedy, as vLLM treats them.
        return self.temperature < GREEDY_BELOW


def adjust_logits(logits: torch.Tensor, params: SamplingParams, output_counts: torch.Tensor | None,
                  num_output: int, end_ids: frozenset[int] | set[int]) -> torch.Tensor:
    """One row's logits [V] float32 with its OpenAI-style adjustments, in vLLM's order: the
    penalties over the output so far (output_counts [V]: each token's count), the bias, then
    min_tokens' ban on the end tokens (end_ids) while fewer than min_tokens are out."""
    if output_counts is not None and (params.frequency_penalty or params.presence_penalty):
        logits = logits - params.frequency_penalty * output_counts - params.presence_penalty * (output_counts > 0)
    if params.logit_bias:
        ids, biases = params.bias_tensors()
        logits = logits.index_add(0, ids.to(logits.device), biases.to(device=logits.device, dtype=logits.dtype))
    if num_output < params.min_tokens and end_ids:
        logits = logits.index_fill(0, torch.tensor(sorted(end_ids), device=logits.device), float("-inf"))
    return logits


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float | torch.Tensor) -> torch.Tensor:
    """logits [B, V]; seen [B, V] bool (tokens in the prompt or generated so far); penalty a
    number or [B, 1]."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def top_k_filter(logits: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """Keep the k largest logits per row (ties at the k-th value are kept), -inf elsewhere.

    k: a number, or [B, 1] int64 per row (0 or >= vocab disables that row's filter)."""
    vocab = logits.shape[-1]
    if isinstance(k, torch.Tensor):
        on = (k > 0) & (k < vocab)
        k = torch.where(on, k, 1)
        kth = torch.topk(logits, int(k.max()), dim=-1).values.gather(-1, k - 1)  # size on the host
        return logits.masked_fill(on & (logits < kth), float("-inf"))
    if k <= 0 or k >= vocab:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


# top-p first looks at this many most likely tokens (see top_p_filter).
NUCLEUS_CANDIDATES = 256


def top_p_filter(logits: torch.Tensor, p: float | torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to >= p (a number or
    [B, 1]; p >= 1 keeps everything)."""
    if isinstance(p, torch.Tensor):
        p = torch.where(p >= 1.0, float("inf"), p)  # rounding in the cumsum must not drop tokens
    elif p >= 1.0:
        return logits
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[-1] > NUCLEUS_CANDIDATES:
        # The nucleus is a prefix of the tokens sorted by probability. Where the most likely
        # NUCLEUS_CANDIDATES tokens already hold mass p (a language model's usual case), sorting
        # just those (topk) decides it; sorting a whole 49k vocabulary costs ~3 ms a step on CPU.
        # Rows whose nucleus reaches further take the full sort. Each row is decided on its own
        # values, so a row's result does not depend on its batch. (On GPUs the sort is cheap and
        # this check would cost a host sync.)
        top, index = torch.topk(logits, NUCLEUS_CANDIDATES, dim=-1)
        probs = (top - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
        mass = probs.cumsum(dim=-1)
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, index, mass - probs < p)
        wider = (mass[:, -1:] < p)[:, 0]
        if wider.any():
            keep[wider] = _top_p_sorted(logits[wider], p[wider] if isinstance(p, torch.Tensor) else p) > float("-inf")
        return logits.masked_fill(~keep, float("-inf"))
    return _top_p_sorted(logits, p)


def _top_p_sorted(logits: torch.Tensor, p: float | torch.Tensor) -> torch.Tensor:
    """top_p_filter by a full sort of each row (p < 1, or a [B, 1] tensor with inf for 'keep all')."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly more likely tokens
    drop_sorted = mass_before >= p  # the first token always has mass_before 0 and is kept
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float | torch.Tensor) -> torch.Tensor:
    """Keep tokens whose probability is >= min_p (a number or [B, 1]) times the most likely
    token's."""
    if not isinstance(min_p, torch.Tensor) and min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p, min-p (HF's order). logits [B, V] float32."""
    logits = logits / params.temperature
    logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    return min_p_filter(logits, params.min_p)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           seen: torch.Tensor | None = None) -> torch.Tensor:
    """Pick one token per row. logits [B, V]; returns [B] int64 on logits' device."""
    logits = logits.float()
    if params.repetition_penalty != 1.0 and seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return kernels.argmax_rows(logits)
    probs = filtered_logits(logits, params).softmax(dim=-1)
    return draw(probs, [generator] * probs.shape[0])


def penalized(logits: torch.Tensor, params: list[SamplingParams], seen: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] as float32 with each row's repetition penalty applied (seen [B, V] bool,
    needed only for rows with a penalty): what greedy rows take the argmax of."""
    logits = logits.float()
    penalties = [p.repetition_penalty for p in params]
    if seen is not None and any(r != 1.0 for r in penalties):
        logits = apply_repetition_penalty(logits, seen, torch.tensor(penalties, device=logits.device)[:, None])
    return logits


def warped_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution [B, V] each (non-greedy) row draws from: penalized logits [B, V] (see
    `penalized`) through its temperature, then top-k, top-p, min-p, as [B, 1]-parameter tensor
    ops over the rows that use each filter (a disabled filter leaves its rows untouched)."""
    dev = logits.device

    def column(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=dev)[:, None]

    x = logits / column([p.temperature for p in params])
    for name, fn, off in (("top_k", top_k_filter, 0), ("top_p", top_p_filter, 1.0), ("min_p", min_p_filter, 0.0)):
        on = [i for i, p in enumerate(params) if getattr(p, name) != off]
        if on:
            dtype = torch.int64 if name == "top_k" else torch.float32
            x[on] = fn(x[on], column([getattr(params[i], name) for i in on], dtype))
    return x.softmax(dim=-1)


DRAW_BLOCK = 256


def draw(probs: torch.Tensor, generators: list[torch.Generator | None] | None = None) -> torch.Tensor:
    """One token per row of probs [B, V] (any non-negative weights, a positive sum), row b from
    its own generator: one uniform u per row, and the token where the row's cumulative weight
    first exceeds u times its total (the inverse CDF). Returns [B] int64.

    In two levels, so that float32 rounding never biases a small probability: the weights summed
    in float64 per block of DRAW_BLOCK tokens, the block found on the cumulative block sums, then
    the token on the cumulative sum (float64) inside that block. Each row's arithmetic is its
    own: a seeded row draws the same token in any batch. (Not an exponential race, argmax(p_i /
    E_i): its V exponentials a row cost ~0.7 ms, 22 ms a step at batch 32.)"""
    B, V = probs.shape
    dev = probs.device
    u = torch.cat([torch.rand(1, generator=generators[i] if generators else None, dtype=torch.float64,
                              device=dev) for i in range(B)])  # per-request streams
    pad = -V % DRAW_BLOCK
    p = torch.nn.functional.pad(probs.float(), (0, pad)) if pad else probs.float()
    blocks = p.view(B, -1, DRAW_BLOCK)
    cum = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [B, V / DRAW_BLOCK]
    target = (u * cum[:, -1])[:, None]
    j = torch.searchsorted(cum, target, right=True).clamp_(max=cum.shape[1] - 1)  # [B, 1]
    before = torch.where(j > 0, cum.gather(1, (j - 1).clamp_(min=0)), torch.zeros_like(target))
    inside = blocks.gather(1, j[:, :, None].expand(B, 1, DRAW_BLOCK))[:, 0]  # [B, DRAW_BLOCK]
    k = torch.searchsorted(inside.double().cumsum(-1) + before, target, right=True)
    # (the block's sum and its running sum may differ in the last bit: never past its last
    # token with a weight)
    last = (torch.arange(DRAW_BLOCK, device=dev) * (inside > 0)).amax(-1, keepdim=True)
    return (j * DRAW_BLOCK + torch.minimum(k, last))[:, 0]


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None] | None = None,
                seen: torch.Tensor | None = None) -> torch.Tensor:
    """Pick one token per row, row b with its own `params[b]` and `generators[b]`.

    The filters run as [B, 1]-parameter tensor ops over the rows that need them (`warped_probs`);
    only the random draw loops over rows, so that a seeded request takes the same numbers from
    its own generator whatever shares its batch. Greedy rows are exactly `sample`'s argmax.
    logits [B, V]; seen [B, V] bool (needed only for rows with a repetition penalty). Returns
    [B] int64.
    """
    logits = penalized(logits, params, seen)
    tokens = kernels.argmax_rows(logits)
    rows = [b for b, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    probs = warped_probs(logits[rows], [params[b] for b in rows])
    tokens[rows] = draw(probs, [generators[b] for b in rows] if generators else None)
    return tokens
