"""Speculative decoding (arlm.engine.speculative): exact greedy output, the target's distribution
when sampling, rollback, cut points, the draft-length rule, and the edges (LLM, CLI, serve).

Greedy references are plain decoding on the same engine configuration: no tolerance, every
token of every prompt. The sampled rule is held to a chi-squared test against the exact
distribution of the first tokens (enumerated from the model's own logits), and the same test
must reject two deliberately broken rules, so that it can fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from arlm.config import ModelConfig
from arlm.engine import Engine, EngineConfig, FinishReason
from arlm.engine.block_pool import block_hash
from arlm.engine.speculative import verification
from arlm.engine.speculative import (Drafter, ModelDrafter, NgramDrafter, SpeculativeConfig, SpecState,
                                     verify)
from arlm.model import Transformer
from arlm.quant import quantize
from arlm.sampling import SamplingParams, penalized, warped_probs

from conftest import FixedStepCost, randomize_, run_arlm


STATIC = dict(block_size=None, max_num_seqs=1024, max_num_batched_tokens=1 << 20)
PAGED = dict(block_size=4, kv_cache_tokens=4096, max_num_batched_tokens=64)
GREEDY = dict(temperature=0.0, ignore_eos=True)


def tiny(seed: int = 3, vocab: int = 199, max_seq_len: int = 256, n_layer: int = 3) -> Transformer:
    """A random Llama-family model on the quantized kernels (rows independent of the batch)."""
    config = ModelConfig.llama(vocab_size=vocab, n_layer=n_layer, n_head=6, n_kv_heads=2, d_model=96, d_ff=160,
                               max_seq_len=max_seq_len, rope_theta=10000.0, tie_embeddings=False)
    torch.manual_seed(seed)
    model = randomize_(Transformer(config), seed).eval()
    return quantize(model, "int8", keep_dense=False)


@pytest.fixture(scope="module")
def model():
    return tiny()


def prompts(n: int, vocab: int = 199, seed: int = 0) -> list[list[int]]:
    """Ragged prompts; every third one repeats a phrase, so that prompt lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(0, vocab, (3 + (7 * i) % 23,), generator=g).tolist()
        out.append(p * 3 if i % 3 == 0 else p)
    return out


def generate(model, ps, params, drafter=None, eos_ids=(), **config):
    """(output ids, finish reasons, engine stats) of the prompts on one engine. Adaptive drafters
    draft by fixed step times, not the engine's clock (`conftest.FixedStepCost`): the same drafts
    on a quiet machine and a loaded one."""
    engine = Engine(model, eos_ids, EngineConfig(**{**STATIC, **config}))
    engine.step_cost = FixedStepCost()
    reqs = [engine.add_request(p, params if isinstance(params, SamplingParams) else params[i], drafter=drafter)
            for i, p in enumerate(ps)]
    while engine.has_unfinished():
        engine.step()
    return [r.output_ids for r in reqs], [r.finish_reason for r in reqs], engine


class WrongDrafter(Drafter):
    """Always proposes k tokens that differ from the target's greedy choice where it can tell
    (a fixed token, shifted): most of each draft is rejected, its K/V written all the same."""

    def propose(self, request, k):
        last = request.token_ids[-1]
        return [(last + 1 + j) % 199 for j in range(k)]


# -- exact greedy output ---------------------------------------------------------------------------

DRAFTERS = {
    "ngram": lambda m: NgramDrafter(SpeculativeConfig()),
    "ngram-fixed": lambda m: NgramDrafter(SpeculativeConfig(num_speculative_tokens=5, adaptive=False,
                                                            ngram_min=2, ngram_max=3)),
    "self-draft": lambda m: ModelDrafter(m.first_layers(1), SpeculativeConfig(num_speculative_tokens=3,
                                                                               adaptive=False), m),
    "other-model": lambda m: ModelDrafter(tiny(seed=11, n_layer=1), SpeculativeConfig(num_speculative_tokens=4,
                                                                                      adaptive=False), m),
    "wrong": lambda m: WrongDrafter(SpeculativeConfig(num_speculative_tokens=6, adaptive=False)),
}


@pytest.mark.parametrize("cache", ["static", "paged"])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_speculative_output_is_plain_output(model, name, cache):
    """Every prompt, every token: a ragged batch, and prompts alone."""
    config = {} if cache == "static" else PAGED
    ps = prompts(18)
    params = SamplingParams(max_new_tokens=40, **GREEDY)
    plain, _, _ = generate(model, ps, params, **config)
    drafter = DRAFTERS[name](model)
    spec, reasons, engine = generate(model, ps, params, drafter, **config)
    assert spec == plain
    assert reasons == [FinishReason.LENGTH] * len(ps)
    passes, accepted, proposed = engine.stats.spec_passes, engine.stats.spec_accepted, engine.stats.spec_proposed
    for i in (0, 1, 6):  # (at batch 18 the adaptive rule drafts little: the bar is high)
        out, _, engine = generate(model, [ps[i]], params, drafter, **config)
        assert out[0] == plain[i]
        passes, accepted, proposed = (passes + engine.stats.spec_passes, accepted + engine.stats.spec_accepted,
                                      proposed + engine.stats.spec_proposed)
    assert passes > 0 and 0 < accepted < proposed, "the test must draft, accept and reject"


def test_speculative_beside_prompt_chunks_and_preemption(model):
    """A small pool and token budget: drafts share steps with prompt chunks, requests are
    preempted and recomputed, prompts share prefixes (cached blocks, copy on write)."""
    base = prompts(1, seed=5)[0] * 2
    ps = [base + p for p in prompts(10, seed=6)] + prompts(6, seed=7)
    params = SamplingParams(max_new_tokens=30, **GREEDY)
    config = dict(block_size=4, kv_cache_tokens=4 * 60, max_num_batched_tokens=24, max_num_seqs=8)
    plain, _, _ = generate(model, ps, params, **config)
    for name in ("ngram-fixed", "wrong", "self-draft"):
        spec, _, engine = generate(model, ps, params, DRAFTERS[name](model), **config)
        assert spec == plain, name
        assert engine.scheduler.stats.preemptions > 0 and engine.scheduler.stats.prefix_hits > 0


def test_rollback_frees_blocks_and_caches_only_verified_tokens(model):
    """Rejected draft positions: their blocks go back to the pool, no cached block's hash covers
    them, and a later request that takes the cached blocks gets what a fresh engine gives."""
    ps = prompts(8, seed=2)
    params = SamplingParams(max_new_tokens=37, **GREEDY)
    engine = Engine(model, (), EngineConfig(**PAGED))
    drafter = WrongDrafter(SpeculativeConfig(num_speculative_tokens=7, adaptive=False))
    reqs = [engine.add_request(p, params, drafter=drafter) for p in ps]
    peak = 0
    while engine.has_unfinished():
        engine.step()
        for r in reqs:
            if not r.finished:  # no block past the verified tokens (and the one to come)
                assert len(r.blocks) <= -(-(r.num_computed + 1) // 4)
        peak = max(peak, engine.scheduler.pool.num_used)
    assert engine.stats.spec_proposed > 5 * engine.stats.spec_accepted
    pool = engine.scheduler.pool
    assert pool.num_free == pool.n_blocks  # everything returned
    verified = set()
    for r in reqs:
        window, parent = r.token_ids, None
        for i in range(len(window) // 4):
            parent = block_hash(parent, window[4 * i:4 * i + 4])
            verified.add(parent)
    assert pool.cached and set(pool.cached) <= verified
    # The cached blocks hold the right K/V: continue each sequence from them.
    more = [r.token_ids for r in reqs]
    fresh, _, _ = generate(model, more, params, **PAGED, enable_prefix_caching=False)
    again = [engine.add_request(p, params) for p in more]
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.stats.prefix_hits > sum(len(p) for p in ps)
    assert [r.output_ids for r in again] == fresh


def test_cuts_fall_where_plain_decoding_puts_them(model):
    """EOS, max_new_tokens and the context window end a sequence at the same token."""
    ps = prompts(9, seed=4)
    drafter = NgramDrafter(SpeculativeConfig(num_speculative_tokens=6, adaptive=False))
    # max_new_tokens from 1 up
    for n in (1, 2, 3, 7, 12):
        params = SamplingParams(max_new_tokens=n, **GREEDY)
        assert generate(model, ps, params, drafter)[0] == generate(model, ps, params)[0]
    # EOS: a token the plain outputs reach at different points
    plain, _, _ = generate(model, ps, SamplingParams(max_new_tokens=40, **GREEDY))
    eos = max(set(t for o in plain for t in o[3:]), key=lambda t: sum(t in o for o in plain))
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    for config in ({}, PAGED):
        a = generate(model, ps, params, eos_ids=[eos], **config)
        b = generate(model, ps, params, drafter, eos_ids=[eos], **config)
        assert a[:2] == b[:2] and FinishReason.EOS in a[1]
    # the context window (a model of 48 positions), stopping or shifting
    short = tiny(max_seq_len=48)
    long_ps = [p[:10] * 2 for p in prompts(6, seed=8)]
    params = SamplingParams(max_new_tokens=80, **GREEDY)
    for shift in (False, True):
        for config in ({}, PAGED):
            engine_a = Engine(short, (), EngineConfig(**{**STATIC, **config}))
            engine_b = Engine(short, (), EngineConfig(**{**STATIC, **config}))
            ra = [engine_a.add_request(p, params, context_shift=shift) for p in long_ps]
            rb = [engine_b.add_request(p, params, context_shift=shift, drafter=drafter) for p in long_ps]
            for e in (engine_a, engine_b):
                while e.has_unfinished():
                    e.step()
            assert [r.output_ids for r in ra] == [r.output_ids for r in rb]
            assert [r.finish_reason for r in ra] == [r.finish_reason for r in rb]
            assert {r.finish_reason for r in ra} == {FinishReason.LENGTH if shift else FinishReason.CONTEXT}
            assert engine_b.stats.spec_accepted > 0


def test_repetition_penalty_sees_the_draft(model):
    """Position j of a draft is penalized for the draft's first j tokens, as decoding would be."""
    ps = prompts(8, seed=9)
    params = SamplingParams(max_new_tokens=30, temperature=0.0, repetition_penalty=1.6, ignore_eos=True)
    # The target as its own draft, without the penalty: accepted until the penalty changes a choice.
    drafter = ModelDrafter(model, SpeculativeConfig(num_speculative_tokens=4, adaptive=False), model)
    spec, _, engine = generate(model, ps, params, drafter)
    assert spec == generate(model, ps, params)[0]
    assert 0 < engine.stats.spec_accepted < engine.stats.spec_proposed


@pytest.mark.parametrize("family", ["llama-int8", "gpt2"])
def test_first_layers_share_the_targets_tensors(model, family):
    """A self-draft is the target's first layers, final norm and head themselves: each of its
    parameters and buffers is the target's tensor of the same name (no copy, nothing left on
    the meta device it was built on)."""
    if family == "gpt2":  # learned positions and a tied head, unquantized
        config = ModelConfig.gpt2(vocab_size=199, n_layer=3, n_head=4, d_model=64, max_seq_len=64)
        model = randomize_(Transformer(config), 4).eval()
    draft = model.first_layers(2)
    assert draft.config.n_layer == 2 and len(draft.blocks) == 2 and not draft.training
    target = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    mine = {**dict(draft.named_parameters()), **dict(draft.named_buffers())}
    assert len(mine) > 10 and not any(t.is_meta for t in mine.values())
    assert all(t.data_ptr() == target[name].data_ptr() for name, t in mine.items())
    for n in (0, 3):
        with pytest.raises(ValueError, match="layers"):
            model.first_layers(n)


def test_ngram_proposes_what_followed_the_longest_match():
    d = NgramDrafter(SpeculativeConfig(ngram_min=1, ngram_max=3))

    def req(tokens):
        from arlm.engine.request import Request

        r = Request.create("r", tokens, SamplingParams(), 16)
        r.spec = SpecState()
        return r

    assert d.propose(req([1, 2, 3, 9, 9, 2, 3, 7, 7, 1, 2, 3]), 3) == [9, 9, 2]  # "1 2 3" beats "2 3"
    assert d.propose(req([5, 2, 3, 8, 4, 2, 3]), 2) == [8, 4]  # "2 3": its latest earlier end
    assert d.propose(req([5, 6, 7]), 4) == []
    r = req([4, 5, 6, 4, 5])
    assert d.propose(r, 4) == [6, 4, 5]  # runs up to the end of the list
    r.token_ids += [6, 4]  # the index keeps up as tokens arrive
    assert d.propose(r, 2) == [5, 6]


def test_draft_length_rule():
    """k grows with the acceptance estimate, shrinks under load, and is 0 where it cannot pay;
    estimates are kept per kind of proposal (the n-gram's match length)."""
    from arlm.engine.request import Request

    d = NgramDrafter(SpeculativeConfig(num_speculative_tokens=8))
    r = Request.create("r", [1, 2, 3, 4, 9, 1, 2, 3, 4], SamplingParams(), 16)
    r.spec = SpecState()
    base = d.draft_length(r, 8, 1)
    assert r.spec.kind == 4 and base > 0  # a 4-token match
    for _ in range(10):
        r.spec.record(5, 5)
    assert d.draft_length(r, 8, 1) > base and d.draft_length(r, 8, 1) == 8
    assert d.draft_length(r, 8, 8) > 0  # a request that keeps being right drafts beside 7 others
    assert d.draft_length(r, 3, 1) == 3 and d.draft_length(r, 0, 1) == 0
    for _ in range(20):  # alpha ~ 0.75: a few tokens alone, fewer beside 7 other decodes, none at 64
        r.spec.record(4, 3)
    assert 2 <= d.draft_length(r, 8, 1) < 8
    assert d.draft_length(r, 8, 8) < d.draft_length(r, 8, 1) and d.draft_length(r, 8, 64) == 0
    for _ in range(20):
        r.spec.record(5, 0)
    assert d.draft_length(r, 8, 1) == 0
    short = Request.create("s", [7, 1, 2, 3, 4, 9, 5, 4], SamplingParams(), 16)  # only "4" matches
    short.spec = r.spec  # the 4-gram estimate is low; the 1-gram one still at its prior
    assert d.draft_length(short, 8, 1) == 1 and short.spec.kind == 1
    for _ in range(200):  # not drafting, the estimate drifts back to the prior: it tries again
        d.draft_length(r, 8, 1)
    assert d.draft_length(r, 8, 1) > 0
    fixed = NgramDrafter(SpeculativeConfig(num_speculative_tokens=5, adaptive=False))
    assert fixed.draft_length(r, 8, 64) == 5
    none = Request.create("n", [5, 6, 7], SamplingParams(), 16)
    none.spec = SpecState()
    assert fixed.draft_length(none, 8, 1) == 0  # nothing to look up: no draft


def test_step_cost_follows_the_machine():
    """Step times by size from the engine's own steps: seen sizes as seen, others interpolated,
    or extrapolated by the prior but never below the largest sizes' slope; drafts follow them."""
    from arlm.engine.request import Request
    from arlm.engine.speculative import StepCost

    c = StepCost()
    assert c.time(3, 0.25) == 1 + 0.25 * 3  # nothing seen: the prior
    for n, t in ((1, 5.0), (2, 6.0), (8, 16.0), (9, 18.5)):
        c.observe(n, t)
    assert c.time(8, 0.25) == 16.0 and c.time(5, 0.25) == 11.0  # interpolated
    assert c.time(11, 0.25) == 23.5  # the last slope (2.5 per token), above the prior's
    c.observe(8, 18.0)
    assert c.time(8, 0.25) == 16.2  # an average, not the last step alone
    c.observe(8, 1000.0)
    assert c.time(8, 0.25) < 17.5  # a stalled step moves it by at most half the average
    d = NgramDrafter(SpeculativeConfig(num_speculative_tokens=8))
    r = Request.create("r", [1, 2, 3, 4, 9, 1, 2, 3, 4], SamplingParams(), 16)
    r.spec = SpecState()
    cheap, dear = StepCost(), StepCost()
    for n in range(1, 17):
        cheap.observe(n, 5.0 + 0.5 * n)  # extra rows nearly free
        dear.observe(n, 5.0 * n)  # every row costs a whole step
    assert d.draft_length(r, 8, 1, dear) == 0 < d.draft_length(r, 8, 1) < d.draft_length(r, 8, 1, cheap)


def test_adaptive_speculation_backs_off_a_drafter_that_never_helps(model):
    ps = prompts(4, seed=3)
    params = SamplingParams(max_new_tokens=60, **GREEDY)
    wrong = WrongDrafter(SpeculativeConfig(num_speculative_tokens=8))  # adaptive
    out, _, engine = generate(model, ps, params, wrong)
    assert out == generate(model, ps, params)[0]
    # all but the first few steps of each request run without a draft
    assert engine.stats.spec_passes < 0.3 * 60 * len(ps)


# -- sampling: the target's distribution -------------------------------------------------------------

def chi2_pvalue(stat: float, df: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def exact_distribution(model, prompt, params, n):
    """P(first n tokens) by enumeration: each prefix through the model, the warped distribution
    (the repetition penalty over the prompt and the prefix)."""
    vocab = model.config.vocab_size
    probs = {(): 1.0}
    with torch.inference_mode():
        for _ in range(n):
            nxt = {}
            for seq, p in probs.items():
                ids = prompt + list(seq)
                logits = model(torch.tensor([ids]))[:, -1]
                seen = torch.zeros(1, vocab, dtype=torch.bool)
                seen[0, torch.tensor(ids)] = True
                q = warped_probs(penalized(logits, [params], seen), [params])[0].double()
                for t in range(vocab):
                    if q[t] > 0:
                        nxt[seq + (t,)] = p * float(q[t])
            probs = nxt
    return probs


WARPS = {"top-k": dict(temperature=1.0, top_k=4),
         "top-p, min-p, penalty": dict(temperature=0.8, top_p=0.9, min_p=0.05, repetition_penalty=1.3)}


def chi2_test(model, drafter, samples=3000, n=3, warp="top-k"):
    prompt = [0, 1, 2, 3, 4, 5, 4, 3, 2, 1, 0, 4]  # every token: prompt lookup always finds one
    params = [SamplingParams(max_new_tokens=n, seed=s, ignore_eos=True, **WARPS[warp]) for s in range(samples)]
    out, _, engine = generate(model, [prompt] * samples, params, drafter)
    assert engine.stats.spec_proposed > samples // 2  # the draft decides tokens 2 .. n
    exact = exact_distribution(model, prompt, params[0], n)
    counts: dict[tuple, int] = {}
    for o in out:
        counts[tuple(o)] = counts.get(tuple(o), 0) + 1
    if not set(counts) <= set(exact):
        return 0.0  # a sequence the target's distribution cannot produce
    # cells with fewer than 5 expected draws are pooled into one
    stat, df, pooled_e, pooled_o = 0.0, -1, 0.0, 0
    for seq, p in exact.items():
        e = p * samples
        if e < 5:
            pooled_e += e
            pooled_o += counts.get(seq, 0)
            continue
        stat += (counts.get(seq, 0) - e) ** 2 / e
        df += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        df += 1
    assert df >= 5
    return chi2_pvalue(stat, df)


@pytest.fixture(scope="module")
def small():
    """Vocabulary of 6: the first tokens' joint distribution has few enough cells to test."""
    return tiny(seed=21, vocab=6, n_layer=2)


def test_sampled_speculation_keeps_the_distribution(small):
    ngram = NgramDrafter(SpeculativeConfig(num_speculative_tokens=2, adaptive=False))
    other = ModelDrafter(tiny(seed=5, vocab=6, n_layer=1), SpeculativeConfig(num_speculative_tokens=2, adaptive=False),
                         small)
    for warp in WARPS:
        assert chi2_test(small, ngram, warp=warp) > 0.01, warp
        assert chi2_test(small, other, warp=warp) > 0.01, warp


@pytest.mark.slow  # the statistical test's own power: it changes only with chi2_test
def test_the_chi2_test_catches_broken_rules(small, monkeypatch):
    ngram = NgramDrafter(SpeculativeConfig(num_speculative_tokens=2, adaptive=False))
    other = ModelDrafter(tiny(seed=5, vocab=6, n_layer=1), SpeculativeConfig(num_speculative_tokens=2, adaptive=False),
                         small)
    with monkeypatch.context() as m:  # accept every draft token
        m.setattr(verification, "acceptance_probability", lambda p, q: torch.ones_like(p))
        assert chi2_test(small, other) < 0.01
    with monkeypatch.context() as m:  # after a rejection, draw from p instead of the residual
        m.setattr(verification, "residual", lambda p, q: p)
        assert chi2_test(small, ngram) < 0.01


def test_verify_greedy_keeps_the_argmax_prefix():
    from arlm.engine.request import Request

    logits = torch.full((4, 10), -5.0)
    for j, t in enumerate([3, 4, 9, 1]):
        logits[j, t] = 5.0
    r = Request.create("r", [0], SamplingParams(temperature=0), 10)
    assert verify(logits, [r], [[3, 4, 5]]) == [[3, 4, 9]]  # rejected at the third: the correction
    assert verify(logits, [r], [[3, 4, 9]]) == [[3, 4, 9, 1]]  # all accepted: the bonus
    assert verify(logits, [r], [[7, 4, 9]]) == [[3]]


# -- the edges: LLM, CLI, serve ----------------------------------------------------------------------

COPY = ("Repeat this paragraph exactly:\n\nThe committee met on Tuesday to discuss the budget for the new "
        "library. After a long debate, they agreed to fund the project, but only if the city council "
        "approves the plan by the end of the month.")


@pytest.fixture(scope="module")
def llm(smollm2_default):
    return smollm2_default


def questions() -> list[str]:
    data = json.loads((Path(__file__).parent / "data" / "chat_questions.json").read_text())
    return [q["question"] for q in data["questions"]]


@pytest.mark.slow  # a whole-model sweep: 27 prompts, 4 ways; the tiny models cover each drafter in the fast suite
def test_smollm2_greedy_speculative_equals_plain(llm, monkeypatch):
    """The real model on its default path: 24 questions and 3 copy tasks, a ragged batch and
    alone, prompt lookup and a self-draft: identical tokens."""
    # (adaptive "ngram" drafts by fixed step times, not the machine's: under load the measured
    # ones can make it draft nothing, and `passes > 0` would fail)
    monkeypatch.setattr(llm.engine, "step_cost", FixedStepCost())
    texts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions()]
    texts += [llm.apply_chat_template([{"role": "user", "content": c}]) for c in
              (COPY, "Fix the spelling: Teh cat sat on teh mat and lookd at the brid.",
               "Edit this code to rename x to count:\n\ndef f(x):\n    return x + 1\n")]
    params = SamplingParams(max_new_tokens=48, temperature=0)
    plain = [c.token_ids for c in llm.generate(texts, params)]
    for spec in ("ngram", SpeculativeConfig("ngram", num_speculative_tokens=5, adaptive=False),
                 SpeculativeConfig("self:10", num_speculative_tokens=3, adaptive=False)):
        out = llm.generate(texts, params, speculative=spec)
        assert [c.token_ids for c in out] == plain, spec
        passes = out[0].stats.spec_passes  # (adaptive: few drafts at batch 27, where they rarely pay)
        for i in (0, len(texts) - 3, len(texts) - 1):
            alone = llm.generate(texts[i], params, speculative=spec)[0]
            assert alone.token_ids == plain[i]
            passes += alone.stats.spec_passes
        assert passes > 0
    copy = llm.generate(texts[-3], params, speculative=SpeculativeConfig("ngram", adaptive=False))[0]
    assert copy.stats.spec_tokens_per_pass > 2  # the copy task is where prompt lookup pays


@pytest.mark.slow  # float32 SmolLM2 decoded twice
def test_smollm2_float32_path_speculates_within_its_exact_rows(smollm2):
    """float32 matrices (--quantize none): above 4 rows a GEMM sums in its own order, so drafts
    stay within 4 tokens a step; there the output is still plain decoding's."""
    assert smollm2.runner.exact_rows == 4
    text = smollm2.apply_chat_template([{"role": "user", "content": COPY}])
    params = SamplingParams(max_new_tokens=40, temperature=0)
    plain = smollm2.generate(text, params)[0]
    spec = smollm2.generate(text, params, speculative=SpeculativeConfig("ngram", adaptive=False))[0]
    assert spec.token_ids == plain.token_ids and spec.stats.spec_accepted > 0
    assert spec.stats.spec_proposed <= 3 * spec.stats.spec_passes
    # two sequences: 4 tokens a step between them, drafts included
    texts = [text, smollm2.apply_chat_template([{"role": "user", "content": "Repeat: one two three four."}])]
    plain2 = [c.token_ids for c in smollm2.generate(texts, params)]
    spec2 = smollm2.generate(texts, params, speculative=SpeculativeConfig("ngram", adaptive=False))
    assert [c.token_ids for c in spec2] == plain2 and spec2[0].stats.spec_passes > 0


def test_smollm2_stop_strings_cut_where_plain_decoding_does(llm):
    text = llm.apply_chat_template([{"role": "user", "content": COPY}])
    params = SamplingParams(max_new_tokens=60, temperature=0)
    full = llm.generate(text, params)[0].text
    # (fixed drafts: the adaptive rule follows the machine's step times, and under load it may
    # decide that no draft pays, leaving nothing to cut)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=8, adaptive=False)
    for stop in ("library", "debate,", "council", "month"):  # (the last: EOS may come in the same step)
        assert stop in full
        p = SamplingParams(max_new_tokens=60, temperature=0, stop=[stop])
        a, b = llm.generate(text, p)[0], llm.generate(text, p, speculative=spec)[0]
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
        assert b.finish_reason == FinishReason.STOP and b.stats.spec_accepted > 0


def test_smollm2_sampled_speculation_runs_seeded(llm):
    # (adaptive, and still the same drafts on any machine: seeded requests draft by the prior
    # step cost, never the measured one)
    text = llm.apply_chat_template([{"role": "user", "content": COPY}])
    params = SamplingParams(max_new_tokens=40, temperature=0.7, seed=3)
    a = llm.generate(text, params, speculative="ngram")[0]
    b = llm.generate(text, params, speculative="ngram")[0]
    assert a.token_ids == b.token_ids and a.stats.spec_accepted > 0  # reproducible with a seed


def test_bad_speculative_settings(llm):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="n-gram"):
        SpeculativeConfig(ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="self:N"):
        llm.drafter("self:x")
    with pytest.raises(ValueError, match="layers"):
        llm.drafter("self:99")
    with pytest.raises(TypeError, match="speculative"):
        llm.drafter(3)


@pytest.mark.slow  # two model loads
def test_cli_generate_speculative(capfd):
    # (`arlm generate` through its main() in this process: the command's flags and output, without
    # a new interpreter's imports for each of its six runs)
    # (both at one fixed width: left to itself each would narrow under load, and where prefill
    # runs torch's float GEMMs, another width sums in another order)
    args = ("generate", COPY, "--chat", "--temperature", "0", "--max-new-tokens", "30", "--json",
            "--threads", str(torch.get_num_threads()))
    # (fixed drafts, --speculative-fixed: the adaptive rule follows the process's measured step
    # times, and under load it may draft nothing, leaving accepted == 0)
    r = run_arlm(capfd, *args, "--speculative", "ngram", "--speculative-fixed")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    plain = json.loads(run_arlm(capfd, *args).stdout)
    assert out["text"] == plain["text"]
    spec = out["stats"]["speculative"]
    assert spec["proposed"] >= spec["accepted"] > 0 and spec["tokens_per_pass"] > 1
    for bad, msg in ((["--speculative", "self:x"], "self:N"), (["--speculative", "no-such-model"], "unknown model"),
                     (["--speculative", "ngram", "--prompt-lookup-min", "5"], "n-gram"),
                     (["--speculative", "ngram", "--num-speculative-tokens", "0"], "positive integer")):
        r = run_arlm(capfd, "generate", "Hi", "--max-new-tokens", "2", *bad)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_serve_speculative_equals_plain(llm):
    """`arlm serve --speculative ngram`: greedy completions of concurrent clients are the plain
    path's, token for token, and /metrics counts the drafts."""
    import concurrent.futures as cf

    import openai

    from servers import ServerProcess

    # (fixed drafts: the server's adaptive rule follows its measured step times, and under load
    # it may draft nothing, leaving no drafts to count)
    server = ServerProcess("--speculative", "ngram", "--speculative-fixed", "--kv-cache-tokens", "8192")
    try:
        server.wait_ready()
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)
        texts = [COPY] + questions()[:11]
        params = SamplingParams(max_new_tokens=40, temperature=0)
        plain = [x.text for x in llm.generate([llm.apply_chat_template([{"role": "user", "content": t}])
                                                for t in texts], params)]

        def ask(t):
            r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": t}], max_tokens=40,
                                          temperature=0)
            return r.choices[0].message.content, r.usage.completion_tokens

        with cf.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(ask, texts))
        assert [g[0] for g in got] == plain
        m = server.wait_idle()
        assert m["arlm_spec_decode_num_accepted_tokens_total"] > 0
        assert m["arlm_spec_decode_num_draft_tokens_total"] >= m["arlm_spec_decode_num_accepted_tokens_total"]
        assert m["arlm_spec_decode_tokens_per_pass"] > 1
        assert m["arlm_generation_tokens_total"] == sum(g[1] for g in got)
    finally:
        server.stop()

