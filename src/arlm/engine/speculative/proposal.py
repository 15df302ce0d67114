"""The step's drafts: which decoding requests draft how many tokens before a step is scheduled."""

from __future__ import annotations

from ..request import Request
from ..scheduler import Scheduler
from .cost import StepCost


def propose_drafts(scheduler: Scheduler, max_step_tokens: int, exact_rows: int | None, step_cost: StepCost,
                   grammars) -> list[Request]:
    """Drafts (`Request.draft`) for the scheduler's running requests that decode speculatively,
    as long as their drafter's rule finds them worth it in a step of this size; returns those
    requests. max_step_tokens: the step's token budget; exact_rows: the most tokens a step may
    hold for each row's arithmetic not to depend on the others (`ModelRunner.exact_rows`; None:
    any); step_cost: the machine's step times (`StepCost`); grammars: the engine's
    `arlm.structured.Grammars`, which cut a guided request's draft to what its grammar takes."""
    running = scheduler.running
    decoding = [r for r in running if r.num_tokens - r.num_computed == 1]
    spec = [r for r in decoding if r.drafter is not None]
    if not spec:
        return []
    # The step's tokens before drafts: a token per decode, and the prompt tokens it will take.
    prompts = sum(r.num_tokens - r.num_computed for r in running if r.num_tokens - r.num_computed > 1)
    if not scheduler.static_batches:  # (a static batch admits no one while it runs)
        prompts += sum(r.num_tokens for r in scheduler.waiting)
    step_tokens = min(max_step_tokens, len(decoding) + prompts)
    spare = max_step_tokens - len(decoding)
    if exact_rows is not None:  # a bigger step would change the decode rows' arithmetic
        spare = min(spare, exact_rows - step_tokens)
    by_drafter: dict[int, tuple[object, list[Request], list[int]]] = {}
    for r in spec:
        # Never past what may be emitted (max_new_tokens), nor past the context window:
        # the last draft position must have a slot, so a cut falls where plain decoding's does.
        cap = min(r.params.max_new_tokens - r.num_output_tokens - 1, scheduler.max_model_len - r.num_tokens, spare)
        # Drafts by the measured step times, but for seeded sampling: its draws depend on
        # where drafts fall, so it drafts by the prior cost alone and reproduces run to run.
        timed = r.params.greedy or r.params.seed is None
        k = r.drafter.draft_length(r, cap, step_tokens, step_cost if timed else None)
        spare -= k
        step_tokens += k
        if k > 0:
            group = by_drafter.setdefault(id(r.drafter), (r.drafter, [], []))
            group[1].append(r)
            group[2].append(k)
    drafting = []
    for drafter, reqs, ks in by_drafter.values():
        for r, k, draft in zip(reqs, ks, drafter.propose_batch(reqs, ks)):
            r.draft = list(draft[:k])
            if r.matcher is not None:  # only what the grammar can take (it would reject the rest)
                r.draft = r.draft[:grammars.valid_prefix(r.matcher, r.draft, r.eos_ids)]
            if r.draft_probs is not None:
                r.draft_probs = r.draft_probs[:len(r.draft)]
            if r.draft:
                drafting.append(r)
    return drafting
