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
from ..structured import matcher_error, refused
from .request import Request
from .scheduler import ScheduledBatch
from .speculative import verify


class PrefetchedMasks:
    """The grammar masks of a step's eager rows (`eager`), computed on the grammar engine's mask
    thread while the forward pass runs (`Grammars.prefetch`): by the time the logits exist, the
    masks mostly do too, and a costly grammar no longer adds its masks to the step's time."""

    def __init__(self, reqs: list[Request], grammars) -> None:
        self.index = {id(r): j for j, r in enumerate(reqs)}
        self.future = grammars.prefetch([r.matcher for r in reqs])

    @classmethod
    def start(cls, batch: ScheduledBatch, grammars) -> "PrefetchedMasks | None":
        """For the rows of `batch` that will sample a token under a grammar, eagerly, with no
        draft; None if there are none."""
        reqs = [r for i, r in enumerate(batch.seqs)
                if r.matcher is not None and not batch.drafts[i] and eager(r) and batch.samples(i)]
        return cls(reqs, grammars) if reqs else None

    def bits(self, reqs: list[Request]) -> torch.Tensor | None:
        """The masks of `reqs` (waiting for them), or None if some were not prefetched."""
        at = [self.index.get(id(r)) for r in reqs]
        if None in at:
            return None
        bits = self.future.result()
        return bits if at == list(range(bits.shape[0])) else bits[torch.tensor(at)]


def eager(req: Request) -> bool:
    """Whether a grammar row is masked before its draw: unless the draw commutes with the mask
    (greedy, or temperature alone), when it is masked only if the grammar refuses the draw."""
    return not (req.params.greedy or req.params.unfiltered)


def sample_step(logits: torch.Tensor, rows: list[int], batch: ScheduledBatch, grammars,
                keep_raw: bool = False, prefetched: PrefetchedMasks | None = None
                ) -> tuple[dict[int, list[int]], dict[int, Exception]]:
    """The tokens of each sampling row as {batch row: token ids} (logits [len(rows), V]; a row
    that verifies a draft has its k + 1 logits rows in a run and gets the tokens
    `speculative.verify` keeps, any other one token), and the rows whose sampling raised, with
    the error. grammars: the engine's `arlm.structured.Grammars` (None where no request has a
    grammar). keep_raw: leave `logits` as they are (a hook reads them after the step).
    prefetched: the eager grammar rows' masks, computed during the forward pass."""
    if not rows:
        return {}, {}
    plain = [j for j, i in enumerate(rows) if not batch.drafts[i]]
    verifying = [j for j, i in enumerate(rows) if batch.drafts[i]]
    sampled, failed = sample_plain(logits, [rows[j] for j in plain], batch, plain, grammars, keep_raw, prefetched)
    if verifying:
        more, more_failed = sample_drafts(logits, [rows[j] for j in verifying], batch, verifying, grammars)
        sampled.update(more)
        failed.update(more_failed)
    return sampled, failed


def sample_plain(logits: torch.Tensor, rows: list[int], batch: ScheduledBatch, at: list[int], grammars,
                 keep_raw: bool = False, prefetched: PrefetchedMasks | None = None
                 ) -> tuple[dict[int, list[int]], dict[int, Exception]]:
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
    lazy = [j for j in guided if not eager(reqs[j])]
    masked = [j for j in guided if j not in lazy]
    if guided or any(r.params.adjusts_logits for r in reqs):
        # changed in place; a copy where the raw logits are still read (logprobs, a hook)
        logits = logits.float()
        if logits is raw and (keep_raw or any(r.params.logprobs is not None for r in reqs)):
            logits = logits.clone()
        for j, r in enumerate(reqs):
            if r.params.adjusts_logits:
                logits[j] = adjust_logits(logits[j], r.params, r.output_counts, r.num_output_tokens, r.end_ids)
    broken: dict[int, Exception] = {}  # (logits row: a grammar that hit its limits computing the mask)
    try:
        if masked:
            broken = mask_grammar(logits, [reqs[j] for j in masked], masked, grammars, prefetched)
        next_ids = sample_rows(logits, [r.params for r in reqs], [r.generator for r in reqs],
                               seen_masks(reqs)).tolist()  # the step's one host sync
        if lazy:
            broken.update(redraw_refused(logits, reqs, lazy, next_ids, grammars))
        keep_logprobs(raw, reqs, next_ids)
        ok = [j for j in range(len(reqs)) if j not in broken]
        failed = {rows[j]: e for j, e in broken.items()}
        failed.update(advance_grammars([reqs[j] for j in ok], [next_ids[j] for j in ok], [rows[j] for j in ok]))
        return {i: [t] for i, t in zip(rows, next_ids) if i not in failed}, failed
    except Exception:  # noqa: BLE001 - narrowed down to rows below
        pass
    sampled, failed = {}, {}
    for j, (i, r) in enumerate(zip(rows, reqs)):
        try:
            if j in lazy or j in masked:
                for e in mask_grammar(logits, [r], [j], grammars, prefetched).values():
                    raise e
            sampled[i] = [sample_rows(logits[j:j + 1], [r.params], [r.generator], seen_masks([r])).item()]
            keep_logprobs(raw[j:j + 1], [r], sampled[i])
            for e in advance_grammars([r], sampled[i], [i]).values():
                raise e
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
                   grammars) -> dict[int, Exception]:
    """The lazy rows whose token their grammar refuses: masked, and drawn again (in place in
    `tokens`); the rows whose grammar hit its limits on the way, with the error."""
    redo = [j for j in lazy if not grammars.takes(reqs[j].matcher, tokens[j])]
    broken = {}
    if redo:
        broken = mask_grammar(logits, [reqs[j] for j in redo], redo, grammars)
        again = sample_rows(logits[torch.tensor(redo, device=logits.device)], [reqs[j].params for j in redo],
                            [reqs[j].generator for j in redo], seen_masks([reqs[j] for j in redo])).tolist()
        for j, t in zip(redo, again):
            tokens[j] = t
    return broken


def mask_grammar(logits: torch.Tensor, reqs: list[Request], at: list[int], grammars,
                 prefetched: PrefetchedMasks | None = None) -> dict[int, Exception]:
    """In place: -inf in logits rows `at` for the tokens each request's grammar refuses next
    (the masks prefetched where they were). The rows (of `at`) whose grammar stopped in an
    error computing it (its step budget spent: `GrammarLimits`), with the error."""
    matchers = [r.matcher for r in reqs]
    bits = prefetched.bits(reqs) if prefetched is not None else None
    kernels.mask_rows(logits, torch.tensor(at), bits if bits is not None else grammars.bitmask(matchers))
    return {j: matcher_error(m) for j, m in zip(at, matchers) if m.is_error()}


def advance_grammars(reqs: list[Request], tokens: list[int], rows: list[int]) -> dict[int, Exception]:
    """Feed each sampled token to its request's grammar matcher; the rows whose token the
    grammar refused as failures: a GrammarError where the grammar hit its limits (the request's
    input, a client's error), else a RuntimeError (with the mask applied, a bug)."""
    failed = {}
    for r, tok, i in zip(reqs, tokens, rows):
        if r.matcher is not None and tok not in r.eos_ids and not r.matcher.consume_token(tok):
            failed[i] = refused(r.matcher, tok)
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
