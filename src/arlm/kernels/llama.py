"""The native Llama-family layer stack, bound to one model's weights.

`NativeLlama.bind(model)` collects the weights once, in the order the C++ side takes them
(`LayerWeight`, kernels/layout.py: decode.cpp's enum of the same name is generated from it), and
exposes the three calls the engine makes:

- `decode(x, cache, pos, kv_len)`: one decode step over a contiguous cache, rows in cache order
  (`torch.ops.arlm.decode_llama`);
- `forward(x, cache, pos)`: any flattened batch of tokens through the cache's block table
  (`torch.ops.arlm.forward_llama_paged`): prompt chunks, decodes, or both;
- `head(x, out)`: the final norm and the LM head (`torch.ops.arlm.llama_head`).

Both stacks do the math of `Transformer.forward` op for op (the module path is the reference,
tests/test_fused_decode.py) without ~2,000 small tensor ops per step. They apply to the
Llama-shaped families on CPU (RoPE, RMSNorm, SwiGLU or tanh-GeGLU; no biases but Qwen 2's on q,
k and v; per-head q/k norms, post norms, sliding-window layers with their own RoPE base: Qwen 3,
Gemma 3), every linear float32 or quantized (arlm.quant) with one activation mode; `bind`
returns None elsewhere and the engine runs the modules.

The kernels sit below the model in the import graph: a model and its layers are taken by what
they hold (`config`, `blocks`, a quantized layer's `tensors()`), not by their classes.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from . import native_available
from .layout import LayerWeight

# forward's "no split pool": empty sliding-layer pools (two tensors: the op writes both) and table
_NO_SPLIT = (torch.empty(0), torch.empty(0), torch.empty(0, dtype=torch.long))

# A model this binds: an arlm.model.Transformer (not imported: the kernels sit below the model,
# which calls them through its quantized layers).
Transformer = nn.Module


def architecture_supported(cfg) -> bool:
    """Whether decode.cpp computes this ModelConfig's layers (its `Arch` and `LayerWeight`'s
    extras): GPT-2's learned positions, LayerNorm, GELU MLP and biases are the module path's."""
    return (cfg.pos_embedding == "rope" and cfg.norm == "rmsnorm" and not cfg.bias
            and (cfg.mlp == "swiglu" or cfg.mlp == "geglu" and cfg.gelu_approximate == "tanh"))


def applies(model: Transformer) -> bool:
    """Whether the native stack can run this model at all (architecture, device, kernels built)."""
    return architecture_supported(model.config) and not (
        model.training or model.rope_cos.device.type != "cpu" or os.environ.get("ARLM_NO_FUSED")
        or not native_available())


def norm_weight(norm: nn.Module) -> torch.Tensor:
    """An RMSNorm's weight as the kernels multiply by it: Gemma's (1 + w) formed here, in float32
    as its module does (`model.RMSNorm`)."""
    w = norm.weight.detach()
    return 1.0 + w.float() if getattr(norm, "plus_one", False) else w


def linear_weights(layer: torch.nn.Module, dense: bool = False,
                   bias: bool = False) -> tuple[list[torch.Tensor], bool] | None:
    """A linear layer as the kernels take it, [w, scale, mins], and whether it wants 8-bit
    activations; None for a layer they cannot run (other dtypes; a bias, unless `bias`: the
    caller adds it). A quantized layer (`quant.QuantizedLinear`) is one with `tensors()`, its
    weight in its current layout. dense: a quantized layer's dense copy for the prompt
    (`QuantizedLinear.dense_weight`, float32 or bfloat16)."""
    none = torch.empty(0)
    if layer.bias is not None and not bias:
        return None
    if dense:
        w = getattr(layer, "dense_weight", None)
        if w is None or w.dtype not in (torch.float32, torch.bfloat16):
            return None
        return [w.contiguous(), none, none], False
    if callable(getattr(layer, "tensors", None)):  # in its layout, packed or rows
        if getattr(layer, "packed_only", False) and not (layer.packed and layer.int8_activations):
            return None  # (quant.PackedOnlyLinear: its one layout, read with 8-bit activations only)
        w = list(layer.tensors())
        return w + [none] * (3 - len(w)), layer.int8_activations
    if type(layer) is torch.nn.Linear and layer.weight.dtype == torch.float32:
        return [layer.weight.detach().contiguous(), none, none], False
    return None


def layer_weights(model: Transformer, dense: bool = False) -> tuple[list[torch.Tensor], bool, int] | None:
    """Every layer's weights laid out as `LayerWeight` says, whether the stack runs with 8-bit
    activations, and the residual mask: bit 1 << slot for each linear whose 8-bit activations are
    taken twice (`QuantizedLinear.residual_activations`); None where the kernels cannot take them
    (float32 norms, one activation mode, one residual choice per linear across the layers).
    dense: the quantized layers' dense copies instead (`linear_weights`), float activations."""
    weights: list[torch.Tensor] = []
    a8: set[bool] = set()
    masks: set[int] = set()
    none = torch.empty(0)
    for block in model.blocks:
        norms = {LayerWeight.ATTN_NORM: block.attn_norm, LayerWeight.MLP_NORM: block.mlp_norm}
        if hasattr(block.attn, "q_norm"):
            norms |= {LayerWeight.Q_NORM: block.attn.q_norm, LayerWeight.K_NORM: block.attn.k_norm}
        if hasattr(block, "attn_post_norm"):
            norms |= {LayerWeight.ATTN_POST_NORM: block.attn_post_norm, LayerWeight.MLP_POST_NORM: block.mlp_post_norm}
        if any(n.weight.dtype != torch.float32 for n in norms.values()):
            return None
        layer: list[torch.Tensor | None] = [none] * LayerWeight.COUNT
        mask = 0
        for slot, norm in norms.items():
            layer[slot] = norm_weight(norm).contiguous()
        bias = block.attn.wqkv.bias
        if bias is not None:
            layer[LayerWeight.QKV_BIAS] = bias.detach().float().contiguous()
        # a fused projection held in parts (quant.SplitLinear): the first part in its slot, the
        # others in theirs
        rest = {LayerWeight.WQKV: (LayerWeight.WK, LayerWeight.WV), LayerWeight.GATE_UP: (LayerWeight.UP,)}
        linears = []
        for slot, linear in ((LayerWeight.WQKV, block.attn.wqkv), (LayerWeight.WO, block.attn.wo),
                             (LayerWeight.GATE_UP, block.mlp.gate_up), (LayerWeight.DOWN, block.mlp.down)):
            parts = list(getattr(linear, "parts", ()))
            if not parts:
                linears.append((slot, slot, linear, slot == LayerWeight.WQKV))
            elif dense or len(parts) != 1 + len(rest.get(slot, ())):
                return None
            else:
                linears += [(s, slot, p, False) for s, p in zip((slot, *rest[slot]), parts)]
        for slot, projection, linear, with_bias in linears:
            native = linear_weights(linear, dense, bias=with_bias)
            if native is None:
                return None
            layer[slot:slot + 3] = native[0]
            if native[0][1].numel():  # float32 layers run in either mode
                a8.add(native[1])
            if getattr(linear, "residual_activations", False) and not dense:
                mask |= 1 << projection  # (a projection's parts take their activations alike)
        masks.add(mask)
        weights.extend(layer)  # type: ignore[arg-type]
    if len(a8) > 1 or len(masks) > 1:
        return None
    return weights, a8 == {True}, masks.pop() if masks else 0


class NativeLlama:
    """A model's layer stack and head as native calls; see the module docstring."""

    def __init__(self, model: Transformer, weights: list[torch.Tensor], a8: bool,
                 head: tuple[list[torch.Tensor], bool] | None, residual: int = 0) -> None:
        self.model, self.weights, self.a8, self.residual = model, weights, a8, residual
        cfg = model.config
        self.n_head, self.n_kv_heads, self.eps = cfg.n_head, cfg.n_kv_heads, cfg.norm_eps
        # decode.cpp's Arch: the MLP's gate, the queries' scale, each layer's window and RoPE tables
        self.geglu = cfg.mlp == "geglu"
        self.q_scale = model.blocks[0].attn.q_scale or 1.0
        self.windows = [cfg.sliding_window if cfg.sliding(i) else 0 for i in range(cfg.n_layer)]
        if not any(self.windows):
            self.windows = []
        self.embed_scale = torch.tensor(cfg.d_model ** 0.5) if cfg.embed_scale else None
        emb = getattr(model.tok_emb, "weight", None)  # None: gathered from quantized rows (quant.QuantizedEmbedding)
        self.emb = emb.detach() if isinstance(emb, torch.Tensor) else None
        self._head = head
        self._norm = norm_weight(model.norm).contiguous()
        # the layers' dense copies (float32 or bf16, `--matmul-path bf16|float32`) for prompt tokens.
        # The head stays quantized (8-bit activations twice): more faithful than its bf16 copy
        # (KL to float32 over every position 8.5e-5 vs 1.35e-4, docs/benchmarks.md), and a prompt
        # pass sends only its last token there.
        self.dense_weights: list[torch.Tensor] | None = None

    @classmethod
    def bind(cls, model: Transformer) -> "NativeLlama | None":
        """The native stack over `model`'s weights as they are now (re-quantizing the model later
        needs a new binding), or None where it does not apply."""
        if not applies(model):
            return None
        layers = layer_weights(model)
        if layers is None:
            return None
        head = linear_weights(model.lm_head)
        if model.norm.weight.dtype != torch.float32:
            head = None
        native = cls(model, layers[0], layers[1], head, layers[2])
        dense = layer_weights(model, dense=True)
        if dense is not None and dense[0] is not None:
            native.dense_weights = dense[0]
        return native

    def embed(self, tokens: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings [N, d] float32 for ids [N] (a fresh tensor, or `out`; times
        sqrt(d_model) where the model scales them): the stacks run in place on them."""
        if self.emb is not None and self.emb.dtype == torch.float32:
            x = torch.index_select(self.emb, 0, tokens) if out is None else \
                torch.index_select(self.emb, 0, tokens, out=out)
        else:
            x = self.model.tok_emb(tokens).float()
            x = x.contiguous() if out is None else out.copy_(x)
        return x if self.embed_scale is None else x.mul_(self.embed_scale)

    def _rope_rows_for(self, pos: torch.Tensor) -> None:
        """The model's RoPE table rows computed up to these positions (`Transformer.ensure_rope`)."""
        m = self.model
        if getattr(m, "_rope_rows", 0) < m.rope_cos.shape[0] and pos.numel():
            m.ensure_rope(int(pos.max()) + 1)

    def _arch(self) -> tuple:
        """decode.cpp's Arch arguments: geglu, q_scale, windows, local cos and sin (or empty)."""
        m = self.model
        local = (m.rope_local_cos, m.rope_local_sin) if self.windows and m._local_rope else (torch.empty(0),) * 2
        return (self.geglu, self.q_scale, self.windows, *local)

    def decode(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, kv_len: int,
               kv_format: int = 0) -> None:
        """One decode step in place on x [B, d]: row b at position pos[b] over rows b of the
        contiguous cache k, v [L, B, H_kv, T, row] (kv_format: `KVCache.format`); attention reads
        slots < kv_len."""
        m = self.model
        self._rope_rows_for(pos)
        torch.ops.arlm.decode_llama(x, self.weights, k, v, pos, m.rope_cos, m.rope_sin, kv_len,
                                    self.n_head, self.n_kv_heads, self.eps, self.a8, self.residual, kv_format,
                                    *self._arch())

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor,
                seq_index: torch.Tensor, pos: torch.Tensor, kv_format: int = 0, window: int = 0,
                sinks: int = 0, dense: bool = False,
                local: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """A flattened batch in place on x [N, d]: token i of sequence seq_index[i] (a row of
        block_table [S, M]) at position pos[i], K/V in the pools k, v [L, n_blocks, H_kv, bs, row]
        (kv_format: `KVCache.format`; window, sinks: `KVCache.set_window`). dense: through the
        layers' dense copies (`dense_weights`, float activations; torch's GEMMs). local: a split
        pool's sliding layers' (k, v, block table) (`KVCache.split`; then k, v hold the others)."""
        m = self.model
        weights, a8, residual = (self.dense_weights, False, 0) if dense else (self.weights, self.a8, self.residual)
        if window and self.windows:
            raise ValueError("a model with sliding-window layers runs without the cache's own window (kv_window)")
        self._rope_rows_for(pos)
        torch.ops.arlm.forward_llama_paged(x, weights, k, v, block_table, seq_index, pos, m.rope_cos,
                                           m.rope_sin, self.n_head, self.n_kv_heads, self.eps, a8,
                                           residual, kv_format, window, sinks, *self._arch(),
                                           *(local or _NO_SPLIT))

    def head(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm + LM head: hidden states [N, d] -> float32 logits [N, vocab] (into `out`).
        Natively where the head's weights allow: a float32 head streams the most bytes of a decode
        step (vocab x d_model), and the row-streaming kernel reads it at memory speed where
        F.linear's matrix-vector product does not."""
        if self._head is None:
            logits = self.model.lm_head(self.model.norm(x)).float()
            return logits if out is None else out.copy_(logits)
        weights, a8 = self._head
        out = x.new_empty(x.shape[0], self.model.config.vocab_size) if out is None else out
        residual = bool(getattr(self.model.lm_head, "residual_activations", False))
        torch.ops.arlm.llama_head(x.contiguous(), self._norm, weights, self.eps, a8, residual, out)
        return out

