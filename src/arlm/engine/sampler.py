"""Sampling a step: the tokens of every row that reached the end of its window.

`sample_step` is the one entry point `Engine.step` calls. It splits the rows two ways:

- `sample_plain`: one token per row, all rows in one `sample_rows` (the step's one host sync),
  each with its own `SamplingParams`, generator and `seen` mask (`arlm.sampling`);
- `sample_drafts`: a row that verifies a draft has its k + 1 logits rows in a run, and keeps the
  tokens `speculative.verify` accepts;

and grammar-guided rows (`SamplingParams.structured`) are masked by their matcher's bitmask
(`mask_grammar`) - eagerly, or lazily where the draw commutes with the mask (`redraw_refused`) -
and their matchers advanced with the tokens drawn (`advance_grammars`).

A request whose parameters or grammar break its row fails by itself: the row's error is
returned, and the other rows get the tokens they would have got without it (a row's draw never
depends on its batch).
"""

from __future__ import annotations

import torch

from .. import kernels
from ..sampling import adjust_logits, sample_rows, top_logprobs
from .request import Request
from .scheduler import ScheduledBatch
from .speculative import verify


def sample_step(logits: torch.Tensor, rows: list[int], batch: ScheduledBatch, grammars,
                keep_raw: bool = False) -> tuple[dict[int, list[int]], dict[int, Exception]]:
    """The tokens of each sampling row as {batch row: token ids} (logits [len(rows), V]; a row
    that verifies a draft has its k + 1 logits rows in a run and gets the tokens
    `speculative.verify` keeps, any other one token), and the rows whose sampling raised, with
    the error. grammars: the engine's `arlm.structured.Grammars` (None where no request has a
    grammar). keep_raw: leave `logits` as they are (a hook reads them after the step)."""
    if not rows:
        return {}, {}
    plain = [j for j, i in enumerate(rows) if not batch.drafts[i]]
    verifying = [j for j, i in enumerate(rows) if batch.drafts[i]]
    sampled, failed = sample_plain(logits, [rows[j] for j in plain], batch, plain, grammars, keep_raw)
    if verifying:
        more, more_failed = sample_drafts(logits, [rows[j] for j in verifying], batch, verifying, grammars)
        sampled.update(more)
        failed.update(more_failed)
    return sampled, failed


def sample_plain(logits: torch.Tensor, rows: list[int], batch: ScheduledBatch, at: list[int], grammars,
                 keep_raw: bool = False) -> tuple[dict[int, list[int]], dict[int, Exception]]:
    """One token for each of `rows` (batch rows), from logits rows `at`.

    All rows are drawn in one `sample_rows`; if that raises, each row is drawn alone, so that a
    request whose parameters break sampling fails by itself. The filters, where a bad parameter
    fails, run before any generator is drawn from: the rows that succeed alone get the tokens
    they would have got."""
    if not rows:
        return {}, {}
    if len(at) != logits.shape[0]:
        logits = logits[torch.tensor(at, device=logits.device)]
    reqs = [batch.seqs[i] for i in rows]
    raw = logits
    guided = [j for j, r in enumerate(reqs) if r.matcher is not None]
    # Rows whose draw commutes with the mask (greedy, or temperature alone: no top-k/p, min-p
    # filter, which would see the unmasked distribution) draw first and compute the mask
    # only if the grammar refuses the token, then draw again from the masked row: the
    # argmax, or the masked distribution exactly (rejection sampling: P(t) = p(t) / p(A)).
    # llama.cpp's sampler does the same; most tokens of a model that follows its format
    # then cost a validation (~microseconds) instead of a mask (~0.1 ms a row).
    lazy = [j for j in guided if reqs[j].params.greedy or reqs[j].params.unfiltered]
    eager = [j for j in guided if j not in lazy]
    if guided or any(r.params.adjusts_logits for r in reqs):
        # changed in place; a copy where the raw logits are still read (logprobs, a hook)
        logits = logits.float()
        if logits is raw and (keep_raw or any(r.params.logprobs is not None for r in reqs)):
            logits = logits.clone()
        for j, r in enumerate(reqs):
            if r.params.adjusts_logits:
                logits[j] = adjust_logits(logits[j], r.params, r.output_counts, r.num_output_tokens, r.end_ids)
        if eager:
            mask_grammar(logits, [reqs[j] for j in eager], eager, grammars)
    try:
        next_ids = sample_rows(logits, [r.params for r in reqs], [r.generator for r in reqs],
                               seen_masks(reqs)).tolist()  # the step's one host sync
        if lazy:
            redraw_refused(logits, reqs, lazy, next_ids, grammars)
        keep_logprobs(raw, reqs, next_ids)
        failed = advance_grammars(reqs, next_ids, rows)
        return {i: [t] for i, t in zip(rows, next_ids) if i not in failed}, failed
    except Exception:  # noqa: BLE001 - narrowed down to rows below
        pass
    sampled, failed = {}, {}
    for j, (i, r) in enumerate(zip(rows, reqs)):
        try:
            if j in lazy:
                mask_grammar(logits, [r], [j], grammars)
            sampled[i] = [sample_rows(logits[j:j + 1], [r.params], [r.generator], seen_masks([r])).item()]
            keep_logprobs(raw[j:j + 1], [r], sampled[i])
            if advance_grammars([r], sampled[i], [i]):
                raise ValueError(f"token {sampled[i][0]} breaks the grammar: {r.matcher.get_error()}")
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            failed[i] = e
    return sampled, failed


def sample_drafts(logits: torch.Tensor, rows: list[int], batch: ScheduledBatch, at: list[int],
                  grammars) -> tuple[dict[int, list[int]], dict[int, Exception]]:
    """The tokens each verifying row keeps (`speculative.verify`): `rows` holds each such batch
    row once per logits row it has (k + 1 in a run), `at` those logits rows. A grammar masks
    every position along the draft; the request's spec estimates record the outcome."""
    sampled: dict[int, list[int]] = {}
    failed: dict[int, Exception] = {}
    vrows = list(dict.fromkeys(rows))  # each verifying row once, in order
    raw = vlogits = logits[torch.tensor(at, device=logits.device)]
    guided, start = [], 0
    for i in vrows:
        if batch.seqs[i].matcher is not None:
            guided.append((start, i))
        start += len(batch.drafts[i]) + 1
    if guided:  # each position's grammar mask: the matcher's, then after each draft token
        vlogits = vlogits.float().clone()
        for start, i in guided:
            try:
                bits = grammars.bitmask_along(batch.seqs[i].matcher, batch.drafts[i])
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                failed[i] = e
                continue
            kernels.mask_rows(vlogits, torch.arange(start, start + bits.shape[0]), bits)
    try:
        kept = verify(vlogits, [batch.seqs[i] for i in vrows], [batch.drafts[i] for i in vrows])
    except Exception:  # noqa: BLE001 - narrowed down to rows below
        kept = None
    start = 0
    for n, i in enumerate(vrows):
        k = len(batch.drafts[i])
        seq = batch.seqs[i]
        if i in failed:
            start += k + 1
            continue
        try:
            toks = kept[n] if kept is not None else \
                verify(vlogits[start:start + k + 1], [seq], [batch.drafts[i]])[0]
            keep_logprobs(raw[start:start + len(toks)], [seq] * len(toks), toks)
            bad = advance_grammars([seq] * len(toks), toks, [i] * len(toks))
            if bad:
                raise bad[i]
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            failed[i] = e
            start += k + 1
            continue
        start += k + 1
        sampled[i] = toks
        seq.spec.record(k, len(toks) - 1)
    return sampled, failed


def redraw_refused(logits: torch.Tensor, reqs: list[Request], lazy: list[int], tokens: list[int],
                   grammars) -> None:
    """The lazy rows whose token their grammar refuses: masked, and drawn again (in place in
    `tokens`)."""
    redo = [j for j in lazy if not grammars.takes(reqs[j].matcher, tokens[j])]
    if redo:
        mask_grammar(logits, [reqs[j] for j in redo], redo, grammars)
        again = sample_rows(logits[torch.tensor(redo, device=logits.device)], [reqs[j].params for j in redo],
                            [reqs[j].generator for j in redo], seen_masks([reqs[j] for j in redo])).tolist()
        for j, t in zip(redo, again):
            tokens[j] = t


def mask_grammar(logits: torch.Tensor, reqs: list[Request], at: list[int], grammars) -> None:
    """In place: -inf in logits rows `at` for the tokens each request's grammar refuses next."""
    kernels.mask_rows(logits, torch.tensor(at), grammars.bitmask([r.matcher for r in reqs]))


def advance_grammars(reqs: list[Request], tokens: list[int], rows: list[int]) -> dict[int, Exception]:
    """Feed each sampled token to its request's grammar matcher; the rows whose token the
    grammar refused (it cannot happen with the mask applied) as failures."""
    failed = {}
    for r, tok, i in zip(reqs, tokens, rows):
        if r.matcher is not None and tok not in r.eos_ids and not r.matcher.consume_token(tok):
            failed[i] = RuntimeError(f"token {tok} breaks the grammar: {r.matcher.get_error()}")
    return failed


def keep_logprobs(logits: torch.Tensor, reqs: list[Request], tokens: list[int]) -> None:
    """The sampled tokens' log-probabilities for the requests that ask (`params.logprobs`), from
    the raw logits (before temperature and the filters), appended to `output_logprobs`."""
    want = [j for j, r in enumerate(reqs) if r.params.logprobs is not None]
    if not want:
        return
    k = max(reqs[j].params.logprobs for j in want)
    rows = logits[torch.tensor(want, device=logits.device)] if len(want) != len(reqs) else logits
    for j, (lp, top) in zip(want, top_logprobs(rows, [tokens[j] for j in want], k)):
        reqs[j].output_logprobs.append((lp, top[:reqs[j].params.logprobs]))


def seen_masks(reqs: list[Request]) -> torch.Tensor | None:
    """[B, V] tokens seen so far, only when some row has a repetition penalty (the others' rows
    are ignored: a penalty of 1 changes nothing)."""
    masks = [r.seen for r in reqs]
    if all(m is None for m in masks):
        return None
    blank = next(m for m in masks if m is not None)
    return torch.stack([m if m is not None else blank for m in masks])
