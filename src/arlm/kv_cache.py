"""The KV cache: one preallocated pool of fixed-size blocks, written in place.

K and V live as `[n_layer, n_blocks, H_kv, block_size, d_head]`. A sequence owns a list of
blocks (its block table): position `p` lives in slot `p % block_size` of block
`table[p // block_size]`, so memory is handed out `block_size` tokens at a time as a sequence
grows (`arlm serve`: many requests of unknown length share one pool).

The textbook contiguous cache `[n_layer, B, H_kv, T, d_head]` is the same tensor with one block of
`T` slots per sequence: `KVCache.contiguous(config, B, T)`. Row `b` is block `b`, slot `t` holds
position `t`, and rows of a batch may sit at different positions. It is what a static batch
wants (`LLM.generate`): no table to look through, and a decode step whose shapes never change.

The model reads the cache in one of two ways (`Transformer.forward`):
- rows: tokens `[B, T]`, row `b` in block `b` (`update`, then SDPA over slots `0 .. kv_len - 1`);
  the textbook path, for contiguous caches (tests, `torch.compile`, CUDA graphs);
- a block table: a flattened batch `[1, N]` of tokens from any mix of sequences, set with
  `set_batch` (`attend`: a native kernel writes the new K/V and attends through the table in
  place on CPU; elsewhere a PyTorch path gathers each token's keys and calls SDPA).

A cache narrower than the model (float16 under float32) stores K/V rounded and attends in the
model's dtype.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .config import ModelConfig

# The share of the memory available that a KV pool may take: the rest is for the step's
# activations, the HTTP side and whatever else runs on the machine.
POOL_MEMORY_FRACTION = 0.9


def available_memory(device: str | torch.device = "cpu") -> int | None:
    """Bytes a new allocation on `device` can take now: the host's MemAvailable (physical pages
    where there is no /proc/meminfo), a CUDA device's free memory; None where it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_pool_fits(nbytes: int, device: str | torch.device = "cpu", reserved: int = 0) -> None:
    """Raise ValueError if a KV pool of `nbytes` (plus `reserved` bytes still to be taken, such as
    the model's weights) would not fit in the memory `device` has available. Checked before the
    pool is allocated: a pool too large for the host gets the process OOM-killed without a word,
    or a failed allocation reported as an internal error."""
    free = available_memory(device)
    if free is not None and nbytes + reserved > POOL_MEMORY_FRACTION * free:
        model = f" beside the model (~{reserved / 2**30:.1f} GiB)" if reserved else ""
        raise ValueError(f"a KV pool of {nbytes / 2**30:.1f} GiB does not fit{model}: "
                         f"{torch.device(device).type} memory available is {free / 2**30:.1f} GiB, and the pool "
                         f"may take at most {POOL_MEMORY_FRACTION:.0%} of it")


class KVCache:
    """K/V blocks for every layer, plus the block table of the batch being run (if any)."""

    def __init__(self, n_layer: int, n_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 use_kernel: bool | None = None) -> None:
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {n_blocks} x {block_size}")
        shape = (n_layer, n_blocks, n_kv_heads, block_size, head_dim)
        # zeros, not empty: the memory is committed at start-up, so an over-large budget fails now.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        if use_kernel is None:
            from . import kernels

            use_kernel = (self.k.device.type == "cpu" and dtype in (torch.float32, torch.float16)
                          and kernels.native_available())
        self.use_kernel = use_kernel
        self.block_table: torch.Tensor | None = None  # [S, max_blocks] int64, S sequences this forward
        self.seq_index: torch.Tensor | None = None  # [N] int64, row of block_table per token

    @classmethod
    def pool(cls, config: ModelConfig, n_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu", use_kernel: bool | None = None) -> "KVCache":
        """A pool of `n_blocks` blocks of `block_size` slots for `config`'s layers and heads."""
        return cls(config.n_layer, n_blocks, block_size, config.n_kv_heads, config.head_dim, dtype, device,
                   use_kernel)

    @classmethod
    def contiguous(cls, config: ModelConfig, batch_size: int, capacity: int | None = None,
                   dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> "KVCache":
        """The textbook cache `[n_layer, batch_size, H_kv, capacity, d_head]`: one block a row."""
        capacity = config.max_seq_len if capacity is None else capacity
        if not 0 < capacity <= config.max_seq_len:
            raise ValueError(f"cache capacity must be in 1..{config.max_seq_len}, got {capacity}")
        return cls.pool(config, batch_size, capacity, dtype, device)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype = torch.float32) -> int:
        """2 (K and V) * n_layer * H_kv * block_size * d_head * bytes per element."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return 2 * config.n_layer * config.n_kv_heads * block_size * config.head_dim * itemsize

    @property
    def n_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]

    # The contiguous view's names for the same dimensions.
    batch_size = n_blocks
    capacity = block_size

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) * n_layer * H_kv * d_head * bytes per element."""
        n_layer, _, h_kv, _, d_head = self.k.shape
        return 2 * n_layer * h_kv * d_head * self.k.element_size()

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def paged(self) -> bool:
        """Whether the next forward reads through a block table (`set_batch`) rather than by rows."""
        return self.block_table is not None

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every layer (copy-on-write of a shared block)."""
        self.k[:, dst].copy_(self.k[:, src])
        self.v[:, dst].copy_(self.v[:, src])

    # -- by rows: the contiguous cache's textbook path ------------------------------------------

    def rows(self, b0: int, b1: int) -> "KVCache":
        """Rows (blocks) b0 .. b1 - 1 as a cache of their own over this one's storage: what is
        written there lands here."""
        view = KVCache.__new__(KVCache)
        view.k, view.v = self.k[:, b0:b1], self.v[:, b0:b1]
        view.use_kernel, view.block_table, view.seq_index = self.use_kernel, None, None
        return view

    def update(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `k`, `v` ([B, H_kv, T, d_head]) at `input_pos` ([B, T]) of rows 0 .. B-1, in place.

        Returns views of slots `0 .. kv_len - 1` of this layer: ([B, H_kv, kv_len, d_head]) * 2.
        """
        B = k.shape[0]
        index = input_pos[:, None, :, None].expand_as(k)
        k_layer, v_layer = self.k[layer, :B], self.v[layer, :B]
        k_layer.scatter_(2, index, k.to(k_layer.dtype))
        v_layer.scatter_(2, index, v.to(v_layer.dtype))
        k_out, v_out = k_layer[:, :, :kv_len], v_layer[:, :, :kv_len]
        if k_out.dtype != k.dtype:  # a float16 cache under a float32 model: stored narrow, attended in float32
            return k_out.to(k.dtype), v_out.to(v.dtype)
        return k_out, v_out

    # -- through a block table ----------------------------------------------------------------------

    def set_batch(self, block_table: torch.Tensor | None, seq_index: torch.Tensor | None) -> None:
        """The next forward's layout: block_table [S, max_blocks] (a row per sequence, unused
        entries 0), seq_index [N] (the row of each of the N flattened tokens); None, None goes
        back to rows."""
        self.block_table, self.seq_index = block_table, seq_index

    def attend(self, layer: int, input_pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Write the new K/V, then attend each token to its own sequence's positions 0..pos.

        input_pos [1, N]; q [1, H, N, d_head]; k, v [1, H_kv, N, d_head]. Returns [1, H, N, d_head].
        """
        assert q.shape[0] == 1, "a block-table forward takes a flattened batch: [1, N] tokens"
        pos = input_pos[0]
        q3, k3, v3 = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))  # [N, heads, d_head]
        if self.use_kernel and q3.dtype == torch.float32:
            y = torch.ops.arlm.paged_attention(q3, k3, v3, self.k[layer], self.v[layer], self.block_table,
                                               self.seq_index, pos.contiguous(), q.shape[-1] ** -0.5)
        else:
            y = self._attend_torch(layer, pos, q3, k3, v3)
        return y.transpose(0, 1).unsqueeze(0)

    def _attend_torch(self, layer: int, pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
        """Reference path (any device and dtype): scatter, gather each token's keys, SDPA."""
        bs = self.block_size
        table = self.block_table[self.seq_index]  # [N, max_blocks]
        rows = torch.arange(len(pos), device=pos.device)
        blocks = table[rows, pos // bs]
        k_pool, v_pool = self.k[layer], self.v[layer]  # [n_blocks, H_kv, bs, d]
        k_pool[blocks, :, pos % bs] = k.to(k_pool.dtype)
        v_pool[blocks, :, pos % bs] = v.to(v_pool.dtype)
        n = int(pos.max()) // bs + 1  # blocks the longest query reads
        N, H_kv, d = k.shape
        # [N, H_kv, n*bs, d], widened to q's dtype where the pool is narrower
        keys = k_pool[table[:, :n]].transpose(1, 2).reshape(N, H_kv, n * bs, d).to(q.dtype)
        values = v_pool[table[:, :n]].transpose(1, 2).reshape(N, H_kv, n * bs, d).to(q.dtype)
        mask = (torch.arange(n * bs, device=pos.device)[None, :] <= pos[:, None])[:, None, None, :]
        y = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask,
                                           enable_gqa=q.shape[1] != H_kv)
        return y[:, :, 0, :]  # [N, H, d]
