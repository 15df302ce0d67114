"""Bookkeeping for the KV block pool: which blocks are free, who shares them, which hold a prefix.

The pool's memory lives in `arlm.kv_cache.KVCache`; this module only hands out block ids. Each block has a
reference count (the number of sequences whose block table holds it). A block that is full gets
a hash that names its exact contents: the hash of the previous block's hash and this block's
token ids, so equal hashes mean equal token prefixes up to and including this block. Another
sequence whose prompt starts the same way takes the cached block instead of recomputing it
(prefix caching). Hashed blocks are never written again: a sequence that must write into one
copies it first (copy-on-write).

A block whose count falls to 0 goes back to the free queue but keeps its hash, so a later request
can still hit it; the free queue hands out the least recently freed block first (LRU eviction).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

# Token slots a block holds, unless an engine is configured otherwise: small enough that a
# sequence wastes under a block, large enough that a block table stays short and the attention
# kernels read whole runs of slots.
DEFAULT_BLOCK_SIZE = 16


def block_hash(parent: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Content hash of one full block given its predecessor's hash (None for the first block).

    A cryptographic hash, not Python's `hash`: a collision would hand one request another's keys.
    """
    h = hashlib.sha256(parent or b"")
    h.update(b",".join(str(t).encode() for t in token_ids))
    return h.digest()


class BlockPool:
    """Allocator for `n_blocks` block ids with reference counts and a prefix-hash table."""

    def __init__(self, n_blocks: int, enable_prefix_caching: bool = True) -> None:
        if n_blocks < 1:
            raise ValueError(f"the pool needs at least one block, got {n_blocks}")
        self.n_blocks = n_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * n_blocks
        self.hash_of: list[bytes | None] = [None] * n_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id holding those tokens
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(n_blocks))  # LRU first

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free, including cached ones that may be evicted)."""
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.n_blocks - len(self.free)

    @property
    def utilization(self) -> float:
        """Fraction of blocks held by at least one sequence."""
        return self.num_used / self.n_blocks

    def allocate(self) -> int:
        """A free block (evicting its cached prefix, if any) with reference count 1."""
        if not self.free:
            raise RuntimeError("KV block pool exhausted")  # the scheduler checks num_free first
        block, _ = self.free.popitem(last=False)
        h = self.hash_of[block]
        if h is not None:  # evict: its tokens are no longer cached
            del self.cached[h]
            self.hash_of[block] = None
        self.ref_count[block] = 1
        return block

    def release(self, block: int) -> None:
        """Drop one reference; at 0 the block is free again (its cached prefix kept for now)."""
        if self.ref_count[block] <= 0:
            raise RuntimeError(f"block {block} released more often than taken")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free[block] = None  # most recently freed: evicted last

    def lookup(self, h: bytes) -> int | None:
        """The block caching hash `h`, now with one more reference; None on a miss."""
        block = self.cached.get(h) if self.enable_prefix_caching else None
        if block is None:
            return None
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1
        return block

    def peek(self, h: bytes) -> bool:
        """Whether a block caches hash `h` (`lookup` without taking it)."""
        return self.enable_prefix_caching and h in self.cached

    def register(self, block: int, h: bytes) -> None:
        """Record that full block `block` holds the tokens named by `h` (first writer wins)."""
        if self.enable_prefix_caching and h not in self.cached and self.hash_of[block] is None:
            self.cached[h] = block
            self.hash_of[block] = h

    def is_shared_or_cached(self, block: int) -> bool:
        """Whether writing into `block` would change what another sequence or a future prefix hit
        reads: then the writer must copy it first."""
        return self.ref_count[block] > 1 or self.hash_of[block] is not None
