"""Preallocated key/value cache whose rows may sit at different positions."""

from __future__ import annotations

import torch

from .config import ModelConfig


class KVCache:
    """Per-layer K and V buffers, `[n_layer, B, H_kv, capacity, d_head]`, written in place.

    The cache may be narrower than the model (a float16 cache under a float32 model halves the
    bytes each decode step reads, as llama.cpp's default f16 cache does): K/V are rounded to the
    cache's dtype when written and widened back to the model's when attended.

    Slot `t` of row `b` holds the key/value of the token at position `t` of that row, so rows of
    one batch can hold prompts of different lengths. Attention reads slots `0 .. pos` of its own
    row (the mask is built from positions, see `Transformer.forward`); slots beyond a row's length
    may hold stale values from padding and are never attended to.

    `seq_lens[b]` is the number of tokens of row `b` whose K/V are in the cache: it is host-side
    bookkeeping kept by the caller (generation knows every position without asking the device).
    """

    paged = False  # see arlm.serve.paged_cache.PagedKVCache for the block-pool cache

    def __init__(self, n_layer: int, batch_size: int, n_kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (n_layer, batch_size, n_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.seq_lens = [0] * batch_size

    @classmethod
    def for_model(cls, config: ModelConfig, batch_size: int, capacity: int | None = None,
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> "KVCache":
        capacity = config.max_seq_len if capacity is None else capacity
        if not 0 < capacity <= config.max_seq_len:
            raise ValueError(f"cache capacity must be in 1..{config.max_seq_len}, got {capacity}")
        return cls(config.n_layer, batch_size, config.n_kv_heads, capacity, config.head_dim, dtype, device)

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        """Token slots per row."""
        return self.k.shape[3]

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) * n_layer * H_kv * d_head * bytes per element."""
        n_layer, _, h_kv, _, d_head = self.k.shape
        return 2 * n_layer * h_kv * d_head * self.k.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the whole cache."""
        return self.k.nbytes + self.v.nbytes

    @property
    def bytes_used(self) -> int:
        """Bytes holding live tokens (sum over rows of seq_len * bytes_per_token)."""
        return sum(self.seq_lens) * self.bytes_per_token

    def update(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `k`, `v` ([B, H_kv, T, d_head]) at `input_pos` ([B, T]) of each row, in place.

        Returns views of slots `0 .. kv_len - 1` of this layer: ([B, H_kv, kv_len, d_head]) * 2.
        """
        index = input_pos[:, None, :, None].expand_as(k)
        k_layer, v_layer = self.k[layer], self.v[layer]
        k_layer.scatter_(2, index, k.to(k_layer.dtype))
        v_layer.scatter_(2, index, v.to(v_layer.dtype))
        k_out, v_out = k_layer[:, :, :kv_len], v_layer[:, :, :kv_len]
        if k_out.dtype != k.dtype:  # a float16 cache under a float32 model: stored narrow, attended in float32
            return k_out.to(k.dtype), v_out.to(v.dtype)
        return k_out, v_out

    def rows(self, b0: int, b1: int) -> "KVCache":
        """Rows b0 .. b1 - 1 as a cache of their own over this one's storage: what is written
        there lands here. Its seq_lens are a copy (this cache's stay the caller's to keep)."""
        view = KVCache.__new__(KVCache)
        view.k, view.v = self.k[:, b0:b1], self.v[:, b0:b1]
        view.seq_lens = self.seq_lens[b0:b1]
        return view

    def reset(self) -> None:
        self.seq_lens = [0] * self.batch_size
