"""The native layer stack (`kernels.llama.NativeLlama`, arlm/kernels/decode.cpp) against the module path.

Reference: `engine.decode_step`, the `Transformer` modules with the same cache. Float32 models:
logits within 1e-4 (relative to their scale) and identical greedy tokens. Quantized models (8-bit
activations): each token's rounding of activations can flip on float32 noise, so the check is
quality: the perplexity of teacher-forced decoding through the native step within 1% of the
float32 model's, and logits close to the module path's.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import pytest
import torch

from arlm import kernels
from arlm.engine import Engine, EngineConfig, ModelRunner, decode_step, prefill
from arlm.kernels import layout
from arlm.kernels.llama import NativeLlama
from arlm.kv_cache import KVCache
from arlm.quant import quantize
from arlm.sampling import SamplingParams

from conftest import arlm_from_hf, hf_family, hf_gpt2, hf_llama
from cpu_flags import native_kernels_expected, packed_expected

ROOT = Path(__file__).resolve().parents[1]


def native_decode_fn(model):
    """`decode_step`'s native twin (what the engine's rows path runs): embeddings, the layer
    stack and the head into buffers kept from step to step; None where the kernels do not apply."""
    native = NativeLlama.bind(model)
    if native is None:
        return None
    buffers = {}

    def step(model, cache, tokens, input_pos, kv_len):
        B = tokens.shape[0]
        if B not in buffers:
            buffers[B] = (torch.empty(B, model.config.d_model), torch.empty(B, model.config.vocab_size))
        x, logits = buffers[B]
        native.embed(tokens[:, 0], out=x)
        native.decode(x, cache.k, cache.v, input_pos[:, 0].contiguous(), kv_len, cache.format)
        return native.head(x, logits)

    return step


def _greedy(model, prompts, n, decode_fn, kv_dtype=None):
    """Greedy tokens through the engine (static batch, contiguous cache): decode steps by
    `decode_fn`, or natively where it is None; and whether they ran natively."""
    runner = ModelRunner(model, decode_fn)
    engine = Engine(runner, (), EngineConfig(block_size=None, kv_dtype=kv_dtype))
    out = engine.generate(prompts, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
    return out, runner.native is not None and decode_fn is None


def _step_logits(model, prompts, steps, fn, kv_dtype=torch.float32):
    """Logits of `steps` teacher-forced decode steps after a ragged prefill, with `fn`."""
    B, P = len(prompts), max(len(p) for p in prompts)
    cache = KVCache.contiguous(model.config, B, P + steps, dtype=kv_dtype)
    lens = torch.tensor([len(p) for p in prompts])
    out = []
    with torch.inference_mode():
        for b, p in enumerate(prompts):  # each row prefilled alone: the batch only meets in decode
            one = KVCache.contiguous(model.config, 1, len(p), dtype=kv_dtype)
            prefill(model, one, torch.tensor([p]), torch.arange(len(p))[None], torch.tensor([len(p) - 1]), len(p))
            cache.k[:, b, :, :len(p)], cache.v[:, b, :, :len(p)] = one.k[:, 0], one.v[:, 0]
        for s in range(steps):  # each row's tokens depend on its prompt alone, not on the batch
            tok = torch.tensor([[(7919 * s + 104729 * sum(p) + 13) % model.config.vocab_size] for p in prompts])
            pos = (lens + s)[:, None]
            out.append(fn(model, cache, tok, pos, int(pos.max()) + 1).clone())  # the native step reuses its buffer
    return torch.stack(out)


def test_rope_table_rows_are_computed_as_positions_reach_them(monkeypatch):
    # A long context's RoPE tables are computed ROPE_ROWS rows at first (here 64), the rest as
    # positions reach them, in place: the rows are those of a table computed at once, bit for
    # bit, and steps past the first rows give the logits they give with every row computed up
    # front, on the modules and on the native stack.
    from arlm import model as model_module
    from arlm.model import rope_table

    monkeypatch.setattr(model_module, "ROPE_ROWS", 64)
    model = arlm_from_hf(hf_llama(seed=19, max_position_embeddings=600))
    c = model.config
    assert model._rope_rows == 64 < model.rope_cos.shape[0] == c.max_seq_len
    full = copy.deepcopy(model)
    full.ensure_rope(c.max_seq_len)
    prompts = [[(7 * i) % 190 + 2 for i in range(300)], [3, 4, 5]]
    for native in (False, True):
        lazy = copy.deepcopy(model)
        fns = [native_decode_fn(m) if native else decode_step for m in (lazy, full)]
        assert torch.equal(_step_logits(lazy, prompts, 2, fns[0]), _step_logits(full, prompts, 2, fns[1]))
        assert lazy._rope_rows >= 302
    cos, sin = rope_table(c.head_dim, c.max_seq_len, c.rope_theta, c.rope_scaling)
    assert torch.equal(full.rope_cos, cos) and torch.equal(full.rope_sin, sin)


def test_sliding_layers_over_split_k_rows():
    # Gemma 3's sliding layers (window 8) on rows long enough for decode.cpp's split-K (over 1,024
    # slots): the full layers read every chunk, the sliding ones only their window's slots: the
    # modules' result (1e-4 of the logits' scale).
    model = arlm_from_hf(hf_family("gemma3", seed=29, max_position_embeddings=1200))
    prompts = [[(7 * i) % 190 + 2 for i in range(1100)], [5, 9, 11]]
    native = native_decode_fn(model)
    ref, got = _step_logits(model, prompts, 3, decode_step), _step_logits(model, prompts, 3, native)
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


@pytest.mark.parametrize("n_head,n_kv_heads", [(6, 2), (4, 1), (4, 4)])
def test_float_native_step_matches_modules(n_head, n_kv_heads):
    model = arlm_from_hf(hf_llama(seed=n_head + n_kv_heads, n_head=n_head, n_kv_heads=n_kv_heads))
    prompts = [[3, 5, 7, 9, 11], [2, 4], [8, 8, 8, 1, 2, 3, 4, 5, 6]]
    native = native_decode_fn(model)
    assert native is not None
    ref, got = _step_logits(model, prompts, 20, decode_step), _step_logits(model, prompts, 20, native)
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    plain, _ = _greedy(model, prompts, 30, decode_step)
    fused, ran_native = _greedy(model, prompts, 30, None)
    assert ran_native and fused == plain


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama3", "gemma3"])
def test_later_families_native_step_matches_modules(family):
    # Every switch decode.cpp's Arch carries: q/k/v biases (qwen2), per-head q/k norms and a
    # head_dim apart from d_model / n_head (qwen3), scaled RoPE tables (llama3), and Gemma 3's
    # GeGLU, (1 + w) norms, post norms, embedding scale, query scale and sliding-window layers
    # with their own RoPE base (window 8: the rows run past it). Both the contiguous cache (the
    # rows path) and the paged pool (block tables) against the modules, tokens and logits.
    model = arlm_from_hf(hf_family(family, seed=23))
    prompts = [[3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23], [2, 4], [8, 8, 8, 1, 2, 3, 4, 5, 6]]
    native = native_decode_fn(model)
    assert native is not None
    ref, got = _step_logits(model, prompts, 20, decode_step), _step_logits(model, prompts, 20, native)
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    plain, _ = _greedy(model, prompts, 30, decode_step)
    fused, ran_native = _greedy(model, prompts, 30, None)
    assert ran_native and fused == plain
    params = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    paged = Engine(ModelRunner(model), (), EngineConfig(block_size=4, kv_cache_tokens=256, max_num_batched_tokens=8))
    assert paged.runner.native is not None and paged.generate(prompts, params) == plain


def test_float16_cache_native_step_matches_modules():
    # A float16 cache under a float32 model: both paths store K/V rounded to float16 (nearest
    # even) and attend in float32, so the native step matches the modules as closely as with a
    # float32 cache (1e-4 of the logits' scale), and greedy decoding picks the same tokens.
    model = arlm_from_hf(hf_llama(seed=11, n_head=6, n_kv_heads=2))
    prompts = [[3, 5, 7, 9, 11], [2, 4], [8, 8, 8, 1, 2, 3, 4, 5, 6]]
    native = native_decode_fn(model)
    assert native is not None
    ref = _step_logits(model, prompts, 20, decode_step, torch.float16)
    got = _step_logits(model, prompts, 20, native, torch.float16)
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    full = _step_logits(model, prompts, 20, decode_step)  # and the rounding is visible, but small
    assert 0 < (ref - full).abs().max().item() <= 1e-2 * full.abs().max().item()
    params = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    tokens = []
    for fn in (decode_step, None):
        engine = Engine(ModelRunner(model, fn), (), EngineConfig(block_size=None, kv_dtype=torch.float16))
        tokens.append(engine.generate(prompts, params))
        assert engine.cache.k.dtype == torch.float16
    assert tokens[0] == tokens[1]


def test_native_stack_applies_only_where_it_can():
    gpt2 = arlm_from_hf(hf_gpt2())
    assert NativeLlama.bind(gpt2) is None  # LayerNorm, GELU, biases
    llama = arlm_from_hf(hf_llama())
    assert NativeLlama.bind(llama) is not None
    # A bfloat16 cache has no native kernel: the engine runs the modules, with the same tokens
    # as they give on their own.
    prompts = [[3, 5, 7], [2, 4]]
    native, _ = _greedy(llama, prompts, 8, None, kv_dtype=torch.bfloat16)
    assert native == _greedy(llama, prompts, 8, decode_step, kv_dtype=torch.bfloat16)[0]


# -- the constants shared with C++ (kernels/layout.py -> arlm_layout.h) ---------------------------

def test_layout_header_is_in_the_build_and_its_key(monkeypatch):
    """The kernels take LayerWeight, kExactRows and KVFormat from the header the build generates
    from layout.py: it is in the build's directory, and a different header (or a define) is a
    different build, so a changed layout can never meet a library built with the old one."""
    build = kernels._build_dir("arlm_kernels", kernels._SOURCES)
    if native_kernels_expected():
        assert kernels.native_available()
        assert (build / "arlm_layout.h").read_text() == layout.header()
    assert kernels._build_dir("arlm_kernels", kernels._SOURCES, ("ARLM_SOME_DEFINE",)) != build
    header = layout.header()
    monkeypatch.setattr(layout, "header", lambda: header.replace(f"kExactRows = {layout.EXACT_ROWS};",
                                                                 f"kExactRows = {layout.EXACT_ROWS + 1};"))
    assert kernels._build_dir("arlm_kernels", kernels._SOURCES) != build


def test_layout_header_holds_each_python_value(tmp_path):
    # The compiler reads the generated header and checks every value against Python's.
    (tmp_path / "arlm_layout.h").write_text(layout.header())
    names = [(layout.cpp_name(m.name, enum), int(m)) for enum in (layout.LayerWeight, layout.KVFormat)
             for m in enum] + [("kExactRows", layout.EXACT_ROWS)]
    assert {"kLayerWeights", "kGateUp", "kExactRows", "kInt4"} <= {n for n, _ in names}  # as the kernels spell them
    checks = "".join(f'static_assert(arlm_layout::{n} == {v}, "{n}");\n' for n, v in names)
    (tmp_path / "check.cpp").write_text(f'#include "arlm_layout.h"\n{checks}')
    proc = subprocess.run(["c++", "-std=c++17", "-fsyntax-only", str(tmp_path / "check.cpp")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(not native_kernels_expected(), reason="the native kernels are not built here")
def test_pass_timer_sums_each_pass_only_while_on():
    """decode.cpp's per-pass timer (benchmarks/phases.py): off by default, every pass of the native
    step (and the head) timed while on, and each read returns the sums since the last and zeroes them."""
    assert kernels.native_available()
    model = arlm_from_hf(hf_llama(seed=3))
    native = NativeLlama.bind(model)
    cache = KVCache.contiguous(model.config, 2, 8)

    def step(pos: int) -> None:
        x = native.embed(torch.tensor([1, 2]))
        native.decode(x, cache.k, cache.v, torch.tensor([pos, pos]), 1, cache.format)
        native.head(x)

    with torch.inference_mode():
        torch.ops.arlm.decode_profile(False)  # whatever an earlier test left
        step(0)
        assert torch.ops.arlm.decode_profile(True).tolist() == [0.0] * 9  # off: nothing summed
        step(1)
        seconds = torch.ops.arlm.decode_profile(False).tolist()  # [norm 1, q/k/v, ..., down, final norm + head]
        step(2)
        after = torch.ops.arlm.decode_profile(False).tolist()
    assert len(seconds) == 9 and all(t > 0 for t in seconds), seconds
    assert after == [0.0] * 9


def test_native_step_rows_are_independent():
    # A row's result does not depend on its batch: bitwise, for the quantized kernels.
    model = quantize(arlm_from_hf(hf_llama(seed=4, hidden_size=192, intermediate_size=256)), "int8")
    prompts = [[3, 5, 7, 9, 11], [2, 4], [8, 8, 8, 1, 2, 3, 4, 5, 6]]
    native = native_decode_fn(model)
    together = _step_logits(model, prompts, 6, native)
    for b, p in enumerate(prompts):
        alone = _step_logits(model, [p], 6, native_decode_fn(model))
        assert torch.equal(alone[:, 0], together[:, b])


@pytest.mark.slow
def test_smollm2_float_native_step_same_greedy_tokens(smollm2):
    prompts = [smollm2.tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    plain, _ = _greedy(smollm2.model, prompts, 48, decode_step)
    fused, ran_native = _greedy(smollm2.model, prompts, 48, None)
    assert ran_native
    assert fused == plain


@pytest.fixture(scope="module")
def val_tokens(smollm2):
    text = (ROOT / "data" / "tinyshakespeare.txt").read_text()
    return smollm2.tokenizer.encode(text[int(0.9 * len(text)):])[:1025]


def _decode_nll(model, tokens, fn, kv_dtype=torch.float32):
    """Mean next-token NLL of tokens[1:], each step decoding one token with the KV cache."""
    cache = KVCache.contiguous(model.config, 1, len(tokens), dtype=kv_dtype)
    nll = []
    with torch.inference_mode():
        logits = prefill(model, cache, torch.tensor([tokens[:1]]), torch.zeros(1, 1, dtype=torch.long),
                         torch.tensor([0]), 1)
        for t in range(1, len(tokens)):
            nll.append(torch.nn.functional.cross_entropy(logits, torch.tensor([tokens[t]])))
            if t < len(tokens) - 1:
                logits = fn(model, cache, torch.tensor([[tokens[t]]]), torch.tensor([[t]]), t + 1)
    return torch.stack(nll).mean().item()


def _forward_nll(model, tokens):
    """The same NLL from one uncached forward pass over the whole text."""
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        logits = model(ids)[0, :-1]
    return torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item()


@pytest.fixture(scope="module")
def forward_nll(smollm2, val_tokens):
    """mode -> (SmolLM2 quantized that way, or float32 for None; its uncached forward NLL), each
    made once for the module (the cases below share the float32 reference and the "auto" model)."""
    made = {}

    def get(mode):
        if mode not in made:
            model = smollm2.model if mode is None else quantize(copy.deepcopy(smollm2.model), mode)
            made[mode] = (model, _forward_nll(model, val_tokens))
        return made[mode]
    return get


@pytest.mark.parametrize("mode,kv_dtype", [("auto", torch.float16), ("auto", torch.float32),
                                           ("int8", torch.float32)])
@pytest.mark.slow
def test_quantized_native_step_perplexity(forward_nll, val_tokens, mode, kv_dtype):
    # 1,024 tokens decoded one at a time through the native step: perplexity within 1% of the
    # float32 model's, and of the same quantized model's uncached forward pass (module path).
    # ("auto" with a float16 cache is LLM's default on CPU.)
    model, module_nll = forward_nll(mode)
    native = native_decode_fn(model)
    assert native is not None
    nll = [forward_nll(None)[1], _decode_nll(model, val_tokens, native, kv_dtype), module_nll]
    ppl = torch.tensor(nll).exp()
    assert 5 < ppl[0] < 100
    assert abs(ppl[1] / ppl[0] - 1) <= 0.01, ppl  # the stated bound: within 1% of float32
    assert abs(ppl[1] / ppl[2] - 1) <= 0.01, ppl  # and next to the module path on the same weights


@pytest.mark.parametrize("mode", [None, "int8", "auto"])
def test_native_step_allocates_nothing(mode):
    # After the first step (which sizes its buffers), a native decode step allocates no tensor
    # memory: the embeddings, every intermediate and the logits live in buffers kept from
    # step to step. Counted by the profiler's allocator events. (The row-layout kernels still
    # allocate their outputs: CPUs without AVX-512 VNNI, and layers whose width is not a multiple
    # of 16, hence a vocabulary of 256 here.)
    if mode is not None and not packed_expected():  # where it must, a failed build fails this test
        pytest.skip("this CPU has no AVX-512 VNNI: its row-layout kernels allocate their outputs")
    model = arlm_from_hf(hf_llama(seed=5, hidden_size=192, intermediate_size=256, vocab_size=256))
    if mode is not None:
        model = quantize(model, mode)
    B = 4
    cache = KVCache.contiguous(model.config, B, 16)
    step = native_decode_fn(model)
    tokens = torch.randint(0, model.config.vocab_size, (B, 1), generator=torch.Generator().manual_seed(0))
    pos = torch.full((B, 1), 3), torch.full((B, 1), 4)
    with torch.inference_mode():
        first = step(model, cache, tokens, pos[0], 4).clone()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            second = step(model, cache, tokens, pos[1], 5)
    allocations = [e for e in prof.events() if e.cpu_memory_usage > 0]
    assert allocations == [], [(e.name, e.cpu_memory_usage) for e in allocations]
    assert torch.isfinite(second).all() and not torch.equal(first, second)  # it did run the step


@pytest.mark.parametrize("lengths", [(300, 3, 530), (1100, 3, 2100)], ids=["one-chunk", "split-k"])
def test_native_step_long_rows(lengths):
    # Rows of hundreds to thousands of cached slots beside a short one: still the modules' result
    # (float32: 1e-4 of the logits' scale), and a row's logits do not depend on its batch (bitwise,
    # quantized). Rows over 1,024 slots are attended in chunks of 1,024 combined by each chunk's
    # max and sum (decode.cpp's split-K): the second case has rows of one, two and three chunks.
    capacity = max(lengths) + 10
    model = arlm_from_hf(hf_llama(seed=13, max_position_embeddings=capacity + 90))
    prompts = [[(k * i) % 190 + 2 for i in range(n)] for k, n in zip((7, 5, 3), lengths)]
    native = native_decode_fn(model)
    ref, got = _step_logits(model, prompts, 4, decode_step), _step_logits(model, prompts, 4, native)
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    quantized = quantize(model, "int8")
    native = native_decode_fn(quantized)
    together = _step_logits(quantized, prompts, 4, native)
    for b, p in enumerate(prompts):
        one = native_decode_fn(quantized)
        alone = _step_logits(quantized, [p], 4, one)
        assert torch.equal(alone[:, 0], together[:, b])
