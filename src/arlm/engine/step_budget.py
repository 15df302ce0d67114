"""A step's token budget and its shares, as the scheduler spends it: `max_num_batched_tokens`
for the whole step (decodes first, then draft tokens from what they leave, `spare`), the share
long prompts take together (`long_budget`), and the turns each group of choices gets
(`group_turns`). One `StepBudget` a step, spent as rows are scheduled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .request import Request

# While others decode: a step's long-prompt tokens at most this, or half the decoding rows
LONG_PREFILL_SHARED = 4


def long_budget(long_prefill_tokens: int | None, decoding: int, waiting: Iterable[Request]) -> int | None:
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
    cap = long_prefill_tokens
    if cap is None:
        return None
    if decoding or any(not s.embed and s.num_tokens - s.num_computed <= cap for s in waiting):
        return max(LONG_PREFILL_SHARED, decoding // 2)
    return cap


def group_turns(group_rows: int | None, running: Iterable[Request],
                waiting: Iterable[Request]) -> dict[str, int] | None:
    """How many of each group's sequences (`Request.group`: the choices of one API request)
    may step now: `group_rows` each while any other request runs or waits, so that one
    request's n = 16 choices do not make every other stream's step 3x longer (a CPU's
    decode step costs about a row's share per sequence); None (no limit) while a group is
    alone, or with no `group_rows`. A sequence past its group's turns holds its blocks and
    waits a step; which sequences step never changes their tokens."""
    if group_rows is None:
        return None
    owners = {s.group if s.group is not None else id(s) for s in running}
    owners.update(s.group if s.group is not None else id(s) for s in waiting)
    if len(owners) < 2:
        return None
    return {g: group_rows for g in owners if isinstance(g, str)}


def weight(seq: Request) -> int:
    """A prompt token's share of a long-prompt budget: 2 for a request that keeps every
    position's logits (echo with logprobs, perplexity: the LM head runs at each, about a
    token's cost again), else 1."""
    return 2 if seq.keep_prompt_logits else 1


@dataclass
class StepBudget:
    """What is left of one step's budget. tokens: of `max_num_batched_tokens`; spare: what the
    decodes leave for their drafts; long: of the long prompts' share (None: no such rule); turns:
    of each group's (None: no limit). long_prefill_tokens: a prompt with more tokens than this
    left is long; interactive: whether a request that is not an embedding runs or waits."""

    tokens: int
    spare: int
    long: int | None
    turns: dict[str, int] | None
    long_prefill_tokens: int | None
    interactive: bool

    def is_long(self, seq: Request) -> bool:
        """Whether `seq`'s prompt tokens come out of the long-prompt budget: a long prompt's;
        and an embedding request's while any other request runs or waits (batch work: 2,048
        inputs of one call must not make every stream's step longer)."""
        if self.long_prefill_tokens is None:
            return False
        return seq.num_tokens - seq.num_computed > self.long_prefill_tokens or (seq.embed and self.interactive)

    def takes_turn(self, seq: Request) -> bool:
        """Whether `seq` steps now (and if so, its group has one turn fewer)."""
        if self.turns is None or seq.group is None:
            return True
        if self.turns[seq.group] == 0:
            return False
        self.turns[seq.group] -= 1
        return True

    def turns_taken(self, seq: Request) -> bool:
        """Whether `seq`'s group has no turn left this step (admitted, it would hold blocks and wait)."""
        return self.turns is not None and self.turns.get(seq.group) == 0

    def trim_draft(self, seq: Request) -> None:
        """Cut `seq`'s draft to what the budget spares once every decode has its own token."""
        if seq.draft:
            del seq.draft[max(0, min(self.spare, self.tokens - 1)):]
            self.spare -= len(seq.draft)
            if not seq.draft:
                seq.draft_probs = None

    def long_share(self, seq: Request, n: int) -> int:
        """`n` tokens of `seq`, cut to the long prompts' share left where its prompt is long."""
        return min(n, self.long // weight(seq)) if self.is_long(seq) else n

    def take_long(self, seq: Request, n: int) -> None:
        """`n` prompt tokens of `seq` out of the long prompts' share."""
        self.long -= n * weight(seq)
