"""A request's acceptance estimates and the draft length they call for (`best_draft_length`),
and the rates of the speculation counts (`SpecRates`) the stats classes report."""

from __future__ import annotations

from dataclasses import dataclass, field


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
