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

`Scheduler` is the composition of its named parts: admission (`_admit`) and the running rows
(`_schedule_running`) spend one `StepBudget` (step_budget.py: the token budget, the long prompts'
share, the groups' turns); `_make_room` preempts; `BlockTables` (block_tables.py) holds the
blocks, the prefix cache's matches, and the window and sliding-layer rules; `update` and `_ends`
decide what a step's tokens finish.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from . import step_budget
from .block_tables import BlockTables
from .request import FinishReason, Request, RequestStatus
from .step_budget import StepBudget

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

    LONG_PREFILL_SHARED = step_budget.LONG_PREFILL_SHARED

    def __init__(self, n_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
                 static_batches: bool = False, long_prefill_tokens: int | None = None,
                 group_rows: int | None = None) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.stats = SchedulerStats()
        self.blocks = BlockTables(n_blocks, block_size, enable_prefix_caching, self.stats)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # static_batches: admit only when nothing runs (a contiguous cache sized for one batch)
        self.static_batches = static_batches
        # A prompt with more than this many tokens left to compute is long: `step_budget.long_budget`
        self.long_prefill_tokens = long_prefill_tokens
        # The sequences of one group (Request.group) that step together while others want the step
        self.group_rows = group_rows
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first

    # The block tables' state, as the engine and the stats read it
    pool = property(lambda self: self.blocks.pool)
    local = property(lambda self: self.blocks.local)
    block_size = property(lambda self: self.blocks.block_size)
    sliding_window = property(lambda self: self.blocks.sliding_window)

    @property
    def window(self) -> tuple[int, int] | None:
        """(window, sinks) of a windowed engine (EngineConfig.kv_window), or None."""
        return self.blocks.window

    @window.setter
    def window(self, value: tuple[int, int] | None) -> None:
        self.blocks.window = value

    def split(self, n_local_blocks: int, sliding_window: int) -> None:
        """Hand out a split pool's sliding-layer blocks too: `n_local_blocks` of them, each
        sequence holding those its next query's window reads (nothing may be running)."""
        assert not self.running, "split with requests running"
        self.blocks.split(n_local_blocks, sliding_window)

    def resize(self, n_blocks: int, block_size: int) -> None:
        """A new pool (nothing may be running): a contiguous cache re-sized for the next batch."""
        assert not self.running, "resize with requests running"
        self.blocks.resize(n_blocks, block_size)
        self.max_model_len = block_size

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
        self.blocks.free(seq)
        seq.status, seq.finish_reason = FINISHED, reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- preemption -------------------------------------------------------------------------------

    def _preempt(self, seq: Request, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.draft, seq.draft_probs = [], None
        seq.status = WAITING
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        self.stats.preemptions += 1

    def _make_room(self, seq: Request, n: int, batch: ScheduledBatch, scheduled: set[int]) -> bool:
        """Preempt the latest admitted unscheduled sequences until `seq` fits; False if it had to
        preempt itself."""
        while not self.blocks.fits(seq, n):
            victims = [s for s in self.running if id(s) not in scheduled]
            victim = victims[-1]  # `seq` itself is running and unscheduled, so never empty
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    # -- one step -------------------------------------------------------------------------------

    def _budget(self, decoding: int) -> StepBudget:
        """This step's budget, as the queues stand (`decoding`: the running rows that decode)."""
        interactive = any(not s.embed for s in self.running) or any(not s.embed for s in self.waiting)
        return StepBudget(tokens=self.max_num_batched_tokens, spare=self.max_num_batched_tokens - decoding,
                          long=step_budget.long_budget(self.long_prefill_tokens, decoding, self.waiting),
                          turns=step_budget.group_turns(self.group_rows, self.running, self.waiting),
                          long_prefill_tokens=self.long_prefill_tokens, interactive=interactive)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        scheduled: set[int] = set()
        decoding = [s for s in self.running if s.num_tokens - s.num_computed == 1]
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        budget = self._budget(len(decoding))
        self._schedule_running(decoding + prefilling, budget, batch, scheduled)
        self._admit(budget, batch, scheduled)
        return batch

    def _schedule_running(self, seqs: list[Request], budget: StepBudget, batch: ScheduledBatch,
                          scheduled: set[int]) -> None:
        """1-2. Running sequences: decodes first (with their drafts, as far as the budget goes:
        every decode gets its own token before any draft token), then chunks of prompts."""
        for seq in seqs:
            if budget.tokens == 0:
                break
            if seq.status != RUNNING:  # preempted earlier in this loop
                continue
            if not budget.takes_turn(seq):
                continue
            budget.trim_draft(seq)
            n = min(seq.num_tokens - seq.num_computed + len(seq.draft), budget.tokens)
            if budget.is_long(seq):
                n = budget.long_share(seq, n)
                if n == 0:  # long prompts have had this step's share
                    continue
                budget.take_long(seq, n)
            if not self._make_room(seq, n, batch, scheduled):
                continue
            self.blocks.reserve(seq, n, batch.copies, batch.local_copies)
            batch.add(seq, n, list(seq.draft))
            scheduled.add(id(seq))
            budget.tokens -= n

    def _admit(self, budget: StepBudget, batch: ScheduledBatch, scheduled: set[int]) -> None:
        """3. Admit waiting requests while they fit; never preempt for a newcomer. With static
        batches, newcomers wait until the running batch is done; a request that already ran
        (shifted its window) rejoins at once. A long prompt past its share stays in line and the
        requests behind it go first."""
        busy = self.static_batches and bool(self.running)
        for seq in list(self.waiting):
            if budget.tokens == 0 or len(self.running) >= self.max_num_seqs:
                break
            if busy and seq.num_dropped == 0:
                break
            if (budget.is_long(seq) and budget.long < step_budget.weight(seq)) or budget.turns_taken(seq):
                continue  # (its group's turns are taken: admitted, it would hold blocks and wait)
            self.blocks.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed, budget.tokens)
            long = budget.is_long(seq)  # (after the prefix cache's hits)
            if long:
                n = budget.long_share(seq, n)
            if n == 0 or not self.blocks.fits(seq, n):
                self.blocks.free(seq)  # give the prefix hits back; try again next step
                if n == 0:
                    continue
                break
            if long:
                budget.take_long(seq, n)
            budget.takes_turn(seq)
            self.waiting.remove(seq)
            seq.status = RUNNING
            self.running.append(seq)
            self.blocks.reserve(seq, n, batch.copies, batch.local_copies)
            batch.add(seq, n)
            scheduled.add(id(seq))
            budget.tokens -= n

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
            self.blocks.after_step(seq)
            if tokens is None:
                continue  # mid-prompt chunk: nothing to sample yet
            if reason == "shift":
                self._shift(seq)
            elif reason is not None:
                self.finish(seq, reason)
            out.append((seq, tokens))
        return out

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
        self.blocks.free(seq)
        seq.num_dropped = len(seq.token_ids) - keep - 1
        seq.block_hashes = []
        seq.status = WAITING
        self.waiting.appendleft(seq)
