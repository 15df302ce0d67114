"""Sampling filters on hand-made distributions, HF's logits processors as a reference, draw statistics.

Hand-made cases have clear margins and expect exact keep-sets; comparisons with HF's processors
on random logits expect identical -inf masks and logits equal to 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

from arlm.sampling import (SamplingParams, apply_repetition_penalty, filtered_logits, min_p_filter, sample,
                           top_k_filter, top_p_filter)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


# -- top-k -----------------------------------------------------------------------------------------

def test_top_k_keeps_the_k_largest():
    x = torch.tensor([[0.5, 3.0, -1.0, 2.0, 1.0]])
    assert kept(top_k_filter(x, 2)) == [1, 3]
    assert kept(top_k_filter(x, 1)) == [1]
    out = top_k_filter(x, 3)
    assert torch.equal(out[0, [1, 3, 4]], x[0, [1, 3, 4]])  # kept logits are untouched


def test_top_k_keeps_ties_at_the_kth_value():
    x = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]])
    assert kept(top_k_filter(x, 2)) == [1, 2, 3]  # as HF's TopKLogitsWarper: `scores < kth` removed


def test_top_k_disabled_or_larger_than_vocab():
    x = torch.randn(2, 7)
    assert torch.equal(top_k_filter(x, 0), x)
    assert torch.equal(top_k_filter(x, 7), x)
    assert torch.equal(top_k_filter(x, 100), x)


# -- top-p -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("p, expect", [
    (0.3, [0]),           # the top token alone already has 0.5 >= 0.3
    (0.5 - 1e-3, [0]),
    (0.7, [0, 1]),        # 0.5 + 0.3 = 0.8 >= 0.7
    (0.85, [0, 1, 2]),    # 0.95 >= 0.85
    (0.99, [0, 1, 2, 3]),
])
def test_top_p_keeps_smallest_set_reaching_p(p, expect):
    x = logits_of([0.5, 0.3, 0.15, 0.05])
    perm = torch.tensor([2, 0, 3, 1])  # the filter must not depend on token order
    assert kept(top_p_filter(x, p)) == expect
    assert sorted(perm[kept(top_p_filter(x[:, perm], p))].tolist()) == expect


def test_top_p_candidates_path_equals_the_full_sort():
    # On CPU, top-p first looks at the NUCLEUS_CANDIDATES most likely tokens and sorts the whole row
    # only where the nucleus reaches past them. Against the full sort on model-like rows (peaked,
    # nucleus inside the candidates) and flat rows (nucleus far wider): the same tokens kept, and
    # every row alone the same as in its batch.
    from arlm.sampling import NUCLEUS_CANDIDATES, _top_p_sorted

    g = torch.Generator().manual_seed(0)
    peaked = torch.randn(6, 49152, generator=g) * 2
    peaked[:, torch.randperm(49152, generator=g)[:40]] += torch.rand(6, 40, generator=g) * 8 + 8  # a few likely tokens
    flat = torch.randn(3, 49152, generator=g) * 0.1
    x = torch.cat([peaked, flat])
    for p in (0.5, 0.9, 0.95):
        fast = top_p_filter(x, p)
        ref = _top_p_sorted(x, p)
        assert torch.equal(fast.isfinite(), ref.isfinite())
        assert (fast[:6].isfinite().sum(-1) < NUCLEUS_CANDIDATES).all()  # the candidates path ran
        assert (fast[6:].isfinite().sum(-1) > NUCLEUS_CANDIDATES).all()  # the full sort ran
        for i in (0, 7):
            assert torch.equal(top_p_filter(x[i:i + 1], p), fast[i:i + 1])
    per_row = torch.tensor([[0.5], [0.9], [0.95], [0.7], [0.99], [0.6], [0.9], [0.5], [0.8]])
    assert torch.equal(top_p_filter(x, per_row).isfinite(), _top_p_sorted(x, per_row).isfinite())


def test_top_p_one_keeps_everything():
    x = logits_of([0.999997, 1e-6, 1e-6, 1e-6])
    assert torch.equal(top_p_filter(x, 1.0), x)
    assert kept(filtered_logits(x, SamplingParams(top_p=1.0, temperature=1.0))) == [0, 1, 2, 3]


# -- min-p -----------------------------------------------------------------------------------------

def test_min_p_is_relative_to_the_top_probability():
    x = logits_of([0.1, 0.6, 0.2, 0.06, 0.04])
    assert kept(min_p_filter(x, 0.2)) == [1, 2]  # threshold 0.12
    assert kept(min_p_filter(x, 0.09)) == [0, 1, 2, 3]  # threshold 0.054
    assert kept(min_p_filter(x, 1.0)) == [1]
    assert torch.equal(min_p_filter(x, 0.0), x)
    # The same relative cut on a flatter distribution keeps more: not an absolute threshold.
    assert kept(min_p_filter(logits_of([0.3, 0.25, 0.25, 0.2]), 0.2)) == [0, 1, 2, 3]


# -- against HF's processors -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_processors():
    import transformers.generation.logits_process as processors  # the reference (test dependency)

    return processors


def test_repetition_penalty_matches_hf(hf_processors):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 50, generator=g) * 3  # both signs
    input_ids = torch.randint(0, 50, (4, 30), generator=g)  # with repeats
    seen = torch.zeros(4, 50, dtype=torch.bool).scatter_(1, input_ids, True)
    for penalty in (1.3, 0.7):
        ref = hf_processors.RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone())
        got = apply_repetition_penalty(logits, seen, penalty)
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
        assert not torch.equal(got, logits)


def test_filter_chain_matches_hf_warpers(hf_processors):
    """Temperature, then top-k, top-p, min-p, in HF's order, on random logits."""
    lp = hf_processors
    g = torch.Generator().manual_seed(8)
    for temperature, top_k, top_p, min_p in [(0.7, 20, 0.9, 0.0), (1.5, 0, 0.8, 0.05), (1.0, 5, 1.0, 0.1),
                                             (2.0, 40, 0.95, 0.02)]:
        logits = torch.randn(8, 100, generator=g) * 2
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        ref = lp.TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            ref = lp.TopKLogitsWarper(top_k)(None, ref)
        if top_p < 1:
            ref = lp.TopPLogitsWarper(top_p)(None, ref)
        if min_p:
            ref = lp.MinPLogitsWarper(min_p)(None, ref)
        got = filtered_logits(logits, params)
        assert torch.equal(torch.isinf(got), torch.isinf(ref))
        assert torch.isinf(got).any()
        finite = torch.isfinite(ref)
        torch.testing.assert_close(got[finite], ref[finite], atol=1e-6, rtol=0)


# -- drawing -----------------------------------------------------------------------------------------

def test_draws_follow_the_filtered_distribution():
    """20000 draws: frequencies within 0.015 of the target (>= 4 standard deviations)."""
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    n = 20000
    logits = probs.log().expand(n, -1)
    g = torch.Generator().manual_seed(9)
    freq = torch.bincount(sample(logits, SamplingParams(temperature=1.0), g), minlength=5).float() / n
    assert (freq - probs).abs().max() < 0.015, freq
    # Temperature 0.5 squares the odds: p^2 / sum p^2.
    target = probs ** 2 / (probs ** 2).sum()
    freq = torch.bincount(sample(logits, SamplingParams(temperature=0.5), g), minlength=5).float() / n
    assert (freq - target).abs().max() < 0.015, freq
    # top_p 0.7 keeps {0.4, 0.25, 0.2} (0.65 < 0.7): renormalised, nothing else ever drawn.
    draws = sample(logits, SamplingParams(temperature=1.0, top_p=0.7), g)
    freq = torch.bincount(draws, minlength=5).float() / n
    assert freq[3:].sum() == 0
    assert (freq[:3] - probs[:3] / probs[:3].sum()).abs().max() < 0.015, freq


def test_draw_over_blocks_never_takes_a_zero_weight_and_is_batch_independent():
    """The two-level inverse CDF (blocks of 256): weights spread over several blocks, with zeros
    between and at the ends, a width that is not a multiple of the block, unnormalised weights;
    frequencies within 4 standard deviations, zero weights never drawn, and a seeded row draws
    the same token alone or in a batch."""
    from arlm.sampling import DRAW_BLOCK, draw

    V = 3 * DRAW_BLOCK + 77
    w = torch.zeros(V)
    hot = {0: 1.0, 255: 2.0, 256: 0.5, 700: 3.0, V - 1: 1.5, 300: 0.02}
    for t, x in hot.items():
        w[t] = x
    n = 40000
    g = torch.Generator().manual_seed(5)
    got = torch.bincount(draw(w.expand(n, -1).contiguous(), [g] * n), minlength=V).double()
    p = w.double() / w.sum()
    assert got[p == 0].sum() == 0
    sd = (n * p * (1 - p)).sqrt()
    assert ((got - n * p).abs() <= 4 * sd + 1).all(), {t: (got[t].item(), n * p[t].item()) for t in hot}
    logits = torch.randn(6, V, generator=g).softmax(-1)
    together = draw(logits, [torch.Generator().manual_seed(i) for i in range(6)])
    alone = [draw(logits[i:i + 1], [torch.Generator().manual_seed(i)]).item() for i in range(6)]
    assert together.tolist() == alone


def test_token_bitmask_native_and_fallback_agree_with_the_bits():
    """kernels.mask_rows (structured outputs): -inf exactly where a row's bit is 0 and past the
    mask's words, other rows untouched; the native kernel and the torch fallback alike."""
    from arlm import kernels

    assert kernels.native_available()
    g = torch.Generator().manual_seed(4)
    for V, words in ((49152, 1536), (1000, 31), (37, 2), (77, 3)):  # (31 words: a mask short of the vocab)
        logits = torch.randn(5, V, generator=g)
        bits = torch.randint(-2**31, 2**31 - 1, (3, words), generator=g, dtype=torch.int32)
        bits[0, :words // 2] = -1  # all allowed
        bits[1, :words // 2] = 0  # none
        rows = torch.tensor([4, 0, 2])
        ref = logits.clone()
        for i, r in enumerate(rows.tolist()):
            for t in range(V):
                if t // 32 >= words or not (int(bits[i, t // 32]) >> (t % 32)) & 1:
                    ref[r, t] = float("-inf")
        native = logits.clone()
        kernels.mask_rows(native, rows, bits)
        assert torch.equal(native, ref), V
        fallback = logits.clone()
        real = kernels.native_available
        kernels.native_available = lambda: False
        try:
            kernels.mask_rows(fallback, rows, bits)
        finally:
            kernels.native_available = real
        assert torch.equal(fallback, ref), V


def test_greedy_is_argmax_and_seed_reproduces():
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(16, 300, generator=g)
    assert torch.equal(sample(logits, SamplingParams(temperature=0)), logits.argmax(-1))
    p = SamplingParams(temperature=1.0)
    a = sample(logits, p, torch.Generator().manual_seed(3))
    b = sample(logits, p, torch.Generator().manual_seed(3))
    c = sample(logits, p, torch.Generator().manual_seed(4))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # 16 draws from near-uniform 300-way distributions


# -- parameter validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(temperature=math.nan), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(top_k=-1), dict(min_p=-0.1), dict(min_p=1.1),
                                 dict(repetition_penalty=0.0), dict(max_new_tokens=0), dict(stop=[""]),
                                 dict(seed=2**64), dict(seed=-(2**63) - 1), dict(seed=1.5)])
def test_invalid_params_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_native_argmax_is_torch_argmax():
    # Greedy decoding's argmax (a native kernel on CPU): the same index as torch.argmax, ties to
    # the first maximum, a NaN row to its first NaN, an all -inf row to 0, any width.
    from arlm import kernels

    assert kernels.native_available()
    g = torch.Generator().manual_seed(3)
    for V in (1, 15, 16, 17, 49152):
        x = torch.randn(5, V, generator=g)
        x[1] = x[1].round()  # ties
        x[2, V // 2] = x[2].max() + 1
        x[3] = float("-inf")
        if V > 2:
            x[4, V - 1] = float("nan")
            x[4, 1] = float("nan")
        assert torch.equal(torch.ops.arlm.argmax_rows(x), x.argmax(dim=-1)), V


# -- OpenAI's sampling fields: penalties over the output, logit bias, min_tokens, stop_token_ids ----

def test_adjust_logits_is_the_openai_formula():
    from arlm.sampling import adjust_logits

    g = torch.Generator().manual_seed(11)
    logits = torch.randn(50, generator=g) * 3
    counts = torch.randint(0, 4, (50,), generator=g).float()
    p = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4, logit_bias={3: 250.0, 7: -2.5}, min_tokens=5)
    assert p.logit_bias == {3: 100.0, 7: -2.5}  # clamped to [-100, 100]
    want = logits - (-0.4) * counts - 0.7 * (counts > 0).float()
    want[3] += 100.0
    want[7] -= 2.5
    want[[9, 11]] = float("-inf")
    got = adjust_logits(logits, p, counts, num_output=4, end_ids={9, 11})
    assert torch.equal(got, want)
    assert torch.equal(adjust_logits(logits, p, counts, num_output=5, end_ids={9, 11})[[9, 11]], want.new_tensor(
        [logits[9] - (-0.4) * counts[9] - 0.7 * (counts[9] > 0).float(),
         logits[11] - (-0.4) * counts[11] - 0.7 * (counts[11] > 0).float()]))
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=float("nan")), dict(logit_bias={-1: 1.0}),
                dict(min_tokens=-1), dict(stop_token_ids=[1.5]), dict(logprobs=21)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_penalties_bias_and_min_tokens_in_the_engine(smollm2):
    """Greedy with presence/frequency penalties = a hand-run loop over the model's logits with the
    formula; the same in a batch beside plain rows; logit_bias, min_tokens, stop_token_ids."""
    llm = smollm2
    prompt = llm.tokenizer.encode("The cat sat on the mat. The cat sat on the")
    params = SamplingParams(max_new_tokens=10, temperature=0.0, presence_penalty=0.8, frequency_penalty=1.2)
    got = llm.generate([prompt], params)[0].token_ids
    ids, counts = list(prompt), torch.zeros(llm.model.config.vocab_size)
    with torch.inference_mode():
        for _ in range(10):
            logits = llm.model(torch.tensor([ids]))[0, -1].float()
            tok = int((logits - 1.2 * counts - 0.8 * (counts > 0).float()).argmax())
            ids.append(tok)
            counts[tok] += 1
    assert got == ids[len(prompt):]
    assert got != llm.generate([prompt], SamplingParams(max_new_tokens=10, temperature=0.0))[0].token_ids
    other = llm.tokenizer.encode("Once upon a time")
    batch = llm.engine.generate([other, prompt, other], [SamplingParams(max_new_tokens=10, temperature=0.0), params,
                                                         SamplingParams(max_new_tokens=10, temperature=0.0)])
    assert batch[1] == got
    first = got[0]
    assert llm.generate([prompt], dataclass_replace(params, logit_bias={first: -100.0}))[0].token_ids[0] != first
    short = llm.tokenizer.encode(llm.apply_chat_template([{"role": "user", "content": "Say OK."}]))
    plain = llm.generate([short], SamplingParams(max_new_tokens=64, temperature=0.0))[0]
    assert plain.finish_reason == "eos" and len(plain.token_ids) < 30
    held = llm.generate([short], SamplingParams(max_new_tokens=64, temperature=0.0, min_tokens=30))[0]
    assert len(held.token_ids) >= 30 and held.token_ids[:len(plain.token_ids) - 1] == plain.token_ids[:-1]
    stop = llm.generate([prompt], SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=[got[2]]))[0]
    assert stop.finish_reason == "eos" and stop.token_ids[-1] == got[2] and len(stop.token_ids) <= 3


def dataclass_replace(params, **kw):
    import dataclasses

    return dataclasses.replace(params, **kw)
