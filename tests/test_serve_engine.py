"""The engine with a paged pool (as `arlm serve` runs it) on the real SmolLM2, in process.

References: `LLM.generate` over the contiguous cache (greedy tokens identical: the paged step's
logits differ from the contiguous cache's rows step by ~1e-5, far below the gaps between SmolLM2's top logits on these
prompts), the paged pool's logits against the contiguous cache's (1e-3 absolute on logits of
magnitude ~20), and the engine without prefix caching (tokens identical).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import pytest
import torch

from arlm.cli_common import parse_size
from arlm.engine import Engine, EngineConfig, ModelRunner, Request
from arlm.engine.scheduler import ScheduledBatch
from arlm.kv_cache import KVCache
from arlm.sampling import SamplingParams

PROMPTS = ["The cat sat on the", "Once upon a time, in a land far away,", "def fibonacci(n):",
           "The capital of France is", "Hello"]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2 as `arlm serve` runs it: int8 weights for every token, prefill too (no float
    copies), so `LLM.generate` below computes what the engine computes."""
    from arlm.llm import LLM
    from arlm.loading import resolve_model_path

    llm = LLM.load(str(resolve_model_path("smollm2")), quantize="int8")
    for module in llm.model.modules():
        if getattr(module, "dense_weight", None) is not None:
            module.dense_weight = None
    return llm


@pytest.fixture(scope="module")
def engine(smollm2):
    return Engine(smollm2.model, smollm2.tokenizer.eos_ids, EngineConfig(kv_cache_tokens=4096))


def test_paged_pool_logits_match_the_contiguous_cache(smollm2):
    # Float activations for this comparison: with 8-bit ones, the float32 noise between the two
    # attention paths can flip an activation's rounding, a 1e-2 logit difference that would hide
    # the error this test is for (a wrong slot or block is O(1)).
    model, cfg = copy.deepcopy(smollm2.model), smollm2.model.config
    for m in model.modules():
        if hasattr(m, "int8_activations"):
            m.int8_activations = False
    ids = [smollm2.tokenizer.encode(p) for p in PROMPTS[:3]]
    pool = KVCache.pool(cfg, 32, 16)
    tables = [[5, 17, 2], [9, 30, 11], [1, 25, 7]]  # scattered blocks
    flat = [t for p in ids for t in p]
    pool.set_batch(torch.tensor(tables), torch.tensor([s for s, p in enumerate(ids) for _ in p]))
    last = torch.tensor([len(p) for p in ids]).cumsum(0) - 1
    positions = torch.tensor([[i for p in ids for i in range(len(p))]])
    with torch.inference_mode():
        paged = model(torch.tensor([flat]), positions, kv_cache=pool, output_index=last)
        for s, p in enumerate(ids):
            cache = KVCache.contiguous(cfg, 1, 64)
            ref = model(torch.tensor([p]), torch.arange(len(p))[None], kv_cache=cache, kv_len=len(p),
                        output_index=torch.tensor([len(p) - 1]))
            assert ref.abs().max() > 10
            torch.testing.assert_close(paged[s], ref[0], atol=1e-3, rtol=0)


@contextmanager
def float_activations(model, llm=None):
    """Quantized weights with float32 activations (weight-only): then the engine and the
    contiguous-cache path differ only by float32 rounding, which greedy decoding absorbs; 8-bit
    activations can turn that rounding into a flipped near-tie. The native stack takes the
    activation mode when it binds the weights, so `llm`'s runner is bound again on the way in
    and on the way out."""
    layers = [m for m in model.modules() if hasattr(m, "int8_activations")]
    before = [m.int8_activations for m in layers]
    for m in layers:
        m.int8_activations = False
    if llm is not None:
        rebind(llm)
    try:
        yield
    finally:
        for m, b in zip(layers, before):
            m.int8_activations = b
        if llm is not None:
            rebind(llm)


def rebind(llm):
    r = llm.runner
    llm._start(ModelRunner(r.model, r.decode_fn, r.static_kv_len, r.dense_prefill))


def test_engine_greedy_equals_llm_generate(smollm2):
    ids = [smollm2.tokenizer.encode(p) for p in PROMPTS]
    with float_activations(smollm2.model, smollm2):
        engine = Engine(smollm2.model, smollm2.tokenizer.eos_ids, EngineConfig(kv_cache_tokens=4096))
        expect = [c.token_ids for c in smollm2.generate(PROMPTS, GREEDY)]
        assert engine.generate(ids, GREEDY) == expect
    assert engine.kv_cache_usage == 0.0


def test_engine_batch_equals_alone(engine, smollm2):
    # The served configuration (8-bit activations): a request's tokens do not depend on what it
    # is batched with, bitwise.
    ids = [smollm2.tokenizer.encode(p) for p in PROMPTS]
    together = engine.generate(ids, GREEDY)
    assert [engine.generate([p], GREEDY)[0] for p in ids] == together
    assert engine.kv_cache_usage == 0.0


def test_chunked_prefill_and_preemption_keep_outputs(smollm2):
    ids = [smollm2.tokenizer.encode(p) for p in PROMPTS[:3]]
    alone = Engine(smollm2.model, smollm2.tokenizer.eos_ids, EngineConfig(kv_cache_tokens=1024))
    expect = [alone.generate([p], GREEDY)[0] for p in ids]
    # 8 blocks of 4 tokens for three sequences of 13 to 17 tokens (11 blocks); 8 tokens a step.
    squeezed = Engine(smollm2.model, smollm2.tokenizer.eos_ids,
                      EngineConfig(kv_cache_tokens=32, block_size=4, max_num_batched_tokens=8))
    assert squeezed.generate(ids, GREEDY) == expect  # bit-identical logits, so identical tokens
    assert squeezed.scheduler.stats.preemptions > 0 and squeezed.kv_cache_usage == 0.0


def test_shared_system_prompt_is_prefilled_once(smollm2):
    system = "You are a helpful assistant for a hardware store. Answer briefly and mention prices in dollars. " * 3
    questions = ["Do you sell hammers?", "How much is a drill?", "I need nails."]
    prompts = [smollm2.tokenizer.encode(smollm2.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": q}])) for q in questions]
    runs = {}
    for caching in (False, True):
        e = Engine(smollm2.model, smollm2.tokenizer.eos_ids,
                   EngineConfig(kv_cache_tokens=2048, enable_prefix_caching=caching))
        outputs = [e.generate([p], SamplingParams(max_new_tokens=2, temperature=0.0))[0] for p in prompts]
        runs[caching] = outputs, e.scheduler.stats
    assert runs[True][0] == runs[False][0]
    shared = 0
    while all(p[shared] == prompts[0][shared] for p in prompts):
        shared += 1
    cached_per_request = shared // 16 * 16  # full blocks of the common prefix
    stats = runs[True][1]
    assert stats.prefix_hits == 2 * cached_per_request and cached_per_request >= 48
    assert runs[False][1].computed_tokens - stats.computed_tokens == 2 * cached_per_request


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_native_paged_forward_matches_the_modules(smollm2, kv_dtype):
    # The engine's one-call layer stack (forward_llama_paged, run by the model runner for a
    # batch of prompts over scattered blocks) against the modules over the same pool layout:
    # logits within 1e-3 (float activations, see float_activations). With a float16
    # pool, float32 noise between the two paths can round a K/V element to the neighbouring
    # float16 now and then (one ulp, ~5e-4 relative), which 30 layers carry to the logits: 1e-2 there.
    model, cfg = copy.deepcopy(smollm2.model), smollm2.model.config
    ids = [smollm2.tokenizer.encode(p) for p in PROMPTS[:3]]
    flat = torch.tensor([t for p in ids for t in p])
    seq_index = torch.tensor([s for s, p in enumerate(ids) for _ in p])
    positions = torch.tensor([i for p in ids for i in range(len(p))])
    last = torch.tensor([len(p) for p in ids]).cumsum(0) - 1
    tables = torch.tensor([[5, 17, 2], [9, 30, 11], [1, 25, 7]])
    with float_activations(model):
        engine = Engine(model, smollm2.tokenizer.eos_ids, EngineConfig(kv_cache_tokens=32 * 16, kv_dtype=kv_dtype))
        assert engine.runner.native is not None and engine.cache.use_kernel and engine.cache.k.dtype == kv_dtype
        batch = ScheduledBatch()
        for s, p in enumerate(ids):
            req = Request.create(f"r{s}", p, GREEDY, cfg.vocab_size)
            req.blocks = tables[s].tolist()
            batch.add(req, len(p))
        with torch.inference_mode():
            native, rows = engine.runner.execute(engine.cache, batch, by_rows=False)
            pool = KVCache.pool(cfg, 32, 16, dtype=kv_dtype)
            pool.set_batch(tables, seq_index)
            ref = model(flat[None], positions[None], kv_cache=pool, output_index=last)
    assert rows == [0, 1, 2]
    assert ref.abs().max() > 10
    half = kv_dtype == torch.float16
    torch.testing.assert_close(native, ref, atol=1e-2 if half else 1e-3, rtol=0)
    # the same K written to the same slots (a misplaced one would be off by O(1))
    torch.testing.assert_close(engine.cache.k.float(), pool.k.float(), atol=1e-2 if half else 1e-4,
                               rtol=2e-3 if half else 0)  # float16: a few ulps at most


def test_parse_size_units():
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("1.5GB") == 1_500_000_000
    assert parse_size("100TiB") == 100 * 2**40 and parse_size("2TB") == 2 * 10**12
    with pytest.raises(ValueError, match="not a memory size"):
        parse_size("lots")


def test_pool_larger_than_memory_is_refused_before_allocating(smollm2):
    # Allocating it would get the process OOM-killed, or fail deep in torch's allocator.
    with pytest.raises(ValueError, match="does not fit"):
        Engine(smollm2.model, smollm2.tokenizer.eos_ids, EngineConfig(kv_cache_tokens=10**12))
    with pytest.raises(ValueError, match="at least 2"):
        Engine(smollm2.model, smollm2.tokenizer.eos_ids, EngineConfig(kv_cache_memory=1))


def test_a_request_whose_sampling_fails_fails_alone(engine, smollm2):
    ids = [smollm2.tokenizer.encode(p) for p in PROMPTS[:3]]
    seeded = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=50, seed=7)
    expect = [engine.generate([ids[0]], GREEDY)[0], engine.generate([ids[1]], seeded)[0]]
    bad = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=5)
    for rid, p, sp in (("good-0", ids[0], GREEDY), ("good-1", ids[1], seeded), ("bad", ids[2], bad)):
        engine.add_request(p, sp, rid)
    bad.top_k = 2**63  # past validation, as a bug could let through: sampling its row raises
    outputs = {"good-0": [], "good-1": [], "bad": []}
    errors = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.error is not None:
                errors[out.request_id] = out.error
            else:
                outputs[out.request_id].append(out.token_id)
    # The bad request fails at its first token; the others (one of them seeded, drawn without
    # the batch on that step) get exactly the tokens they get alone.
    assert list(errors) == ["bad"] and "sampling failed" in errors["bad"] and outputs["bad"] == []
    assert [outputs["good-0"], outputs["good-1"]] == expect
    assert engine.kv_cache_usage == 0.0 and not engine.requests
    # ... and a request is validated in full when it comes in
    with pytest.raises(ValueError, match="top_k"):
        engine.check_request(ids[0], bad)


def test_a_long_prompt_shares_the_steps_of_decoding_streams(smollm2):
    """`long_prefill_tokens` (arlm serve's default 128): a long prompt runs in chunks of at most
    128 tokens while alone; while short requests decode or wait, long prompts get
    Scheduler.LONG_PREFILL_SHARED tokens a step, so every decode step stays near its own cost;
    and every request's tokens are those it gets alone."""
    from arlm.engine.scheduler import Scheduler

    long_ids = smollm2.tokenizer.encode("The history of the printing press. " * 60)  # ~420 tokens
    short = [smollm2.tokenizer.encode(p) for p in PROMPTS[:3]]
    engine = Engine(smollm2.model, smollm2.tokenizer.eos_ids, EngineConfig(
        kv_cache_tokens=2048, long_prefill_tokens=128, enable_prefix_caching=False))  # (every prompt token runs)
    expect = [engine.generate([p], GREEDY)[0] for p in [long_ids] + short]
    long_req = engine.add_request(long_ids, GREEDY)
    sizes = []  # (the long prompt's tokens, the step's other tokens) per step
    engine.step()
    assert long_req.num_computed == 128  # alone: a chunk of long_prefill_tokens
    reqs = [engine.add_request(p, GREEDY) for p in short]
    while engine.has_unfinished():
        before = long_req.num_computed
        engine.step()
        sizes.append((long_req.num_computed - before if long_req.num_output_tokens == 0 else 0,
                      sum(1 for r in reqs if not r.finished)))
    shared = [n for n, others in sizes if others and n]
    assert shared and max(shared) <= Scheduler.LONG_PREFILL_SHARED, sizes
    assert [long_req.output_ids] + [r.output_ids for r in reqs] == expect
    assert engine.kv_cache_usage == 0.0


def test_one_calls_choices_take_turns_while_others_run(smollm2):
    """`group_rows` (arlm serve's --max-running-choices): while another request runs, at most 2
    of a group's 6 choices step together; alone, all of them. Every request's tokens are those
    it gets alone (sampled choices: their own seeded streams)."""
    engine = Engine(smollm2.model, smollm2.tokenizer.eos_ids, EngineConfig(kv_cache_tokens=2048, group_rows=2))
    a, b = (smollm2.tokenizer.encode(p) for p in PROMPTS[:2])
    choices = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=s) for s in range(6)]
    expect_group = [engine.generate([b], p)[0] for p in choices]
    expect_single = engine.generate([a], GREEDY)[0]
    group = [engine.add_request(b, p, group="call-1") for p in choices]
    engine.step()
    assert sum(r.num_computed > 0 for r in group) == 6  # alone: every choice steps
    single = engine.add_request(a, GREEDY)
    while not single.finished:
        batch_before = {id(r): r.num_computed for r in group}
        engine.step()
        stepped = sum(r.num_computed != batch_before[id(r)] for r in group)
        assert stepped <= 2, stepped
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in group] == expect_group and single.output_ids == expect_single
    assert engine.kv_cache_usage == 0.0
