"""Each sequence's block tables over the KV pools, and the rules that hand blocks out and take them
back: room for a step's tokens (`fits` / `reserve`: each check beside its action, copy-on-write of
a shared block), a prompt's cached prefix (`match_prefix`), the blocks a StreamingLLM window
(`window`) or a split pool's sliding-window layers (`local`) no longer read, and the blocks that
join the prefix cache once full (`after_step`). The scheduler decides who runs; this says with
which blocks."""

from __future__ import annotations

from .block_pool import BlockPool, block_hash
from .request import Request

FREED = -1  # a block-table entry behind a windowed request's window: its block went back to the pool


class BlockTables:
    """The pool of `n_blocks` blocks of `block_size` slots and, for a split pool, the sliding
    layers' `local` one. `stats`: the scheduler's (prefix queries and hits, copies on write)."""

    def __init__(self, n_blocks: int, block_size: int, enable_prefix_caching: bool, stats) -> None:
        self.pool = BlockPool(n_blocks, enable_prefix_caching)
        self.block_size = block_size
        self.stats = stats
        # (window, sinks) of a windowed engine (EngineConfig.kv_window): blocks no query reads again
        # go back to the pool as the window moves, their places in `blocks` left as FREED
        self.window: tuple[int, int] | None = None
        # A split pool (KVCache.split): the sliding-window layers' blocks come from `local`, and a
        # sequence gives back those behind its last `sliding_window` positions as it goes
        self.local: BlockPool | None = None
        self.sliding_window = 0

    def split(self, n_local_blocks: int, sliding_window: int) -> None:
        self.local = BlockPool(n_local_blocks, self.pool.enable_prefix_caching)
        self.sliding_window = sliding_window

    def resize(self, n_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(n_blocks, self.pool.enable_prefix_caching)
        self.block_size = block_size

    def tables(self, seq: Request) -> list[tuple[BlockPool, list[int]]]:
        """(pool, the sequence's blocks from it): the pool's, and a split pool's sliding layers'."""
        return [(self.pool, seq.blocks)] + ([(self.local, seq.local_blocks)] if self.local is not None else [])

    def free(self, seq: Request) -> None:
        for pool, blocks in self.tables(seq):
            for b in reversed(blocks):  # the tail first: a prefix's last blocks are evicted first
                if b != FREED:
                    pool.release(b)
        seq.blocks, seq.local_blocks = [], []
        seq.num_computed = seq.num_registered = seq.num_local_registered = seq.num_local_freed = 0

    # -- room for a step's tokens -----------------------------------------------------------------

    def blocks_needed(self, seq: Request, n: int) -> list[int]:
        """New blocks to hold `n` more tokens, plus one if the first write needs a private copy:
        of each pool (`tables`)."""
        bs = self.block_size
        first = seq.num_computed // bs
        needs = []
        for pool, blocks in self.tables(seq):
            need = -(-(seq.num_computed + n) // bs) - len(blocks)
            if first < len(blocks) and pool.is_shared_or_cached(blocks[first]):
                need += 1
            needs.append(need)
        return needs

    def fits(self, seq: Request, n: int) -> bool:
        """Whether the pools have the free blocks `n` more tokens of `seq` need."""
        pools = [pool for pool, _ in self.tables(seq)]
        return all(pool.num_free >= need for pool, need in zip(pools, self.blocks_needed(seq, n)))

    def reserve(self, seq: Request, n: int, copies: list[tuple[int, int]], local_copies: list[tuple[int, int]]) -> None:
        """Allocate the blocks for `n` more tokens (caller checked `fits`); a shared first block
        is copied on write, (src, dst) noted in `copies` (`local_copies` for the sliding layers)."""
        bs = self.block_size
        first = seq.num_computed // bs
        for pool, blocks in self.tables(seq):
            if first < len(blocks) and pool.is_shared_or_cached(blocks[first]):
                old, new = blocks[first], pool.allocate()  # copy-on-write
                (copies if pool is self.pool else local_copies).append((old, new))
                self.stats.copies_on_write += 1
                blocks[first] = new
                pool.release(old)
                if pool is self.pool:  # the copy is not a cached block
                    seq.num_registered = min(seq.num_registered, first)
                else:
                    seq.num_local_registered = min(seq.num_local_registered, first)
            while len(blocks) * bs < seq.num_computed + n:
                blocks.append(pool.allocate())

    # -- the prefix cache -------------------------------------------------------------------------

    def hash(self, seq: Request, i: int) -> bytes:
        """Content hash of full block i of the request's window (it only grows: hashes stay valid)."""
        bs = self.block_size
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if j else None
            seq.block_hashes.append(block_hash(parent, seq.window(j * bs, (j + 1) * bs)))
        return seq.block_hashes[i]

    def match_prefix(self, seq: Request) -> None:
        """Take the cached blocks of the longest prefix of the window (full blocks only); none
        for a request that keeps its prompt's logits or embeds it (every prompt token must run)."""
        bs = self.block_size
        if self.pool.enable_prefix_caching and not (seq.keep_prompt_logits or seq.embed):
            for i in range(seq.num_tokens // bs):
                block = self.pool.lookup(self.hash(seq, i))
                if block is None:
                    break
                seq.blocks.append(block)
        if self.local is not None:
            self.match_local(seq)
        seq.num_registered = len(seq.blocks)
        seq.num_computed = len(seq.blocks) * bs
        if seq.num_computed == seq.num_tokens:
            seq.num_computed -= 1  # the last token must run again: its logits pick the next token
        seq.num_cached_tokens = seq.num_computed
        self.stats.prefix_queries += seq.num_tokens
        self.stats.prefix_hits += seq.num_computed

    def local_start(self, computed: int) -> int:
        """The first sliding-layer block a sequence's queries read once `computed` tokens have
        their K/V: the next query, at that position, reads its last `sliding_window` positions."""
        return max(0, computed - self.sliding_window + 1) // self.block_size

    def match_local(self, seq: Request) -> None:
        """A prefix hit in a split pool: its sliding layers' blocks too, those the continuation
        reads (the window before it; the earlier ones were given back). The longest prefix the
        global hits hold whose window's sliding blocks are all cached; the global hits past it
        are given back."""
        bs, hit = self.block_size, len(seq.blocks)
        while hit:
            computed = hit * bs - (hit * bs == seq.num_tokens)  # (as below: a whole prompt runs its last token)
            start = self.local_start(computed)
            if all(self.local.peek(self.hash(seq, i)) for i in range(start, hit)):
                break
            hit -= 1
        for b in reversed(seq.blocks[hit:]):  # (the tail first, as free)
            self.pool.release(b)
        del seq.blocks[hit:]
        start = self.local_start(hit * bs - (hit * bs == seq.num_tokens)) if hit else 0
        seq.local_blocks = [FREED] * start + [self.local.lookup(self.hash(seq, i)) for i in range(start, hit)]
        seq.num_local_registered, seq.num_local_freed = hit, start

    # -- after a step -----------------------------------------------------------------------------

    def after_step(self, seq: Request) -> None:
        """`seq` has `num_computed` tokens' K/V now: give back the blocks past them (held only
        rejected draft tokens), those no query reads again (a window's, a split pool's sliding
        layers'), and cache the newly full ones."""
        keep = -(-seq.num_computed // self.block_size)
        for pool, blocks in self.tables(seq):
            while len(blocks) > keep:  # blocks that held only rejected draft tokens
                pool.release(blocks.pop())
        if self.window is not None:
            self.drop_behind_window(seq)
        if self.local is not None:
            self.slide(seq)
        full = min(seq.num_computed // self.block_size, len(seq.blocks))
        # (an embedding's blocks are not cached: they would push chat prefixes out)
        while self.pool.enable_prefix_caching and not seq.embed and seq.num_registered < full:
            self.pool.register(seq.blocks[seq.num_registered], self.hash(seq, seq.num_registered))
            seq.num_registered += 1

    def drop_behind_window(self, seq: Request) -> None:
        """Give back the blocks no query of `seq` reads again: the next one, at position
        num_computed, reads the sink slots and positions num_computed - window + 1 on."""
        window, sinks = self.window
        bs = self.block_size
        dead = min(max(0, seq.num_computed - window + 1) // bs, len(seq.blocks))  # blocks wholly before it
        for b in range(-(-sinks // bs), dead):
            if seq.blocks[b] != FREED:
                self.pool.release(seq.blocks[b])
                seq.blocks[b] = FREED

    def slide(self, seq: Request) -> None:
        """A split pool's sliding-layer blocks: the newly full ones join the prefix cache, then
        those wholly behind the next query's window go back to the pool (cached, until evicted:
        a later prompt with this prefix may still take them)."""
        bs, blocks = self.block_size, seq.local_blocks
        full = min(seq.num_computed // bs, len(blocks))
        while seq.num_local_registered < full:
            i = seq.num_local_registered
            if self.local.enable_prefix_caching and not seq.embed and blocks[i] != FREED:
                self.local.register(blocks[i], self.hash(seq, i))
            seq.num_local_registered += 1
        end = min(self.local_start(seq.num_computed), len(blocks))
        for i in range(seq.num_local_freed, end):  # (those before num_local_freed are FREED already)
            if blocks[i] != FREED:
                self.local.release(blocks[i])
                blocks[i] = FREED
        seq.num_local_freed = max(seq.num_local_freed, end)
