"""The model runner: a scheduled batch in, the logits of every request that samples out.

It prepares the step's tensors from the requests and picks how the forward pass runs:

- **rows** (a contiguous cache, every request decoding one token): tokens `[B, 1]`, row `b` of
  the cache for request `b`, rows not in this step riding along at position 0 (their output is
  ignored), so the shapes of a decode step do not change. Natively, once some rows have finished,
  the step takes the block-table path instead (each row in a one-block table), which computes
  only the rows still running. Natively `NativeLlama.decode`; else
  `decode_step` (the module path, or its `torch.compile`d / CUDA-graph twin).
- **rows prefill** (a contiguous cache, a static batch's first step, run by the modules): whole
  prompts `[B, P]` through `prefill`, SDPA over each row's slots.
- **block table** (everything else: prompts, chunks, the paged pool): the step's tokens
  flattened `[1, N]`, each request's blocks in a table. Natively `NativeLlama.forward`; else the
  modules over `KVCache.attend`. Prompt tokens of a quantized model with a dense copy of its
  weights (`dense_prefill`: `--matmul-path bf16|float32`) run through the dense weights, in a pass
  of their own, so decode tokens in the same step still take the quantized kernels: natively
  (`NativeLlama.dense_weights`: torch's GEMMs inside the native stack), else the modules with
  `dense=True`.

A request that keeps its prompt's logits (`Request.keep_prompt_logits`, for perplexity) runs on
the block-table path, where every token of its chunk reaches the LM head, not just the last; the
rows go to the request (`Request.keep_logits`), and its sampling row is the last of them.

`prefill` and `decode_step` are the textbook functions over a contiguous cache by rows (gpt-fast's
shape): the reference the tests hold the engine to, and what `torch.compile` compiles.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..kernels.layout import EXACT_ROWS
from ..kernels.llama import NativeLlama
from ..kv_cache import KVCache
from ..model import Transformer
from .scheduler import ScheduledBatch as Batch


def prefill(model: Transformer, cache: KVCache, tokens: torch.Tensor, input_pos: torch.Tensor,
            last_index: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Run prompts [B, P] (right-padded) at positions [B, P] through the model by rows of a
    contiguous cache; returns the logits [B, vocab] at `last_index` [B], each row's last real
    prompt token. Quantized layers with a dense copy use it (`QuantizedLinear.forward(dense=True)`)."""
    return model(tokens, input_pos, kv_cache=cache, kv_len=kv_len, output_index=last_index, dense=True)


def decode_step(model: Transformer, cache: KVCache, tokens: torch.Tensor, input_pos: torch.Tensor,
                kv_len: int) -> torch.Tensor:
    """One token per row of a contiguous cache: tokens [B, 1] at input_pos [B, 1] -> logits [B, vocab]."""
    return model(tokens, input_pos, kv_cache=cache, kv_len=kv_len)[:, -1]


class ModelRunner:
    """Runs a model's forward passes for the engine; binds the native kernels once.

    decode_fn: the rows path's step when the native one does not apply or is not wanted (e.g.
    `torch.compile(decode_step)`); None: native where it applies, else `decode_step`.
    static_kv_len: the rows path attends over the whole cache (masked) instead of the slots in
    use, so every decode step has the same shapes (CUDA graphs replay fixed shapes).
    dense_prefill: prompt tokens take the quantized layers' dense weights (see the module doc).
    """

    def __init__(self, model: Transformer, decode_fn: Callable | None = None, static_kv_len: bool = False,
                 dense_prefill: bool = False) -> None:
        self.model = model
        self.decode_fn = decode_fn
        self.static_kv_len = static_kv_len
        self.dense_prefill = dense_prefill
        # the prompt's matrix path and its instructions, for stats (LLM.configure sets them)
        self.matmul_path, self.matmul_isa = "float32", "default"
        self.native = NativeLlama.bind(model)
        self.device = next(model.parameters()).device
        # How many tokens a step may hold for each row's result not to depend on the others
        # (speculative decoding verifies through it): any number with the quantized kernels;
        # EXACT_ROWS where the native stack has float32 matrices (above that many rows a GEMM
        # sums in its own order: decode.cpp's f32_linear_into); 1 on the module path (torch's matmuls).
        self.exact_rows: int | None = None
        if self.native is None:
            self.exact_rows = 1
        elif any(type(m) is torch.nn.Linear for m in model.modules()):
            self.exact_rows = EXACT_ROWS
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # rows -> (hidden state, logits)
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # rows -> (token ids, positions)

    @property
    def config(self):
        return self.model.config

    def execute(self, cache: KVCache, batch: Batch, by_rows: bool) -> tuple[torch.Tensor, list[int]]:
        """Run one step; returns the logits [K, vocab] of the K rows that sample, and those rows.
        by_rows: the cache is contiguous, a block per request (its block id is its row)."""
        for src, dst in batch.copies:
            cache.copy_block(src, dst)
        for src, dst in batch.local_copies:
            cache.copy_block(src, dst, local=True)
        if by_rows and all(batch.decodes(i) and not batch.drafts[i] for i in range(len(batch.seqs))) and (
                len(batch.seqs) == cache.n_blocks or not self._native_table(cache)):
            return self._decode_rows(cache, batch), list(range(len(batch.seqs)))
        dense_natively = self.native is not None and self.native.dense_weights is not None and cache.use_kernel
        if by_rows and (self.native is None or self.dense_prefill and not dense_natively) and all(
                s.blocks[0] == i and s.num_computed == 0 and batch.samples(i) and not s.wants_logits and not s.embed
                for i, s in enumerate(batch.seqs)):
            return self._prefill_rows(cache, batch), list(range(len(batch.seqs)))
        if self.dense_prefill:
            prompt = [i for i in range(len(batch.seqs)) if not batch.decodes(i)]
            if prompt and len(prompt) < len(batch.seqs):  # two passes, each with its own weights
                decode = [i for i in range(len(batch.seqs)) if batch.decodes(i)]
                parts = [self._forward_table(cache, batch, rows, dense) for rows, dense in
                         ((prompt, True), (decode, False))]
                rows = parts[0][1] + parts[1][1]
                order = sorted(range(len(rows)), key=rows.__getitem__)
                logits = torch.cat([parts[0][0], parts[1][0]])
                return logits[order], [rows[j] for j in order]
            return self._forward_table(cache, batch, list(range(len(batch.seqs))), bool(prompt))
        return self._forward_table(cache, batch, list(range(len(batch.seqs))), False)

    def _native_table(self, cache: KVCache) -> bool:
        """Whether a decode step can take the native block-table path instead of the rows path:
        then a static batch some of whose rows have finished (an early EOS, a speculative row
        that ran ahead) computes only the rows still running, with the same arithmetic (the two
        paths agree bit for bit); the rows path computes every row of the cache, to keep its
        shapes fixed (what a compiled step or a CUDA graph wants)."""
        return self.native is not None and self.decode_fn is None and cache.use_kernel

    def _decode_rows(self, cache: KVCache, batch: Batch) -> torch.Tensor:
        R = cache.n_blocks
        if R not in self._rows:  # [R] token ids and positions, filled in place every step
            self._rows[R] = (torch.zeros(R, dtype=torch.long, device=self.device),
                             torch.zeros(R, dtype=torch.long, device=self.device))
        tokens, pos = self._rows[R]
        token_list, pos_list = [0] * R, [0] * R  # rows not in this step: token 0 at position 0
        rows = []
        for seq in batch.seqs:
            row = seq.blocks[0]
            rows.append(row)
            token_list[row] = seq.token_ids[-1]
            pos_list[row] = seq.num_computed
        if self.device.type == "cpu":  # straight into the tensors' memory: no allocation
            tokens.numpy()[:] = token_list
            pos.numpy()[:] = pos_list
        else:
            tokens.copy_(torch.tensor(token_list), non_blocking=True)
            pos.copy_(torch.tensor(pos_list), non_blocking=True)
        kv_len = cache.capacity if self.static_kv_len else max(pos_list[r] for r in rows) + 1
        if self.native is not None and self.decode_fn is None and cache.use_kernel:
            if R not in self._buffers:
                self._buffers[R] = (torch.empty(R, self.config.d_model), torch.empty(R, self.config.vocab_size))
            x, logits = self._buffers[R]
            self.native.embed(tokens, out=x)
            self.native.decode(x, cache.k, cache.v, pos, kv_len, cache.format)
            logits = self.native.head(x, logits)  # valid until the next step, as a CUDA graph's outputs
        else:
            step = self.decode_fn or decode_step
            logits = step(self.model, cache, tokens[:, None], pos[:, None], kv_len=kv_len)
        if rows == list(range(R)):
            return logits
        return logits[torch.tensor(rows, device=self.device)]

    def _prefill_rows(self, cache: KVCache, batch: Batch) -> torch.Tensor:
        """Whole prompts by rows (request i in row i), through the modules (no native stack, or a
        dense prefill), where SDPA over padded rows beats gathering each token's keys through a
        table. One pass per run of consecutive
        prompts of one length, padded to no more than its own: a row's attention then covers
        exactly its own slots, as when it runs alone."""
        dev, seqs = self.device, batch.seqs
        parts, b0 = [], 0
        for b1 in range(1, len(seqs) + 1):
            if b1 == len(seqs) or seqs[b1].num_tokens != seqs[b0].num_tokens:
                n = seqs[b0].num_tokens
                tokens = torch.tensor([s.window(0, n) for s in seqs[b0:b1]], device=dev)
                rows = cache.rows(b0, b1)
                pos = torch.arange(n, device=dev).expand(b1 - b0, n)
                last = torch.full((b1 - b0,), n - 1, device=dev)
                parts.append(prefill(self.model, rows, tokens, pos, last, n) if self.dense_prefill else
                             self.model(tokens, pos, kv_cache=rows, kv_len=n, output_index=last))
                b0 = b1
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def forward_flat(self, cache: KVCache, tokens: list[int], positions: list[int], seq_index: list[int],
                     tables: list[list[int]], out_index: list[int], dense: bool = False,
                     local_tables: list[list[int]] | None = None,
                     hidden: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """A flattened batch through block tables: token j of sequence seq_index[j] (whose blocks
        are tables[seq_index[j]]; in a split pool's sliding layers local_tables[seq_index[j]]) at
        positions[j]; the logits [len(out_index), vocab] of the flat positions out_index (at
        least one row). dense: through the dense weights. hidden: (flat positions, out): their
        final normed hidden states into out [len, d_model] (embedding requests)."""
        dev = self.device
        width = max(len(t) for t in tables + (local_tables or []))

        freed = bool(cache.window or cache.split)

        def tensor(tables: list[list[int]]) -> torch.Tensor:
            # entries behind a window (block_tables.FREED) are never read: any block will do
            return torch.tensor([([max(b, 0) for b in t] if freed else t) + [0] * (width - len(t)) for t in tables],
                                device=dev)

        table = tensor(tables)
        local = tensor(local_tables) if cache.split else None
        tokens_t, pos_t = torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev)
        seq_t, out_t = torch.tensor(seq_index, device=dev), torch.tensor(out_index or [0], device=dev)
        if self.native is not None and (not dense or self.native.dense_weights is not None) and cache.use_kernel:
            x = self.native.embed(tokens_t)
            self.native.forward(x, cache.k, cache.v, table, seq_t, pos_t, cache.format, cache.window, cache.sinks,
                                dense=dense, local=(cache.k_local, cache.v_local, local) if cache.split else None)
            if hidden is not None:
                hidden[1].copy_(self.model.norm(x[torch.tensor(hidden[0], device=dev)]))
            return self.native.head(x[out_t])  # (the quantized head: 8 bits twice, the more faithful)
        cache.set_batch(table, seq_t, local)
        try:
            if hidden is None:
                return self.model(tokens_t[None], pos_t[None], kv_cache=cache, output_index=out_t, dense=dense)
            logits, h = self.model(tokens_t[None], pos_t[None], kv_cache=cache, output_index=out_t, dense=dense,
                                   hidden_index=torch.tensor(hidden[0], device=dev))
            hidden[1].copy_(h)
            return logits
        finally:
            cache.set_batch(None, None)

    def _forward_table(self, cache: KVCache, batch: Batch, rows: list[int],
                       dense: bool) -> tuple[torch.Tensor, list[int]]:
        """Rows `rows` of the batch flattened through the block table; (logits, rows that sample)."""
        tokens: list[int] = []
        positions: list[int] = []
        seq_index: list[int] = []
        out_index: list[int] = []  # flat positions that reach the LM head
        out_rows: list[int] = []
        kept: list[tuple[int, int]] = []  # (batch row, its first row in out_index): rows that keep logits
        embeds: list[tuple[int, int]] = []  # (batch row, its first flat position): embedding requests' chunks
        hidden_index: list[int] = []
        sample_at: list[int] = []  # the row in out_index of each sampling row, where some row keeps logits
        for j, i in enumerate(rows):
            seq, n = batch.seqs[i], batch.num_tokens[i]
            start = seq.num_computed
            tokens += batch.input_ids(i)
            positions += range(start, start + n)
            seq_index += [j] * n
            if seq.embed:  # every token's hidden state
                embeds.append((i, len(hidden_index)))
                hidden_index += range(len(tokens) - n, len(tokens))
            if seq.wants_logits:  # every token of the chunk; the last one samples
                kept.append((i, len(out_index)))
                out_index += range(len(tokens) - n, len(tokens))
            elif batch.drafts[i]:  # a draft's k + 1 positions: each one verifies the next
                out_index += range(len(tokens) - n, len(tokens))
                out_rows += [i] * (n - 1)
                sample_at += range(len(out_index) - n, len(out_index) - 1)
            elif batch.samples(i):
                out_index.append(len(tokens) - 1)
            if batch.samples(i):
                out_rows.append(i)
                sample_at.append(len(out_index) - 1)
        tables = [batch.seqs[i].blocks for i in rows]
        local_tables = [batch.seqs[i].local_blocks for i in rows] if cache.split else None
        hidden = (hidden_index, torch.empty(len(hidden_index), self.config.d_model)) if embeds else None
        logits = self.forward_flat(cache, tokens, positions, seq_index, tables, out_index,
                                   dense and self.dense_prefill, local_tables, hidden)
        for i, first in embeds:
            seq = batch.seqs[i]
            seq.add_hidden(seq.num_computed, hidden[1][first:first + batch.num_tokens[i]])
        if not kept:  # out_index holds exactly the sampling rows
            return logits[:len(out_rows)], out_rows
        dev = self.device
        for i, first in kept:
            seq, n = batch.seqs[i], batch.num_tokens[i]
            seq.keep_logits(seq.num_computed, logits[first:first + n])
        return logits[torch.tensor(sample_at, dtype=torch.long, device=dev)], out_rows
