"""The KV cache: one preallocated pool of fixed-size blocks, written in place.

K and V live as `[n_layer, n_blocks, H_kv, block_size, d_head]`. A sequence owns a list of
blocks (its block table): position `p` lives in slot `p % block_size` of block
`table[p // block_size]`, so memory is handed out `block_size` tokens at a time as a sequence
grows (`arlm serve`: many requests of unknown length share one pool).

A model with sliding-window layers (Gemma 3: 5 of every 6 read only their last 512 positions)
keeps, in a pool, those layers' K/V in blocks of their own (`split`: `k_local`, `v_local`
`[n_sliding, n_local_blocks, H_kv, block_size, d_head]`, read through a table of their own,
`local_table`): a sequence holds them only for its window's positions (engine/scheduler.py gives
the rest back), so a token of context costs the full layers' bytes alone (`bytes_per_token`) and
a long context stops growing in 15 of Gemma 3 270M's 18 layers. `self.store` says where each
layer's K/V are.

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
model's dtype. A quantized cache (`kv_dtype` "int8" or "int4") stores each row (the d_head values
of one token and KV head) as a record of bytes, `[n_layer, n_blocks, H_kv, block_size, row_bytes]`
uint8, quantized when written (`quantize_rows`, the native kernels' formats bit for bit:
kernels/attention.h):

- int8: llama.cpp's q8_0, 8-bit codes with a float16 scale per group of 32: 68 bytes a row of 64
  (0.53x float16).
- int4: QuaRot's rotation, then 4-bit values and 5-bit keys (the more sensitive), each group of
  32 with a float16 scale and minimum: the normalized Walsh-Hadamard transform spreads a key's
  outlier channels over the whole row before the row is cut into groups, and q . k = Hq . Hk;
  48 + 40 bytes for a key and a value row of 64 (0.34x float16). benchmarks/kv_schemes.py
  measured the candidates.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import kernels
from .config import ModelConfig
from .kernels.layout import KVFormat

# The cache's element types: a torch float dtype, or a quantized format by name.
KVDtype = torch.dtype | str
QUANTIZED = ("int8", "int4")
KV_DTYPES = ("float32", "float16", "bfloat16", *QUANTIZED)
_FORMAT = {"int8": KVFormat.INT8, "int4": KVFormat.INT4}  # the kernels' kv_format; float rows go by dtype
_INT4 = ((5, 32), (4, 32))  # (bits, group) of keys (the more sensitive) and of values


def kv_dtype_name(dtype: KVDtype) -> str:
    """"float16", "int8", ...: a KV dtype as the CLI, --json and /metrics name it."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def parse_kv_dtype(name: KVDtype) -> KVDtype:
    """A torch float dtype or a quantized format's name, from a name in KV_DTYPES (or as it is)."""
    if isinstance(name, torch.dtype):
        return name
    if name not in KV_DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r} (expected one of {', '.join(KV_DTYPES)})")
    return name if name in QUANTIZED else getattr(torch, name)


def row_bytes(dtype: KVDtype, head_dim: int) -> tuple[int, int]:
    """Bytes of one cached key row and one value row (d_head values of one token and KV head)."""
    if dtype == "int8":
        return (head_dim + 2 * (head_dim // 32),) * 2
    if dtype == "int4":
        return tuple(head_dim // 2 + (head_dim // 8 if bits == 5 else 0) + 4 * (head_dim // g) for bits, g in _INT4)
    n = head_dim * torch.empty(0, dtype=dtype).element_size()
    return n, n


def check_head_dim(dtype: KVDtype, head_dim: int) -> None:
    """Raise ValueError where a quantized format cannot hold rows of head_dim values."""
    if dtype == "int8" and head_dim % 32:
        raise ValueError(f"an int8 KV cache needs a head size that is a multiple of 32, got {head_dim}")
    if dtype == "int4" and (head_dim % 32 or head_dim & (head_dim - 1) or head_dim > 512):
        raise ValueError(f"an int4 KV cache needs a head size that is a power of two from 32 to 512, got {head_dim}")


# -- the quantized rows, mirroring kernels/attention.h operation for operation ---------------------

def hadamard(x: torch.Tensor) -> torch.Tensor:
    """H x along the last dim (a power of two): the Walsh-Hadamard butterflies, then / sqrt(n), in
    the kernel's order (the same float32 results)."""
    shape, n = x.shape, x.shape[-1]
    h = 1
    while h < n:
        y = x.reshape(*shape[:-1], n // (2 * h), 2, h)
        x = torch.stack([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], dim=-2).reshape(shape)
        h *= 2
    return x * _hadamard_scale(n)


def _hadamard_scale(n: int) -> float:
    """1 / sqrt(n) as the kernel computes it, in float32 (a Python float holding that value exactly:
    a tensor times it multiplies by the same float32)."""
    if n not in _HADAMARD_SCALES:
        _HADAMARD_SCALES[n] = (torch.tensor(1.0) / torch.tensor(float(n)).sqrt()).item()
    return _HADAMARD_SCALES[n]


_HADAMARD_SCALES: dict[int, float] = {}


def _scale_bytes(t: torch.Tensor) -> torch.Tensor:  # float16 [..., G] -> its bytes [..., 2G]
    return t.contiguous().view(torch.uint8)


def _quantize_rotated(x: torch.Tensor, bits: int, g: int) -> torch.Tensor:
    *lead, hd = x.shape
    top = 2 ** bits - 1
    xg = hadamard(x.float()).reshape(*lead, hd // g, g)
    lo, hi = xg.amin(-1), xg.amax(-1)
    d, m = ((hi - lo) / float(top)).half(), lo.half()
    df, mf = d.float()[..., None], m.float()[..., None]
    inv = torch.where(df > 0, 1.0 / df, torch.zeros_like(df))
    q = torch.round((xg - mf) * inv).clamp(0, top).to(torch.uint8).reshape(*lead, hd)
    parts = [(q[..., 0::2] & 0x0F) | ((q[..., 1::2] & 0x0F) << 4)]
    if bits == 5:  # the 5th bits, 8 values to a byte, value e in bit e % 8
        fifth = (q >> 4).reshape(*lead, hd // 8, 8)
        parts.append((fifth << torch.arange(8, dtype=torch.uint8, device=x.device)).sum(-1, dtype=torch.uint8))
    parts.append(_scale_bytes(torch.stack([d, m], -1).reshape(*lead, 2 * (hd // g))))  # per group: scale, min
    return torch.cat(parts, -1)


def _dequantize_rotated(rows: torch.Tensor, hd: int, bits: int, g: int) -> torch.Tensor:
    *lead, _ = rows.shape
    low = rows[..., :hd // 2]
    q = torch.stack([low & 0x0F, low >> 4], -1).reshape(*lead, hd)
    at = hd // 2
    if bits == 5:
        high = rows[..., at:at + hd // 8]
        q = q | ((high[..., None] >> torch.arange(8, dtype=torch.uint8, device=rows.device)) & 1).reshape(*lead, hd) << 4
        at += hd // 8
    params = rows[..., at:].contiguous().view(torch.float16).float().reshape(*lead, hd // g, 2)
    return hadamard((q.reshape(*lead, hd // g, g).float() * params[..., :1] + params[..., 1:]).reshape(*lead, hd))


def quantize_rows(x: torch.Tensor, dtype: str, value: bool = False) -> torch.Tensor:
    """Rows x [..., d_head] (float32) -> their records [..., row_bytes] uint8 in `dtype`'s format
    ("int8" or "int4"; value: the format of value rows, which int4 groups differently)."""
    *lead, hd = x.shape
    if dtype == "int4":
        return _quantize_rotated(x, *_INT4[value])
    g = x.float().reshape(*lead, hd // 32, 32)
    d = (g.abs().amax(-1) / 127.0).half()
    df = d.float()[..., None]
    inv = torch.where(df > 0, 1.0 / df, torch.zeros_like(df))
    q = torch.round(g * inv).clamp(-127, 127).to(torch.int8).reshape(*lead, hd)
    return torch.cat([q.view(torch.uint8), _scale_bytes(d)], -1)


def dequantize_rows(rows: torch.Tensor, dtype: str, head_dim: int, value: bool = False) -> torch.Tensor:
    """`quantize_rows`' inverse (up to its rounding): records [..., row_bytes] -> float32 [..., d_head],
    in the model's space (an int4 row rotated back)."""
    if dtype == "int4":
        return _dequantize_rotated(rows, head_dim, *_INT4[value])
    *lead, _ = rows.shape
    q = rows[..., :head_dim].contiguous().view(torch.int8).float().reshape(*lead, head_dim // 32, 32)
    d = rows[..., head_dim:].contiguous().view(torch.float16).float()
    return (q * d[..., None]).reshape(*lead, head_dim)


def quantize_query(q: torch.Tensor) -> torch.Tensor:
    """Query heads q [..., d_head] as an int8 cache's attention reads them (kernels/attention.h
    `quantize_query`, the native kernels' arithmetic mirrored): each group of 32 values quantized to
    int8 codes with the scale amax / 127, as llama.cpp quantizes the activations it dots with a
    q8_0 cache, so the scores are integer dot products per group; returned as their float values
    (codes times scale) in q's dtype."""
    *lead, hd = q.shape
    g = q.float().reshape(*lead, hd // 32, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(g * inv).clamp(-127, 127)
    return (codes * (amax / 127.0)).reshape(q.shape).to(q.dtype)


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


class RowFormat:
    """How the cache stores a row (the d_head values of one token and KV head): a torch float
    dtype as it is, or a quantized record of bytes ("int8", "int4": `quantize_rows`), with the
    kernels' `kv_format` number; and how torch reads rows and queries back in that format."""

    def __init__(self, dtype: KVDtype, head_dim: int) -> None:
        dtype = parse_kv_dtype(dtype)
        check_head_dim(dtype, head_dim)
        self.dtype, self.head_dim = dtype, head_dim
        self.format = int(_FORMAT.get(dtype, KVFormat.FLOAT) if isinstance(dtype, str) else KVFormat.FLOAT)

    @property
    def quantized(self) -> bool:
        return isinstance(self.dtype, str)

    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New K/V rows [..., d_head] as the pool stores them."""
        if self.quantized:
            return quantize_rows(k, self.dtype), quantize_rows(v, self.dtype, value=True)
        return k.to(self.dtype), v.to(self.dtype)

    def load(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored rows back as `dtype` values [..., d_head]."""
        if self.quantized:
            return (dequantize_rows(k, self.dtype, self.head_dim).to(dtype),
                    dequantize_rows(v, self.dtype, self.head_dim, value=True).to(dtype))
        return k.to(dtype), v.to(dtype)

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """Query heads [..., d_head] as attention over this cache reads them: a quantized cache's
        quantized too (`quantize_query`, the kernels' integer scores; int4's in the rotated space
        its keys are stored in, then rotated back), a float cache's as they are."""
        if self.dtype == "int8":
            return quantize_query(q)
        if self.dtype == "int4":
            return hadamard(quantize_query(hadamard(q.float()))).to(q.dtype)
        return q


class KVCache:
    """K/V blocks for every layer, plus the block table of the batch being run (if any)."""

    def __init__(self, n_layer: int, n_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: KVDtype = torch.float32, device: torch.device | str = "cpu",
                 use_kernel: bool | None = None, sliding: list[bool] | None = None,
                 n_local_blocks: int = 0) -> None:
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {n_blocks} x {block_size}")
        self.row_format = RowFormat(dtype, head_dim)
        dtype = self.row_format.dtype
        # Split (a pool's sliding-window layers in blocks of their own): layer l's K/V are
        # (local, index) = self.store[l] of self.k (full layers) or self.k_local (sliding layers).
        split = bool(n_local_blocks) and sliding is not None and any(sliding) and not all(sliding)
        if split and (len(sliding) != n_layer or n_local_blocks < 1):
            raise ValueError(f"a split pool needs one sliding flag per layer ({n_layer}) and local blocks")
        flags = list(sliding) if split else [False] * n_layer
        self.store = [(f, flags[:l].count(f)) for l, f in enumerate(flags)]
        kb, vb = row_bytes(dtype, head_dim)

        def zeros(layers: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
            # zeros, not empty: the memory is committed at start-up, so an over-large budget fails now.
            shape = (layers, blocks, n_kv_heads, block_size)
            if isinstance(dtype, str):
                return (torch.zeros(*shape, kb, dtype=torch.uint8, device=device),
                        torch.zeros(*shape, vb, dtype=torch.uint8, device=device))
            return (torch.zeros(*shape, head_dim, dtype=dtype, device=device),
                    torch.zeros(*shape, head_dim, dtype=dtype, device=device))

        self.k, self.v = zeros(flags.count(False), n_blocks)
        self.k_local, self.v_local = zeros(flags.count(True), n_local_blocks) if split else (None, None)
        self.local_table: torch.Tensor | None = None  # a split pool's sliding layers' block table
        if use_kernel is None:
            use_kernel = (self.k.device.type == "cpu" and dtype in (torch.float32, torch.float16, *QUANTIZED)
                          and kernels.native_available())
        self.use_kernel = use_kernel
        self.block_table: torch.Tensor | None = None  # [S, max_blocks] int64, S sequences this forward
        self.seq_index: torch.Tensor | None = None  # [N] int64, row of block_table per token
        # A sliding window with attention sinks (`set_window`; block-table forwards only): 0, no window.
        self.window, self.sinks = 0, 0
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def pool(cls, config: ModelConfig, n_blocks: int, block_size: int = 16, dtype: KVDtype = torch.float32,
             device: torch.device | str = "cpu", use_kernel: bool | None = None,
             n_local_blocks: int = 0) -> "KVCache":
        """A pool of `n_blocks` blocks of `block_size` slots for `config`'s layers and heads.
        n_local_blocks: a model's sliding-window layers (`ModelConfig.sliding`) keep their K/V in
        a pool of that many blocks of their own (`split`), which a sequence holds only for its
        window's positions (engine/scheduler.py gives back the blocks behind it)."""
        sliding = [config.sliding(l) for l in range(config.n_layer)]
        return cls(config.n_layer, n_blocks, block_size, config.n_kv_heads, config.head_dim, dtype, device,
                   use_kernel, sliding, n_local_blocks)

    @classmethod
    def contiguous(cls, config: ModelConfig, batch_size: int, capacity: int | None = None,
                   dtype: KVDtype = torch.float32, device: torch.device | str = "cpu") -> "KVCache":
        """The textbook cache `[n_layer, batch_size, H_kv, capacity, d_head]`: one block a row."""
        capacity = config.max_seq_len if capacity is None else capacity
        if not 0 < capacity <= config.max_seq_len:
            raise ValueError(f"cache capacity must be in 1..{config.max_seq_len}, got {capacity}")
        return cls.pool(config, batch_size, capacity, dtype, device)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: KVDtype = torch.float32,
                        layers: int | None = None) -> int:
        """layers (default n_layer) * H_kv * block_size * (bytes of a key row + of a value row)."""
        layers = config.n_layer if layers is None else layers
        return layers * config.n_kv_heads * block_size * sum(row_bytes(parse_kv_dtype(dtype), config.head_dim))

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
    def dtype(self) -> KVDtype:
        """The cached elements' type: a torch float dtype, or "int8" / "int4"."""
        return self.row_format.dtype

    @property
    def quantized(self) -> bool:
        return self.row_format.quantized

    @property
    def format(self) -> int:
        """The kernels' kv_format number of the rows (`layout.KVFormat`)."""
        return self.row_format.format

    @property
    def bytes_per_token(self) -> int:
        """The bytes a token of context adds: n_layer * H_kv * (bytes of a key row + of a value
        row), scales included; of a split pool, its full layers' only (a sequence's sliding layers
        hold `window_bytes` at most, however long it grows)."""
        n_layer, _, h_kv, _, _ = self.k.shape
        return n_layer * h_kv * (self.k.shape[-1] * self.k.element_size() + self.v.shape[-1] * self.v.element_size())

    @property
    def bytes_per_layer_token(self) -> int:
        """One layer's K and V rows of one token (H_kv heads, scales included)."""
        h_kv = self.k.shape[2]
        return h_kv * (self.k.shape[-1] * self.k.element_size() + self.v.shape[-1] * self.v.element_size())

    @property
    def split(self) -> bool:
        """Whether the sliding-window layers keep their K/V in blocks of their own (`pool`)."""
        return self.k_local is not None

    @property
    def n_local_blocks(self) -> int:
        return self.k_local.shape[1] if self.split else 0

    @property
    def local_bytes_per_block(self) -> int:
        return (self.k_local[:, 0].nbytes + self.v_local[:, 0].nbytes) if self.split else 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + (self.k_local.nbytes + self.v_local.nbytes if self.split else 0)

    def layer_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Layer `layer`'s K and V pools [n_blocks, H_kv, bs, row] and the block table a
        block-table forward reads them through."""
        local, i = self.store[layer]
        if local:
            return self.k_local[i], self.v_local[i], self.local_table
        return self.k[i], self.v[i], self.block_table

    @property
    def paged(self) -> bool:
        """Whether the next forward reads through a block table (`set_batch`) rather than by rows."""
        return self.block_table is not None

    def copy_block(self, src: int, dst: int, local: bool = False) -> None:
        """Copy one block's K/V in every layer (copy-on-write of a shared block); local: a block
        of a split pool's sliding layers."""
        k, v = (self.k_local, self.v_local) if local else (self.k, self.v)
        k[:, dst].copy_(k[:, src])
        v[:, dst].copy_(v[:, src])

    # -- by rows: the contiguous cache's textbook path ------------------------------------------

    def rows(self, b0: int, b1: int) -> "KVCache":
        """Rows (blocks) b0 .. b1 - 1 as a cache of their own over this one's storage: what is
        written there lands here."""
        view = KVCache.__new__(KVCache)
        view.__dict__.update(self.__dict__)
        assert not self.split, "a split pool has no rows"
        view.k, view.v = self.k[:, b0:b1], self.v[:, b0:b1]
        view.block_table, view.seq_index = None, None
        return view

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """Query heads as attention over this cache reads them (`RowFormat.query`)."""
        return self.row_format.query(q)

    def update(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `k`, `v` ([B, H_kv, T, d_head]) at `input_pos` ([B, T]) of rows 0 .. B-1, in place.

        Returns views of slots `0 .. kv_len - 1` of this layer: ([B, H_kv, kv_len, d_head]) * 2.
        """
        assert not self.split, "a split pool is read through block tables"
        B = k.shape[0]
        k_rows, v_rows = self.row_format.store(k, v)
        k_layer, v_layer = self.k[layer, :B], self.v[layer, :B]
        k_layer.scatter_(2, input_pos[:, None, :, None].expand_as(k_rows), k_rows)
        v_layer.scatter_(2, input_pos[:, None, :, None].expand_as(v_rows), v_rows)
        k_out, v_out = k_layer[:, :, :kv_len], v_layer[:, :, :kv_len]
        if k_out.dtype != k.dtype:  # a narrower cache: stored narrow (or quantized), attended in the model's dtype
            return self.row_format.load(k_out, v_out, k.dtype)
        return k_out, v_out

    # -- through a block table ----------------------------------------------------------------------

    def set_window(self, window: int, sinks: int, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """From now on a block-table forward's query at position p reads only the first `sinks`
        slots and the last `window` (p - window + 1 .. p), as StreamingLLM's cache of sinks +
        window slots: keys keep the rotation of their own positions (the window's are then at
        their true distances), and the sink keys are scored with the query rotated back to the end
        of that cache (by p - (sinks + window - 1) positions, with the model's RoPE tables `rope`
        = (cos, sin) [max_T, d_head]), so no distance exceeds sinks + window. window 0: off."""
        if window < 0 or sinks < 0 or (window and rope is None):
            raise ValueError("a KV window needs window >= 1, sinks >= 0 and the model's RoPE tables")
        self.window, self.sinks, self.rope = window, sinks, rope if window else None

    def set_batch(self, block_table: torch.Tensor | None, seq_index: torch.Tensor | None,
                  local_table: torch.Tensor | None = None) -> None:
        """The next forward's layout: block_table [S, max_blocks] (a row per sequence, unused
        entries 0), seq_index [N] (the row of each of the N flattened tokens), and a split pool's
        sliding layers' table of the same shape (`local_table`); None, None goes back to rows."""
        if self.split and block_table is not None and (local_table is None or local_table.shape != block_table.shape):
            raise ValueError("a split pool's forward needs its sliding layers' block table, shaped as the other")
        self.block_table, self.seq_index, self.local_table = block_table, seq_index, local_table

    def attend(self, layer: int, input_pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, window: int = 0) -> torch.Tensor:
        """Write the new K/V, then attend each token to its own sequence's positions 0..pos
        (window > 0, a sliding-window layer's: only pos - window + 1 .. pos).

        input_pos [1, N]; q [1, H, N, d_head]; k, v [1, H_kv, N, d_head]. Returns [1, H, N, d_head].
        """
        assert q.shape[0] == 1, "a block-table forward takes a flattened batch: [1, N] tokens"
        if window and self.window:
            raise ValueError("a model with sliding-window layers runs without the cache's own window (kv_window)")
        pos = input_pos[0]
        q3, k3, v3 = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))  # [N, heads, d_head]
        if self.use_kernel and q3.dtype == torch.float32:
            win, sinks, (cos, sin) = self.window, self.sinks, self.rope if self.window else (None, None)
            if window:  # the kernel's window without sinks: its RoPE tables are never read, only sized
                win, sinks, cos, sin = window, 0, *self._unread_rope(int(pos.max()) + 1, q.shape[-1])
            k_pool, v_pool, table = self.layer_pools(layer)
            y = torch.ops.arlm.paged_attention(q3, k3, v3, k_pool, v_pool, table, self.seq_index,
                                               pos.contiguous(), q.shape[-1] ** -0.5, self.format, win, sinks,
                                               cos, sin)
        else:
            y = self._attend_torch(layer, pos, q3, k3, v3, window)
        return y.transpose(0, 1).unsqueeze(0)

    def _unread_rope(self, positions: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero cos/sin tables of at least `positions` rows (grown by doubling), for the kernel's
        check: a window without sinks rotates nothing."""
        table = getattr(self, "_zero_rope", None)
        if table is None or table.shape[0] < positions or table.shape[1] != d:
            table = torch.zeros(max(positions, 2 * (table.shape[0] if table is not None else 1024)), d)
            self._zero_rope = table
        return table, table

    def _attend_torch(self, layer: int, pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, window: int = 0) -> torch.Tensor:
        """Reference path (any device and dtype): scatter, gather each token's keys, SDPA."""
        bs = self.block_size
        k_pool, v_pool, table = self.layer_pools(layer)  # [n_blocks, H_kv, bs, row] * 2, [S, max_blocks]
        table = table[self.seq_index]  # [N, max_blocks]
        rows = torch.arange(len(pos), device=pos.device)
        blocks = table[rows, pos // bs]
        k_rows, v_rows = self.row_format.store(k, v)
        k_pool[blocks, :, pos % bs] = k_rows
        v_pool[blocks, :, pos % bs] = v_rows
        n = int(pos.max()) // bs + 1  # blocks the longest query reads
        N, H_kv, d = k.shape
        # [N, H_kv, n*bs, d], widened to q's dtype where the pool is narrower (or quantized)
        keys, values = (pool[table[:, :n]].transpose(1, 2).reshape(N, H_kv, n * bs, -1) for pool in (k_pool, v_pool))
        keys, values = self.row_format.load(keys, values, q.dtype)
        if self.window:
            return window_attention(pos, q, keys, values, self.window, self.sinks, self.rope, self.row_format)
        q = self.query(q)
        slots = torch.arange(n * bs, device=pos.device)[None, :]
        mask = slots <= pos[:, None]
        if window:
            mask = mask & (slots > pos[:, None] - window)
        mask = mask[:, None, None, :]
        y = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask,
                                           enable_gqa=q.shape[1] != H_kv)
        return y[:, :, 0, :]  # [N, H, d]


def window_attention(pos: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int,
                     sinks: int, rope: tuple[torch.Tensor, torch.Tensor], rows: RowFormat) -> torch.Tensor:
    """`KVCache.set_window`'s attention by its definition, torch's reference for the kernel:
    q [N, H, d] at positions pos [N], keys/values [N, H_kv, slots, d] (each query's sequence's
    slots), queries read as `rows` stores keys (`RowFormat.query`). Returns [N, H, d]."""
    W, S = window, sinks
    cos, sin = rope
    N, H, d = q.shape
    slots = torch.arange(keys.shape[2], device=pos.device)
    split = pos >= S + W  # these queries read sinks + window; the rest read 0..p
    back = torch.where(split, pos - (S + W - 1), torch.zeros_like(pos))
    c, s_ = cos[back][:, None, :], sin[back][:, None, :]  # [N, 1, d]
    a, b = q.chunk(2, dim=-1)
    # rotated back by `back` positions: (a cos + b sin, b cos - a sin)
    q_sink = torch.cat([a * c[..., : d // 2] + b * s_[..., : d // 2], b * c[..., d // 2:] - a * s_[..., d // 2:]], -1)
    q, q_sink = rows.query(q), rows.query(q_sink)  # (each quantized as the kernels do, for an int8 cache)
    rep = H // keys.shape[1]
    k, v = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)  # [N, H, slots, d]
    scores = torch.einsum("nhd,nhtd->nht", q, k)
    sink_scores = torch.einsum("nhd,nhtd->nht", q_sink, k)
    sink = (slots[None, :] < S) & split[:, None]  # [N, slots]
    scores = torch.where(sink[:, None, :], sink_scores, scores) * d ** -0.5
    visible = (slots[None, :] <= pos[:, None]) & (~split[:, None] | (slots[None, :] < S)
                                                  | (slots[None, :] > pos[:, None] - W))
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("nht,nhtd->nhd", scores.softmax(-1), v)
