"""Continuous batching: which tokens of which sequences go into the next forward pass.

Every step the scheduler re-forms the batch from scratch, within a token budget:

1. Running sequences that decode (one token each) come first, so a long prompt never stalls them.
2. Running sequences still in their prompt get the next chunk of it (chunked prefill).
3. Waiting requests are admitted, first come first served, while the budget, `max_num_seqs` and
   free blocks allow; each starts from its longest cached prefix (prefix caching).

A sequence that needs a block when none is free takes one from the most recently admitted
running sequence, which is preempted: its blocks are freed and it goes back to the front of the
queue, to be recomputed (prefilled with its prompt and the tokens it had produced) later. A
sequence is a `Request`: one list of token ids (prompt, then output) of which `num_computed` have
their K/V in the pool; a step computes the next `n` of them and, if that reaches the end, samples one
more. After the forward pass `update` takes the sampled tokens and decides which requests finish.
The scheduler speaks block ids and token ids only; the engine owns the tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_pool import BlockPool, block_hash
from .request import FinishReason, Request, RequestStatus

FREED = -1  # a block-table entry behind a windowed request's window: its block went back to the pool

WAITING, RUNNING, FINISHED = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.FINISHED


@dataclass
class ScheduledBatch:
    """What one step computes: `num_tokens[i]` tokens of `seqs[i]`, from its `num_computed`.

    A row that verifies a draft (`drafts[i]`, k proposed tokens not yet in the request) feeds its
    last token and the k drafted ones: num_tokens[i] = 1 + k, and all k + 1 positions reach the
    LM head."""

    seqs: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write blocks
    local_copies: list[tuple[int, int]] = field(default_factory=list)  # ... of a split pool's sliding layers
    preempted: list[Request] = field(default_factory=list)
    drafted: list[Request] = field(default_factory=list)  # requests given a draft this step (Engine._schedule)
    prompt_tokens: int = 0  # tokens of rows that are not decodes (`decodes` reads state the step moves on)

    def add(self, seq: Request, n: int, draft: list[int] | None = None) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)
        self.drafts.append(draft or [])

    def __len__(self) -> int:
        return len(self.seqs)

    def input_ids(self, i: int) -> list[int]:
        """The token ids row i feeds: the next window tokens, then its draft."""
        seq, k = self.seqs[i], len(self.drafts[i])
        start = seq.num_computed
        return seq.window(start, start + self.num_tokens[i] - k) + self.drafts[i]

    def samples(self, i: int) -> bool:
        """Whether row i reaches the end of its window this step (then it samples a token)."""
        seq = self.seqs[i]
        return seq.num_computed + self.num_tokens[i] - len(self.drafts[i]) == seq.num_tokens

    def decodes(self, i: int) -> bool:
        """Whether row i feeds one generated token (not a prompt, not a recomputation), and its
        draft if it has one: it takes decode's arithmetic."""
        seq = self.seqs[i]
        return (self.num_tokens[i] - len(self.drafts[i]) == 1
                and seq.num_dropped + seq.num_computed >= seq.num_prompt_tokens)


@dataclass
class SchedulerStats:
    preemptions: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found (not recomputed)
    computed_tokens: int = 0  # tokens run through the model (prefill and decode)
    copies_on_write: int = 0


class Scheduler:
    """Waiting and running queues over a `BlockPool` of `n_blocks` blocks of `block_size` slots."""

    def __init__(self, n_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
                 static_batches: bool = False, long_prefill_tokens: int | None = None,
                 group_rows: int | None = None) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.pool = BlockPool(n_blocks, enable_prefix_caching)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # static_batches: admit only when nothing runs (a contiguous cache sized for one batch)
        self.static_batches = static_batches
        # A prompt with more than this many tokens left to compute is long: `_long_budget`
        self.long_prefill_tokens = long_prefill_tokens
        # The sequences of one group (Request.group) that step together while others want the step
        self.group_rows = group_rows
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.stats = SchedulerStats()
        # (window, sinks) of a windowed engine (EngineConfig.kv_window): blocks no query reads again
        # go back to the pool as the window moves, their places in `blocks` left as FREED
        self.window: tuple[int, int] | None = None
        self._interactive = False  # (schedule: whether a request that is not an embedding runs or waits)
        # A split pool (KVCache.split): the sliding-window layers' blocks come from `local`, and a
        # sequence gives back those behind its last `sliding_window` positions as it goes
        self.local: BlockPool | None = None
        self.sliding_window = 0

    def split(self, n_local_blocks: int, sliding_window: int) -> None:
        """Hand out a split pool's sliding-layer blocks too: `n_local_blocks` of them, each
        sequence holding those its next query's window reads (nothing may be running)."""
        assert not self.running, "split with requests running"
        self.local = BlockPool(n_local_blocks, self.pool.enable_prefix_caching)
        self.sliding_window = sliding_window

    def resize(self, n_blocks: int, block_size: int) -> None:
        """A new pool (nothing may be running): a contiguous cache re-sized for the next batch."""
        assert not self.running, "resize with requests running"
        self.pool = BlockPool(n_blocks, self.pool.enable_prefix_caching)
        self.block_size = self.max_model_len = block_size

    # -- queue management ---------------------------------------------------------------------

    def add(self, seq: Request) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Request, reason: FinishReason) -> None:
        """End a sequence (finished or aborted) and free its blocks at once."""
        if seq.status == FINISHED:
            return
        if seq.status == RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status, seq.finish_reason = FINISHED, reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _free(self, seq: Request) -> None:
        for pool, blocks in self._tables(seq):
            for b in reversed(blocks):  # the tail first: a prefix's last blocks are evicted first
                if b != FREED:
                    pool.release(b)
        seq.blocks, seq.local_blocks = [], []
        seq.num_computed = seq.num_registered = seq.num_local_registered = seq.num_local_freed = 0

    def _tables(self, seq: Request) -> list[tuple[BlockPool, list[int]]]:
        """(pool, the sequence's blocks from it): the pool's, and a split pool's sliding layers'."""
        return [(self.pool, seq.blocks)] + ([(self.local, seq.local_blocks)] if self.local is not None else [])

    def _preempt(self, seq: Request, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.draft, seq.draft_probs = [], None
        seq.status = WAITING
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        self.stats.preemptions += 1

    # -- one step -------------------------------------------------------------------------------

    def _blocks_needed(self, seq: Request, n: int) -> list[int]:
        """New blocks to hold `n` more tokens, plus one if the first write needs a private copy:
        of each pool (`_tables`)."""
        bs = self.block_size
        first = seq.num_computed // bs
        needs = []
        for pool, blocks in self._tables(seq):
            need = -(-(seq.num_computed + n) // bs) - len(blocks)
            if first < len(blocks) and pool.is_shared_or_cached(blocks[first]):
                need += 1
            needs.append(need)
        return needs

    def _fits(self, seq: Request, n: int) -> bool:
        """Whether the pools have the free blocks `n` more tokens of `seq` need."""
        pools = [pool for pool, _ in self._tables(seq)]
        return all(pool.num_free >= need for pool, need in zip(pools, self._blocks_needed(seq, n)))

    def _reserve(self, seq: Request, n: int, batch: ScheduledBatch) -> None:
        """Allocate the blocks for `n` more tokens (caller checked there are enough)."""
        bs = self.block_size
        first = seq.num_computed // bs
        for pool, blocks in self._tables(seq):
            if first < len(blocks) and pool.is_shared_or_cached(blocks[first]):
                old, new = blocks[first], pool.allocate()  # copy-on-write
                (batch.copies if pool is self.pool else batch.local_copies).append((old, new))
                self.stats.copies_on_write += 1
                blocks[first] = new
                pool.release(old)
                if pool is self.pool:  # the copy is not a cached block
                    seq.num_registered = min(seq.num_registered, first)
                else:
                    seq.num_local_registered = min(seq.num_local_registered, first)
            while len(blocks) * bs < seq.num_computed + n:
                blocks.append(pool.allocate())

    def _hash(self, seq: Request, i: int) -> bytes:
        """Content hash of full block i of the request's window (it only grows: hashes stay valid)."""
        bs = self.block_size
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if j else None
            seq.block_hashes.append(block_hash(parent, seq.window(j * bs, (j + 1) * bs)))
        return seq.block_hashes[i]

    def _match_prefix(self, seq: Request) -> None:
        """Take the cached blocks of the longest prefix of the window (full blocks only); none
        for a request that keeps its prompt's logits or embeds it (every prompt token must run)."""
        bs = self.block_size
        if self.pool.enable_prefix_caching and not (seq.keep_prompt_logits or seq.embed):
            for i in range(seq.num_tokens // bs):
                block = self.pool.lookup(self._hash(seq, i))
                if block is None:
                    break
                seq.blocks.append(block)
        if self.local is not None:
            self._match_local(seq)
        seq.num_registered = len(seq.blocks)
        seq.num_computed = len(seq.blocks) * bs
        if seq.num_computed == seq.num_tokens:
            seq.num_computed -= 1  # the last token must run again: its logits pick the next token
        seq.num_cached_tokens = seq.num_computed
        self.stats.prefix_queries += seq.num_tokens
        self.stats.prefix_hits += seq.num_computed

    def _local_start(self, computed: int) -> int:
        """The first sliding-layer block a sequence's queries read once `computed` tokens have
        their K/V: the next query, at that position, reads its last `sliding_window` positions."""
        return max(0, computed - self.sliding_window + 1) // self.block_size

    def _match_local(self, seq: Request) -> None:
        """A prefix hit in a split pool: its sliding layers' blocks too, those the continuation
        reads (the window before it; the earlier ones were given back). The longest prefix the
        global hits hold whose window's sliding blocks are all cached; the global hits past it
        are given back."""
        bs, hit = self.block_size, len(seq.blocks)
        while hit:
            computed = hit * bs - (hit * bs == seq.num_tokens)  # (as below: a whole prompt runs its last token)
            start = self._local_start(computed)
            if all(self.local.peek(self._hash(seq, i)) for i in range(start, hit)):
                break
            hit -= 1
        for b in reversed(seq.blocks[hit:]):  # (the tail first, as _free)
            self.pool.release(b)
        del seq.blocks[hit:]
        start = self._local_start(hit * bs - (hit * bs == seq.num_tokens)) if hit else 0
        seq.local_blocks = [FREED] * start + [self.local.lookup(self._hash(seq, i)) for i in range(start, hit)]
        seq.num_local_registered, seq.num_local_freed = hit, start

    # While others decode: a step's long-prompt tokens at most this, or half the decoding rows
    LONG_PREFILL_SHARED = 4

    def _long_budget(self, decoding: int) -> int | None:
        """The tokens of long prompts (`long_prefill_tokens`; None: no such rule) this step may
        run, all together: `long_prefill_tokens` while nothing else wants the step; while a
        request decodes or a short prompt waits, max(LONG_PREFILL_SHARED, decoding / 2). A
        decode step of a small model on a CPU costs about as much as a dozen prompt tokens (SmolLM2,
        one thread, 8 decoding rows: 18 ms; with 4 prompt tokens 23 ms, 8: 29 ms, 16: 41 ms,
        128: 190 ms), so a long prompt (or several) then adds about a quarter to its neighbours'
        steps: one client's 8,000-token prompt slows its own first token, not every stream's
        next one. A long prompt alone still runs in chunks of long_prefill_tokens (~0.1-0.3 s
        steps; a prompt costs about the same per token in chunks of 128 as of 512 on this CPU).
        Short prompts are not held back."""
        cap = self.long_prefill_tokens
        if cap is None:
            return None
        if decoding or any(not s.embed and s.num_tokens - s.num_computed <= cap for s in self.waiting):
            return max(self.LONG_PREFILL_SHARED, decoding // 2)
        return cap

    def _group_turns(self) -> dict[str, int] | None:
        """How many of each group's sequences (`Request.group`: the choices of one API request)
        may step now: `group_rows` each while any other request runs or waits, so that one
        request's n = 16 choices do not make every other stream's step 3x longer (a CPU's
        decode step costs about a row's share per sequence); None (no limit) while a group is
        alone, or with no `group_rows`. A sequence past its group's turns holds its blocks and
        waits a step; which sequences step never changes their tokens."""
        if self.group_rows is None:
            return None
        owners = {s.group if s.group is not None else id(s) for s in self.running}
        owners.update(s.group if s.group is not None else id(s) for s in self.waiting)
        if len(owners) < 2:
            return None
        return {g: self.group_rows for g in owners if isinstance(g, str)}

    def _takes_turn(self, seq: Request, turns: dict[str, int] | None) -> bool:
        """Whether `seq` steps now (and if so, its group has one turn fewer)."""
        if turns is None or seq.group is None:
            return True
        if turns[seq.group] == 0:
            return False
        turns[seq.group] -= 1
        return True

    @staticmethod
    def _weight(seq: Request) -> int:
        """A prompt token's share of a long-prompt budget: 2 for a request that keeps every
        position's logits (echo with logprobs, perplexity: the LM head runs at each, about a
        token's cost again), else 1."""
        return 2 if seq.keep_prompt_logits else 1

    def _is_long(self, seq: Request) -> bool:
        """Whether `seq`'s prompt tokens come out of the long-prompt budget (`_long_budget`): a
        long prompt's; and an embedding request's while any other request runs or waits (batch
        work: 2,048 inputs of one call must not make every stream's step longer)."""
        if self.long_prefill_tokens is None:
            return False
        return seq.num_tokens - seq.num_computed > self.long_prefill_tokens or (seq.embed and self._interactive)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._interactive = any(not s.embed for s in self.running) or any(not s.embed for s in self.waiting)
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()

        def make_room(seq: Request, n: int) -> bool:
            """Preempt the latest admitted unscheduled sequences until `seq` fits; False if it
            had to preempt itself."""
            while not self._fits(seq, n):
                victims = [s for s in self.running if id(s) not in scheduled]
                victim = victims[-1]  # `seq` itself is running and unscheduled, so never empty
                self._preempt(victim, batch)
                if victim is seq:
                    return False
            return True

        # 1-2. Running sequences: decodes first (with their drafts, as far as the budget goes:
        # every decode gets its own token before any draft token), then chunks of prompts.
        decoding = [s for s in self.running if s.num_tokens - s.num_computed == 1]
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        spare = budget - len(decoding)
        long_budget = self._long_budget(len(decoding))
        turns = self._group_turns()
        for seq in decoding + prefilling:
            if budget == 0:
                break
            if seq.status != RUNNING:  # preempted earlier in this loop
                continue
            if not self._takes_turn(seq, turns):
                continue
            if seq.draft:
                del seq.draft[max(0, min(spare, budget - 1)):]
                spare -= len(seq.draft)
                if not seq.draft:
                    seq.draft_probs = None
            n = min(seq.num_tokens - seq.num_computed + len(seq.draft), budget)
            if self._is_long(seq):
                n = min(n, long_budget // self._weight(seq))
                if n == 0:  # long prompts have had this step's share
                    continue
                long_budget -= n * self._weight(seq)
            if not make_room(seq, n):
                continue
            self._reserve(seq, n, batch)
            batch.add(seq, n, list(seq.draft))
            scheduled.add(id(seq))
            budget -= n

        # 3. Admit waiting requests while they fit; never preempt for a newcomer.
        # With static batches, newcomers wait until the running batch is done; a request that
        # already ran (shifted its window) rejoins at once.
        # A long prompt past its share stays in line and the requests behind it go first.
        busy = self.static_batches and bool(self.running)
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if busy and seq.num_dropped == 0:
                break
            if (self._is_long(seq) and long_budget < self._weight(seq)) or \
                    (turns is not None and turns.get(seq.group) == 0):
                continue  # (its group's turns are taken: admitted, it would hold blocks and wait)
            self._match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            long = self._is_long(seq)  # (after the prefix cache's hits)
            if long:
                n = min(n, long_budget // self._weight(seq))
            if n == 0 or not self._fits(seq, n):
                self._free(seq)  # give the prefix hits back; try again next step
                if n == 0:
                    continue
                break
            if long:
                long_budget -= n * self._weight(seq)
            self._takes_turn(seq, turns)
            self.waiting.remove(seq)
            seq.status = RUNNING
            self.running.append(seq)
            self._reserve(seq, n, batch)
            batch.add(seq, n)
            scheduled.add(id(seq))
            budget -= n
        return batch

    def update(self, batch: ScheduledBatch, sampled: dict[int, list[int]]) -> list[tuple[Request, list[int]]]:
        """After the forward pass: advance `num_computed`, cache newly full blocks, append the
        sampled tokens (`sampled[i]` for batch row i: one token, or for a row that verified a
        draft the accepted draft tokens and one more) and finish requests (end of sequence, max
        tokens, a full context window) or shift their window, checked after each token as plain
        decoding would: a token past the one that finishes is dropped. Returns each request that
        got tokens, with them.

        A verifying row computed its draft's K/V too; only the accepted ones count. The rejected
        positions stay in the blocks, never read (attention reads positions below the reader's,
        and the next step writes them first), and the blocks past the accepted length go back to
        the pool. Blocks join the prefix cache only once every slot holds a verified token."""
        bs = self.block_size
        out = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            tokens = sampled.get(i)
            k = len(batch.drafts[i])
            reason = None
            if tokens is not None:
                # The tokens taken: up to the first that ends the request (or fills the window).
                for j, tok in enumerate(tokens):
                    reason = self._ends(seq, tok, j + 1)
                    if reason is not None:
                        tokens = tokens[:j + 1]
                        break
                for tok in tokens:
                    seq.append(tok)
            # Computed: the row's tokens but the rejected draft ones (and any past the end).
            computed = n - k + (len(tokens) - 1 if k and tokens else 0)
            seq.num_computed += computed
            self.stats.computed_tokens += computed
            keep = -(-seq.num_computed // bs)
            for pool, blocks in self._tables(seq):
                while len(blocks) > keep:  # blocks that held only rejected draft tokens
                    pool.release(blocks.pop())
            if self.window is not None:
                self._drop_behind_window(seq)
            if self.local is not None:
                self._slide(seq)
            full = min(seq.num_computed // bs, len(seq.blocks))
            # (an embedding's blocks are not cached: they would push chat prefixes out)
            while self.pool.enable_prefix_caching and not seq.embed and seq.num_registered < full:
                self.pool.register(seq.blocks[seq.num_registered], self._hash(seq, seq.num_registered))
                seq.num_registered += 1
            if tokens is None:
                continue  # mid-prompt chunk: nothing to sample yet
            if reason == "shift":
                self._shift(seq)
            elif reason is not None:
                self.finish(seq, reason)
            out.append((seq, tokens))
        return out

    def _drop_behind_window(self, seq: Request) -> None:
        """Give back the blocks no query of `seq` reads again: the next one, at position
        num_computed, reads the sink slots and positions num_computed - window + 1 on."""
        window, sinks = self.window
        bs = self.block_size
        dead = min(max(0, seq.num_computed - window + 1) // bs, len(seq.blocks))  # blocks wholly before it
        for b in range(-(-sinks // bs), dead):
            if seq.blocks[b] != FREED:
                self.pool.release(seq.blocks[b])
                seq.blocks[b] = FREED

    def _slide(self, seq: Request) -> None:
        """A split pool's sliding-layer blocks: the newly full ones join the prefix cache, then
        those wholly behind the next query's window go back to the pool (cached, until evicted:
        a later prompt with this prefix may still take them)."""
        bs, blocks = self.block_size, seq.local_blocks
        full = min(seq.num_computed // bs, len(blocks))
        while seq.num_local_registered < full:
            i = seq.num_local_registered
            if self.local.enable_prefix_caching and not seq.embed and blocks[i] != FREED:
                self.local.register(blocks[i], self._hash(seq, i))
            seq.num_local_registered += 1
        end = min(self._local_start(seq.num_computed), len(blocks))
        for i in range(seq.num_local_freed, end):  # (those before num_local_freed are FREED already)
            if blocks[i] != FREED:
                self.local.release(blocks[i])
                blocks[i] = FREED
        seq.num_local_freed = max(seq.num_local_freed, end)

    def _ends(self, seq: Request, tok: int, nth: int) -> FinishReason | str | None:
        """Whether appending `tok` as the nth new token of this step ends the request (a reason),
        shifts its window ("shift"), or neither (None)."""
        if tok in seq.eos_ids:
            return FinishReason.EOS
        if seq.num_output_tokens + nth >= seq.params.max_new_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens + nth > self.max_model_len:  # the window is full: no slot for the token just sampled
            return "shift" if seq.context_shift and self.max_model_len >= 2 else FinishReason.CONTEXT
        return None

    def _shift(self, seq: Request) -> None:
        """Context shift: the request goes on from the last half of its window (the tokens before
        the one just sampled, recomputed at positions 0.., as nanoGPT's sample.py crops its
        context), through the queue like a preempted request, first in line."""
        keep = self.max_model_len // 2
        self.running.remove(seq)
        self._free(seq)
        seq.num_dropped = len(seq.token_ids) - keep - 1
        seq.block_hashes = []
        seq.status = WAITING
        self.waiting.appendleft(seq)
