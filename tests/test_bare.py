"""`arlm generate` without torch (arlm.bare): its numpy embedding gathers against the torch path's,
its plan's model against the torch path (the same tokens, the same logits to the bit) on files of
every block type and family, and the command itself: the same text, torch never imported, and
the torch path wherever the plan does not serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from arlm.bare import gather, library, pieces, write
from arlm.bare.model import BareModel, BarePlan
from arlm.kernels import layout
from arlm.llm import LLM
from arlm.model_files import cache_dir
from arlm.quant import Int8Linear, Q4Linear, Q8Linear
from arlm.sampling import SamplingParams

from conftest import hf_family, hf_llama
from cpu_flags import packed_expected
from test_gguf_weights import _k_blocks, _k_layer

needs_packed = pytest.mark.skipif(not packed_expected(),
                                  reason="the bare path runs the packed kernels (AVX-512 VNNI or AVX2), not built here")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lib():
    """The bare library, built (once per machine and source version) and loaded."""
    path = library.build(layout.header(), wait=True)
    assert path is not None, (library.path().parent / "build.log").read_text()
    return library.Library(path)


@pytest.fixture
def bare_on(monkeypatch):
    monkeypatch.setenv("ARLM_BARE", "1")


# -- the embedding gathers -------------------------------------------------------------------------

def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32),
                                                                                        b.view(np.uint32))


@needs_packed
@pytest.mark.parametrize("kind", ["Int8Linear", "Q8Linear", "Q4Linear", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K"])
def test_numpy_gathers_the_torch_paths_rows(kind):
    """Every packed table kind: numpy's rows equal `dequantize_rows`' to the bit (fresh random
    weights each run), repeated and unordered indices included."""
    seed = int.from_bytes(os.urandom(2), "little")
    g = torch.Generator().manual_seed(seed)
    if kind in ("Int8Linear", "Q8Linear", "Q4Linear"):
        layer = {"Int8Linear": Int8Linear, "Q8Linear": Q8Linear, "Q4Linear": Q4Linear}[kind].from_float(
            torch.randn(64, 96, generator=g))
        layer._a8 = True
        layer.pack()
    else:
        layer = _k_layer(kind, _k_blocks(kind, 48, 2, seed=seed))
        layer.int8_activations = True
    assert layer.packed
    N = layer.out_features
    index = torch.tensor([N - 1, 0, 16, 5, 5, 31, N // 2])
    want = layer.dequantize_rows(index).numpy()
    arrays = [t.numpy() for t in layer.tensors()]
    got = gather.rows(type(layer).__name__, arrays, index.numpy(), getattr(layer, "kind", None))
    assert _same_bits(got, want), f"seed {seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_numpy_gathers_float_tables(dtype):
    w = torch.randn(40, 24).to(dtype)
    index = np.array([3, 39, 0, 3])
    arrays = [w.view(torch.uint16).numpy() if dtype == torch.bfloat16 else w.numpy()]
    assert _same_bits(gather.rows("dense", arrays, index), w[torch.from_numpy(index)].float().numpy())


def test_an_unknown_table_kind_is_refused():
    with pytest.raises(ValueError, match="no numpy gather"):
        gather.rows("Q8MinsLinear", [np.zeros((1, 1))], np.array([0]))


# -- the plan's model against the torch path -------------------------------------------------------

# Llama files of the loader's kinds (tests/test_cache_build.py's), Qwen 2 (q/k/v biases), Qwen 3
# (q/k norms) and Gemma 3 (sliding windows and their RoPE base, GeGLU, post norms, the scaled
# embedding), K-quant matrices throughout.
KQ = {"attn_q.weight": "Q4_K", "attn_k.weight": "Q4_K", "attn_v.weight": "Q6_K", "attn_output.weight": "Q4_K",
      "ffn_gate.weight": "Q4_K", "ffn_up.weight": "Q4_K", "ffn_down.weight": "Q6_K"}
MODELS = {
    "llama-tied-kquant": (lambda: hf_llama(seed=41, n_head=4, n_kv_heads=2, hidden_size=256, intermediate_size=512,
                                           vocab_size=208, tie=True),
                          {**KQ, "ffn_up.weight": "Q5_K", "attn_output.weight": "Q8_0", "token_embd.weight": "Q6_K"}),
    "llama-untied-mixed": (lambda: hf_llama(seed=42, n_head=4, n_kv_heads=2, hidden_size=256, intermediate_size=512,
                                            vocab_size=208, tie=False),
                           {"attn_q.weight": "Q8_0", "attn_k.weight": "Q5_0", "attn_v.weight": "Q4_0",
                            "attn_output.weight": "Q6_K", "ffn_gate.weight": "Q4_1", "ffn_up.weight": "Q4_1",
                            "ffn_down.weight": "Q5_K", "output.weight": "Q8_0"}),
    "qwen2": (lambda: hf_family("qwen2", seed=43, hidden_size=256, intermediate_size=512, vocab_size=208,
                                num_attention_heads=4, num_key_value_heads=2), {**KQ, "output.weight": "Q6_K"}),
    "qwen3": (lambda: hf_family("qwen3", seed=44, hidden_size=256, intermediate_size=512, vocab_size=208,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64),
              {**KQ, "token_embd.weight": "Q8_0"}),
    "gemma3": (lambda: hf_family("gemma3", seed=45, hidden_size=256, intermediate_size=512, vocab_size=208,
                                 head_dim=64), {**KQ, "token_embd.weight": "Q6_K"}),
}


@pytest.fixture(scope="module", params=list(MODELS))
def gguf_file(request, tmp_path_factory):
    from gguf_writer import write_gguf

    make, kquant = MODELS[request.param]
    return write_gguf(make(), tmp_path_factory.mktemp("bare") / f"{request.param}.gguf", kquant=kquant)


def _bare_tokens(model: BareModel, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    k, v = model.new_cache(len(ids) + n)
    logits = model.prefill(ids, k, v)
    first = logits.copy()  # (the buffer is the next step's)
    out = []
    for i in range(n):
        out.append(model.next_token(logits))
        if i + 1 < n:
            logits = model.decode(out[-1], len(ids) + i, k, v)
    return out, first


@needs_packed
@pytest.mark.parametrize("activations", ["int8x2", "int8"])
def test_the_plans_model_decodes_as_the_torch_path(gguf_file, activations, lib, bare_on):
    """Greedy tokens equal the torch path's (its engine, LLM.generate) for prompts of several
    lengths (a Gemma prompt past its window of 8), and the prompt's logits equal the native
    stack's torch ops on the same cache to the bit."""
    llm = LLM.load(str(gguf_file), activations=activations)
    write.save(llm, activations)  # (None where an earlier run wrote it: this file's bytes are seeded)
    assert write._current(cache_dir(gguf_file, "packed") / f"bare-{activations}.json")
    model = BareModel(BarePlan(cache_dir(gguf_file, "packed"), activations), lib)
    rng = np.random.default_rng(int.from_bytes(os.urandom(2), "little"))
    for n in (1, 7, 23):
        ids = [int(t) for t in rng.integers(2, 208, n)]
        want = llm.generate([ids], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
        got, logits = _bare_tokens(model, ids, 12)
        assert got == want, (n, ids)
        native = llm.runner.native
        T = n + 1
        shape = (llm.model.config.n_layer, 1, llm.model.config.n_kv_heads, T, llm.model.config.head_dim)
        k, v = torch.zeros(shape, dtype=torch.float16), torch.zeros(shape, dtype=torch.float16)
        x = native.embed(torch.tensor(ids))
        native.forward(x, k, v, torch.zeros(1, 1, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                       torch.arange(n))
        assert _same_bits(logits, native.head(x[-1:].contiguous())[0].numpy())


@needs_packed
@pytest.mark.parametrize("table", ["Q4_K", "float"])
def test_a_model_off_the_packed_layouts_gets_no_plan(table, tmp_path, bare_on):
    """200 rows (no whole tiles of 16; tests/test_cache_build.py's "ragged" file): a quantized
    table has no numpy gather, and with a float table the head (Q8_0) stays in the row layout,
    which the bare build does not run: no plan either way, so its commands keep the torch path."""
    from gguf_writer import write_gguf

    hf = hf_llama(seed=46, n_head=4, n_kv_heads=2, hidden_size=256, intermediate_size=512, vocab_size=200, tie=False)
    kquant = {**KQ, "output.weight": "Q8_0"} | ({"token_embd.weight": "Q4_K"} if table == "Q4_K" else {})
    path = write_gguf(hf, tmp_path / "ragged.gguf", kquant=kquant)
    llm = LLM.load(str(path))
    plan = cache_dir(path, "packed") / "bare-int8x2.json"
    plan.unlink(missing_ok=True)  # (one an older arlm wrote for these seeded bytes)
    assert write.save(llm, "int8x2") is None
    assert not plan.exists()


# -- SentencePiece's BPE without HF's parse (arlm.bare.pieces) ------------------------------------

@pytest.fixture(scope="module")
def gemma_tokenizer():
    """Gemma 3 270M's tokenizer (arlm's, HF tokenizers underneath) and its arrays."""
    tokenizer = LLM.load("gemma3-270m").tokenizer
    arrays = pieces.build(tokenizer.backend.to_str())
    assert arrays is not None
    return tokenizer.backend, pieces.PieceTokenizer(arrays)


def _strings(rng: np.random.Generator) -> list[str]:
    """Shakespeare's text, strings of the characters where BPE's order and the added tokens'
    cut matter, and random code points (no surrogates)."""
    text = (ROOT / "data" / "tinyshakespeare.txt").read_text()
    out = [text[i:i + n] for i, n in zip(rng.integers(0, len(text) - 1500, 150), rng.integers(1, 1500, 150))]
    alphabet = list("ab  ▁▁\n\n\t<>_unused0123456789é中😀\u0301\ufffd\x00") + ["<start_of_turn>", "<eos>", "<unused12>",
                                                                          "\n\n\n", "aaa", "<<bos>>"]
    out += ["".join(rng.choice(alphabet, rng.integers(0, 40))) for _ in range(1000)]
    planes = [c for c in rng.integers(1, 0x30000, 6000) if not 0xD800 <= c < 0xE000]
    out += ["".join(map(chr, planes[i:i + 20])) for i in range(0, len(planes), 20)]
    return out + pieces.PROBES


def test_piece_tokenizer_gives_hf_tokenizers_ids_and_text(gemma_tokenizer):
    """Gemma 3 270M's tokenizer as arrays: HF tokenizers' ids for ~1,450 strings, and its text
    back for those ids and for random ids (byte pieces, special tokens, out of range), with and
    without the special tokens."""
    hf, mine = gemma_tokenizer
    rng = np.random.default_rng(0)
    assert pieces.same_as(mine, hf, _strings(rng))
    special = sorted(mine.special)
    for _ in range(2000):
        ids = [int(rng.choice([rng.integers(0, 262144), rng.integers(0, 300), rng.integers(236, 600),
                               special[rng.integers(len(special))], 262144 + 5])) for _ in range(rng.integers(0, 12))]
        for skip in (False, True):
            assert mine.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), ids


@needs_packed
def test_gemmas_bare_start_reads_its_pieces_and_prints_the_torch_paths_text(lib):
    """Gemma 3 270M: the plan's writer stores its tokenizer as pieces, which the bare start takes
    in place of HF's JSON, and the bare run prints the torch path's text."""
    from arlm import bare
    from arlm.loading import resolve_model_path

    prompt = ("--model", "gemma3-270m", "--stop", "\n\n\n")
    want = _generate(*prompt, bare=False)
    _generate(*prompt)  # (the plan written, where it is not yet)
    directory = cache_dir(resolve_model_path("gemma3-270m"), "packed")
    check = json.loads((directory / "bare-int8x2.json").read_text())["tokenizer"]["pieces"]
    assert isinstance(bare._tokenizer_backend(directory, check), pieces.PieceTokenizer)
    got = _generate(*prompt, torch_free=True)
    assert got.returncode == 0 and "no torch" in got.stderr.splitlines()[-1], got.stderr
    assert got.stdout == want.stdout


def test_other_tokenizers_are_not_stored_as_pieces(smollm2_default):
    """SmolLM2's byte-level BPE (a pre-tokenizer, GPT-2's byte table) is not SentencePiece's:
    no arrays, and the bare start parses HF's JSON."""
    assert pieces.build(smollm2_default.tokenizer.backend.to_str()) is None


# -- the command -----------------------------------------------------------------------------------

PROMPT = "The three primary colors are"


def _generate(*extra: str, bare: bool = True, torch_free: bool = False) -> subprocess.CompletedProcess:
    """`arlm generate` (greedy, 20 tokens) in a fresh process, the bare path on or off;
    torch_free: also assert that torch was never imported."""
    env = {**os.environ, "ARLM_BARE": "1" if bare else "0", "ARLM_BARE_BUILD_WAIT": "1"}
    check = "assert 'torch' not in sys.modules, 'torch was imported'; " if torch_free else ""
    script = f"import sys, arlm.cli as c; code = c.main(sys.argv[1:]); {check}sys.exit(code)"
    args = ["generate", PROMPT, "--temperature", "0", "--max-new-tokens", "20", *extra]
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)


@needs_packed
def test_generate_without_torch_prints_the_torch_paths_text(lib):
    """SmolLM2 (the default model): a torch run (it writes the plan), then the same command
    without torch: the same text, byte for byte, torch never imported; with stop strings and
    --ignore-eos too."""
    for extra in ((), ("--stop", " and", "--ignore-eos"), ("--activations", "int8", "--threads", "1")):
        torch_run = _generate(*extra, bare=False)
        assert torch_run.returncode == 0, torch_run.stderr
        _generate(*extra)  # (a torch run too where the plan is not there yet: it writes it)
        run = _generate(*extra, torch_free=True)
        assert run.returncode == 0, run.stderr
        assert "no torch" in run.stderr.splitlines()[-1], run.stderr
        assert run.stdout == torch_run.stdout
        assert run.stderr.splitlines()[-1].split("]")[0] == torch_run.stderr.splitlines()[-1].split("]")[0]


@needs_packed
def test_the_first_run_of_a_command_writes_the_plan_and_goes_on_without_torch(lib, smollm2_path):
    """The `arlm` process itself (`python -m arlm`), the plan not written: the torch path loads
    the file, writes the plan and hands the command over to the bare path in its place (exec):
    the torch path's text, a stats line that says no torch, the plan there after. A command
    handed over already (ARLM_BARE_RERUN) is not handed over again: the torch path runs it."""
    want = _generate(bare=False)
    plan = cache_dir(smollm2_path, "packed") / "bare-int8x2.json"
    command = [sys.executable, "-m", "arlm", "generate", PROMPT, "--temperature", "0", "--max-new-tokens", "20"]
    for rerun, bare in (("1", False), ("", True)):
        plan.unlink(missing_ok=True)
        run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600,
                             env={**os.environ, "ARLM_BARE": "1", "ARLM_BARE_RERUN": rerun})
        assert run.returncode == 0, run.stderr
        assert ("no torch" in run.stderr.splitlines()[-1]) == bare, run.stderr
        assert run.stdout == want.stdout and plan.exists()


@needs_packed
@pytest.mark.parametrize("extra", [("--seed", "3"), ("--presence-penalty", "0.5"),
                                   ("--chat-template", "{{ messages[0].content }}"), ("--kv-dtype", "int8"),
                                   ("--min-tokens", "3"), ("--regex", "[a-z ]+"), ("--matmul-path", "avx2"),
                                   ("--stop", ""), ("--threads", "0"), ("--kv-sinks", "-1")])
def test_what_the_plan_does_not_serve_takes_the_torch_path(extra, lib, monkeypatch):
    monkeypatch.setenv("ARLM_BARE", "1")
    _generate()  # (the plan written)
    run = subprocess.run([sys.executable, "-m", "arlm", "generate", PROMPT, "--temperature", "0",
                          "--max-new-tokens", "4", *extra], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert "no torch" not in run.stderr
    assert "Traceback" not in run.stderr
    if extra[0] in ("--stop", "--threads", "--kv-sinks"):  # (refused, as the torch path refuses them)
        assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr


@needs_packed
def test_a_chat_template_given_writes_no_plan_of_it(lib, smollm2_path, bare_on):
    """--chat --chat-template X runs on the torch path and leaves the plan the file's own
    template: a later plain --chat renders the file's, as the torch path does."""
    _generate()
    plan = cache_dir(smollm2_path, "packed") / "bare-int8x2.json"
    before = json.loads(plan.read_text())["chat_template"]
    plan.unlink()
    _generate("--chat", "--chat-template", "USER {{ messages[0].content }} BOT")
    assert not plan.exists()
    _generate()
    assert json.loads(plan.read_text())["chat_template"] == before
    want = _generate("--chat", bare=False)
    got = _generate("--chat", torch_free=True)
    assert got.stdout == want.stdout and "no torch" in got.stderr


@needs_packed
@pytest.mark.parametrize("damage", ["blob", "library", "json-list"])
def test_damaged_plan_parts_are_rebuilt(damage, smollm2_path, lib, tmp_path, monkeypatch):
    """A blob cut short, a library that does not load, a plan that is not an object: the torch
    path runs the command and repairs what it can (the plan and blob written again; the library
    moved aside for its rebuild, which fails at once here and is put back by hand), and the next
    run is torch-free again."""
    kernels = library.path().parents[1]
    monkeypatch.setenv("ARLM_CACHE", str(tmp_path))
    (tmp_path / "kernels").symlink_to(kernels)
    monkeypatch.setenv("ARLM_BARE", "1")
    _generate()
    directory = cache_dir(smollm2_path, "packed")
    assert "no torch" in _generate(torch_free=True).stderr
    if damage == "blob":
        with open(directory / "bare-int8x2.bin", "r+b") as f:
            f.truncate(100)
    elif damage == "json-list":
        (directory / "bare-int8x2.json").write_text("[]")
    else:  # (a library file that is not one: moved aside; a new inode, as this process has the
        # good one mapped)
        good = tmp_path / "good.so"
        good.write_bytes(library.path().read_bytes())
        bad = tmp_path / "bad.so"
        bad.write_bytes(b"not a library")
        os.replace(bad, library.path())
        monkeypatch.setenv("CXX", "false")  # (its rebuild fails at once here: the fixture tests a build)
    run = _generate()
    assert run.returncode == 0 and "no torch" not in run.stderr and "Traceback" not in run.stderr, run.stderr
    if damage == "library":
        assert not library.path().exists() and library.path().with_suffix(".bad").exists()
        library.path().with_suffix(".bad").unlink()
        os.replace(good, library.path())  # (as the rebuild would have made it)
    assert "no torch" in _generate(torch_free=True).stderr


@needs_packed
def test_a_stale_or_damaged_plan_takes_the_torch_path_and_is_written_again(smollm2_path, lib, bare_on):
    _generate()
    plan = cache_dir(smollm2_path, "packed") / "bare-int8x2.json"
    good = plan.read_text()
    for bad in (good.replace('"stamp": "', '"stamp": "x'), good[:100], json.dumps({**json.loads(good), "format": 0})):
        plan.write_text(bad)
        run = _generate()
        assert run.returncode == 0 and "no torch" not in run.stderr, run.stderr
        assert plan.read_text() == good  # (the torch run wrote it again)
        assert "no torch" in _generate(torch_free=True).stderr


@needs_packed
def test_a_sequence_past_the_plans_rope_rows_is_left_to_the_torch_path(lib, bare_on, capsys):
    """Decided before anything is written: the torch path then runs the command whole."""
    from arlm.bare import generate
    from arlm.cli import build_parser

    _generate()
    args = build_parser().parse_args(["generate", PROMPT, "--temperature", "0", "--max-new-tokens", "5000"])
    assert generate(args) is None
    args = build_parser().parse_args(["generate", PROMPT, "--temperature", "0", "--max-new-tokens", "2"])
    assert generate(args) == 0
    out = capsys.readouterr()
    assert out.out.startswith(PROMPT) and "no torch" in out.err


# -- sampling --------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(0.8, 0, 0.95, 0.0), (1.0, 0, 1.0, 0.0), (0.5, 40, 1.0, 0.0),
                                                           (1.3, 0, 0.5, 0.05), (0.7, 10, 0.9, 0.1)])
def test_unseeded_sampling_draws_from_the_torch_paths_distribution(temperature, top_k, top_p, min_p):
    """numpy's warped distribution is the torch path's (`sampling.warped_probs`) on the same
    logits, the same tokens kept, to float32 rounding; and draws follow it."""
    from arlm.bare import sampling as bare_sampling
    from arlm.sampling import warped_probs

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))
    logits = torch.randn(1, 1000, generator=g) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    want = warped_probs(logits, [params])[0].double().numpy()
    got = bare_sampling.warped_probs(logits[0].numpy(), temperature, top_k, top_p, min_p)
    assert np.array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)
    rng = np.random.default_rng(0)
    n = 20000
    counts = np.bincount([bare_sampling.draw(got, rng) for _ in range(n)], minlength=1000)
    assert not counts[got == 0].any()
    top = np.argsort(-got)[:5]  # the likeliest tokens' frequencies within 5 standard deviations
    assert np.all(np.abs(counts[top] / n - got[top]) <= 5 * np.sqrt(got[top] * (1 - got[top]) / n) + 1e-3)


@needs_packed
def test_sampled_and_chat_commands_run_without_torch(lib):
    """The default command (temperature 0.8, top-p 0.95: no seed) and --chat (the file's own
    template) run without torch; --chat's greedy text is the torch path's."""
    _generate()
    run = subprocess.run([sys.executable, "-c", "import sys, arlm.cli as c; code = c.main(sys.argv[1:]); "
                          "assert 'torch' not in sys.modules; sys.exit(code)", "generate", PROMPT,
                          "--max-new-tokens", "12"], capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**os.environ, "ARLM_BARE": "1"})
    assert run.returncode == 0 and "no torch" in run.stderr and run.stdout.startswith(PROMPT), run.stderr
    want = _generate("--chat", bare=False)
    _generate("--chat")
    got = _generate("--chat", torch_free=True)
    assert got.returncode == 0 and "no torch" in got.stderr, got.stderr
    assert got.stdout == want.stdout


@needs_packed
def test_a_damaged_cache_under_a_plan_takes_the_torch_path(smollm2_path, lib, tmp_path, monkeypatch):
    """weights.bin cut short, or the tokenizer file gone, under a current plan: the torch path
    runs the command (and rebuilds what it must), never a traceback."""
    kernels = library.path().parents[1]  # (the built kernels and library, linked into the fresh cache)
    monkeypatch.setenv("ARLM_CACHE", str(tmp_path))
    (tmp_path / "kernels").symlink_to(kernels)
    monkeypatch.setenv("ARLM_BARE", "1")
    want = _generate(bare=False).stdout
    _generate()
    directory = cache_dir(smollm2_path, "packed")
    assert "no torch" in _generate(torch_free=True).stderr
    for damage in ("weights", "tokenizer"):
        if damage == "weights":
            with open(directory / "weights.bin", "r+b") as f:
                f.truncate(1000)
        else:
            (directory / "tokenizer.json").unlink()
        run = _generate()
        assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
        assert run.stdout == want
        _generate()
        assert "no torch" in _generate(torch_free=True).stderr


@needs_packed
@pytest.mark.parametrize("extra", [(), ("--stop", " color"), ("--chat",), ("--max-new-tokens", "1")])
def test_json_output_is_the_torch_paths(extra, lib):
    """--json: the same object (model, prompt, token ids, text, finish reason, every stats field
    but the timings and the thread width, which the torch path may narrow under load)."""
    def fields(run):
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        for key in ("prefill_seconds", "prefill_tokens_per_s", "decode_seconds", "decode_tokens_per_s", "threads"):
            out["stats"].pop(key)
        return out

    want = fields(_generate("--json", *extra, bare=False))
    _generate("--json", *extra)
    got = _generate("--json", *extra, torch_free=True)
    assert got.stderr == "" and fields(got) == want
