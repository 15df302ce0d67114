"""Quantized KV caches (`--kv-dtype int8|int4`, arlm/kv_cache.py, kernels/attention.h).

The native kernels and the torch mirror must write the same bytes; the native step must read them
as the modules do (float tolerance: only the attention's arithmetic differs); a row's logits must
not depend on its batch or on the cache's layout (paged or contiguous: bit for bit, the kernels
compute each row alone); and the rounding must cost what the docs say, measured on SmolLM2. Last,
the sliding window with attention sinks (`KVCache.set_window`) against its definition.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from arlm.config import ModelConfig
from arlm.engine import Engine, EngineConfig, ModelRunner, decode_step
from arlm.kv_cache import KVCache, dequantize_rows, hadamard, quantize_rows, row_bytes
from arlm.sampling import SamplingParams

from conftest import arlm_from_hf, hf_llama
from test_fused_decode import _step_logits, native_decode_fn, val_tokens  # noqa: F401 (a fixture)

FORMATS = ("int8", "int4")


def _rows(n=200, hd=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hd, generator=g) * torch.rand(n, 1, generator=g) * 4
    x[:, 7] *= 25  # an outlier channel, as keys have
    return x


def test_hadamard_is_orthonormal_and_its_own_inverse():
    x = _rows()
    y = hadamard(x)
    assert torch.allclose(hadamard(y), x, atol=1e-4)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("value", [False, True])
def test_quantized_rows_round_trip_within_their_step(fmt, value):
    x = _rows()
    rows = quantize_rows(x, fmt, value)
    assert rows.dtype == torch.uint8 and rows.shape[-1] == row_bytes(fmt, 64)[value]
    back = dequantize_rows(rows, fmt, 64, value)
    if fmt == "int8":  # half a step of max|x| / 127 per group of 32 (+ the float16 scale's rounding)
        step = x.view(-1, 2, 32).abs().amax(-1, keepdim=True) / 127
        assert ((back - x).view(-1, 2, 32).abs() <= 0.5 * step * 1.01 + 1e-6).all()
    else:  # in the rotated space: half a step of (max - min) / (2^bits - 1) per group of 32
        bits, g = (4, 32) if value else (5, 32)
        r = hadamard(x).view(-1, 64 // g, g)
        step = (r.amax(-1, keepdim=True) - r.amin(-1, keepdim=True)) / (2 ** bits - 1)
        err = (hadamard(back) - hadamard(x)).view(-1, 64 // g, g).abs()
        assert (err <= 0.5 * step * 1.01 + 1e-3 * step + 1e-5).all()
    # the rotation spreads the outlier channel: 4-bit keys lose far less than they would unrotated
    if fmt == "int4" and not value:
        rel = ((back - x).norm() / x.norm()).item()
        assert rel < 0.04


def test_bytes_per_token_and_pool_capacity():
    """The formats' budgets on SmolLM2's shapes: bytes per token against float16 (int8 <= 0.55x,
    int4 <= 0.35x), and how many
    2,048-token sequences a fixed --kv-cache-memory holds."""
    cfg = ModelConfig(vocab_size=49152, d_model=576, n_layer=30, n_head=9, n_kv_heads=3, d_ff=1536,
                      max_seq_len=8192)
    per = {dt: KVCache.bytes_per_block(cfg, 16, dt) for dt in (torch.float16, "int8", "int4")}
    assert per[torch.float16] == 16 * 30 * 3 * 64 * 2 * 2  # 23,040 bytes a token
    assert per["int8"] / per[torch.float16] <= 0.55
    assert per["int4"] / per[torch.float16] <= 0.35
    memory = 2 << 30
    fits = {dt: memory // b // (2048 // 16) for dt, b in per.items()}
    assert fits["int8"] >= 1.8 * fits[torch.float16] and fits["int4"] >= 2.8 * fits[torch.float16]


def _model(seed=3):
    # head size 32: the smallest the quantized formats take
    return arlm_from_hf(hf_llama(seed=seed, n_head=4, n_kv_heads=2, hidden_size=128, max_position_embeddings=128))


def test_head_size_the_format_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        KVCache(1, 2, 16, 2, 16, "int8")
    with pytest.raises(ValueError, match="power of two"):
        KVCache(1, 2, 16, 2, 96, "int4")
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        KVCache(1, 2, 16, 2, 64, "int3")


@pytest.mark.parametrize("fmt", ("float32", "float16") + FORMATS)
def test_kernel_and_torch_paths_write_the_same_bytes(fmt):
    """The paged-attention op and the torch path (`_attend_torch`) over two caches: identical
    pools after a prefill and a mixed batch, outputs within float32 noise."""
    from arlm import kernels

    assert kernels.native_available()  # (make test builds them: a missing build must fail here)
    H, Hkv, D, BS = 8, 2, 64, 16
    caches = [KVCache(1, 10, BS, Hkv, D, fmt, use_kernel=use) for use in (True, False)]
    table = torch.tensor([[3, 5, 7, 0], [1, 2, 4, 6]])
    g = torch.Generator().manual_seed(1)
    steps = [(torch.ones(10, dtype=torch.long), torch.arange(10)),  # sequence 1's first 10 tokens
             (torch.tensor([0] * 25 + [1] * 15), torch.tensor(list(range(25)) + list(range(10, 25))))]
    for seq, pos in steps:
        q = torch.randn(1, H, len(pos), D, generator=g)
        k, v = torch.randn(1, Hkv, len(pos), D, generator=g) * 3, torch.randn(1, Hkv, len(pos), D, generator=g)
        k[..., 5] *= 20
        outs = []
        for c in caches:
            c.set_batch(table, seq)
            outs.append(c.attend(0, pos[None], q, k, v))
        assert (outs[0] - outs[1]).abs().max() <= 1e-5 * outs[1].abs().max()
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


@pytest.mark.parametrize("fmt", FORMATS)
def test_native_step_reads_a_quantized_cache_as_the_modules_do(fmt):
    model = _model()
    native = native_decode_fn(model)
    assert native is not None
    prompts = [[3, 5, 7, 9, 11], [2, 4], [8, 8, 8, 1, 2, 3, 4, 5, 6]]
    ref, got = _step_logits(model, prompts, 20, decode_step, fmt), _step_logits(model, prompts, 20, native, fmt)
    err = (got - ref).abs().amax(-1) / ref.abs().max()  # [steps, rows]
    # A quantized cache's queries are quantized too (kv_cache.quantize_query, the kernels' integer
    # scores). The two paths' queries differ in their last bits (their own RoPE and matmuls), so
    # now and then a value on a rounding boundary takes the other code: that step off by ~1e-3,
    # and the later steps of its row too (their keys were written from it). Unquantized queries
    # on the torch side put every step ~1e-3 off.
    assert err.median().item() <= 1e-5 and err.max().item() <= 5e-3
    full = _step_logits(model, prompts, 20, decode_step)  # the rounding shows, and stays small
    assert 0 < (ref - full).abs().max().item() <= (0.05 if fmt == "int8" else 0.3) * full.abs().max().item()


def _decode_logits(runner, cache, prompts, steps, rows_path):
    """Teacher-forced decode logits [steps, B, vocab]: each prompt prefilled alone, then all rows
    decoded together, through the rows path (contiguous cache) or block tables (paged pool)."""
    out, lens = [], [len(p) for p in prompts]
    tables = [[b] for b in range(len(prompts))] if rows_path else \
        [list(range(8 * b, 8 * b + 8)) for b in range(len(prompts))]
    with torch.inference_mode():
        for b, p in enumerate(prompts):
            runner.forward_flat(cache, p, list(range(len(p))), [0] * len(p), [tables[b]], [len(p) - 1])
        for s in range(steps):
            tok = [(7919 * s + 104729 * sum(p) + 13) % runner.config.vocab_size for p in prompts]
            pos = [n + s for n in lens]
            if rows_path:
                x = runner.native.embed(torch.tensor(tok))
                runner.native.decode(x, cache.k, cache.v, torch.tensor(pos), max(pos) + 1, cache.format)
                out.append(runner.native.head(x))
            else:
                out.append(runner.forward_flat(cache, tok, pos, list(range(len(prompts))), tables,
                                               list(range(len(prompts)))))
    return torch.stack(out)


@pytest.mark.parametrize("fmt", ("float16",) + FORMATS)
def test_paged_and_contiguous_caches_give_the_same_logits(fmt):
    model = _model(seed=5)
    runner = ModelRunner(model)
    assert runner.native is not None
    prompts = [[3, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59], [2, 4], [8, 8, 8, 1, 2, 3]]
    contiguous = _decode_logits(runner, KVCache.contiguous(model.config, 3, 64, fmt), prompts, 30, True)
    paged = _decode_logits(runner, KVCache.pool(model.config, 24, 8, fmt), prompts, 30, False)
    assert torch.equal(contiguous, paged)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [None, 16])
def test_a_prompt_gets_its_tokens_alone_or_in_any_batch(fmt, block_size):
    model = _model(seed=7)
    prompts = [[3, 5, 7, 9, 11], [2, 4], [8, 8, 8, 1, 2, 3, 4, 5, 6], [100, 3]]
    params = SamplingParams(max_new_tokens=24, temperature=0.9, seed=11, ignore_eos=True)

    def run(batch):
        engine = Engine(ModelRunner(model), (), EngineConfig(block_size=block_size, kv_dtype=fmt,
                                                             kv_cache_tokens=1024))
        return engine.generate(batch, params)

    together = run(prompts)
    for p, tokens in zip(prompts, together):
        assert run([p])[0] == tokens


@pytest.mark.slow  # SmolLM2 decoded twice; the tiny models cover speculative exactness in the fast suite
def test_speculative_decoding_over_a_quantized_cache_keeps_greedy_tokens():
    from arlm.engine.speculative import NgramDrafter, SpeculativeConfig

    model = _model(seed=9)
    assert ModelRunner(model).native is not None
    prompt = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]]
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    for fmt in FORMATS:
        plain = Engine(ModelRunner(model), (), EngineConfig(kv_dtype=fmt)).generate(prompt, params)
        engine = Engine(ModelRunner(model), (), EngineConfig(kv_dtype=fmt))
        spec = engine.generate(prompt, params, drafter=NgramDrafter(SpeculativeConfig(adaptive=False)))
        assert spec == plain and engine.stats.spec_proposed > 0


@pytest.mark.slow
def test_smollm2_perplexity_cost_of_each_format(smollm2, val_tokens):
    """On SmolLM2 (float32 weights) over 1,024 tokens of held-out Shakespeare,
    scored through the paged engine: int8 within 0.5% of the float32 cache's perplexity, int4
    within 3% (docs/benchmarks.md has the 2,048-context figures)."""
    llm = smollm2
    ppl = {}
    for fmt in (torch.float32, "int8", "int4"):
        engine = Engine(llm.runner, (), EngineConfig(kv_dtype=fmt, enable_prefix_caching=False,
                                                     max_num_batched_tokens=2048, kv_cache_tokens=2048))
        req = engine.add_request(val_tokens, SamplingParams(max_new_tokens=1, temperature=0), prompt_logits=True)
        while engine.has_unfinished():
            engine.step()
        logp = req.prompt_logits[:-1].log_softmax(-1)
        nll = -logp.gather(-1, torch.tensor(val_tokens[1:])[:, None]).mean().item()
        ppl[fmt] = math.exp(nll)
    assert ppl["int8"] <= ppl[torch.float32] * 1.005
    assert ppl["int4"] <= ppl[torch.float32] * 1.03


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefix_cache_and_preemption_over_a_quantized_pool(fmt):
    """Shared prompt blocks (prefix caching, copy-on-write) and preempted requests recomputed in a
    pool too small for all of them: the tokens of each request are those it gets alone."""
    model = _model(seed=13)
    shared = [(7 * i + 3) % 190 + 2 for i in range(40)]
    prompts = [shared + [5, 6], shared + [9], shared[:20] + [11, 12, 13], [4, 4, 4]]
    params = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    alone = [Engine(ModelRunner(model), (), EngineConfig(kv_dtype=fmt, enable_prefix_caching=False))
             .generate([p], params)[0] for p in prompts]
    engine = Engine(ModelRunner(model), (), EngineConfig(kv_dtype=fmt, block_size=8, kv_cache_tokens=160,
                                                         max_num_batched_tokens=32))
    assert engine.generate(prompts, params) == alone
    assert engine.scheduler.stats.prefix_hits > 0 and engine.scheduler.stats.preemptions > 0


# -- a sliding window with attention sinks (KVCache.set_window; paged_attention.h) ----------------

def _rope(x, pos, cos, sin):
    """x [..., T, d] rotated at positions pos [T] (the model's half-split RoPE)."""
    from arlm.model import apply_rope

    return apply_rope(x.transpose(-2, -3), cos[pos][:, None, :], sin[pos][:, None, :]).transpose(-2, -3)


def _window_case(fmt, use_kernel, W=8, S=2, n=40, seed=3, D=64):
    """One sequence of n tokens through a cache with a window of W (0: none) and S sinks, in
    chunks; (outputs [n, H, d], the cache, raw q and k [H, n, d] before RoPE, v, (cos, sin))."""
    from arlm.model import rope_table

    H, Hkv, BS = 4, 2, 16
    cos, sin = rope_table(D, 128, 10000.0)
    g = torch.Generator().manual_seed(seed)
    q_raw, k_raw = torch.randn(H, n, D, generator=g), torch.randn(Hkv, n, D, generator=g) * 2
    v = torch.randn(Hkv, n, D, generator=g)
    pos = torch.arange(n)
    q, k = _rope(q_raw, pos, cos, sin), _rope(k_raw, pos, cos, sin)
    cache = KVCache(1, 8, BS, Hkv, D, fmt, use_kernel=use_kernel)
    if W:
        cache.set_window(W, S, (cos, sin))
    table = torch.tensor([list(range(8))])
    outs = []
    for a, b in ((0, 9), (9, 10), (10, 27), (27, n)):  # prompt chunks and single decode tokens
        cache.set_batch(table, torch.zeros(b - a, dtype=torch.long))
        outs.append(cache.attend(0, pos[None, a:b], q[None, :, a:b], k[None, :, a:b], v[None, :, a:b])[0])
    return torch.cat(outs, dim=1).transpose(0, 1), cache, q_raw, k_raw, v, (cos, sin)


@pytest.mark.parametrize("fmt", ("float32", "float16") + FORMATS)
def test_windowed_kernel_matches_its_definition(fmt):
    from arlm import kernels

    assert kernels.native_available()
    native, cache_n, *_ = _window_case(fmt, True)
    torch_, cache_t, *_ = _window_case(fmt, False)
    assert torch.equal(cache_n.k, cache_t.k) and torch.equal(cache_n.v, cache_t.v)
    assert (native - torch_).abs().max() <= 1e-5 * torch_.abs().max()


@pytest.mark.parametrize("D", (64, 128))
@pytest.mark.parametrize("W", (0, 21))
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_kernel_matches_the_torch_reference(fmt, W, D):
    """Head sizes of one and two 64-byte pieces, 75 keys (16-key batches and a partial one), a
    window whose 3 sinks sit inside the first batch: the kernels' integer scores (int8, VNNI
    where built) and the torch path's dequantized arithmetic agree to float rounding."""
    native, cache_n, *_ = _window_case(fmt, True, W=W, S=3, n=75, D=D)
    torch_, cache_t, *_ = _window_case(fmt, False, W=W, S=3, n=75, D=D)
    assert torch.equal(cache_n.k, cache_t.k) and torch.equal(cache_n.v, cache_t.v)
    assert (native - torch_).abs().max() <= 1e-5 * torch_.abs().max()


def test_window_is_streamingllm_attention_over_positions_inside_the_cache():
    """Each query past the window attends to the sinks and its last W keys as if the cache held
    them at positions 0 .. S + W - 1 (sinks first, then the window in order) and the query sat at
    the last one: the reference rotates the raw q and k at those positions."""
    W, S, n = 8, 2, 40
    out, _, q_raw, k_raw, v, (cos, sin) = _window_case("float32", None, W, S, n)
    H, Hkv, D = q_raw.shape[0], k_raw.shape[0], q_raw.shape[2]
    for p in range(n):
        slots = list(range(p + 1)) if p < S + W else list(range(S)) + list(range(p - W + 1, p + 1))
        at = torch.arange(len(slots))  # positions inside the cache
        k = _rope(k_raw[:, slots], at, cos, sin).repeat_interleave(H // Hkv, 0)  # [H, len, D]
        qp = _rope(q_raw[:, p:p + 1], at[-1:], cos, sin)  # [H, 1, D]
        att = ((qp @ k.transpose(-1, -2)) * D ** -0.5).softmax(-1) @ v[:, slots].repeat_interleave(H // Hkv, 0)
        assert (out[p] - att[:, 0]).abs().max() <= 1e-4 * att.abs().max(), p


@pytest.mark.parametrize("fmt", ("float16", "int8"))
def test_a_window_wider_than_the_sequence_changes_nothing(fmt):
    plain, *_ = _window_case(fmt, None, W=0)
    wide, *_ = _window_case(fmt, None, W=40, S=4)  # position 39 still reads every slot
    narrow, *_ = _window_case(fmt, None, W=8, S=2)
    assert torch.equal(plain, wide)
    assert torch.equal(plain[:10], narrow[:10]) and not torch.equal(plain, narrow)


@pytest.mark.parametrize("fmt", ("float32", "int8"))
def test_engine_generates_past_the_context_with_a_window_in_bounded_blocks(fmt):
    """A windowed engine (EngineConfig.kv_window): a request runs to 3.5x the model's context
    (128 positions) holding at most the sinks' and the window's blocks; with a window wider than
    the whole request, the same tokens as without one, bit for bit."""
    model = _model(seed=17)
    W, S, bs, step = 24, 4, 8, 16
    prompt = [(5 * i + 3) % 190 + 2 for i in range(40)]

    def engine(window):
        return Engine(ModelRunner(model), (), EngineConfig(kv_dtype=fmt, block_size=bs, kv_cache_tokens=256,
                                                           max_num_batched_tokens=step, kv_window=window,
                                                           kv_sinks=S))

    e = engine(W)
    req = e.add_request(prompt, SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True))
    peak = 0
    while e.has_unfinished():
        e.step()
        peak = max(peak, e.scheduler.pool.num_used)
    assert req.num_output_tokens == 400 and req.num_tokens > 3 * 128
    assert peak <= -(-S // bs) + -(-(W + step) // bs) + 1
    assert e.scheduler.pool.num_used == 0  # all given back at the end
    params = SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True)
    plain = Engine(ModelRunner(model), (), EngineConfig(kv_dtype=fmt, block_size=bs, kv_cache_tokens=256,
                                                        max_num_batched_tokens=step)).generate([prompt], params)
    assert engine(120).generate([prompt], params) == plain
    assert engine(W).generate([prompt], params) != plain


def test_a_window_is_refused_where_it_cannot_run():
    model = _model(seed=17)
    with pytest.raises(ValueError, match="needs"):
        Engine(ModelRunner(model), (), EngineConfig(block_size=8, kv_cache_tokens=32, kv_window=24))
    from arlm.engine.speculative import NgramDrafter, SpeculativeConfig

    e = Engine(ModelRunner(model), (), EngineConfig(block_size=8, kv_cache_tokens=256, kv_window=24,
                                                    max_num_batched_tokens=16))
    with pytest.raises(ValueError, match="speculative"):
        e.add_request([3, 4, 5], SamplingParams(max_new_tokens=4), drafter=NgramDrafter(SpeculativeConfig()))


def test_stream_perplexity_through_a_window():
    """`perplexity.stream_nll`: a window wider than the text scores every token as full attention
    does (the prompt-logits path); a narrow one runs a text 3x the model's context in chunks."""
    from types import SimpleNamespace

    from arlm.perplexity import stream_nll, token_nll

    model = _model(seed=19)
    llm = SimpleNamespace(runner=ModelRunner(model), tokenizer=SimpleNamespace(eos_ids=()), kv_dtype=torch.float32)
    text = [(11 * i + 7) % 190 + 2 for i in range(100)]
    engine = Engine(llm.runner, (), EngineConfig(enable_prefix_caching=False, max_num_batched_tokens=16))
    req = engine.add_request(text, SamplingParams(max_new_tokens=1, temperature=0), prompt_logits=True)
    while engine.has_unfinished():
        engine.step()
    full = token_nll(req.prompt_logits[:-1], torch.tensor(text[1:]))
    assert np.array_equal(stream_nll(llm, text, window=120, sinks=4, chunk=16), full)
    long = [(11 * i + 7) % 190 + 2 for i in range(400)]  # the model's context is 128
    nll = stream_nll(llm, long, window=32, sinks=4, chunk=16)
    assert nll.shape == (399,) and np.isfinite(nll).all() and (nll > 0).all()
    # a prefix of the stream in the same chunks of 16 (float32 matrices sum by the chunk's rows):
    # the same numbers, bit for bit, whatever follows
    assert np.array_equal(nll[:47], stream_nll(llm, long[:48], window=32, sinks=4, chunk=16))
