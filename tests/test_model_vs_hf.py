"""arlm's Transformer against HF transformers on the same random weights (GPT-2, Llama, and the
later Llama-shaped families: Qwen 2, Qwen 3, Llama 3's scaled RoPE, Gemma 3).

Reference: HF `GPT2LMHeadModel` / `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` /
`Gemma3ForCausalLM` (float32, eager attention), random weights of
a useful scale (see `conftest.randomize_`), converted by `hf_to_arlm` + `config_from_hf` and
loaded by `build_model`. Tolerance: max |Δ logits| <= 1e-4 in float32, with logits of std > 1.
"""

from __future__ import annotations

import pytest
import torch

from arlm.engine import decode_step, prefill
from arlm.kv_cache import KVCache
from arlm.loading import load_model
from arlm.loading.hf import config_from_hf

from conftest import arlm_from_hf, hf_family, hf_gpt2, hf_llama


ATOL = 1e-4

MODELS = {
    "gpt2-tied": lambda: hf_gpt2(seed=10, tie=True),
    "gpt2-untied": lambda: hf_gpt2(seed=11, tie=False),
    "gpt2-exact-gelu": lambda: hf_gpt2(seed=12, activation="gelu"),
    "llama-gqa-untied": lambda: hf_llama(seed=13, n_head=6, n_kv_heads=2, tie=False),
    "llama-gqa-tied": lambda: hf_llama(seed=14, n_head=6, n_kv_heads=2, tie=True),
    "llama-mqa": lambda: hf_llama(seed=15, n_head=6, n_kv_heads=1),
    "llama-mha": lambda: hf_llama(seed=16, n_head=4, n_kv_heads=4),
    "qwen2": lambda: hf_family("qwen2", seed=17),
    "qwen3": lambda: hf_family("qwen3", seed=18),
    "llama3-scaled-rope": lambda: hf_family("llama3", seed=19),
    "gemma3": lambda: hf_family("gemma3", seed=20),
}
LATER = ("qwen2", "qwen3", "llama3-scaled-rope", "gemma3")


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request):
    hf = MODELS[request.param]()
    return request.param, hf, arlm_from_hf(hf)


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits.float()


def test_config_maps_every_field(pair):
    name, hf, model = pair
    c, h = model.config, hf.config
    if name in LATER:  # (their switches: test_later_families_switches)
        return
    if name.startswith("gpt2"):
        expect = dict(vocab_size=h.vocab_size, n_layer=h.n_layer, n_head=h.n_head, n_kv_heads=h.n_head,
                      d_model=h.n_embd, d_ff=h.n_inner, max_seq_len=h.n_positions, norm_eps=h.layer_norm_epsilon,
                      tie_embeddings=h.tie_word_embeddings, pos_embedding="learned", norm="layernorm", mlp="gelu",
                      gelu_approximate="none" if h.activation_function == "gelu" else "tanh", bias=True)
    else:
        expect = dict(vocab_size=h.vocab_size, n_layer=h.num_hidden_layers, n_head=h.num_attention_heads,
                      n_kv_heads=h.num_key_value_heads, d_model=h.hidden_size, d_ff=h.intermediate_size,
                      max_seq_len=h.max_position_embeddings, norm_eps=h.rms_norm_eps,
                      rope_theta=h.rope_parameters["rope_theta"], tie_embeddings=h.tie_word_embeddings,
                      pos_embedding="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    assert {k: getattr(c, k) for k in expect} == expect
    assert (model.lm_head.weight is model.tok_emb.weight) == c.tie_embeddings


def test_full_sequence_logits_match_hf(pair):
    """Whole sequences, no cache, up to the full context window."""
    _, hf, model = pair
    g = torch.Generator().manual_seed(100)
    ids = torch.randint(0, model.config.vocab_size, (3, model.config.max_seq_len), generator=g)
    ref = hf_logits(hf, ids)
    with torch.no_grad():
        got = model(ids)
    assert ref.std() > 1.0, "logits too flat for the comparison to mean anything"
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_cached_decode_matches_hf_full_sequence(pair):
    """Prefill ragged prefixes (7 and 19 tokens) into a KVCache, then decode one token per step.

    Every step's logits must equal HF's full-sequence logits at that position (<= 1e-4).
    """
    _, hf, model = pair
    T = 48
    g = torch.Generator().manual_seed(101)
    seqs = torch.randint(0, model.config.vocab_size, (2, T), generator=g)
    ref = hf_logits(hf, seqs)  # [2, T, V]
    prefix = [7, 19]
    cache = KVCache.contiguous(model.config, batch_size=2, capacity=T)
    P = max(prefix)
    tokens = torch.zeros(2, P, dtype=torch.long)
    for b, n in enumerate(prefix):
        tokens[b, :n] = seqs[b, :n]
    input_pos = torch.arange(P).expand(2, P)
    with torch.inference_mode():
        logits = prefill(model, cache, tokens, input_pos, torch.tensor(prefix) - 1, kv_len=P)
        for b, n in enumerate(prefix):
            torch.testing.assert_close(logits[b], ref[b, n - 1], atol=ATOL, rtol=0)
        pos = torch.tensor(prefix)
        worst = 0.0
        # Rows advance together but sit 12 positions apart, so each decode step is ragged.
        while pos.max() < T:
            step_pos = pos.clamp(max=T - 1)
            step_tok = seqs[torch.arange(2), step_pos][:, None]
            logits = decode_step(model, cache, step_tok, step_pos[:, None], kv_len=int(step_pos.max()) + 1)
            for b in range(2):
                if pos[b] < T:
                    worst = max(worst, (logits[b] - ref[b, pos[b]]).abs().max().item())
            pos += 1
    assert worst <= ATOL, f"cached decode differs from HF by {worst:.2e}"


def test_later_families_switches():
    """config_from_hf switches on what each family has, and nothing else."""
    got = {name: config_from_hf(MODELS[name]().config.to_dict()) for name in LATER}
    q2, q3, l3, g3 = (got[n] for n in LATER)
    assert q2.qkv_bias and not q2.bias and not q2.qk_norm
    assert q3.qk_norm and q3.head_dim == 32 and q3.head_size == 32 and not q3.qkv_bias
    assert l3.rope_scaling["rope_type"] == "llama3" and l3.rope_theta == 500000.0
    assert (g3.mlp, g3.gelu_approximate, g3.norm_plus_one, g3.embed_scale, g3.post_norms, g3.qk_norm) == \
        ("geglu", "tanh", True, True, True, True)
    assert g3.layer_types == ("sliding",) * 5 + ("full", "sliding") and g3.sliding_window == 8
    assert g3.rope_theta == 1e6 and g3.rope_local_theta == 1e4 and g3.attn_scale == 24 ** -0.5


@pytest.mark.parametrize("name", ["gpt2-untied", "gpt2-tied", "llama-gqa-tied", "llama-mqa", *LATER])
def test_load_hf_directory(name, tmp_path):
    """save_pretrained (safetensors) -> arlm.loading.load_model(dir) gives the same logits."""
    hf = MODELS[name]()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    assert list(tmp_path.glob("*.safetensors"))
    loaded = load_model(str(tmp_path))
    assert loaded.source == "hf"
    assert loaded.config == config_from_hf(hf.config.to_dict())
    ids = torch.randint(0, hf.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(102))
    with torch.no_grad():
        got = loaded.model(ids)
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_unsupported_gpt2_activation_is_refused():
    from arlm.loading.errors import LoadError

    cfg = hf_gpt2(seed=0).config.to_dict()
    cfg["activation_function"] = "relu"
    with pytest.raises(LoadError, match="relu"):
        config_from_hf(cfg)


@pytest.mark.parametrize("name", LATER)
def test_paged_engine_equals_full_sequences(name):
    """The engine's paged pool (block tables; sliding layers through the pool's window) gives
    each prompt the greedy tokens of full-sequence forwards, for prompts and outputs past the
    sliding window, in one ragged batch with chunked prefill."""
    from arlm.engine import Engine, EngineConfig
    from arlm.sampling import SamplingParams

    hf = MODELS[name]()
    model = arlm_from_hf(hf)
    g = torch.Generator().manual_seed(103)
    prompts = [torch.randint(2, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 13, 21)]
    expect = []
    for p in prompts:  # greedy by full-sequence forwards, the reference's own logits
        ids = list(p)
        for _ in range(12):
            ids.append(int(hf_logits(hf, torch.tensor([ids]))[0, -1].argmax()))
        expect.append(ids[len(p):])
    engine = Engine(model, (), EngineConfig(block_size=4, kv_cache_tokens=256, max_num_batched_tokens=16))
    got = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.0))
    assert got == expect


@pytest.mark.parametrize("name", ["llama-gqa-untied", *LATER])
def test_gguf_of_each_architecture_loads_as_transformers_computes(name, tmp_path):
    """A GGUF written the way llama.cpp's converter writes one (tests/gguf_writer.py: its names,
    Llama's permuted q/k rows, Gemma's 1 + w norms; F32) loads to transformers' logits; with
    the matrices in Q8_0 the quantized path (the file's blocks as stored, the rest rounded to
    int8) loads too, close to the file's float weights."""
    from gguf_writer import write_gguf

    from arlm.loading import load_model

    # (GGUF has no query_pre_attn_scalar: llama.cpp takes head_dim, so the file's model must too)
    hf = hf_family("gemma3", seed=20, query_pre_attn_scalar=32) if name == "gemma3" else MODELS[name]()
    ids = torch.randint(2, hf.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(104))
    f32 = write_gguf(hf, tmp_path / "f32.gguf")
    loaded = load_model(str(f32))
    want = config_from_hf(hf.config.to_dict())
    assert (loaded.config.layer_types, loaded.config.head_dim, loaded.config.qkv_bias, loaded.config.qk_norm) == \
        (want.layer_types, want.head_dim, want.qkv_bias, want.qk_norm)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids), hf_logits(hf, ids), atol=ATOL, rtol=0)
    q8 = write_gguf(hf, tmp_path / "q8.gguf", quantize={"attn_q.weight", "attn_k.weight", "attn_v.weight",
                                                         "ffn_down.weight"})
    quantized = load_model(str(q8), quantized=True)
    floats = load_model(str(q8))
    with torch.no_grad():
        q, f = quantized.model(ids), floats.model(ids)
    # (the F32 matrices are held in float32 as they are, the Q8_0 ones as stored; only the
    # activations of the Q8_0 layers are rounded, to 8 bits x 2: close, not equal)
    assert quantized.requantized == []
    assert (q - f).abs().max() < 2e-3 * f.abs().max() and (q.argmax(-1) == f.argmax(-1)).float().mean() > 0.95


def test_attention_biases_arlm_does_not_hold_are_refused():
    from arlm.loading.errors import LoadError

    for name in ("qwen3", "llama-mqa"):
        cfg = MODELS[name]().config.to_dict()
        cfg["attention_bias"] = True  # (o_proj's bias too, in both)
        with pytest.raises(LoadError, match="attention biases"):
            config_from_hf(cfg)


def test_a_q4_k_m_style_file_runs_every_block_as_stored(tmp_path, monkeypatch):
    """Q4_K_M's mix, as llama.cpp writes it for Llama and Qwen: q and k in Q4_K beside v in Q6_K
    (one fused q/k/v of two kinds), gate in Q4_K beside up in Q5_K, Q5_K and Q6_K elsewhere, the
    head in Q6_K. Nothing is re-quantized: on the packed kernels every kind in its packed layout
    (KQuantLinear), on the row layout (AVX2 CPUs) with float32 scales (Q4Linear, Q8MinsLinear,
    Q8Linear). The fused weights are held in parts (SplitLinear), each as stored, and the
    native stack runs them (its WK, WV, UP slots); logits next to those of the file's float
    weights as gguf dequantizes them (read_gguf), the same after the kernel-layout cache, greedy
    tokens on the engine equal to the module path's."""
    from cpu_flags import packed_expected
    from gguf_writer import write_gguf

    from arlm.engine import Engine, EngineConfig, ModelRunner
    from arlm.kernels import packed_available
    from arlm.loading import build_model, cache
    from arlm.loading.gguf import read_gguf
    from arlm.quant import KQuantLinear, Q4Linear, Q8Linear, Q8MinsLinear, SplitLinear, prepare
    from arlm.sampling import SamplingParams

    packed = packed_expected()
    assert packed_available() == packed  # (the kernels loaded from their own cache before the models' moves)
    monkeypatch.setenv("ARLM_CACHE", str(tmp_path / "cache"))
    hf = hf_family("qwen2", seed=31, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=208)
    path = write_gguf(hf, tmp_path / "q4km.gguf", kquant={
        "attn_q.weight": "Q4_K", "attn_k.weight": "Q4_K", "attn_v.weight": "Q6_K", "attn_output.weight": "Q5_K",
        "ffn_gate.weight": "Q4_K", "ffn_up.weight": "Q5_K", "ffn_down.weight": "Q6_K", "output.weight": "Q6_K"})
    quantized = load_model(str(path), quantized=True)
    block = quantized.model.blocks[0]
    assert isinstance(block.attn.wqkv, SplitLinear) and block.attn.wqkv.bias is not None
    assert isinstance(block.mlp.gate_up, SplitLinear)
    assert quantized.requantized == []
    if packed:
        assert [p.kind for p in block.attn.wqkv.parts] == ["Q4_K", "Q4_K", "Q6_K"]
        assert isinstance(block.mlp.down, KQuantLinear)
    else:
        assert [type(p) for p in block.attn.wqkv.parts] == [Q4Linear, Q4Linear, Q8Linear]
        assert isinstance(block.mlp.down, Q8Linear) and isinstance(block.mlp.gate_up.parts[1], Q8MinsLinear)
    g = read_gguf(path)  # gguf's dequantization, not arlm's layers
    floats = build_model(g.config, g.state_dict)
    ids = torch.randint(2, 208, (2, 24), generator=torch.Generator().manual_seed(32))
    with torch.no_grad():
        q, f = quantized.model(ids), floats(ids)
    assert f.std() > 0.1 and (q - f).abs().max() < 1e-3 * f.abs().max()
    assert cache.cache_dir(path, "packed" if packed else "rows").is_dir()
    cached = load_model(str(path), quantized=True)  # (from the kernel-layout cache)
    with torch.no_grad():
        assert torch.equal(cached.model(ids), q)
    runner = ModelRunner(quantized.model)
    assert runner.native is not None
    prepare(cached.model, keep_dense=True)  # (--matmul-path float32: the parts keep no dense copy they never use)
    assert all(p.dense_weight is None for p in cached.model.blocks[0].attn.wqkv.parts)
    assert cached.model.blocks[0].mlp.down.dense_weight is not None
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [ids[0].tolist(), ids[1, :9].tolist()]
    native = Engine(runner, (), EngineConfig(block_size=4, kv_cache_tokens=128)).generate(prompts, params)
    modules = Engine(ModelRunner(quantized.model, decode_step), (), EngineConfig(block_size=None)).generate(prompts, params)
    assert native == modules
