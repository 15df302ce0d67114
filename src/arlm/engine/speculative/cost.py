"""`StepCost`: how long a step of n tokens takes on this machine, for the draft length rule."""

from __future__ import annotations


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
