"""`SpeculativeConfig`: which drafter, and how many tokens it may draft."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpeculativeConfig:
    """How a drafter drafts. method: "ngram" (prompt lookup), "self:N" (the target's first N
    layers and its head), or a model spec `arlm.loading.load_model` takes (name or path)."""

    method: str = "ngram"
    num_speculative_tokens: int = 8  # the most tokens drafted for one request in one step
    adaptive: bool = True  # draft length from the acceptance estimate and the load (module doc)
    ngram_min: int = 1
    ngram_max: int = 4
    # r = b / a of a step's cost a + b * N (N tokens): 0.25 was measured for SmolLM2-135M with the
    # default kernels on an AMD EPYC (Zen 4), 2 threads (docs/benchmarks.md, speculative decoding).
    verify_cost: float = 0.25

    def __post_init__(self) -> None:
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be an integer in 1..64, got {self.num_speculative_tokens!r}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 64:
            raise ValueError(f"the n-gram range must satisfy 1 <= min <= max <= 64, got "
                             f"{self.ngram_min}..{self.ngram_max}")
        if not self.verify_cost >= 0:
            raise ValueError(f"verify_cost must be >= 0, got {self.verify_cost}")
