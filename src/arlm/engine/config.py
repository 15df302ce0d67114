"""`EngineConfig`: the engine's cache and batch, typed (engine.py reads it, cache_layout.py sizes
the cache from it). No torch here: the command line's parsers read the defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..settings import KV_SINKS
from .block_pool import DEFAULT_BLOCK_SIZE

if TYPE_CHECKING:
    from ..kv_cache import KVDtype


@dataclass
class EngineConfig:
    """The cache and the batch. A paged pool is `kv_cache_tokens` token slots if given, else as
    many blocks as `kv_cache_memory` bytes hold (K and V, every layer)."""

    block_size: int | None = DEFAULT_BLOCK_SIZE  # token slots per block; None: a contiguous cache (engine.py's doc)
    kv_cache_memory: int = 1 << 30
    kv_cache_tokens: int | None = None
    max_num_seqs: int = 64  # running requests at most
    max_num_batched_tokens: int = 512  # tokens per forward pass (decodes + prompt chunks)
    # A prompt with more tokens than this left is long: it runs in chunks of at most this many, and
    # while others decode, long prompts share a few tokens a step (step_budget.long_budget), so one
    # client's long prompt never stretches every stream's steps. None: prompts take the whole budget.
    long_prefill_tokens: int | None = None
    # The sequences of one group (Request.group: one API call's choices) that step together while
    # other requests run or wait (step_budget.group_turns). None: no limit.
    group_rows: int | None = None
    enable_prefix_caching: bool = True
    # None: the model's; float16 halves a step's K/V reads, "int8" / "int4" quantize them (kv_cache.py)
    kv_dtype: KVDtype | None = None
    # A sliding window with attention sinks (StreamingLLM; KVCache.set_window): each token attends to
    # the first kv_sinks tokens and the last kv_window, and requests run past the model's context
    # with a bounded number of blocks each. 0: off. Paged pool only; no prefix caching, no drafts.
    kv_window: int = 0
    kv_sinks: int = KV_SINKS

    @property
    def contiguous(self) -> bool:
        return self.block_size is None

    def check(self) -> None:
        """Raise ValueError for a batch no engine can run."""
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        for name in ("long_prefill_tokens", "group_rows"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (or None: off)")
