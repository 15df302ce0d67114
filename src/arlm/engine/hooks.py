"""What watches the engine's steps: attached beside the step's four calls, not inside them.

`Engine.step` is schedule -> forward -> sample -> postprocess. Everything else that happens
around a step is a `StepHook` in `Engine.hooks`, called at three points, in the order added:

- `scheduled(engine, batch)`: the batch is known, nothing computed yet;
- `forwarded(engine, batch)`: the forward pass is done, sampling not yet (the thread width for
  the steps that follow is chosen here: see `ThreadWidthHook`);
- `stepped(engine, result)`: the step's tokens are out (`StepResult`).

The engine attaches its own (the step counters, the thread governor, the step-cost clock of
speculative decoding, a sliding window's RoPE tables); front ends add theirs (`arlm trace`'s
`Tracer`, `arlm serve --trace`'s `LiveTrace`) and remove them when done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .request import RequestOutput
from .scheduler import ScheduledBatch

if TYPE_CHECKING:  # (annotations only)
    from ..threads import ThreadGovernor
    from .speculative import StepCost

# The engine a hook watches (arlm.engine.Engine; not imported: engine.py imports this module).
Engine = Any


@dataclass
class StepStats:
    """What the last step did: prompt tokens computed (prefill), tokens sampled, wall time."""

    prompt_tokens: int = 0
    sampled: int = 0
    seconds: float = 0.0


@dataclass
class StepResult:
    """One step as it happened. `logits` [K, vocab]: the K sampling rows', row j belonging to
    batch row `rows[j]`; as the model gave them (before penalties, bias or grammar masks) where
    some hook `reads_logits`, else possibly adjusted in place by the sampler."""

    batch: ScheduledBatch
    logits: torch.Tensor
    rows: list[int]
    sampled: dict[int, list[int]]  # batch row -> the tokens it emitted
    outputs: list[RequestOutput]
    seconds: float  # wall time of the step, hooks before `stepped` included

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the step computed (rows that are not decodes)."""
        return self.batch.prompt_tokens


class StepHook:
    """A watcher of `Engine.step`; each call does nothing unless overridden. `reads_logits`:
    `stepped` reads `result.logits` (the sampler then adjusts a copy, not the model's tensor)."""

    reads_logits = False

    def scheduled(self, engine: Engine, batch: ScheduledBatch) -> None:
        pass

    def forwarded(self, engine: Engine, batch: ScheduledBatch) -> None:
        pass

    def stepped(self, engine: Engine, result: StepResult) -> None:
        pass


class StepHooks:
    """An engine's hooks, called in the order added."""

    def __init__(self) -> None:
        self._hooks: list[StepHook] = []
        self.reads_logits = False

    def add(self, hook: StepHook) -> StepHook:
        self._hooks.append(hook)
        self.reads_logits = any(h.reads_logits for h in self._hooks)
        return hook

    def remove(self, hook: StepHook) -> None:
        """Detach `hook` (one not attached is ignored)."""
        if hook in self._hooks:
            self._hooks.remove(hook)
        self.reads_logits = any(h.reads_logits for h in self._hooks)

    def __contains__(self, hook: StepHook) -> bool:
        return hook in self._hooks

    def scheduled(self, engine: Engine, batch: ScheduledBatch) -> None:
        for h in tuple(self._hooks):  # (a hook may remove itself)
            h.scheduled(engine, batch)

    def forwarded(self, engine: Engine, batch: ScheduledBatch) -> None:
        for h in tuple(self._hooks):
            h.forwarded(engine, batch)

    def stepped(self, engine: Engine, result: StepResult) -> None:
        for h in tuple(self._hooks):
            h.stepped(engine, result)


# -- the engine's own ------------------------------------------------------------------------------

class StepStatsHook(StepHook):
    """The engine's step counters: `Engine.last_step` and `EngineStats.steps / step_seconds`."""

    def stepped(self, engine: Engine, result: StepResult) -> None:
        engine.last_step = StepStats(result.prompt_tokens, len(result.outputs), result.seconds)
        engine.stats.steps += 1
        engine.stats.step_seconds += result.seconds


class ThreadWidthHook(StepHook):
    """The thread governor's sample after each forward pass (see `arlm.threads`): the width of
    the steps that follow."""

    def __init__(self, governor: ThreadGovernor) -> None:
        self.governor = governor

    def forwarded(self, engine: Engine, batch: ScheduledBatch) -> None:
        self.governor.observe()


class StepClockHook(StepHook):
    """What decode steps cost on this machine, by size (the engine's `step_cost`, a `StepCost`:
    speculative decoding's draft length rule): each decode-only step's time, once something has
    drafted. (Read from the engine at each step: the table the drafts are judged by.)"""

    def stepped(self, engine: Engine, result: StepResult) -> None:
        cost: StepCost = engine.step_cost
        if not result.prompt_tokens and (result.batch.drafted or cost.times):
            cost.observe(sum(result.batch.num_tokens), result.seconds)


class WindowRopeHook(StepHook):
    """RoPE tables long enough for a windowed pool's positions: a request under a sliding window
    (`EngineConfig.kv_window`) runs past the model's context, so the tables grow (doubled) on
    demand; their first rows stay as they were."""

    def scheduled(self, engine: Engine, batch: ScheduledBatch) -> None:
        positions = max(s.num_computed + n for s, n in zip(batch.seqs, batch.num_tokens))
        m = engine.model
        if positions <= m.rope_cos.shape[0]:
            return
        # (the model's own tables, longer: its RoPE scaling and any sliding layers' base kept)
        m.set_rope_tables(m.rope_cos.device, max(positions, 2 * m.rope_cos.shape[0]))
        m.ensure_rope(positions)
        engine.cache.set_window(engine.cache.window, engine.cache.sinks, (m.rope_cos, m.rope_sin))
