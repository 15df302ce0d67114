"""Drafters: `Drafter` (the interface and the draft length rule), `NgramDrafter` (prompt
lookup), `ModelDrafter` (a draft model with its own paged KV pool)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from ... import kernels
from ...kv_cache import KVCache
from ...model import Transformer
from ...quant import weight_bytes
from ...sampling import draw, penalized, warped_probs
from ..block_pool import DEFAULT_BLOCK_SIZE, BlockPool
from ..request import Request
from ..runner import ModelRunner
from .acceptance import best_draft_length
from .config import SpeculativeConfig
from .cost import StepCost


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
    passes of one token each (after a first pass that catches up on what it has not seen).

    The pool is a `KVCache` whose blocks a `BlockPool` hands out, as the engine's target pool
    is. How many tokens the drafting requests hold at once is not known up front, so it starts
    at `INITIAL_BLOCKS` and grows on demand up to `max_tokens` (`_grow`)."""

    INITIAL_BLOCKS = 64  # 1,024 token slots at the default block size; more as requests need them

    def __init__(self, model: Transformer, config: SpeculativeConfig, target: Transformer,
                 max_tokens: int = 1 << 20, kv_dtype: torch.dtype | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        super().__init__(config)
        if model.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({model.config.vocab_size} tokens) is not the "
                             f"target's ({target.config.vocab_size})")
        self.runner = ModelRunner(model)
        self.model = model
        self.max_len = model.config.max_seq_len
        self.block_size = block_size
        self.max_blocks = max(2, max_tokens // block_size)
        param = next(model.parameters())
        self.kv_dtype = kv_dtype or (torch.float16 if self.runner.native is not None else
                                     param.dtype if param.dtype.is_floating_point else torch.float32)
        self.cache = KVCache.pool(model.config, self.INITIAL_BLOCKS, block_size, self.kv_dtype, param.device)
        self.pool = BlockPool(self.INITIAL_BLOCKS, enable_prefix_caching=False)  # (nothing is shared)
        self.seqs: dict[str, _DraftSeq] = {}
        self.cost = weight_bytes(model) / max(1, weight_bytes(target))

    def release(self, request: Request) -> None:
        st = self.seqs.pop(request.request_id, None)
        if st is not None:
            for block in st.blocks:
                self.pool.release(block)

    def _blocks(self, st: _DraftSeq, tokens: int) -> bool:
        """Hold blocks for `tokens` positions; False if the pool cannot grow that far."""
        need = -(-tokens // self.block_size) - len(st.blocks)
        if need > self.pool.num_free:
            n = self.pool.n_blocks
            # Doubling: the copies of a pool grown to N blocks sum to less than N blocks.
            grown = min(self.max_blocks, max(2 * n, n + need))
            if grown - n < need - self.pool.num_free:
                return False
            self._grow(grown)
        st.blocks += [self.pool.allocate() for _ in range(need)]
        return True

    def _grow(self, n_blocks: int) -> None:
        """Move to a pool of `n_blocks` blocks: each held block gets a new id there (only this
        drafter's tables name them) and its K/V copied, in every layer."""
        old = self.cache
        self.cache = KVCache.pool(self.model.config, n_blocks, self.block_size, old.dtype, old.k.device)
        self.pool = BlockPool(n_blocks, enable_prefix_caching=False)
        for st in self.seqs.values():
            moved = [self.pool.allocate() for _ in st.blocks]
            self.cache.k[:, moved] = old.k[:, st.blocks]
            self.cache.v[:, moved] = old.v[:, st.blocks]
            st.blocks = moved

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

