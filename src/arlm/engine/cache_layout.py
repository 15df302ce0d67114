"""How big the engine's KV cache is: a contiguous cache's shape for the static batch waiting, or a
paged pool's blocks from `EngineConfig`'s budget, with a pool of their own for sliding-window
layers (Gemma 3) or a StreamingLLM window (`kv_window`).

Plain arithmetic over the configs: `Engine` builds the `KVCache` and the `Scheduler` from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..kv_cache import KVCache, KVDtype, check_pool_fits
from .config import EngineConfig
from .request import Request

# A windowed engine's max_model_len: requests are not bounded by the model's context.
WINDOWED_MAX_LEN = 1 << 31


def window_blocks(block_size: int, kv_window: int, kv_sinks: int, max_step_tokens: int) -> int:
    """Blocks one windowed sequence holds at most: its sinks', its window's plus one step's, and
    one more for the block the window's edge is in."""
    return -(-kv_sinks // block_size) + -(-(kv_window + max_step_tokens) // block_size) + 1


def contiguous_shape(waiting: list[Request], max_seq_len: int) -> tuple[int, int]:
    """(rows, slots) of a contiguous cache for a static batch: a row per request, each as long as
    the longest request can grow (the whole context where one may shift)."""
    length = max(max_seq_len if r.context_shift else
                 min(max_seq_len, r.num_tokens + r.params.max_new_tokens - r.num_output_tokens)
                 for r in waiting)
    return len(waiting), length


def full_layers(cfg: ModelConfig) -> int:
    """Layers that attend to the whole context (every layer but the sliding-window ones)."""
    return sum(not cfg.sliding(l) for l in range(cfg.n_layer))


@dataclass(frozen=True)
class PoolLayout:
    """A paged pool: `n_blocks` blocks of `block_size` slots (of every layer, or of the full
    layers where `n_local`), `n_local` sliding-layer blocks (0: one pool; `Scheduler.split`), a
    StreamingLLM `window` as (kv_window, kv_sinks) or None, and the longest request it runs."""

    block_size: int
    n_blocks: int
    n_local: int
    window: tuple[int, int] | None
    max_model_len: int

    @classmethod
    def plan(cls, config: EngineConfig, cfg: ModelConfig, kv_dtype: KVDtype,
             device: torch.device) -> PoolLayout:
        """The pool `config.kv_cache_tokens` slots or `kv_cache_memory` bytes hold for this
        model; ValueError (MemoryError from `check_pool_fits`) where it cannot run."""
        bs = config.block_size
        if bs < 1:
            raise ValueError(f"block size must be >= 1, got {bs}")
        block_bytes = KVCache.bytes_per_block(cfg, bs, kv_dtype)
        if config.kv_cache_tokens is not None:
            n_blocks = -(-config.kv_cache_tokens // bs)
        else:
            n_blocks = config.kv_cache_memory // block_bytes
        if n_blocks < 2:
            raise ValueError(f"the KV cache budget holds {n_blocks} block(s) of {bs} tokens; it needs at least 2 "
                             f"({2 * block_bytes} bytes, {2 * bs} tokens)")
        n_blocks, n_local = split_pool(config, cfg, kv_dtype, n_blocks)
        full = full_layers(cfg)
        check_pool_fits(n_blocks * block_bytes if not n_local else
                        n_blocks * KVCache.bytes_per_block(cfg, bs, kv_dtype, full)
                        + n_local * KVCache.bytes_per_block(cfg, bs, kv_dtype, cfg.n_layer - full),
                        device)
        window = check_window(config, cfg, n_blocks) if config.kv_window else None
        # One block in reserve: copy-on-write takes a block before it gives one back.
        max_len = min(cfg.max_seq_len, (n_blocks - 1) * bs) if window is None else WINDOWED_MAX_LEN
        return cls(bs, n_blocks, n_local, window, max_len)


def split_pool(config: EngineConfig, cfg: ModelConfig, kv_dtype: KVDtype, n_blocks: int) -> tuple[int, int]:
    """(blocks, sliding-layer blocks) of a pool of the memory of `n_blocks` blocks of every
    layer. A model with sliding-window layers (Gemma 3: 5 of every 6) keeps theirs in blocks
    of their own, which a sequence holds only for its window (`Scheduler.split`): enough of
    them for max_num_seqs sequences at their window and one step's tokens besides, and the
    memory left over goes to the full layers' blocks, so the context the pool holds grows by
    up to n_layer / full layers (6x for Gemma 3); a budget too small for that many splits
    it evenly (as many blocks in each: the sliding pool then never runs out first). (0
    sliding-layer blocks: one pool, as other models, where the sliding layers are all there
    is, there are none, or the pool has a window of its own.)"""
    full = full_layers(cfg)
    if not cfg.layer_types or full in (0, cfg.n_layer) or config.kv_window:
        return n_blocks, 0
    bs = config.block_size
    per_seq = -(-cfg.sliding_window // bs) + 3  # the window's blocks, its edge's, the write's, a draft's
    need = config.max_num_seqs * per_seq + -(-config.max_num_batched_tokens // bs)
    if need >= n_blocks:  # no smaller than the other pool: as many blocks in each
        return n_blocks, n_blocks
    g = KVCache.bytes_per_block(cfg, bs, kv_dtype, full)
    s = KVCache.bytes_per_block(cfg, bs, kv_dtype, cfg.n_layer - full)
    if config.kv_cache_tokens is not None:  # a budget in tokens: the tokens of context it holds
        return n_blocks, need
    return (n_blocks * (g + s) - need * s) // g, need


def check_window(config: EngineConfig, cfg: ModelConfig, n_blocks: int) -> tuple[int, int]:
    """Check a windowed pool (config.kv_window) and return (window, sinks)."""
    c = config
    if c.kv_window < 1 or c.kv_sinks < 0:
        raise ValueError(f"a KV window needs kv_window >= 1 and kv_sinks >= 0, got {c.kv_window}, {c.kv_sinks}")
    if cfg.pos_embedding != "rope":
        raise ValueError("a KV window needs a RoPE model (learned positions end at the context length)")
    live = window_blocks(c.block_size, c.kv_window, c.kv_sinks, c.max_num_batched_tokens)
    if n_blocks - 1 < live:
        raise ValueError(f"a window of {c.kv_window} tokens with {c.kv_sinks} sinks needs {live + 1} blocks of "
                         f"{c.block_size} tokens for one sequence (steps of up to {c.max_num_batched_tokens} "
                         f"tokens); the pool has {n_blocks}")
    return c.kv_window, c.kv_sinks
