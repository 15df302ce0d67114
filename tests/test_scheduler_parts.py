"""The scheduler's parts, each alone: the step budget and its shares (step_budget.py), the block
tables' rules (block_tables.py: room and copy-on-write, the prefix cache, a StreamingLLM window)
and preemption (`Scheduler._make_room`). Exact counts: every rule is integer arithmetic."""

from __future__ import annotations

from arlm.engine.block_tables import FREED, BlockTables
from arlm.engine.request import Request
from arlm.engine.scheduler import ScheduledBatch, Scheduler, SchedulerStats
from arlm.engine.step_budget import LONG_PREFILL_SHARED, StepBudget, group_turns, long_budget, weight
from arlm.sampling import SamplingParams


def request(n_prompt: int, computed: int = 0, group: str | None = None, embed: bool = False,
            logits: bool = False, first: int = 0) -> Request:
    seq = Request(f"r{first}-{n_prompt}", list(range(first, first + n_prompt)), n_prompt, SamplingParams(),
                  group=group, embed=embed, keep_prompt_logits=logits)
    seq.num_computed = computed
    return seq


# -- the step budget ------------------------------------------------------------------------------

def test_long_prompts_take_the_whole_cap_alone_and_a_share_beside_others():
    assert long_budget(None, 3, []) is None  # no rule
    assert long_budget(128, 0, []) == 128  # alone: chunks of the cap
    assert long_budget(128, 0, [request(1000)]) == 128  # a long prompt waiting is no reason to share
    assert long_budget(128, 0, [request(10)]) == LONG_PREFILL_SHARED  # a short one waiting is
    assert long_budget(128, 0, [request(10, embed=True)]) == 128  # (an embedding is batch work)
    assert long_budget(128, 3, []) == LONG_PREFILL_SHARED
    assert long_budget(128, 20, []) == 10  # half the decoding rows


def test_group_turns_only_while_others_want_the_step():
    a, b, lone = request(5, group="a"), request(5, group="b"), request(5)
    assert group_turns(None, [a, b], []) is None
    assert group_turns(2, [a, request(5, group="a")], []) is None  # one group alone: no limit
    assert group_turns(2, [a], [lone]) == {"a": 2}  # a request without a group is an owner of its own
    assert group_turns(2, [a, b], []) == {"a": 2, "b": 2}


def test_step_budget_turns_drafts_and_long_shares():
    budget = StepBudget(tokens=10, spare=8, long=6, turns={"a": 1}, long_prefill_tokens=4, interactive=True)
    a1, a2 = request(3, group="a"), request(3, group="a")
    assert budget.takes_turn(a1) and not budget.takes_turn(a2) and budget.turns_taken(a2)
    assert budget.takes_turn(request(3))  # no group: always
    seq = request(3, computed=3)
    seq.draft = list(range(12))
    budget.trim_draft(seq)
    assert seq.draft == list(range(8)) and budget.spare == 0  # what the decodes spare
    budget.trim_draft(seq)
    assert seq.draft == [] and seq.draft_probs is None
    long, echo = request(20), request(20, logits=True)
    assert budget.is_long(long) and not budget.is_long(request(4))
    assert budget.is_long(request(2, embed=True))  # an embedding beside interactive requests
    assert weight(long) == 1 and weight(echo) == 2
    assert budget.long_share(long, 10) == 6 and budget.long_share(echo, 10) == 3
    assert budget.long_share(request(4), 4) == 4  # short: not held back
    budget.take_long(echo, 3)
    assert budget.long == 0 and budget.long_share(long, 10) == 0


# -- block tables ---------------------------------------------------------------------------------

def tables(n_blocks: int = 8, block_size: int = 4, caching: bool = True) -> BlockTables:
    return BlockTables(n_blocks, block_size, caching, SchedulerStats())


def test_room_for_tokens_and_copy_on_write_of_a_shared_block():
    t = tables()
    seq = request(6)
    assert t.blocks_needed(seq, 6) == [2] and t.fits(seq, 6)
    copies, local = [], []
    t.reserve(seq, 6, copies, local)
    assert len(seq.blocks) == 2 and t.pool.num_free == 6 and copies == []
    seq.num_computed = 6
    t.after_step(seq)  # the full first block joins the prefix cache
    assert seq.num_registered == 1
    other = request(6)
    t.match_prefix(other)  # the same prompt: its first block is a hit
    assert other.blocks == seq.blocks[:1] and other.num_computed == 4 and other.num_cached_tokens == 4
    rewind = request(4)  # a whole cached prompt: its last token runs again, in a private copy
    t.match_prefix(rewind)
    assert rewind.num_computed == 3 and t.blocks_needed(rewind, 1) == [1]
    t.reserve(rewind, 1, copies, local)
    assert copies == [(seq.blocks[0], rewind.blocks[0])] and t.stats.copies_on_write == 1
    assert t.stats.prefix_queries == 10 and t.stats.prefix_hits == 7


def test_no_prefix_hits_for_a_request_that_keeps_its_prompts_logits():
    t = tables()
    seq = request(8)
    t.reserve(seq, 8, [], [])
    seq.num_computed = 8
    t.after_step(seq)
    echo = request(8, logits=True)
    t.match_prefix(echo)
    assert echo.blocks == [] and echo.num_computed == 0


def test_a_window_gives_back_the_blocks_behind_it_but_the_sinks():
    t = tables(n_blocks=16)
    t.window = (8, 4)  # 8 recent positions, 4 sinks: block 0 stays
    seq = request(24)
    t.reserve(seq, 24, [], [])
    seq.num_computed = 24
    t.after_step(seq)  # the next query (position 24) reads 0..3 and 17..23
    assert seq.blocks[0] != FREED and seq.blocks[1:4] == [FREED] * 3 and FREED not in seq.blocks[4:]
    assert t.pool.num_free == 16 - 6 + 3


def test_blocks_past_the_computed_tokens_go_back():
    t = tables()
    seq = request(2)
    t.reserve(seq, 9, [], [])  # a draft's positions: 3 blocks
    seq.num_computed = 5  # of which 5 tokens verified
    t.after_step(seq)
    assert len(seq.blocks) == 2 and t.pool.num_free == 6


# -- preemption -----------------------------------------------------------------------------------

def test_make_room_preempts_the_latest_admitted_unscheduled_first():
    s = Scheduler(n_blocks=4, block_size=4, max_model_len=64)
    first, second, third = request(4, first=0), request(4, first=100), request(4, first=200)
    for seq in (first, second, third):
        s.add(seq)
    batch = s.schedule()
    assert len(batch) == 3 and s.pool.num_free == 1
    grow = ScheduledBatch()
    first.num_computed = 4
    assert s._make_room(first, 8, grow, scheduled=set())  # needs 2 more blocks: third goes, then second
    assert grow.preempted == [third] and s.waiting[0] is third and s.stats.preemptions == 1
    assert not s._make_room(second, 16, grow, scheduled={id(first)})  # itself, in the end
    assert grow.preempted == [third, second] and list(s.waiting) == [second, third]
