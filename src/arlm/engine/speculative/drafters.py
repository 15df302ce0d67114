"""Speculative decoding: a drafter proposes k tokens, the target scores all k + 1 positions in
one pass, and the longest prefix the acceptance rule allows is kept (Leviathan et al. 2023,
Chen et al. 2023).

A decode step streams every weight for one token per sequence; a pass over k + 1 positions of a
sequence costs little more at batch 1 (the packed kernels serve up to 4 rows per weight load).
The engine asks each decoding request's drafter for a draft before it schedules a step
(`Engine._propose`); the scheduler feeds the draft after the request's last token, as a row of
k + 1 tokens beside the other decodes and prompt chunks of the same flattened step; the runner
brings every one of those positions to the LM head; `verify` keeps what the rule accepts; the
scheduler rolls the rest back (`Scheduler.update`).

Exact by construction, and tested so: a row's arithmetic does not depend on how many rows share
its pass (the quantized kernels compute each row alone, the paged attention each query alone),
so position j of a verification pass gives bitwise the logits decoding that token would have
given, and greedy verification (argmax, the same penalty) keeps exactly the tokens plain greedy
decoding emits. With sampling, the modified rejection rule keeps the target's distribution: draft
token x (drawn from the drafter's q, or proposed outright: q one-hot) is accepted with
probability min(1, p(x) / q(x)); on the first rejection the token comes from norm(max(0, p - q));
when every draft token passes, one more comes from p. p and q are the *warped* distributions
(penalty, temperature, top-k, top-p, min-p), so that is the distribution preserved.

Drafters (`Drafter.propose(request, k) -> token ids`):
- `NgramDrafter`: prompt lookup. The last n tokens (n from `ngram_max` down to `ngram_min`) are
  looked up among the request's earlier tokens (prompt and output); what followed their latest
  earlier occurrence is proposed. No second model; it shines where the output copies the input.
- `ModelDrafter`: any arlm model with the target's vocabulary, with its own paged KV pool in the
  same process; its rows are rolled back with the target's (the tokens it computed are compared
  with the request's each time, and it recomputes from the first difference). `self_draft` makes
  one from the target itself: its first layers, final norm and LM head, sharing the weights.

How many tokens to draft (`SpeculativeConfig.adaptive`): k draft tokens make the step k tokens
longer and yield alpha + ... + alpha^k expected tokens, alpha the request's estimated acceptance
for this kind of proposal (per n-gram length: a long match in a copy is right far more often
than a one-token one). `best_draft_length` picks the k that maximizes the step's expected tokens
per second, with step times by size from `StepCost`: the engine's own decode steps, and before
it has seen a size, a + b * n with b / a = `verify_cost`. So drafts grow after full acceptance
(alpha rises), shrink after rejections, and stop for a request whose alpha is too low, and for
the whole step under load, where an extra token costs nearly a whole token's share of the step.
A request not drafting drifts back toward its prior and tries again. Each request's draft counts
in the step size the next one is judged at.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from ... import kernels
from ...kv_cache import KVCache
from ...model import Transformer
from ...quant import weight_bytes
from ...sampling import draw, penalized, warped_probs
from ..request import Request


@dataclass
class SpeculativeConfig:
    """How a drafter drafts. method: "ngram" (prompt lookup), "self:N" (the target's first N
    layers and its head), or a model spec `arlm.loading.load_model` takes (name or path)."""

    method: str = "ngram"
    num_speculative_tokens: int = 8  # the most tokens drafted for one request in one step
    adaptive: bool = True  # draft length from the acceptance estimate and the load (module doc)
    ngram_min: int = 1
    ngram_max: int = 4
    # r = b / a of a step's cost a + b * N (N tokens): 0.25 was measured for SmolLM2-135M with the
    # default kernels on an AMD EPYC (Zen 4), 2 threads (docs/benchmarks.md, speculative decoding).
    verify_cost: float = 0.25

    def __post_init__(self) -> None:
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be an integer in 1..64, got {self.num_speculative_tokens!r}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 64:
            raise ValueError(f"the n-gram range must satisfy 1 <= min <= max <= 64, got "
                             f"{self.ngram_min}..{self.ngram_max}")
        if not self.verify_cost >= 0:
            raise ValueError(f"verify_cost must be >= 0, got {self.verify_cost}")


# Acceptance estimates: alpha = A / (A + R), A and R decayed sums of accepted draft tokens and
# of rejections, one estimate per kind of proposal (the drafter's `kind`: the n-gram's match
# length; one kind for a draft model). A request starts from the drafter's prior (`PRIOR_WEIGHT`
# pseudo-passes at `prior(kind)`), and one not drafting drifts back to it.
PRIOR_WEIGHT = 3.0
DECAY = 0.8  # per verification: recent passes weigh most
DRIFT = 0.97  # per step without a draft: back toward the prior (about 25 steps to half-way)


class SpecRates:
    """The rates of speculation counts `spec_proposed`, `spec_accepted`, `spec_passes` (draft
    tokens verified, of those accepted, rows that verified a draft: one per sequence per target
    pass), for the stats classes that keep them (EngineStats, GenerationStats)."""

    spec_proposed: int
    spec_accepted: int
    spec_passes: int

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0

    @property
    def spec_tokens_per_pass(self) -> float:
        """Mean tokens a verifying row emitted per target pass (1 is plain decoding's)."""
        return (self.spec_accepted + self.spec_passes) / self.spec_passes if self.spec_passes else 0.0


@dataclass
class SpecState:
    """A request's speculation: its acceptance estimates and its counts."""

    estimates: dict[int, list[float]] = field(default_factory=dict)  # kind -> [A, R]
    kind: int = 0  # the kind of this step's draft
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of those, accepted
    passes: int = 0  # target passes that verified a draft for it
    drafter_state: object = None  # the drafter's own (an n-gram index)

    def estimate(self, kind: int, prior: float) -> list[float]:
        if kind not in self.estimates:
            self.estimates[kind] = [PRIOR_WEIGHT * prior, PRIOR_WEIGHT * (1 - prior)]
        return self.estimates[kind]

    def alpha(self, kind: int, prior: float) -> float:
        a, r = self.estimate(kind, prior)
        return a / (a + r)

    def record(self, proposed: int, accepted: int) -> None:
        """A verification of this step's draft (of `kind`): `accepted` of `proposed` kept."""
        self.proposed += proposed
        self.accepted += accepted
        self.passes += 1
        e = self.estimates.get(self.kind)
        if e is not None:
            e[0] = DECAY * e[0] + accepted
            e[1] = DECAY * e[1] + (accepted < proposed)

    def drift(self, kind: int, prior: float) -> None:
        e = self.estimate(kind, prior)
        e[0] = DRIFT * e[0] + (1 - DRIFT) * PRIOR_WEIGHT * prior
        e[1] = DRIFT * e[1] + (1 - DRIFT) * PRIOR_WEIGHT * (1 - prior)


# A draft must promise this much more than the plain step's rate: the acceptance estimates are
# noisy (a new request starts from a prior), and a marginal draft mostly adds variance.
MARGIN = 0.03


def best_draft_length(alpha: float, cap: int, step_tokens: int, step_time, d: float = 0.0) -> int:
    """The k in 0..cap that maximizes the step's expected tokens per second: a step of n tokens
    takes `step_time(n)` (any unit), the drafter d * step_time(1) per draft token, and k draft
    tokens yield alpha + alpha^2 + ... + alpha^k expected extra tokens (a draft token is kept
    only with all before it); 0 unless that beats the plain step by `MARGIN`."""
    n = max(step_tokens, 1)
    one = step_time(1)
    best_k, best, gain, p = 0, (1 + MARGIN) * n / step_time(n), 0.0, 1.0
    for k in range(1, cap + 1):
        p *= alpha
        gain += p
        rate = (n + gain) / (step_time(n + k) + d * k * one)
        if rate > best:
            best_k, best = k, rate
    return best_k


class StepCost:
    """What a decode step of n tokens takes on this machine: the engine's own decode steps (no
    prompt tokens), an exponential average per size; sizes not seen yet are interpolated
    between the nearest seen, or extrapolated from them by the prior a + b * n (b / a =
    `SpeculativeConfig.verify_cost`), never more cheaply than the largest two seen sizes'
    slope. The cost is not linear: at one sequence an extra token costs ~0.2 of a step (the
    weights are streamed once for all rows), from ~8 tokens on nearly a whole token's share
    (the matrix units are busy). Speculation varies the sizes, so the table fills where drafts
    are tried; a CPU where extra rows cost more gets shorter drafts."""

    KEEP = 0.9  # per observation of a size: the last ~10 weigh most

    def __init__(self) -> None:
        self.times: dict[int, float] = {}
        self._memo: dict[tuple[int, float], float] = {}  # time() between two observations

    def observe(self, tokens: int, seconds: float) -> None:
        self._memo.clear()
        t = self.times.get(tokens)
        if t is not None:  # a step the machine stalled (another process, a page fault) moves it less
            seconds = min(max(seconds, 0.5 * t), 1.5 * t)
        self.times[tokens] = seconds if t is None else self.KEEP * t + (1 - self.KEEP) * seconds

    def time(self, n: int, r: float) -> float:
        """The time of a step of n tokens (seconds where anything was seen, else prior units)."""
        key = (n, r)
        if key not in self._memo:  # (asked for the same few sizes by every request of a step)
            self._memo[key] = self._time(n, r)
        return self._memo[key]

    def _time(self, n: int, r: float) -> float:
        t = self.times
        if n in t:
            return t[n]
        if not t:
            return 1 + r * n
        below = [m for m in t if m < n]
        above = [m for m in t if m > n]
        if below and above:
            lo, hi = max(below), min(above)
            return t[lo] + (t[hi] - t[lo]) * (n - lo) / (hi - lo)
        if above:  # smaller than anything seen: the prior's shape under the smallest seen
            hi = min(above)
            return t[hi] * (1 + r * n) / (1 + r * hi)
        lo = max(below)
        prior = t[lo] * (1 + r * n) / (1 + r * lo)
        if len(below) >= 2:
            lo2 = max(m for m in below if m < lo)
            slope = (t[lo] - t[lo2]) / (lo - lo2)
            return max(prior, t[lo] + slope * (n - lo))
        return prior


class Drafter(ABC):
    """Proposes the next tokens of a request. `cost`: one drafted token's cost relative to the
    target's pass over its weights (0 for a lookup), for the draft length rule."""

    cost: float = 0.0

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    @abstractmethod
    def propose(self, request: Request, k: int) -> list[int]:
        """Up to k tokens to follow the request's tokens (fewer, or none, where it has no guess)."""

    def propose_batch(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        """`propose` for several requests at once (a draft model runs them as one batch)."""
        return [self.propose(r, k) if k > 0 else [] for r, k in zip(requests, ks)]

    def release(self, request: Request) -> None:
        """The request is finished: drop what the drafter holds for it."""

    def kind(self, request: Request) -> int | None:
        """What kind of proposal the request would get now (acceptance is estimated per kind),
        or None where there is none to make."""
        return 0

    def prior(self, kind: int) -> float:
        """The acceptance a request starts from, for proposals of this kind."""
        return 0.6

    def draft_length(self, request: Request, cap: int, step_tokens: int, cost: StepCost | None = None) -> int:
        """How many tokens to draft for `request` now (at most `cap`), in a step of about
        `step_tokens` tokens before this draft, with step times from `cost` (the engine's
        `StepCost`; None: the prior a + b * n alone). See the module doc."""
        cap = min(cap, self.config.num_speculative_tokens)
        if cap <= 0:
            return 0
        kind = self.kind(request)
        if kind is None:
            return 0
        spec = request.spec
        spec.kind = kind
        if not self.config.adaptive:
            return cap
        prior = self.prior(kind)
        r = self.config.verify_cost
        step_time = (lambda n: 1 + r * n) if cost is None else (lambda n: cost.time(n, r))
        k = best_draft_length(spec.alpha(kind, prior), cap, step_tokens, step_time, self.cost)
        if k == 0:
            spec.drift(kind, prior)
        return k


class NgramDrafter(Drafter):
    """Prompt lookup: propose what followed the latest earlier occurrence of the request's last
    n tokens, n from `ngram_max` down to `ngram_min` (the longest match first). Acceptance is
    estimated per match length: a 4-token match in a copy is right far more often than a 1-token
    one."""

    # Where a request starts, by match length: the share of draft tokens accepted on
    # benchmarks/speculative.py's free-text prompts with SmolLM2 (rewriting accepts more: 0.31,
    # 0.54, 0.68, 0.84). The lower of the two: a wrong guess costs a whole extra row, and a
    # request that copies raises its estimate within a few steps.
    PRIORS = {1: 0.27, 2: 0.4, 3: 0.5}
    PRIOR_LONG = 0.65

    def prior(self, kind: int) -> float:
        return self.PRIORS.get(kind, self.PRIOR_LONG)

    def _lookup(self, request: Request) -> tuple[int, int] | None:
        """(match length, where its continuation starts) for the request's tokens now."""
        spec = request.spec
        index = spec.drafter_state
        if index is None:
            index = spec.drafter_state = _NgramIndex(self.config.ngram_min, self.config.ngram_max)
        return index.update(request.token_ids)

    def kind(self, request: Request) -> int | None:
        found = self._lookup(request)
        return None if found is None else found[0]

    def propose(self, request: Request, k: int) -> list[int]:
        found = self._lookup(request)
        if found is None:
            return []
        return request.token_ids[found[1]:found[1] + k]


class _NgramIndex:
    """For each n-gram of a token list, where it last ended (exclusive), over the positions seen
    so far; kept up to date as the list grows (tokens are only ever appended)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.last: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending at positions < indexed are in `last`
        self.found: tuple[int, tuple[int, int] | None] = (-1, None)  # (list length, its lookup)

    def update(self, tokens: list[int]) -> tuple[int, int] | None:
        """Index every n-gram but the list's own suffix, then look the suffix up: (n, the end of
        its latest earlier occurrence: what follows it is a proposal), or None."""
        L = len(tokens)
        if self.found[0] == L:
            return self.found[1]
        for end in range(max(self.indexed, 1), L):  # n-grams ending before the last position
            for n in range(self.lo, min(self.hi, end) + 1):
                self.last[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, L)
        result = None
        for n in range(min(self.hi, L - 1), self.lo - 1, -1):
            end = self.last.get(tuple(tokens[L - n:]))
            if end is not None:
                result = (n, end)
                break
        self.found = (L, result)
        return result


@dataclass
class _DraftSeq:
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # window tokens whose K/V the draft cache holds
    dropped: int = 0  # the request's num_dropped when they were computed


class ModelDrafter(Drafter):
    """A draft model with its own paged KV pool: runs the requests' drafts as one batch, k
    passes of one token each (after a first pass that catches up on what it has not seen)."""

    BLOCK_SIZE = 16

    def __init__(self, model: Transformer, config: SpeculativeConfig, target: Transformer,
                 max_tokens: int = 1 << 20, kv_dtype: torch.dtype | None = None) -> None:
        from ..runner import ModelRunner

        super().__init__(config)
        if model.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({model.config.vocab_size} tokens) is not the "
                             f"target's ({target.config.vocab_size})")
        self.runner = ModelRunner(model)
        self.model = model
        self.max_len = model.config.max_seq_len
        self.max_blocks = max(2, max_tokens // self.BLOCK_SIZE)
        param = next(model.parameters())
        self.kv_dtype = kv_dtype or (torch.float16 if self.runner.native is not None else
                                     param.dtype if param.dtype.is_floating_point else torch.float32)
        self.cache = KVCache.pool(model.config, 64, self.BLOCK_SIZE, self.kv_dtype, param.device)
        self.free = list(range(63, -1, -1))
        self.seqs: dict[str, _DraftSeq] = {}
        self.cost = weight_bytes(model) / max(1, weight_bytes(target))

    def release(self, request: Request) -> None:
        st = self.seqs.pop(request.request_id, None)
        if st is not None:
            self.free += st.blocks

    def _blocks(self, st: _DraftSeq, tokens: int) -> bool:
        """Hold blocks for `tokens` positions; False if the pool cannot grow that far."""
        need = -(-tokens // self.BLOCK_SIZE) - len(st.blocks)
        if need > len(self.free):
            n = self.cache.n_blocks
            grown = min(self.max_blocks, max(2 * n, n + need))
            if grown - n < need - len(self.free):
                return False
            old = self.cache
            self.cache = KVCache.pool(self.model.config, grown, self.BLOCK_SIZE, old.dtype, old.k.device)
            self.cache.k[:, :n] = old.k
            self.cache.v[:, :n] = old.v
            self.free = list(range(grown - 1, n - 1, -1)) + self.free
        for _ in range(need):
            st.blocks.append(self.free.pop())
        return True

    def propose(self, request: Request, k: int) -> list[int]:
        return self.propose_batch([request], [k])[0]

    def propose_batch(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        jobs = []  # (index, request, state, window length, k)
        for i, (req, k) in enumerate(zip(requests, ks)):
            window = req.num_tokens
            k = min(k, self.max_len - window)
            if k <= 0:
                continue
            st = self.seqs.setdefault(req.request_id, _DraftSeq())
            if st.dropped != req.num_dropped:  # the window shifted: its positions moved
                st.tokens, st.dropped = [], req.num_dropped
            # What the draft computed is a prefix of the window and the draft tokens after it
            # that were rejected: compare from where a draft could have started.
            c = max(0, min(len(st.tokens), window - 1) - self.config.num_speculative_tokens - 1)
            mine = req.window(c, window)
            while c < min(len(st.tokens), window - 1) and st.tokens[c] == mine[0]:
                c += 1
                mine = mine[1:]
            del st.tokens[c:]
            if not self._blocks(st, window + k - 1):
                continue
            jobs.append((i, req, st, k))
        if not jobs:
            return out
        # Pass 1: each request's tokens the draft has not computed (at least its last); pass j:
        # the draft token j - 1 of each request still drafting.
        feeds = [req.window(len(st.tokens), req.num_tokens) for _, req, st, _ in jobs]
        for step in range(max(k for *_, k in jobs)):
            active = [j for j, job in enumerate(jobs) if job[3] > step]
            tokens, positions, seq_index, out_index = [], [], [], []
            for s, j in enumerate(active):
                st, feed = jobs[j][2], feeds[j]
                tokens += feed
                positions += range(len(st.tokens), len(st.tokens) + len(feed))
                seq_index += [s] * len(feed)
                out_index.append(len(tokens) - 1)
                st.tokens += feed
            with torch.inference_mode():
                logits = self.runner.forward_flat(self.cache, tokens, positions, seq_index,
                                                  [jobs[j][2].blocks for j in active], out_index)
            picked = self._pick(logits, [jobs[j][1] for j in active])
            for j, (tok, q) in zip(active, picked):
                i, req = jobs[j][0], jobs[j][1]
                out[i].append(tok)
                feeds[j] = [tok]
                if q is not None:
                    req.draft_probs = q[None] if step == 0 else torch.cat([req.draft_probs, q[None]])
        return out

    def _pick(self, logits: torch.Tensor, requests: list[Request]) -> list[tuple[int, torch.Tensor | None]]:
        """Each request's draft token from the draft's logits [B, V]: the argmax for greedy
        requests, else a draw from the warped distribution q (returned, for the rule)."""
        logits = penalized(logits, [r.params for r in requests])
        tokens = kernels.argmax_rows(logits).tolist()
        rows = [b for b, r in enumerate(requests) if not r.params.greedy]
        qs: list[torch.Tensor | None] = [None] * len(requests)
        if rows:
            probs = warped_probs(logits[rows], [requests[b].params for b in rows])
            drawn = draw(probs, [requests[b].generator for b in rows]).tolist()
            for j, b in enumerate(rows):
                tokens[b], qs[b] = drawn[j], probs[j]
        return list(zip(tokens, qs))


def self_draft(model: Transformer, n_layers: int) -> Transformer:
    """The target's first `n_layers` layers, final norm and LM head as a model of its own, sharing
    the target's weights (no copy): a draft model where no smaller one exists."""
    if not 1 <= n_layers < model.config.n_layer:
        raise ValueError(f"a self-draft takes 1..{model.config.n_layer - 1} of the target's "
                         f"{model.config.n_layer} layers, got {n_layers}")
    draft = Transformer.__new__(Transformer)
    nn.Module.__init__(draft)
    draft.config = replace(model.config, n_layer=n_layers)
    draft.tok_emb = model.tok_emb
    if model.config.pos_embedding == "learned":
        draft.pos_emb = model.pos_emb
    else:
        draft.register_buffer("rope_cos", model.rope_cos, persistent=False)
        draft.register_buffer("rope_sin", model.rope_sin, persistent=False)
    draft.emb_dropout = model.emb_dropout
    draft.blocks = nn.ModuleList(list(model.blocks)[:n_layers])
    draft.norm, draft.lm_head = model.norm, model.lm_head
    return draft.eval()


# -- verification -------------------------------------------------------------------------------

def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The rule's chance of keeping draft tokens x: min(1, p(x) / q(x)), from their probabilities
    under the target (p) and the drafter (q)."""
    return (p / q).clamp(max=1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What to draw from after rejecting a draft token: norm(max(0, p - q)) over the vocabulary
    (unnormalized: `draw` takes weights). Where p <= q everywhere (only by rounding: then x is
    always accepted), p itself."""
    r = (p - q).clamp_min(0.0)
    return r if float(r.sum()) > 0 else p


def verify(logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]) -> list[list[int]]:
    """The tokens each request keeps: `logits` holds, request after request, the target's logits
    at its k + 1 positions (k = len(draft)); returns the accepted draft tokens and one more (the
    correction at the first rejection, or the bonus after full acceptance)."""
    dev = logits.device
    seen = None
    if any(r.params.repetition_penalty != 1.0 for r in requests):
        # Position j of a draft has seen the draft's first j tokens as well.
        rows = []
        for r, d in zip(requests, drafts):
            base = r.seen if r.seen is not None else torch.zeros(logits.shape[1], dtype=torch.bool, device=dev)
            for j in range(len(d) + 1):
                m = base.clone()
                if j:
                    m[torch.tensor(d[:j], device=dev)] = True
                rows.append(m)
        seen = torch.stack(rows)
    params = [r.params for r, d in zip(requests, drafts) for _ in range(len(d) + 1)]
    logits = penalized(logits, params, seen)
    best = kernels.argmax_rows(logits).tolist()
    sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    probs = None
    if sampled:
        rows = [j for i in sampled for j in range(starts[i], starts[i + 1])]
        probs = dict(zip(rows, warped_probs(logits[rows], [params[j] for j in rows])))
    out = []
    for i, (req, d) in enumerate(zip(requests, drafts)):
        s, k = starts[i], len(d)
        if req.params.greedy:  # the argmax at each position: what plain greedy decoding emits
            kept = []
            for j in range(k):
                kept.append(best[s + j])
                if best[s + j] != d[j]:
                    break
            else:
                kept.append(best[s + k])
            out.append(kept)
            continue
        p = torch.stack([probs[s + j] for j in range(k + 1)])  # [k + 1, V]
        index = torch.tensor(d, device=dev)
        q = req.draft_probs[:k] if req.draft_probs is not None else \
            torch.zeros(k, p.shape[1], device=dev).scatter_(1, index[:, None], 1.0)  # a proposal: one-hot
        chance = acceptance_probability(p[torch.arange(k), index], q[torch.arange(k), index])
        u = torch.rand(k, generator=req.generator, device=dev)
        passed = (u < chance).tolist()
        a = passed.index(False) if False in passed else k
        last = p[k] if a == k else residual(p[a], q[a])
        out.append(d[:a] + draw(last[None], [req.generator]).tolist())
    return out
