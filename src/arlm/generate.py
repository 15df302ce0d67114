"""Two-phase generation over token ids: one parallel prefill, then one token per row per step.

The engine knows nothing about text. `prefill` and `decode_step` are plain functions over a
preallocated `KVCache` (so either can be compiled on its own); `Generation` drives them for a
batch of ragged prompts and yields each step's new tokens; `generate` runs it to the end.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .kv_cache import KVCache
from .model import Transformer
from .quant import dense_weights
from .sampling import SamplingParams, sample, sample_rows

# Why a row stopped. The OpenAI-style "stop"/"length" pair loses which limit was hit, so the
# engine keeps four reasons and the HTTP edge maps eos/stop -> "stop", length/context -> "length".
EOS, STOP, LENGTH, CONTEXT = "eos", "stop", "length", "context"


def prefill(model: Transformer, cache: KVCache, tokens: torch.Tensor, input_pos: torch.Tensor,
            last_index: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Run prompts [B, P] (right-padded) at positions [B, P] through the model in one pass.

    Writes every prompt token's K/V into `cache`; returns the logits [B, vocab] at `last_index`
    [B], each row's last real prompt token. Quantized layers use their float weights here: many
    rows per weight make prefill compute-bound, where float GEMMs are fastest.
    """
    with dense_weights():
        return model(tokens, input_pos, kv_cache=cache, kv_len=kv_len, output_index=last_index)


def decode_step(model: Transformer, cache: KVCache, tokens: torch.Tensor, input_pos: torch.Tensor,
                kv_len: int) -> torch.Tensor:
    """One token per row: tokens [B, 1] at input_pos [B, 1] -> next-token logits [B, vocab]."""
    return model(tokens, input_pos, kv_cache=cache, kv_len=kv_len)[:, -1]


def _native_applies(model: Transformer) -> bool:
    from . import kernels

    cfg = model.config
    return not (cfg.pos_embedding != "rope" or cfg.norm != "rmsnorm" or cfg.mlp != "swiglu" or cfg.bias
                or model.training or model.rope_cos.device.type != "cpu" or os.environ.get("ARLM_NO_FUSED")
                or not kernels.native_available())


def _native_linear(layer: torch.nn.Module) -> tuple[list[torch.Tensor], bool] | None:
    """A linear layer as the native kernels take it, (w, scale, mins), and whether it wants 8-bit
    activations; None for a layer they cannot run (biases, other dtypes)."""
    from .quant import Int8Linear, Q4Linear

    none = torch.empty(0)
    if isinstance(layer, Q4Linear) and layer.bias is None:  # packed layout where it has one (quant.py)
        packed = layer.int8_activations and layer.packed is not None
        return list(layer.packed) if packed else [layer.weight, layer.scale, layer.mins], layer.int8_activations
    if isinstance(layer, Int8Linear) and layer.bias is None:
        packed = layer.int8_activations and layer.packed is not None
        return [layer.packed if packed else layer.weight, layer.scale, none], layer.int8_activations
    if type(layer) is torch.nn.Linear and layer.bias is None and layer.weight.dtype == torch.float32:
        return [layer.weight.detach().contiguous(), none, none], False
    return None


def native_layers(model: Transformer) -> tuple[list[torch.Tensor], bool] | None:
    """The weights of the layer stack in the order the native kernels take them (arlm/kernels/
    decode.cpp: 14 tensors a layer) and the activation mode, or None where they do not apply.

    Applies to: RoPE + RMSNorm + SwiGLU without biases, float32 norms, every linear float32 or
    quantized (arlm.quant) with one activation mode, on CPU with the native kernels built.
    """
    if not _native_applies(model):
        return None
    weights: list[torch.Tensor] = []
    a8: set[bool] = set()

    def linear(layer: torch.nn.Module) -> bool:
        native = _native_linear(layer)
        if native is None:
            return False
        weights.extend(native[0])
        if native[0][1].numel():  # float32 layers run in either mode
            a8.add(native[1])
        return True

    for block in model.blocks:
        norms = (block.attn_norm.weight, block.mlp_norm.weight)
        if any(w.dtype != torch.float32 for w in norms):
            return None
        weights.append(norms[0].detach())
        if not (linear(block.attn.wqkv) and linear(block.attn.wo)):
            return None
        weights.append(norms[1].detach())
        if not (linear(block.mlp.gate_up) and linear(block.mlp.down)):
            return None
    if len(a8) > 1:
        return None
    return weights, a8 == {True}


def native_head(model: Transformer) -> Callable[..., torch.Tensor]:
    """Final norm + LM head: hidden states [N, d] -> float32 logits [N, vocab], written into `out`
    when given. Natively (`torch.ops.arlm.llama_head`) where the layer stack runs natively: a
    float32 head streams the most bytes of a decode step (vocab x d_model), and the row-streaming
    kernel reads it at memory speed, where F.linear's matrix-vector product does not."""
    head = _native_linear(model.lm_head) if _native_applies(model) else None
    norm = model.norm.weight
    if head is None or norm.dtype != torch.float32:
        def module_head(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            logits = model.lm_head(model.norm(x)).float()
            return logits if out is None else out.copy_(logits)

        return module_head
    weights, a8 = head
    norm, eps, vocab = norm.detach(), model.config.norm_eps, model.config.vocab_size

    def native(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        out = x.new_empty(x.shape[0], vocab) if out is None else out
        torch.ops.arlm.llama_head(x.contiguous(), norm, weights, eps, a8, out)
        return out

    return native


def native_decode_fn(model: Transformer, cache: KVCache) -> Callable | None:
    """`decode_step`'s native twin for Llama-family models on CPU, or None where it does not apply.

    The whole stack of layers runs as one call to `torch.ops.arlm.decode_llama` (see
    arlm/kernels/decode.cpp): the same math as the modules, without ~2,000 small tensor ops per
    step, and the final norm and LM head as one more. Applies where `native_layers` does, with a
    contiguous float32 or float16 cache. The step allocates nothing: the embeddings, every intermediate and
    the logits live in buffers kept from step to step, so the logits it returns are valid until
    the next step (as a CUDA graph's outputs are): clone them to keep them.
    """
    if cache.paged or cache.k.dtype not in (torch.float32, torch.float16) or cache.k.device.type != "cpu":
        return None
    native = native_layers(model)
    if native is None:
        return None
    weights, int8_activations = native
    cfg = model.config
    args = (model.rope_cos, model.rope_sin)
    head = native_head(model)
    emb = model.tok_emb.weight.detach()
    buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # batch size -> (hidden state, logits)

    def step(model: Transformer, cache: KVCache, tokens: torch.Tensor, input_pos: torch.Tensor,
             kv_len: int) -> torch.Tensor:
        B = tokens.shape[0]
        if B not in buffers:
            buffers[B] = (emb.new_empty(B, cfg.d_model, dtype=torch.float32),
                          emb.new_empty(B, cfg.vocab_size, dtype=torch.float32))
        x, logits = buffers[B]
        if emb.dtype == torch.float32:
            torch.index_select(emb, 0, tokens[:, 0], out=x)
        else:
            x.copy_(model.tok_emb(tokens[:, 0]))
        torch.ops.arlm.decode_llama(x, weights, cache.k, cache.v, input_pos[:, 0].contiguous(), *args,
                                    kv_len, cfg.n_head, cfg.n_kv_heads, cfg.norm_eps, int8_activations)
        return head(x, logits)

    return step


@dataclass
class GenerationStats:
    prompt_tokens: int = 0  # real (unpadded) tokens prefilled, over all rows
    prefill_seconds: float = 0.0
    decode_tokens: int = 0  # tokens produced by decode steps (excludes the first, from prefill)
    decode_seconds: float = 0.0
    kv_cache_bytes: int = 0  # bytes allocated for the cache

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "prefill_seconds": round(self.prefill_seconds, 4),
                "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 2),
                "decode_tokens": self.decode_tokens, "decode_seconds": round(self.decode_seconds, 4),
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
                "kv_cache_bytes": self.kv_cache_bytes}


@dataclass
class StepOutput:
    """The tokens produced in one step: (row, token id) for every row still running."""

    tokens: list[tuple[int, int]]
    finished: list[tuple[int, str]] = field(default_factory=list)  # rows that stopped this step


class Generation:
    """Generates for a batch of prompts (lists of token ids, lengths may differ).

    Iterate it to run: the first step is the prefill (one forward pass over all prompts), every
    later step is one decode forward pass with [B, 1] tokens. A caller that watches text (stop
    strings) calls `finish(row, STOP)` to end a row early. With `cache` given (one row that holds
    earlier turns, as in chat), the prompt is appended after the cache's `seq_lens`. kv_dtype: the
    dtype of the cache made here (default: the model's; see `KVCache`).
    """

    def __init__(self, model: Transformer, prompts: list[list[int]], params: SamplingParams,
                 eos_ids: list[int] | tuple[int, ...] = (), cache: KVCache | None = None,
                 decode_fn: Callable | None = None, static_kv_len: bool = False,
                 context_shift: bool = False, kv_dtype: torch.dtype | None = None) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        cfg = model.config
        vocab = cfg.vocab_size
        for p in prompts:
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"token id out of range for a vocabulary of {vocab}")
        self.model, self.params, self.prompts = model, params, [list(p) for p in prompts]
        # CUDA graphs replay fixed shapes: attend over the whole cache (masked) instead of the
        # slots in use, so every decode step has the same shapes.
        self.static_kv_len = static_kv_len
        # context_shift: a row that fills the context window keeps going on its last half window
        # (recomputed at positions 0..), as nanoGPT's sample.py crops the context, instead of
        # finishing with CONTEXT.
        self.context_shift = context_shift
        self._to_shift: list[int] = []
        self.eos_ids = [] if params.ignore_eos else list(eos_ids)
        B, P = len(prompts), max(len(p) for p in prompts)
        device = next(model.parameters()).device
        if cache is None:
            cache_dtype = kv_dtype or next(model.parameters()).dtype
            capacity = min(cfg.max_seq_len, P + params.max_new_tokens)
            if P > cfg.max_seq_len:
                raise ValueError(f"prompt of {P} tokens exceeds the context window of {cfg.max_seq_len} tokens")
            cache = KVCache.for_model(cfg, B, capacity, dtype=cache_dtype, device=device)
        if cache.batch_size != B:
            raise ValueError(f"cache holds {cache.batch_size} rows, got {B} prompts")
        start = list(cache.seq_lens)
        if max(s + P for s in start) > cache.capacity:
            raise ValueError(f"prompt of {P} tokens after {max(start)} cached ones exceeds the cache "
                             f"capacity of {cache.capacity} tokens")
        self.cache, self.device, self.start = cache, device, start
        self.context_shift = self.context_shift and not any(start)  # it needs every row's whole history
        # decode_fn: e.g. torch.compile(decode_step); by default the native step where it applies
        self.decode_fn = decode_fn or native_decode_fn(model, cache) or decode_step
        self.completions: list[list[int]] = [[] for _ in range(B)]
        self.finish_reasons: list[str | None] = [None] * B
        self.stats = GenerationStats(kv_cache_bytes=cache.nbytes)
        # A seed gives every row a generator of its own, seeded alike (as vLLM gives each request
        # one): a row draws the same numbers whatever shares its batch, so it samples as it
        # would alone.
        self.generators = None
        if params.seed is not None:
            self.generators = [torch.Generator(device=device).manual_seed(params.seed) for _ in range(B)]
        self.seen = None  # [B, V] tokens seen so far, only when a repetition penalty needs it
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(B, vocab, dtype=torch.bool, device=device)
            for b, p in enumerate(prompts):
                self.seen[b, torch.tensor(p, device=device)] = True

    @property
    def batch_size(self) -> int:
        return len(self.prompts)

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        if self.generators is None or self.params.greedy:
            return sample(logits, self.params, None, self.seen)
        return sample_rows(logits, [self.params] * len(self.generators), self.generators, self.seen)

    def finish(self, row: int, reason: str) -> None:
        # A stop string completed by the token that also reached max_new_tokens or the context
        # limit wins: the text was cut at the string, so that is why the row stopped.
        if self.finish_reasons[row] is None or (reason == STOP and self.finish_reasons[row] in (LENGTH, CONTEXT)):
            self.finish_reasons[row] = reason

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.finish_reasons)

    def _accept(self, next_ids: list[int]) -> StepOutput:
        """Record the sampled token of every running row and decide which rows stop."""
        out = StepOutput([])
        limit = min(self.cache.capacity, self.model.config.max_seq_len)
        for b, tok in enumerate(next_ids):
            if self.finish_reasons[b] is not None:
                continue
            self.completions[b].append(tok)
            out.tokens.append((b, tok))
            if tok in self.eos_ids:
                self.finish(b, EOS)
            elif len(self.completions[b]) >= self.params.max_new_tokens:
                self.finish(b, LENGTH)
            elif self.cache.seq_lens[b] >= limit:
                if self.context_shift and limit == self.model.config.max_seq_len and limit >= 2:
                    self._to_shift.append(b)  # see _shift: the row goes on
                else:
                    self.finish(b, CONTEXT)  # the token just sampled has no slot left to be fed into
            if self.finish_reasons[b] is not None:
                out.finished.append((b, self.finish_reasons[b]))
        return out

    def _shift(self, b: int) -> int:
        """Context shift of row b: refill its cache with the last half window of its tokens
        (before the one just sampled) at positions 0.., by a prefill of that row alone. Returns
        the position the sampled token is fed at."""
        keep = self.model.config.max_seq_len // 2
        window = (self.prompts[b] + self.completions[b])[-keep - 1:-1]
        one = KVCache.for_model(self.model.config, 1, keep, dtype=self.cache.k.dtype, device=self.device)
        with torch.inference_mode():
            prefill(self.model, one, torch.tensor([window], device=self.device),
                    torch.arange(keep, device=self.device)[None], torch.tensor([keep - 1], device=self.device), keep)
            self.cache.k[:, b, :, :keep] = one.k[:, 0]
            self.cache.v[:, b, :, :keep] = one.v[:, 0]
        self.cache.seq_lens[b] = keep
        return keep

    def __iter__(self) -> Iterator[StepOutput]:
        B, P = self.batch_size, max(len(p) for p in self.prompts)
        dev, cache, model = self.device, self.cache, self.model
        lens = torch.tensor([len(p) for p in self.prompts], device=dev)
        start = torch.tensor(self.start, device=dev)
        tokens = torch.zeros(B, P, dtype=torch.long, device=dev)  # right padding (id 0 is ignored)
        for b, p in enumerate(self.prompts):
            tokens[b, : len(p)] = torch.tensor(p, device=dev)
        input_pos = start[:, None] + torch.arange(P, device=dev)[None, :]

        t0 = time.perf_counter()
        with torch.inference_mode():
            # One prefill per run of consecutive rows with the same prompt length and start, padded
            # to no more than its own length: a row's attention then covers exactly its own slots,
            # as when it runs alone. (Attention over a longer padded span rounds differently, and
            # 8-bit activations can turn that float32 noise into a different token.)
            parts, b0 = [], 0
            for b1 in range(1, B + 1):
                if b1 == B or (len(self.prompts[b1]), self.start[b1]) != (len(self.prompts[b0]), self.start[b0]):
                    L = len(self.prompts[b0])
                    parts.append(prefill(model, cache.rows(b0, b1), tokens[b0:b1, :L], input_pos[b0:b1, :L],
                                         lens[b0:b1] - 1, kv_len=self.start[b0] + L))
                    b0 = b1
            logits = parts[0] if len(parts) == 1 else torch.cat(parts)
            next_tok = self._sample(logits)
            next_ids = next_tok.tolist()  # the one host sync per step: the tokens must be emitted
        for b, p in enumerate(self.prompts):
            cache.seq_lens[b] = self.start[b] + len(p)
        self.stats.prompt_tokens = sum(len(p) for p in self.prompts)
        self.stats.prefill_seconds = time.perf_counter() - t0
        yield self._accept(next_ids)

        # Decode: each running row feeds its last token at position seq_lens[b]. Rows that have
        # finished ride along at a frozen position (their output is ignored) until all are done.
        pos = torch.tensor(cache.seq_lens, device=dev)[:, None]  # [B, 1]
        advance = torch.ones(B, 1, dtype=torch.long, device=dev)
        frozen: set[int] = set()
        t0 = time.perf_counter()
        while not self.done:
            while self._to_shift:
                b = self._to_shift.pop()
                if self.finish_reasons[b] is None:
                    pos[b, 0] = self._shift(b)
            for b, reason in enumerate(self.finish_reasons):
                if reason is not None and b not in frozen:  # rare: only when a row stops
                    frozen.add(b)
                    advance[b, 0] = 0
                    pos[b, 0] = min(cache.seq_lens[b], cache.capacity - 1)
            kv_len = cache.capacity if self.static_kv_len else \
                max(cache.seq_lens[b] for b in range(B) if b not in frozen) + 1
            with torch.inference_mode():
                if self.seen is not None:
                    self.seen.scatter_(1, next_tok[:, None], True)
                logits = self.decode_fn(model, cache, next_tok[:, None], pos, kv_len=kv_len)
                next_tok = self._sample(logits)
                next_ids = next_tok.tolist()  # the step's one host sync
                pos += advance
            for b in range(B):
                if b not in frozen:
                    cache.seq_lens[b] += 1
            step = self._accept(next_ids)
            self.stats.decode_tokens += len(step.tokens)
            self.stats.decode_seconds = time.perf_counter() - t0
            yield step


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str


def generate(model: Transformer, prompts: list[list[int]], params: SamplingParams,
             eos_ids: list[int] | tuple[int, ...] = ()) -> tuple[list[GenerationResult], GenerationStats]:
    """Run `Generation` to the end; one result per prompt, in order."""
    gen = Generation(model, prompts, params, eos_ids)
    for _ in gen:
        pass
    results = [GenerationResult(p, c, r) for p, c, r in zip(gen.prompts, gen.completions, gen.finish_reasons)]
    return results, gen.stats
