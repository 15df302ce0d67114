"""One decoder-only `Transformer` for the GPT-2 and Llama families, for training and inference.

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

from .config import ModelConfig
from .kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 like the reference implementations, then cast back.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)


def rope_table(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [max_seq_len, head_dim], in the half-split ("rotate_half") layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)  # [T, d/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, d]; cos, sin: [B, T, 1, d]. Rotates pairs (i, i + d/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def project(layer: nn.Module, x: torch.Tensor, dense: bool) -> torch.Tensor:
    """layer(x); dense: a quantized layer that keeps a float copy multiplies with it instead
    (`arlm.quant.QuantizedLinear.forward`: the prompt's compute-bound GEMMs)."""
    return layer(x, dense=True) if dense and getattr(layer, "dense_weight", None) is not None else layer(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head, self.n_kv_heads, self.head_dim = config.n_head, config.n_kv_heads, config.head_dim
        d, hd = config.d_model, config.head_dim
        # One fused projection for q, k and v: one matmul (and, in decode, one weight stream)
        # instead of three; the output splits into n_head + 2 * n_kv_heads heads.
        self.wqkv = nn.Linear(d, (self.n_head + 2 * self.n_kv_heads) * hd, bias=config.bias)
        self.wo = nn.Linear(self.n_head * hd, d, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None, kv_cache: KVCache | None, input_pos: torch.Tensor | None,
                kv_len: int, dense: bool = False) -> torch.Tensor:
        B, T, _ = x.shape
        H, H_kv = self.n_head, self.n_kv_heads
        qkv = project(self.wqkv, x, dense).view(B, T, H + 2 * H_kv, self.head_dim)
        qk, v = qkv[:, :, : H + H_kv], qkv[:, :, H + H_kv:]
        if rope is not None:
            qk = apply_rope(qk, *rope)  # q and k heads rotated in one go
        q, k = qk[:, :, :H], qk[:, :, H:]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, d_head]
        if kv_cache is not None and kv_cache.paged:
            # Through a block table (the engine's flattened batches), the cache writes K/V into its
            # blocks and attends through the table in one kernel; see arlm.kv_cache.
            y = kv_cache.attend(self.layer, input_pos, q, k, v)
            return project(self.wo, y.transpose(1, 2).reshape(B, T, -1), dense)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, input_pos, k, v, kv_len)  # [B, H_kv, kv_len, d_head]
            q = kv_cache.query(q)  # (an int8 cache's integer scores: the query quantized too)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_kv_heads != self.n_head)
        return project(self.wo, y.transpose(1, 2).reshape(B, T, -1), dense)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        self.approximate = config.gelu_approximate
        if self.swiglu:  # gate and up projections fused: one matmul, split in half
            self.gate_up = nn.Linear(config.d_model, 2 * config.d_ff, bias=config.bias)
        else:
            self.up = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.down = nn.Linear(config.d_ff, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor, dense: bool = False) -> torch.Tensor:
        if self.swiglu:
            gate, up = project(self.gate_up, x, dense).chunk(2, dim=-1)
            return project(self.down, F.silu(gate) * up, dense)
        return project(self.down, F.gelu(project(self.up, x, dense), approximate=self.approximate), dense)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = make_norm(config)
        self.attn = Attention(config, layer)
        self.mlp_norm = make_norm(config)
        self.mlp = MLP(config)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, rope, mask, kv_cache, input_pos, kv_len, dense: bool = False):
        x = x + self.resid_dropout(self.attn(self.attn_norm(x), rope, mask, kv_cache, input_pos, kv_len, dense))
        return x + self.resid_dropout(self.mlp(self.mlp_norm(x), dense))


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
            # A loader without init (skip_init) sets the tables itself, on the real device.
            cos, sin = rope_table(config.head_dim, config.max_seq_len, config.rope_theta) if init else \
                (torch.empty(0), torch.empty(0))
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.emb_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = make_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

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
            part = Transformer(replace(self.config, n_layer=n_layers), init=False)
        part.tok_emb = self.tok_emb
        if self.config.pos_embedding == "learned":
            part.pos_emb = self.pos_emb
        else:
            part.rope_cos, part.rope_sin = self.rope_cos, self.rope_sin
        part.emb_dropout = self.emb_dropout
        part.blocks = nn.ModuleList(list(self.blocks)[:n_layers])
        part.norm, part.lm_head = self.norm, self.lm_head
        return part.eval()

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, kv_len: int | None = None,
                output_index: torch.Tensor | None = None, dense: bool = False) -> torch.Tensor:
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
        Returns [B, T, vocab] float logits, or [B, vocab] with output_index.
        """
        B, T = idx.shape
        if input_pos is None:
            if T > self.config.max_seq_len:
                raise ValueError(f"sequence of {T} tokens exceeds the context window ({self.config.max_seq_len})")
            input_pos = torch.arange(T, device=idx.device).expand(B, T)
        x = self.tok_emb(idx)
        if self.config.pos_embedding == "learned":
            x = x + self.pos_emb(input_pos)
            rope = None
        else:
            rope = (self.rope_cos[input_pos].unsqueeze(2), self.rope_sin[input_pos].unsqueeze(2))
        x = self.emb_dropout(x)

        mask = None  # no cache: plain causal attention within the sequence
        if kv_cache is not None and not kv_cache.paged:
            kv_len = kv_cache.capacity if kv_len is None else kv_len
            slots = torch.arange(kv_len, device=idx.device)
            mask = (slots <= input_pos[:, :, None]).unsqueeze(1)  # [B, 1, T, kv_len]

        for block in self.blocks:
            x = block(x, rope, mask, kv_cache, input_pos, kv_len, dense)
        if output_index is not None:
            x = x[torch.arange(B, device=x.device), output_index]  # [B, d_model]
        return project(self.lm_head, self.norm(x), dense).float()
