"""Speculative decoding: a drafter proposes k tokens, the target scores all k + 1 positions in
one pass, and the longest prefix the acceptance rule allows is kept (Leviathan et al. 2023,
Chen et al. 2023).

A decode step streams every weight for one token per sequence; a pass over k + 1 positions of a
sequence costs little more at batch 1 (the packed kernels serve up to 4 rows per weight load).
The engine asks each decoding request's drafter for a draft before it schedules a step
(`propose_drafts`); the scheduler feeds the draft after the request's last token, as a row of
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
  with the request's each time, and it recomputes from the first difference). A self-draft
  (`Transformer.first_layers`) makes one from the target itself: its first layers, final norm
  and LM head, sharing the weights.

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

config.py        SpeculativeConfig: which drafter, how many tokens
acceptance.py    a request's acceptance estimates (SpecState), the draft length rule, SpecRates
cost.py          StepCost: a step's time by its size, from the engine's own steps
drafters.py      Drafter, NgramDrafter, ModelDrafter
verification.py  verify: the tokens the target keeps (greedy, or the rejection rule)
proposal.py      propose_drafts: which requests draft how many tokens in the next step
"""

from .acceptance import DECAY, DRIFT, MARGIN, PRIOR_WEIGHT, SpecRates, SpecState, best_draft_length
from .config import SpeculativeConfig
from .cost import StepCost
from .drafters import Drafter, ModelDrafter, NgramDrafter
from .proposal import propose_drafts
from .verification import acceptance_probability, residual, verify

__all__ = ["DECAY", "DRIFT", "Drafter", "MARGIN", "ModelDrafter", "NgramDrafter", "PRIOR_WEIGHT", "SpecRates",
           "SpecState", "SpeculativeConfig", "StepCost", "acceptance_probability", "best_draft_length", "propose_drafts", "residual",
           "verify"]
