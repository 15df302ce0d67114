"""The paged KV cache: one preallocated pool of fixed-size blocks shared by every sequence.

The pool holds K and V as `[n_layer, n_blocks, H_kv, block_size, d_head]`. A sequence owns a
list of blocks (its block table): position `p` lives in slot `p % block_size` of block
`table[p // block_size]`, so memory is handed out `block_size` tokens at a time as a sequence
grows, and never reserved for a maximum length it may not reach.

The model sees the cache through one call per layer, `attend(layer, input_pos, q, k, v)`, made on
a flattened batch: `[1, N]` tokens from any mix of sequences (decode tokens and prompt chunks),
with `set_batch` telling which sequence (row of the block table) each token belongs to. On CPU a
native kernel (paged_attention.cpp) writes the new K/V and attends through the block table in
place; elsewhere a PyTorch fallback gathers each token's keys and calls SDPA.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import ModelConfig

_SOURCE = Path(__file__).with_name("paged_attention.cpp")
_native: dict[str, bool] = {}


def native_available() -> bool:
    """Build (once per machine and source version) and load the paged-attention kernel."""
    if "ok" not in _native:
        from ..kernels import load_native

        _native["ok"] = (load_native("arlm_serve_kernels", [_SOURCE], "paged-attention kernel")
                         and hasattr(torch.ops.arlm_serve, "paged_attention"))
    return _native["ok"]


class PagedKVCache:
    """K/V block pool for all sequences of a server, plus the current batch's block table."""

    paged = True  # the model hands attention to `attend` instead of calling SDPA itself

    def __init__(self, n_layer: int, n_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 use_kernel: bool | None = None) -> None:
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {n_blocks} x {block_size}")
        shape = (n_layer, n_blocks, n_kv_heads, block_size, head_dim)
        # zeros, not empty: the memory is committed at start-up, so an over-large budget fails now.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        if use_kernel is None:
            use_kernel = (self.k.device.type == "cpu" and dtype in (torch.float32, torch.float16)
                          and native_available())
        self.use_kernel = use_kernel
        self.block_table: torch.Tensor | None = None  # [S, max_blocks] int64, S sequences this step
        self.seq_index: torch.Tensor | None = None  # [N] int64, row of block_table per token

    @classmethod
    def for_model(cls, config: ModelConfig, n_blocks: int, block_size: int = 16,
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                  use_kernel: bool | None = None) -> "PagedKVCache":
        return cls(config.n_layer, n_blocks, block_size, config.n_kv_heads, config.head_dim, dtype, device,
                   use_kernel)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype = torch.float32) -> int:
        """2 (K and V) * n_layer * H_kv * block_size * d_head * bytes per element."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return 2 * config.n_layer * config.n_kv_heads * block_size * config.head_dim * itemsize

    @property
    def n_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def set_batch(self, block_table: torch.Tensor, seq_index: torch.Tensor) -> None:
        """The next forward's layout: block_table [S, max_blocks] (a row per sequence, unused
        entries 0), seq_index [N] (the row of each of the N flattened tokens)."""
        self.block_table, self.seq_index = block_table, seq_index

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every layer (copy-on-write of a shared block)."""
        self.k[:, dst].copy_(self.k[:, src])
        self.v[:, dst].copy_(self.v[:, src])

    def attend(self, layer: int, input_pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Write the new K/V, then attend each token to its own sequence's positions 0..pos.

        input_pos [1, N]; q [1, H, N, d_head]; k, v [1, H_kv, N, d_head]. Returns [1, H, N, d_head].
        """
        assert q.shape[0] == 1, "the paged cache takes a flattened batch: [1, N] tokens"
        pos = input_pos[0]
        q3, k3, v3 = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))  # [N, heads, d_head]
        if self.use_kernel and q3.dtype == torch.float32:
            y = torch.ops.arlm_serve.paged_attention(q3, k3, v3, self.k[layer], self.v[layer], self.block_table,
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
