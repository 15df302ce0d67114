"""One decoder-only `Transformer` for GPT-2 and the Llama-shaped families (Llama 2/3, Qwen 2/3,
Gemma 3), for training and inference.

Training calls `model(idx)` on whole sequences (causal mask, no cache). Inference calls it twice
over: prefill with the prompt and a `KVCache`, then decode with `[B, 1]` tokens per step.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import fused
from .config import ModelConfig
from .kv_cache import KVCache


class RMSNorm(nn.Module):
    """x / rms(x) times the weight w, or times (1 + w) with plus_one (Gemma, whose weights are
    stored as the offset from 1)."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False) -> None:
        super().__init__()
        self.eps, self.plus_one = eps, plus_one
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad) \
                and x.dtype == torch.float32 and not self.plus_one:
            return fused.rms_norm(x, self.weight, self.eps)  # (training: the same values, a shorter backward)
        # Normalize in float32 like the reference implementations, then cast back (Gemma scales
        # before the cast, Llama after: each as its reference does).
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.plus_one:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def make_norm(config: ModelConfig, dim: int | None = None) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(dim or config.d_model, config.norm_eps, config.norm_plus_one)
    return nn.LayerNorm(dim or config.d_model, eps=config.norm_eps, bias=config.bias)


# RoPE table rows a CPU model computes when it is built; the rest as positions reach them
# (`Transformer.ensure_rope`).
ROPE_ROWS = 4096


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies [head_dim / 2]; `scaling` (ModelConfig.rope_scaling) divides
    them by its factors ("freq_factors": one each), by its factor ("linear"), or, "llama3", the low frequencies (wavelengths past the
    original context / low_freq_factor) by the factor, the high ones (below original /
    high_freq_factor) not at all, and the band between by a blend of the two."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "freq_factors":  # (llama.cpp's rope_freqs: one divisor per frequency)
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    blend = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: scaled, 1: as it is
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    middle = (wavelength <= original / low) & (wavelength >= original / high)
    return torch.where(middle, (1 - blend) * inv_freq / factor + blend * inv_freq, scaled)


def rope_table(head_dim: int, max_seq_len: int, theta: float,
               scaling: dict | None = None, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [max_seq_len - start, head_dim], of positions start .. max_seq_len - 1,
    in the half-split ("rotate_half") layout. A row's values do not depend on `start`."""
    inv_freq = rope_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(start, max_seq_len, dtype=torch.float32), inv_freq)  # [T, d/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, d]; cos, sin: [B, T, 1, d]. Rotates pairs (i, i + d/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def compute_weight(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The bf16 copy of `layer`'s weight that training keeps beside it (`layer.shadow`, written by
    arlm.train.optim.ShadowAdamW: what autocast would cast the weight to), where autocast multiplies
    in its dtype here; else None."""
    shadow = layer.__dict__.get("shadow")
    if shadow is None or not torch.is_autocast_enabled(x.device.type) \
            or torch.get_autocast_dtype(x.device.type) != shadow.dtype:
        return None
    return shadow


def project(layer: nn.Module, x: torch.Tensor, dense: bool) -> torch.Tensor:
    """layer(x); dense: a quantized layer that keeps a float copy multiplies with it instead
    (`arlm.quant.QuantizedLinear.forward`: the prompt's compute-bound GEMMs). A Linear with a
    training shadow (`compute_weight`) multiplies with that."""
    if dense and getattr(layer, "dense_weight", None) is not None:
        return layer(x, dense=True)
    if type(layer) is nn.Linear and (shadow := compute_weight(layer, x)) is not None:
        return F.linear(x, shadow, layer.bias)
    return layer(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head, self.n_kv_heads, self.head_dim = config.n_head, config.n_kv_heads, config.head_dim
        d, hd = config.d_model, config.head_dim
        # One fused projection for q, k and v: one matmul (and, in decode, one weight stream)
        # instead of three; the output splits into n_head + 2 * n_kv_heads heads.
        self.wqkv = nn.Linear(d, (self.n_head + 2 * self.n_kv_heads) * hd, bias=config.bias or config.qkv_bias)
        self.wo = nn.Linear(self.n_head * hd, d, bias=config.bias)
        self.dropout = config.dropout
        self.window = config.sliding_window if config.sliding(layer) else 0  # 0: every earlier position
        if config.qk_norm:  # per head, over head_dim, before RoPE
            self.q_norm, self.k_norm = make_norm(config, hd), make_norm(config, hd)
        # A score scale other than 1/sqrt(head_dim) goes into q, so that every attention path
        # (SDPA, the cache's, the paged kernel) keeps its own default
        self.q_scale = None if config.attn_scale in (None, hd ** -0.5) else config.attn_scale * hd ** 0.5

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None, kv_cache: KVCache | None, input_pos: torch.Tensor | None,
                kv_len: int, dense: bool = False) -> torch.Tensor:
        B, T, _ = x.shape
        H, H_kv = self.n_head, self.n_kv_heads
        qkv = project(self.wqkv, x, dense).view(B, T, H + 2 * H_kv, self.head_dim)
        split = fused.qkv_rope(qkv, *rope, H, H_kv) if rope is not None and not hasattr(self, "q_norm") else None
        if split is not None:  # (training: one pass each way, no split/rope/cat)
            q, k, v = split
        else:
            qk, v = qkv.split([H + H_kv, H_kv], dim=2)  # (split, not slices: one backward pass, a cat)
            if hasattr(self, "q_norm"):
                qk = torch.cat([self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])], dim=2)
            if rope is not None:  # q and k heads rotated in one go
                qk = fused.rope(qk, *rope) if torch.is_grad_enabled() and qk.requires_grad else apply_rope(qk, *rope)
            q, k = qk.split([H, H_kv], dim=2)
        if self.q_scale is not None:
            q = q * self.q_scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, d_head]
        if kv_cache is not None and kv_cache.paged:
            # Through a block table (the engine's flattened batches), the cache writes K/V into its
            # blocks and attends through the table in one kernel; see arlm.kv_cache.
            y = kv_cache.attend(self.layer, input_pos, q, k, v, window=self.window)
            return project(self.wo, y.transpose(1, 2).reshape(B, T, -1), dense)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, input_pos, k, v, kv_len)  # [B, H_kv, kv_len, d_head]
            q = kv_cache.query(q)  # (an int8 cache's integer scores: the query quantized too)
        dropout = self.dropout if self.training else 0.0
        y = fused.causal_attention(q, k, v, mask) if kv_cache is None and dropout == 0.0 else None
        if y is None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout,
                                               enable_gqa=self.n_kv_heads != self.n_head)
        return project(self.wo, y.transpose(1, 2).reshape(B, T, -1), dense)


class MLP(nn.Module):
    """GELU (GPT-2), or gated: SwiGLU (Llama: silu(gate) * up) and GeGLU (Gemma: gelu(gate) * up)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.kind = config.mlp
        self.approximate = config.gelu_approximate
        if self.kind != "gelu":  # gate and up projections fused: one matmul, split in half
            self.gate_up = nn.Linear(config.d_model, 2 * config.d_ff, bias=config.bias)
        else:
            self.up = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.down = nn.Linear(config.d_ff, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor, dense: bool = False) -> torch.Tensor:
        if self.kind == "swiglu":
            return project(self.down, fused.swiglu(project(self.gate_up, x, dense)), dense)
        if self.kind != "gelu":
            gate, up = project(self.gate_up, x, dense).chunk(2, dim=-1)
            return project(self.down, F.gelu(gate, approximate=self.approximate) * up, dense)
        return project(self.down, F.gelu(project(self.up, x, dense), approximate=self.approximate), dense)


def add_norm(x: torch.Tensor, h: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, norm(x + h)): a residual add and the norm after it, in one pass each way where
    training's native pass serves (arlm.fused.add_rms_norm), else as written."""
    if isinstance(norm, RMSNorm) and not norm.plus_one:
        both = fused.add_rms_norm(x, h, norm.weight, norm.eps)
        if both is not None:
            return both
    x = x + h
    return x, norm(x)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = make_norm(config)
        self.attn = Attention(config, layer)
        self.mlp_norm = make_norm(config)
        self.mlp = MLP(config)
        self.resid_dropout = nn.Dropout(config.dropout)
        if config.post_norms:  # Gemma's "sandwich": each branch's output normed before its residual add
            self.attn_post_norm, self.mlp_post_norm = make_norm(config), make_norm(config)

    def forward(self, x, rope, mask, kv_cache, input_pos, kv_len, dense: bool = False,
                residual: torch.Tensor | None = None, defer: bool = False):
        """x [B, T, d_model] -> the block's output. residual: the previous block's MLP output, not
        yet added to x (this block adds it in its first norm's pass); defer: return (x, h) with
        this block's MLP output h not added either (training: `Transformer.forward`)."""
        if residual is None:
            normed = self.attn_norm(x)
        else:
            x, normed = add_norm(x, residual, self.attn_norm)
        h = self.attn(normed, rope, mask, kv_cache, input_pos, kv_len, dense)
        if hasattr(self, "attn_post_norm"):
            h = self.attn_post_norm(h)
        x, normed = add_norm(x, self.resid_dropout(h), self.mlp_norm)
        h = self.mlp(normed, dense)
        if hasattr(self, "mlp_post_norm"):
            h = self.mlp_post_norm(h)
        h = self.resid_dropout(h)
        return (x, h) if defer else x + h


@contextmanager
def skip_init():
    """Modules built inside this block get no random init (their weights stay as allocated), for
    loaders that overwrite every weight: on the meta device, torch's init functions would import
    its compiler stack (~2 s) to do nothing useful. Not thread-safe: it swaps torch.nn.init's
    functions for the block's duration, as HF transformers' no_init_weights does."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_", "trunc_normal_")
    saved = {n: getattr(nn.init, n) for n in names}
    for n in names:
        setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, init: bool = True) -> None:
        """init=False: no random init (see `skip_init`), for a loader that sets every weight."""
        super().__init__()
        with nullcontext() if init else skip_init():
            self._build(config, init)
        if init:
            self._init_all()

    def _build(self, config: ModelConfig, init: bool) -> None:
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        if config.pos_embedding == "learned":
            self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        else:
            # A loader without init (skip_init) sets the tables itself (`set_rope_tables`), on the real device.
            for name in ("rope_cos", "rope_sin") + (("rope_local_cos", "rope_local_sin") if self._local_rope else ()):
                self.register_buffer(name, torch.empty(0), persistent=False)
            if init:
                self.set_rope_tables()
        self.emb_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = make_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    @property
    def _local_rope(self) -> bool:
        """Whether sliding layers rotate with tables of their own (a base of their own)."""
        c = self.config
        return "sliding" in (c.layer_types or ()) and c.rope_local_theta not in (None, c.rope_theta)

    def set_rope_tables(self, device: torch.device | str = "cpu", positions: int | None = None) -> None:
        """RoPE's cos/sin tables for `positions` rows (default: the context): the full layers'
        (rope_theta, rope_scaling) and, where sliding layers have a base of their own, theirs
        (rope_local_theta, unscaled). A longer table's first rows are a shorter one's.

        On CPU only the first ROPE_ROWS rows are computed now, the rest as positions reach them
        (`ensure_rope`, in place: the tensors stay the same objects); a row not yet computed is
        memory never touched, so a long context's tables (Gemma 3's 32,768 positions: 134 MB)
        cost what is used. Elsewhere every row is computed at once."""
        c = self.config
        n = positions or c.max_seq_len
        names = ("rope_cos", "rope_sin") + (("rope_local_cos", "rope_local_sin") if self._local_rope else ())
        for name in names:
            setattr(self, name, torch.empty(n, c.head_dim, device=device))
        self._rope_rows = 0
        self.ensure_rope(n if torch.device(device).type != "cpu" else min(n, ROPE_ROWS))

    def ensure_rope(self, positions: int) -> None:
        """The RoPE tables' rows computed up to `positions` (at least doubling what is, at most the
        tables' length), in place."""
        filled, n = getattr(self, "_rope_rows", 0), self.rope_cos.shape[0]
        if positions <= filled or filled >= n:
            return
        stop = min(n, max(positions, 2 * filled))
        c = self.config
        tables = [((self.rope_cos, self.rope_sin), c.rope_theta, c.rope_scaling)]
        if self._local_rope:
            tables.append(((self.rope_local_cos, self.rope_local_sin), c.rope_local_theta, None))
        for (cos, sin), theta, scaling in tables:
            rows_cos, rows_sin = rope_table(c.head_dim, stop, theta, scaling, start=filled)
            cos[filled:stop] = rows_cos
            sin[filled:stop] = rows_sin
        self._rope_rows = stop

    def _apply(self, fn, recurse: bool = True):
        # tables leaving the CPU take every row with them (ensure_rope computes rows on demand on CPU only)
        out = super()._apply(fn, recurse)
        cos = getattr(self, "rope_cos", None)
        if cos is not None and cos.numel() and cos.device.type not in ("cpu", "meta"):
            self.ensure_rope(cos.shape[0])
        return out

    def _init_all(self) -> None:
        config = self.config
        self.apply(self._init_weights)
        # GPT-2's scaled init: each residual branch adds to the stream, so shrink the projections
        # that write into it by 1/sqrt(2 * n_layer) to keep the stream's variance flat with depth.
        for name, p in self.named_parameters():
            if name.endswith("attn.wo.weight") or name.endswith("mlp.down.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def first_layers(self, n_layers: int) -> "Transformer":
        """This model's first `n_layers` layers, final norm and LM head as a model of its own,
        sharing this one's modules (no copy: its weights, quantized or not, are these): the
        speculative self-draft, where no smaller draft model exists (arlm.engine.speculative)."""
        if not 1 <= n_layers < self.config.n_layer:
            raise ValueError(f"a self-draft takes 1..{self.config.n_layer - 1} of the target's "
                             f"{self.config.n_layer} layers, got {n_layers}")
        with torch.device("meta"):  # (every module and buffer built here is replaced by this model's)
            types = self.config.layer_types
            part = Transformer(replace(self.config, n_layer=n_layers, layer_types=types[:n_layers] if types else None),
                               init=False)
        part.tok_emb = self.tok_emb
        if self.config.pos_embedding == "learned":
            part.pos_emb = self.pos_emb
        else:
            part.rope_cos, part.rope_sin = self.rope_cos, self.rope_sin
            if self._local_rope:
                part.rope_local_cos, part.rope_local_sin = self.rope_local_cos, self.rope_local_sin
            part._rope_rows = getattr(self, "_rope_rows", 0)  # (the same tensors: rows either fills serve both)
        part.emb_dropout = self.emb_dropout
        part.blocks = nn.ModuleList(list(self.blocks)[:n_layers])
        part.norm, part.lm_head = self.norm, self.lm_head
        return part.eval()

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, kv_len: int | None = None,
                output_index: torch.Tensor | None = None, dense: bool = False,
                hidden_index: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                head: bool = True) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits for token ids `idx` [B, T].

        input_pos: [B, T] position of each token in its row (default 0 .. T-1 for every row).
        kv_cache: if given, the new K/V are written at `input_pos` and each query attends to the
            slots of its own row at positions <= its own. kv_len bounds the slots read (default:
            the whole capacity); it must exceed every position in `input_pos`.
        output_index: [B] index into T per row; if given, only those positions reach the LM head
            and the result is [B, vocab] (prefill needs just the last prompt token's logits). With
            B == 1 it may be [K]: K positions of the one row, [K, vocab] (a flattened batch of
            many sequences, as the paged cache takes).
        dense: quantized layers that keep a float copy multiply with it (arlm.quant; the
            engine's prompt tokens on the bf16 / float32 matrix paths).
        hidden_index: [K] positions of a one-row batch whose final normed hidden states [K, d_model]
            (float32) come back too, as (logits, hidden) (embedding requests: arlm.engine).
        doc_ids: [B, T] the document each token belongs to, without a cache (training rows that
            pack several conversations): a token attends only to its own document's tokens at
            positions <= its own, so `input_pos` must count from 0 within each document.
        head: False returns the final normed hidden states [B, T, d_model] instead of logits
            (training multiplies them into the LM head and the loss together: arlm.train.loss).
        Returns [B, T, vocab] float logits, or [B, vocab] with output_index.
        """
        B, T = idx.shape
        if input_pos is None:
            if T > self.config.max_seq_len:
                raise ValueError(f"sequence of {T} tokens exceeds the context window ({self.config.max_seq_len})")
            input_pos = torch.arange(T, device=idx.device).expand(B, T)
        cfg = self.config
        if cfg.pos_embedding == "rope" and not torch.compiler.is_compiling() \
                and getattr(self, "_rope_rows", 0) < self.rope_cos.shape[0]:  # (CPU tables, filled on demand)
            self.ensure_rope(int(input_pos.max()) + 1)
        x = self.tok_emb(idx)
        if cfg.embed_scale:  # (the factor rounded to the activations' dtype, as Gemma's reference does)
            x = x * torch.tensor(cfg.d_model ** 0.5, dtype=x.dtype)
        if cfg.pos_embedding == "learned":
            x = x + self.pos_emb(input_pos)
            rope = local_rope = None
        else:
            rope = local_rope = (self.rope_cos[input_pos].unsqueeze(2), self.rope_sin[input_pos].unsqueeze(2))
            if self._local_rope:
                local_rope = (self.rope_local_cos[input_pos].unsqueeze(2), self.rope_local_sin[input_pos].unsqueeze(2))
        x = self.emb_dropout(x)

        # Which earlier positions each query reads: None is plain causal attention within the
        # sequence (no cache); a cache's slots up to each query's position; a sliding layer's
        # only its last `sliding_window` positions, itself included.
        # A packed row's documents add a block-diagonal mask: each query reads its own document only.
        mask = local_mask = None
        if kv_cache is not None and not kv_cache.paged:
            kv_len = kv_cache.capacity if kv_len is None else kv_len
            slots = torch.arange(kv_len, device=idx.device)
            mask = (slots <= input_pos[:, :, None]).unsqueeze(1)  # [B, 1, T, kv_len]
            if cfg.sliding_window:
                local_mask = mask & (slots > input_pos[:, :, None] - cfg.sliding_window).unsqueeze(1)
        elif kv_cache is None and (cfg.sliding_window or doc_ids is not None):
            pos = input_pos[:, :, None]
            visible = input_pos[:, None, :] <= pos  # [B, T, T]: key position <= query position
            if doc_ids is not None:
                visible = visible & (doc_ids[:, None, :] == doc_ids[:, :, None])
                mask = visible.unsqueeze(1)
            if cfg.sliding_window:
                local_mask = (visible & (input_pos[:, None, :] > pos - cfg.sliding_window)).unsqueeze(1)

        # Training adds each block's MLP output in the next norm's pass (add_norm), not on its own.
        defer = kv_cache is None and torch.is_grad_enabled() and isinstance(self.norm, RMSNorm) \
            and not self.norm.plus_one and fused.native(x)
        residual = None
        for i, block in enumerate(self.blocks):
            sliding = cfg.sliding(i)
            out = block(x, local_rope if sliding else rope, local_mask if sliding else mask, kv_cache, input_pos,
                        kv_len, dense, residual=residual, defer=defer)
            x, residual = out if defer else (out, None)
        if residual is not None:
            if not head:
                return add_norm(x, residual, self.norm)[1]
            x = x + residual
        if not head:
            return self.norm(x)
        h = self.norm(x[0, hidden_index]).float() if hidden_index is not None else None
        if output_index is not None:
            x = x[torch.arange(B, device=x.device), output_index]  # [B, d_model]
        logits = project(self.lm_head, self.norm(x), dense).float()
        return logits if h is None else (logits, h)
