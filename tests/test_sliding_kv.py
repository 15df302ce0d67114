"""Sliding-window layers in a paged pool of their own (KVCache.split, Scheduler.split): a sequence
holds their blocks only for its window, so 5 of every 6 of Gemma 3's layers stop growing with the
context, and every engine feature stays exact across the window's edge (the contiguous cache, which
keeps every position, is the reference)."""

import pytest
import torch

from arlm.engine import Engine, EngineConfig
from arlm.sampling import SamplingParams
from arlm.engine.runner import ModelRunner
from arlm.engine.block_tables import FREED
from arlm.engine.speculative import Drafter, SpeculativeConfig
from arlm.kv_cache import KVCache

from conftest import FixedStepCost, arlm_from_hf, hf_family

WINDOW = 8  # hf_family("gemma3"): 7 layers, the 6th full, the others a window of 8


@pytest.fixture(scope="module")
def gemma():
    return arlm_from_hf(hf_family("gemma3", seed=31, max_position_embeddings=256))


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 199, (n,), generator=g).tolist() for n in (41, 5, 23, 9)]


def _greedy(n=24):
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def _contiguous(model, prompts, params, kv_dtype=None):
    engine = Engine(ModelRunner(model), (), EngineConfig(block_size=None, kv_dtype=kv_dtype))
    return engine.generate(prompts, params)


def _paged(model, kv_dtype=None, **kw):
    config = dict(block_size=4, kv_cache_tokens=512, max_num_batched_tokens=16, max_num_seqs=8, kv_dtype=kv_dtype)
    return Engine(ModelRunner(model), (), EngineConfig(**{**config, **kw}))


def _held(engine):
    """Live sliding-layer blocks of each running request."""
    return [sum(b != FREED for b in r.local_blocks) for r in engine.scheduler.running]


def _run_watching(engine, prompts, params):
    """generate, stepping by hand: the most sliding-layer blocks any request held at once."""
    reqs = [engine.add_request(p, params) for p in prompts]
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max([most, *_held(engine)])
    return [r.output_ids for r in reqs], most


@pytest.mark.parametrize("kv_dtype", [None, "int8", torch.bfloat16])
def test_split_pool_matches_the_contiguous_cache(gemma, kv_dtype):
    # float32 and int8 natively, bfloat16 through the modules (no native kernel): prompts past the
    # window in chunks of 16, greedy tokens equal to the contiguous cache's, each request holding
    # at most its window's blocks of the sliding layers, and every block back in the pools at the end.
    prompts, params = _prompts(), _greedy()
    engine = _paged(gemma, kv_dtype)
    cache = engine.cache
    assert cache.split and cache.k.shape[0] == 1 and cache.k_local.shape[0] == 6
    assert cache.use_kernel == (kv_dtype != torch.bfloat16)
    got, most = _run_watching(engine, prompts, params)
    assert got == _contiguous(gemma, prompts, params, kv_dtype)
    # the window's blocks, the one its edge is in and a step's 16 tokens (4 blocks) at most
    assert 0 < most <= WINDOW // 4 + 1 + 4
    s = engine.scheduler
    assert s.pool.num_free == s.pool.n_blocks and s.local.num_free == s.local.n_blocks


def test_bytes_per_token_count_the_full_layers():
    # Gemma 3 270M's shape (18 layers, every 6th full): a token of context adds the 3 full layers'
    # K/V; the sliding layers' blocks are sized for the running sequences' windows, and the memory
    # a budget holds goes to 6x the context an unsplit pool would hold.
    from arlm.config import ModelConfig

    cfg = ModelConfig(vocab_size=300, n_layer=18, n_head=4, n_kv_heads=1, d_model=64, head_size=256, max_seq_len=32768,
                      pos_embedding="rope", norm="rmsnorm", mlp="swiglu", bias=False, sliding_window=512,
                      layer_types=tuple("full" if i % 6 == 5 else "sliding" for i in range(18)))
    from arlm.model import Transformer
    model = Transformer(cfg)
    engine = Engine(ModelRunner(model), (), EngineConfig(kv_cache_memory=1 << 30, kv_dtype=torch.float16,
                                                         max_num_seqs=16))
    cache = engine.cache
    assert cache.split and cache.bytes_per_token == 3 * 2 * 256 * 2
    assert cache.nbytes <= 1 << 30
    unsplit = (1 << 30) // KVCache.bytes_per_block(cfg, 16, torch.float16)
    assert cache.n_blocks > 4 * unsplit  # (16 sequences' windows take their share)
    assert cache.n_local_blocks == 16 * (512 // 16 + 3) + 512 // 16


def _watch(fn, after):
    def wrapped(*a, **kw):
        out = fn(*a, **kw)
        after()
        return out
    return wrapped


def test_prefix_cache_hits_across_the_window_edge(gemma):
    # A second request sharing a 40-token prefix takes it from the cache: the full layers' blocks
    # and the sliding layers' blocks of the window before its continuation (the earlier ones were
    # given back); its tokens are what it gets on a fresh engine. The first request's sliding
    # blocks behind the window went back to the pool but stay cached until evicted.
    g = torch.Generator().manual_seed(9)
    prefix = torch.randint(2, 199, (40,), generator=g).tolist()
    first, second = prefix + [7, 8, 9], prefix + [11, 12]
    params = _greedy(12)
    alone = _paged(gemma).generate([second], params)
    engine = _paged(gemma)
    engine.generate([first], params)
    req = engine.add_request(second, params)
    while engine.has_unfinished():
        engine.step()
    assert req.num_cached_tokens == 40
    assert req.output_ids == alone[0]
    # the same prompt again (43 tokens): its 10 full blocks cached, and of the sliding layers' only
    # the 2 its window reads (positions 33 on); once it has run, those behind position 36's window
    # given back
    req = engine.add_request(first, params)
    engine.scheduler.schedule = _watch(engine.scheduler.schedule, lambda: seen.append(list(req.local_blocks)))
    seen = []
    engine.step()
    assert req.num_cached_tokens == 40
    assert seen[0][:8] == [FREED] * 8 and FREED not in seen[0][8:] and len(seen[0]) == 11
    assert req.local_blocks[:9] == [FREED] * 9 and FREED not in req.local_blocks[9:]


class HalfRightDrafter(Drafter):
    """Proposes the next 2 tokens the request will take (`solo`: its outputs alone), then wrong
    ones: each verification accepts 2 and rejects the rest, their K/V written all the same."""

    solo: dict[tuple[int, ...], list[int]] = {}

    def propose(self, request, k):
        done = request.num_output_tokens
        right = self.solo[tuple(request.prompt_ids)][done:done + 2]
        return (right + [(request.token_ids[-1] + 1 + j) % 199 for j in range(k)])[:k]


def test_preemption_and_speculation_stay_exact(gemma):
    # A pool too small for every request at once preempts (recomputing the victims, their windows
    # too), and speculation verifies drafts whose rejected tokens were written into the
    # sliding blocks past the accepted ones: the tokens of each request are its solo tokens.
    prompts = _prompts()
    params = _greedy(20)
    solo = [_contiguous(gemma, [p], params)[0] for p in prompts]
    tight = _paged(gemma, kv_cache_tokens=100)
    assert tight.generate(prompts, params) == solo
    assert tight.scheduler.stats.preemptions > 0
    spec = _paged(gemma)
    spec.step_cost = FixedStepCost()  # (drafts by fixed step times, not this machine's clock)
    drafter = HalfRightDrafter(SpeculativeConfig(num_speculative_tokens=4, adaptive=False))
    drafter.solo = {tuple(p): out for p, out in zip(prompts, solo)}
    for p, out in zip(prompts, solo):  # one at a time: room for drafts in a step of exact rows
        req = spec.add_request(p, params, drafter=drafter)
        while spec.has_unfinished():
            spec.step()
        assert req.output_ids == out
    assert spec.stats.spec_accepted > 0 and spec.stats.spec_proposed > spec.stats.spec_accepted
