"""The engine's parts on a tiny random model: block pool, paged attention, scheduler, sampler.

References: the contiguous `KVCache` path (paged logits equal to 1e-4 absolute, float32 on O(10)
logits), the same request run alone (tokens identical), and `sample` for one row (identical).
"""

from __future__ import annotations

import pytest
import torch

from arlm.cli_common import parse_size
from arlm.config import ModelConfig
from arlm.engine import Engine, EngineConfig, FinishReason
from arlm.engine.block_pool import BlockPool, block_hash
from arlm.kernels import native_available
from arlm.kv_cache import KVCache
from arlm.model import Transformer
from arlm.sampling import SamplingParams, min_p_filter, sample, sample_rows, top_k_filter, top_p_filter

from conftest import randomize_

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def tiny(pos_embedding: str = "rope", seed: int = 5) -> Transformer:
    family = ModelConfig.llama if pos_embedding == "rope" else ModelConfig.gpt2
    config = family(vocab_size=211, n_layer=2, n_head=4, n_kv_heads=2 if pos_embedding == "rope" else 4,
                    d_model=64, d_ff=128, max_seq_len=256)
    torch.manual_seed(seed)
    return randomize_(Transformer(config), seed).eval()


@pytest.fixture(scope="module")
def model():
    """int8 weights, as served on CPU: the int8 kernel computes each row of a batch on its own,
    so (with the paged kernel) a sequence's logits do not depend on what shares its batch."""
    from arlm import kernels
    from arlm.quant import quantize_int8

    if not kernels.native_available():
        pytest.fail("the native int8 kernel did not build (a C++ compiler is needed)")
    return quantize_int8(tiny())


def prompts_of(lengths, vocab=211, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# -- block pool ------------------------------------------------------------------------------------

def test_pool_allocates_frees_and_reports_utilization():
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    assert a != b and pool.num_used == 2 and pool.utilization == 0.5
    pool.release(a)
    assert pool.num_free == 3
    for _ in range(3):
        pool.allocate()
    assert pool.num_free == 0 and pool.utilization == 1.0
    with pytest.raises(RuntimeError):
        pool.allocate()
    pool.release(b)
    with pytest.raises(RuntimeError):
        pool.release(b)  # more releases than references: a bookkeeping bug, not ignored


def test_pool_prefix_cache_shares_revives_and_evicts_least_recent():
    pool = BlockPool(3)
    h1, h2 = block_hash(None, [1, 2]), block_hash(None, [3, 4])
    x = pool.allocate()
    pool.register(x, h1)
    assert pool.lookup(h1) == x and pool.ref_count[x] == 2 and pool.is_shared_or_cached(x)
    pool.release(x), pool.release(x)
    assert pool.num_free == 3  # free again, but still cached
    assert pool.lookup(h1) == x and pool.num_free == 2  # revived from the free queue
    pool.release(x)
    y = pool.allocate()
    pool.register(y, h2)
    pool.release(y)
    # Free queue order now: the never-used block, x (freed first), y. Two allocations evict x.
    pool.allocate(), pool.allocate()
    assert pool.lookup(h1) is None and pool.lookup(h2) == y


def test_block_hash_names_the_whole_prefix():
    a = block_hash(None, [1, 2, 3])
    assert block_hash(None, [1, 2, 3]) == a and block_hash(None, [1, 2, 4]) != a
    assert block_hash(a, [5]) != block_hash(block_hash(None, [9, 9, 9]), [5])  # same block, other prefix
    assert block_hash(None, [1, 23]) != block_hash(None, [12, 3])


def test_parse_size():
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("512MiB") == 512 * 2**20 and parse_size("1GB") == 10**9
    assert parse_size("1000") == 1000
    with pytest.raises(ValueError):
        parse_size("lots")


# -- paged attention == contiguous cache -----------------------------------------------------------

def paged_logits(model, prompts, chunk, use_kernel, block_size=8, next_token=7, dtype=torch.float32):
    """Prefill `prompts` in chunks through a paged cache with scattered block tables, all sequences
    flattened into each forward; then one decode step. Returns (last prompt logits, decode logits)."""
    cfg = model.config
    cache = KVCache.pool(cfg, 64, block_size, dtype=dtype, use_kernel=use_kernel)
    perm = (torch.randperm(63, generator=torch.Generator().manual_seed(1)) + 1).tolist()
    tables, i = [], 0
    for p in prompts:  # scattered, non-contiguous blocks per sequence
        n = -(-(len(p) + 1) // block_size)
        tables.append(perm[i:i + n])
        i += n
    width = max(map(len, tables))
    cache.set_batch(torch.tensor([t + [0] * (width - len(t)) for t in tables]), None)
    done, first = [0] * len(prompts), [None] * len(prompts)
    with torch.inference_mode():
        while any(d < len(p) for d, p in zip(done, prompts)):
            toks, pos, seq, outs, who = [], [], [], [], []
            for s, p in enumerate(prompts):
                n = min(chunk, len(p) - done[s])
                if n <= 0:
                    continue
                toks += p[done[s]:done[s] + n]
                pos += range(done[s], done[s] + n)
                seq += [s] * n
                done[s] += n
                if done[s] == len(p):
                    outs.append(len(toks) - 1)
                    who.append(s)
            cache.seq_index = torch.tensor(seq)
            logits = model(torch.tensor([toks]), torch.tensor([pos]), kv_cache=cache,
                           output_index=torch.tensor(outs or [0]))
            for j, s in enumerate(who):
                first[s] = logits[j]
        cache.seq_index = torch.arange(len(prompts))
        decode = model(torch.tensor([[next_token] * len(prompts)]), torch.tensor([[len(p) for p in prompts]]),
                       kv_cache=cache, output_index=torch.arange(len(prompts)))
    return torch.stack(first), decode


def contiguous_logits(model, prompts, next_token=7, dtype=torch.float32):
    firsts, decodes = [], []
    with torch.inference_mode():
        for p in prompts:
            cache = KVCache.contiguous(model.config, 1, 128, dtype=dtype)
            L = len(p)
            firsts.append(model(torch.tensor([p]), torch.arange(L)[None], kv_cache=cache, kv_len=L,
                                output_index=torch.tensor([L - 1]))[0])
            decodes.append(model(torch.tensor([[next_token]]), torch.tensor([[L]]), kv_cache=cache, kv_len=L + 1)[0, -1])
    return torch.stack(firsts), torch.stack(decodes)


@pytest.mark.parametrize("pos_embedding", ["rope", "learned"])
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
def test_paged_attention_matches_contiguous_cache(pos_embedding, use_kernel):
    if use_kernel and not native_available():
        pytest.fail("the paged-attention kernel did not build (a C++ compiler is needed)")
    m = tiny(pos_embedding)
    prompts = prompts_of([37, 5, 50, 16, 1])
    ref_first, ref_decode = contiguous_logits(m, prompts)
    assert ref_first.abs().max() > 3  # logits with a real spread, so a 1e-4 match means something
    for chunk in (64, 7, 1):
        first, decode = paged_logits(m, prompts, chunk, use_kernel)
        torch.testing.assert_close(first, ref_first, atol=1e-4, rtol=0)
        torch.testing.assert_close(decode, ref_decode, atol=1e-4, rtol=0)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
def test_float16_pool_matches_float16_contiguous_cache(use_kernel):
    # A float16 pool under a float32 model stores K/V rounded to float16 (nearest even, kernel and
    # torch alike) and attends in float32: the same logits as a float16 contiguous cache, and
    # visibly, but slightly, off the float32 cache's. Tolerance 1e-3 (logits up to ~21): the two
    # paths compute K in different batch shapes, and float32 noise there can round an element to
    # the neighbouring float16 (5e-4 relative) now and then.
    if use_kernel and not native_available():
        pytest.fail("the paged-attention kernel did not build (a C++ compiler is needed)")
    m = tiny("rope")
    prompts = prompts_of([37, 5, 50, 16, 1])
    ref_first, ref_decode = contiguous_logits(m, prompts, dtype=torch.float16)
    full_first, _ = contiguous_logits(m, prompts)
    assert 0 < (ref_first - full_first).abs().max() < 1e-2 * full_first.abs().max()
    for chunk in (64, 7):
        first, decode = paged_logits(m, prompts, chunk, use_kernel, dtype=torch.float16)
        torch.testing.assert_close(first, ref_first, atol=1e-3, rtol=0)
        torch.testing.assert_close(decode, ref_decode, atol=1e-3, rtol=0)


def test_kernel_is_batch_and_chunk_invariant(model):
    """Each query reads only its own sequence's keys in a fixed order: bit-identical logits."""
    if not native_available():
        pytest.fail("the paged-attention kernel did not build")
    prompts = prompts_of([37, 5, 50, 16])
    alone = [paged_logits(model, [p], 64, True) for p in prompts]
    for chunk in (64, 7, 3):
        first, decode = paged_logits(model, prompts, chunk, True)
        for s in range(len(prompts)):
            assert torch.equal(first[s], alone[s][0][0]) and torch.equal(decode[s], alone[s][1][0])


@pytest.mark.parametrize("heads", [(3, 1, 192), (5, 1, 320), (4, 2, 512)], ids=["G3-hd64", "G5-hd64", "G2-hd128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("block_size", [8, 16], ids=["blocks8", "blocks16"])
def test_prompt_runs_score_as_single_queries(heads, dtype, block_size):
    """A prompt chunk's tokens are scored 16 keys at a time for all of a run's queries
    (paged_attention.h, block_scores); one token at a time they take attend_group's dot products.
    Head sizes 64 and 128, query groups of 2, 3 and 5, 16-key blocks across pool blocks of 8 or
    from whole pool blocks of 16 (transposed in registers): the logits are bit for bit those of a
    one-token-at-a-time prefill (int8 weights: the linears compute each row on its own)."""
    if not native_available():
        pytest.fail("the paged-attention kernel did not build")
    n_head, n_kv, d = heads
    config = ModelConfig.llama(vocab_size=211, n_layer=2, n_head=n_head, n_kv_heads=n_kv, d_model=d,
                               d_ff=2 * d, max_seq_len=256)
    from arlm.quant import quantize_int8

    torch.manual_seed(3)
    m = quantize_int8(randomize_(Transformer(config), 3).eval())  # linears row-independent (int8)
    prompts = prompts_of([45, 20, 5, 33])
    one = paged_logits(m, prompts, 1, True, block_size=block_size, dtype=dtype)
    for chunk in (64, 7, 16):
        runs = paged_logits(m, prompts, chunk, True, block_size=block_size, dtype=dtype)
        assert torch.equal(runs[0], one[0]) and torch.equal(runs[1], one[1]), chunk


# -- scheduler and engine --------------------------------------------------------------------------

def engine(model, **kw) -> Engine:
    kw = {"kv_cache_tokens": 1024, "block_size": 8, **kw}
    return Engine(model, eos_ids=(), config=EngineConfig(**kw))


@pytest.mark.parametrize("kv_dtype", [None, torch.float16], ids=["model-dtype", "float16"])
def test_batched_chunked_and_preempted_outputs_equal_alone(model, kv_dtype):
    prompts = prompts_of([30, 3, 17, 9, 24, 1, 40, 12])
    lengths = [12, 5, 9, 12, 3, 12, 7, 10]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    e = engine(model, kv_dtype=kv_dtype)
    assert e.cache.k.dtype == (kv_dtype or torch.float32) and e.cache.use_kernel
    alone = [e.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    assert [len(a) for a in alone] == lengths
    assert e.generate(prompts, params) == alone
    small_chunks = engine(model, max_num_batched_tokens=5, kv_dtype=kv_dtype)
    assert small_chunks.generate(prompts, params) == alone
    # 8 blocks of 8 tokens for 8 sequences of up to 52 tokens: they cannot all be resident.
    tight = engine(model, kv_cache_tokens=64, kv_dtype=kv_dtype)
    assert tight.generate(prompts, params) == alone
    assert tight.scheduler.stats.preemptions > 0
    for e_ in (e, small_chunks, tight):
        assert e_.kv_cache_usage == 0.0 and not e_.requests


def test_chunked_prefill_does_not_stall_decodes(model):
    e = engine(model, max_num_batched_tokens=16)
    e.add_request(prompts_of([4])[0], GREEDY, "short")
    e.step()  # prefill "short"; it now decodes one token a step
    e.add_request(prompts_of([100], seed=1)[0], GREEDY, "long")
    for _ in range(4):
        batch_tokens = {out.request_id for out in e.step()}
        assert "short" in batch_tokens  # a decode every step while the long prompt is chunked in
    assert e.requests["long"].num_computed == 4 * 15  # budget 16: 1 decode + 15 prompt tokens a step


def test_prefix_cache_shares_blocks_and_keeps_outputs(model):
    system = prompts_of([40], seed=7)[0]
    users = prompts_of([5, 9, 3], seed=8)
    e = engine(model, block_size=8)
    no_cache = engine(model, block_size=8, enable_prefix_caching=False)
    expect = no_cache.generate([system + u for u in users], GREEDY)
    first = e.generate([system + users[0]], GREEDY)
    computed = e.scheduler.stats.computed_tokens
    rest = e.generate([system + u for u in users[1:]], GREEDY)
    assert first + rest == expect
    hits = e.scheduler.stats.prefix_hits
    assert hits == 2 * 40  # the 5 full blocks of the system prompt, for each later request
    # The later requests computed only their own tokens: the system prompt was prefilled once.
    assert e.scheduler.stats.computed_tokens - computed == sum(len(u) + 11 for u in users[1:])


def test_full_prefix_hit_copies_on_write(model):
    """A prompt whose every block is cached must still run its last token, which writes into a
    cached block: the writer gets a private copy and the cached block is left untouched."""
    prompt = prompts_of([16], seed=3)[0]  # exactly two blocks of 8
    e = engine(model, block_size=8)
    a = e.generate([prompt], GREEDY)[0]
    cached = e.scheduler.pool.cached[block_hash(block_hash(None, prompt[:8]), prompt[8:])]
    before = e.cache.k[:, cached].clone(), e.cache.v[:, cached].clone()
    b = e.generate([prompt], GREEDY)[0]
    assert a == b
    assert e.scheduler.stats.prefix_hits == 15 and e.scheduler.stats.copies_on_write == 1  # 16 cached, 1 rerun
    assert torch.equal(e.cache.k[:, cached], before[0]) and torch.equal(e.cache.v[:, cached], before[1])
    assert e.kv_cache_usage == 0.0


def test_abort_frees_blocks_at_once(model):
    e = engine(model)
    e.add_request(prompts_of([30])[0], SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True), "a")
    e.add_request(prompts_of([20], seed=2)[0], GREEDY, "b")
    e.step()
    e.step()
    assert e.kv_cache_usage > 0
    e.abort("a")
    assert e.stats.finished == {FinishReason.ABORT: 1}
    used = e.scheduler.pool.num_used
    assert used == len(e.requests["b"].blocks)
    e.abort("b")
    e.abort("b")  # twice, or after it finished: ignored
    assert e.kv_cache_usage == 0.0 and not e.has_unfinished()


def test_finish_reasons_and_request_checks(model):
    e = Engine(model, eos_ids=(5,), config=EngineConfig(kv_cache_tokens=64, block_size=8))
    assert e.max_model_len == 56  # one block kept in reserve for copy-on-write
    e.add_request([1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0.0), "a")
    while e.has_unfinished():
        e.step()
    assert e.stats.finished.get(FinishReason.LENGTH, 0) + e.stats.finished.get(FinishReason.EOS, 0) == 1
    # A request may ask for more tokens than the window holds (the HTTP API refuses that up
    # front, the engine does not): it runs until the tokens it feeds fill the window, the prompt
    # and every sampled token but the last, then stops with CONTEXT.
    long = e.add_request([1] * 50, SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True), "b")
    exact = e.add_request([1] * 50, SamplingParams(max_new_tokens=7, temperature=0.0, ignore_eos=True), "b2")
    while e.has_unfinished():
        e.step()
    assert long.finish_reason == FinishReason.CONTEXT and long.num_tokens == 57 == e.max_model_len + 1
    assert exact.finish_reason == FinishReason.LENGTH and exact.output_ids == long.output_ids
    assert e.kv_cache_usage == 0.0
    e.add_request([1] * 56, GREEDY, "full")  # a prompt that fills the window still gets its one token
    with pytest.raises(ValueError, match="context window"):
        e.add_request([1] * 57, GREEDY, "too-long")
    with pytest.raises(ValueError, match="out of range"):
        e.add_request([1, 999], GREEDY, "c")
    with pytest.raises(ValueError, match="empty"):
        e.add_request([], GREEDY, "d")
    with pytest.raises(ValueError, match="duplicate"):
        e.add_request([1, 2], GREEDY, "full")
    outputs = []
    while e.has_unfinished():
        outputs += e.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("full", FinishReason.CONTEXT)]


def test_eos_finishes_a_sequence(model):
    prompt = prompts_of([6])[0]
    free_run = engine(model).generate([prompt], GREEDY)[0]
    eos = free_run[3]
    e = Engine(model, eos_ids=(eos,), config=EngineConfig(kv_cache_tokens=256, block_size=8))
    out = e.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0.0))[0]
    assert out == free_run[:free_run.index(eos) + 1] and e.stats.finished == {FinishReason.EOS: 1}


# -- per-request sampling --------------------------------------------------------------------------

def test_sample_rows_greedy_rows_equal_sample():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)) * 4
    greedy = SamplingParams(temperature=0.0)
    params = [greedy, SamplingParams(temperature=0.8, seed=1), greedy, SamplingParams(temperature=1.2, top_k=5), greedy]
    out = sample_rows(logits, params, [None] * 5)
    ref = sample(logits, greedy)
    assert out[[0, 2, 4]].tolist() == ref[[0, 2, 4]].tolist()


def test_sample_rows_seeded_row_is_the_same_alone_or_batched():
    """Row b with its own generator draws exactly what `sample` draws for that row alone."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 500, generator=g) * 3
    seen = torch.rand(4, 500, generator=g) < 0.1
    params = [SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.3, seed=11),
              SamplingParams(temperature=0.0, repetition_penalty=1.1),
              SamplingParams(temperature=1.5, top_p=0.5, seed=12),
              SamplingParams(temperature=1.0, min_p=0.1, seed=13)]
    for step in range(3):
        gens = [torch.Generator().manual_seed(p.seed + 100 * step) if p.seed is not None else None for p in params]
        batched = sample_rows(logits, params, gens, seen)
        for b, p in enumerate(params):
            gen = torch.Generator().manual_seed(p.seed + 100 * step) if p.seed is not None else None
            alone = sample(logits[b:b + 1], p, gen, seen[b:b + 1])
            assert batched[b] == alone[0], (step, b)


def test_per_row_filters_equal_the_scalar_filters():
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(2)) * 3
    ks, ps, mins = [0, 5, 100], [1.0, 0.7, 0.3], [0.0, 0.05, 0.5]
    rows_k = top_k_filter(x, torch.tensor(ks)[:, None])
    rows_p = top_p_filter(x, torch.tensor(ps)[:, None])
    rows_m = min_p_filter(x, torch.tensor(mins)[:, None])
    for b in range(3):
        assert torch.equal(rows_k[b:b + 1], top_k_filter(x[b:b + 1], ks[b]))
        assert torch.equal(rows_p[b:b + 1], top_p_filter(x[b:b + 1], ps[b]))
        assert torch.equal(rows_m[b:b + 1], min_p_filter(x[b:b + 1], mins[b]))


def test_engine_seeded_request_is_reproducible_in_any_batch(model):
    e = engine(model)
    seeded = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.95, seed=42, ignore_eos=True)
    prompt = prompts_of([11])[0]
    alone = e.generate([prompt], seeded)[0]
    others = [SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True)] * 3
    batched = e.generate([prompt] + prompts_of([4, 20, 9], seed=5), [seeded] + others)[0]
    assert batched == alone
