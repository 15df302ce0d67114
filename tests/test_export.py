"""`arlm export`: models written as HF transformers directories and GGUF files, read back by the
tools that own those formats.

References and tolerances:
- HF: `transformers.AutoModelForCausalLM.from_pretrained(out)` (float32) against arlm's float32
  logits of the same model: max |Δ| <= 1e-4 (random models of `conftest.randomize_`'s scale,
  logits of std > 1; SmolLM2, logits up to ~30). The tokenizer (AutoTokenizer) encodes as arlm's
  does and renders the chat template as arlm's renderer does, character for character.
- GGUF: read back by arlm's own reader (`read_gguf`, the float path): F32 files give the same
  logits (max |Δ| <= 1e-5); F16 within 1e-2 of the largest logit, Q8_0 within 6e-2 (its 8-bit
  weights of a model whose own weights are SmolLM2's 4-bit ones); the greedy tokens of every
  type equal the source model's. llama.cpp (llama-cpp-python, where installed) on the F16 file:
  its 16 greedy tokens equal arlm's on that file.
- Bad input: one line on stderr, a non-zero exit, nothing written.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from arlm.config import ModelConfig
from arlm.export import CANNOT_EXPRESS, export_loaded
from arlm.loading import LoadedModel, load_model
from arlm.loading.checkpoint import save_checkpoint
from arlm.loading.gguf import read_gguf
from arlm.model import Transformer
from arlm.tokenizer import Tokenizer

from conftest import arlm_from_hf, hf_family, randomize_, run_arlm

ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-4
CHATML = ("{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 * 7? Say it twice."},
            {"role": "assistant", "content": "84. 84."}, {"role": "user", "content": "Thanks — and 3 + 4?"}]


def transformers_model(path: Path):
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return (out if isinstance(out, torch.Tensor) else out.logits).float()


def fresh_ids(vocab_size: int, seed: int, shape=(2, 29)) -> torch.Tensor:
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


# -- tiny from-scratch models, written as training writes them -------------------------------------------

@pytest.fixture(scope="module")
def bpe_tokenizer() -> Tokenizer:
    """A byte-level BPE trained on the README (arlm prepare --tokenizer bpe's), with its
    `<|endoftext|>` as BOS (added) and EOS, and the chat markers as special tokens."""
    from tokenizers import AddedToken

    from arlm.train.data import train_bpe_tokenizer

    tok = train_bpe_tokenizer([ROOT / "README.md"], vocab_size=384)
    tok.backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    tok.bos_id, tok.add_bos = tok.eos_ids[0], True
    return tok


TINY = {  # name -> (family config overrides, expected HF model_type)
    "llama-gqa": (dict(n_kv_heads=2), "llama"),
    "llama-bias-untied": (dict(n_kv_heads=4, bias=True, tie_embeddings=False), "llama"),
    "qwen2": (dict(n_kv_heads=2, qkv_bias=True), "qwen2"),
    "qwen3": (dict(n_kv_heads=1, qk_norm=True, head_size=32), "qwen3"),
    "llama3-rope": (dict(n_kv_heads=2, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                         rope_theta=500000.0), "llama"),
    "gpt2-nobias-gqa": (dict(n_kv_heads=2, bias=False), "gpt2"),
    "gpt2-bias-untied": (dict(bias=True, tie_embeddings=False, gelu_approximate="none"), "gpt2"),
}


def tiny_config(name: str, vocab_size: int) -> ModelConfig:
    overrides, model_type = TINY[name]
    family = "gpt2" if model_type == "gpt2" else "llama"
    shape = dict(vocab_size=vocab_size, n_layer=2, n_head=4, d_model=64, d_ff=96, max_seq_len=64)
    return ModelConfig.for_family(family, **{**shape, **overrides})


def write_tiny_checkpoint(directory: Path, name: str, tokenizer: Tokenizer, seed: int) -> Transformer:
    """A random model of TINY[name] saved as `arlm train` saves a checkpoint; the model, eval."""
    config = tiny_config(name, tokenizer.vocab_size)
    torch.manual_seed(seed)
    model = randomize_(Transformer(config), seed).eval()
    save_checkpoint(directory, model, config, tokenizer, extra={"step": 0}, chat_template=CHATML)
    return model


@pytest.mark.parametrize("name", list(TINY))
def test_checkpoint_to_hf_gives_transformers_the_same_logits(name, bpe_tokenizer, tmp_path, capfd):
    """(a) A from-scratch checkpoint -> `arlm export --to hf` -> transformers' logits equal arlm's."""
    seed = 300 + list(TINY).index(name)
    model = write_tiny_checkpoint(tmp_path / "ckpt", name, bpe_tokenizer, seed)
    r = run_arlm(capfd, "export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {tmp_path / 'hf'} (hf: {TINY[name][1]}, f32")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == TINY[name][1] and config["tie_word_embeddings"] == model.config.tie_embeddings
    hf = transformers_model(tmp_path / "hf")
    ids = fresh_ids(model.config.vocab_size, seed)
    want = logits(load_model(str(tmp_path / "ckpt")).model, ids)
    assert want.std() > 1.0  # (logits with clear gaps: a swapped head or half would show)
    torch.testing.assert_close(logits(hf, ids), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind, dtype", [("bf16", torch.bfloat16), ("f16", torch.float16)])
def test_hf_half_types(kind, dtype, bpe_tokenizer, tmp_path, capfd):
    """`--to hf --type bf16|f16`: the weights rounded to that dtype, nothing else changed
    (transformers upcasting them gives arlm's logits on the same rounded weights)."""
    model = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3", bpe_tokenizer, 320)
    assert run_arlm(capfd, "export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "hf"),
                    "--type", kind).returncode == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == str(dtype).removeprefix("torch.")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    ids = fresh_ids(model.config.vocab_size, 321)
    torch.testing.assert_close(logits(transformers_model(tmp_path / "hf"), ids), logits(model, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama3", "gemma3"])
def test_hf_families_round_trip(kind, tmp_path):
    """A model transformers built (qwen2, qwen3, Llama 3's scaled RoPE, Gemma 3 with its sliding
    layers) -> arlm -> `--to hf` -> transformers again: its logits as the original's, and arlm
    reads the export back to the config it came from."""
    original = hf_family(kind, seed=40)
    model = arlm_from_hf(original)
    loaded = LoadedModel(model, None, None, kind, "hf", tmp_path)
    exported = export_loaded(loaded, "hf", tmp_path / "hf")
    assert exported.architecture == original.config.model_type
    ids = fresh_ids(model.config.vocab_size, 41, (2, 40))
    torch.testing.assert_close(logits(transformers_model(tmp_path / "hf"), ids), logits(original, ids),
                               atol=ATOL, rtol=0)
    assert load_model(str(tmp_path / "hf")).config == model.config


def test_exported_tokenizer_and_chat_template_match_arlm(bpe_tokenizer, tmp_path, capfd):
    """(e) The exported tokenizer.json / tokenizer_config.json: transformers' AutoTokenizer
    encodes as arlm does (a BOS added where arlm adds one) and renders the chat template as
    arlm's renderer does."""
    import transformers

    from arlm.llm import LLM

    write_tiny_checkpoint(tmp_path / "ckpt", "llama-gqa", bpe_tokenizer, 350)
    assert run_arlm(capfd, "export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "hf")).returncode == 0
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    llm = LLM(load_model(str(tmp_path / "ckpt")))
    for text in ("Hello world 12345  x\n\n  y", "<|im_start|>user\nhé<|im_end|>", " lead"):
        assert theirs.encode(text) == llm.tokenizer.encode(text)
    rendered = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == llm.apply_chat_template(MESSAGES) and rendered.startswith("<|endoftext|><|im_start|>system")
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation == {"bos_token_id": bpe_tokenizer.bos_id, "eos_token_id": bpe_tokenizer.eos_id}


def assert_same_config(read: ModelConfig, written: ModelConfig) -> None:
    """The config a GGUF gives back: the same but for its float32 norm epsilon, and scaled RoPE
    as the converter stores it (each frequency's divisor, rope_freqs): the same frequencies."""
    from arlm.model import rope_frequencies

    assert read.norm_eps == pytest.approx(written.norm_eps, rel=1e-6)
    if written.rope_scaling is not None:
        assert read.rope_scaling["rope_type"] == "freq_factors"
        torch.testing.assert_close(rope_frequencies(read.head_dim, read.rope_theta, read.rope_scaling),
                                   rope_frequencies(written.head_dim, written.rope_theta, written.rope_scaling),
                                   rtol=1e-6, atol=0)
    assert dataclasses.replace(read, norm_eps=written.norm_eps, rope_scaling=written.rope_scaling) == written


@pytest.mark.parametrize("name", ["llama-gqa", "llama-bias-untied", "qwen2", "qwen3", "llama3-rope"])
def test_checkpoint_to_gguf_reads_back(name, bpe_tokenizer, tmp_path, capfd):
    """(c) A from-scratch checkpoint -> `--to gguf`: F32 gives arlm the same model back (config,
    tokenizer, chat template, logits); F16 and Q8_0 close logits, the same greedy tokens.
    Llama with biases has no GGUF form: refused in one line."""
    seed = 360 + list(TINY).index(name)
    model = write_tiny_checkpoint(tmp_path / "ckpt", name, bpe_tokenizer, seed)
    ids = fresh_ids(model.config.vocab_size, seed)
    want = logits(model, ids)
    for kind, tol in (("f32", 1e-5), ("f16", 5e-3), ("q8_0", 6e-2)):
        out = tmp_path / f"{kind}.gguf"
        r = run_arlm(capfd, "export", str(tmp_path / "ckpt"), "--to", "gguf", str(out), "--type", kind)
        if name == "llama-bias-untied":
            assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "biases" in r.stderr
            assert CANNOT_EXPRESS["gguf"] in r.stderr and not out.exists()
            return
        assert r.returncode == 0, r.stderr
        g = read_gguf(out)
        assert_same_config(g.config, model.config)
        assert g.chat_template == CHATML
        tok = Tokenizer.from_gguf_fields(g.tokenizer_fields)
        assert (tok.bos_id, tok.eos_ids, tok.add_bos) == (bpe_tokenizer.bos_id, bpe_tokenizer.eos_ids, True)
        assert tok.encode("Hello world 12345 <|im_end|>") == bpe_tokenizer.encode("Hello world 12345 <|im_end|>")
        from arlm.loading import build_model

        got = logits(build_model(g.config, g.state_dict), ids)
        assert (got - want).abs().max() <= tol * want.abs().max(), (kind, (got - want).abs().max())
        assert torch.equal(got[:, -1].argmax(-1), want[:, -1].argmax(-1)), kind


def test_a_lora_checkpoint_exports_merged(bpe_tokenizer, tmp_path, capfd):
    """A LoRA run's checkpoint (frozen weights + adapters, arlm.json's "lora", as `arlm train
    --lora-rank` saves it) -> `--to hf` and `--to gguf` carry the adapters merged: transformers'
    logits and the F32 GGUF's equal the adapted model's (the adapters change them: not the base's)."""
    from arlm.loading import build_model
    from arlm.loading.adapters import is_adapter_key
    from arlm.train import lora

    config = tiny_config("llama-gqa", bpe_tokenizer.vocab_size)
    base = randomize_(Transformer(config), 391).eval()
    adapted = randomize_(Transformer(config), 391)
    lora.apply(adapted, rank=4, alpha=8.0, targets="q,v,gate,down")
    g = torch.Generator().manual_seed(392)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:  # non-zero B, as after training
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    adapted.eval()
    save_checkpoint(tmp_path / "ckpt", adapted, config, bpe_tokenizer, extra={"step": 0, **lora.checkpoint_meta(adapted)},
                    chat_template=CHATML)
    ids = fresh_ids(config.vocab_size, 391)
    want = logits(adapted, ids)
    assert (want - logits(base, ids)).abs().max() > 0.1  # the adapters matter

    r = run_arlm(capfd, "export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    torch.testing.assert_close(logits(transformers_model(tmp_path / "hf"), ids), want, atol=ATOL, rtol=0)

    r = run_arlm(capfd, "export", str(tmp_path / "ckpt"), "--to", "gguf", str(tmp_path / "m.gguf"), "--type", "f32")
    assert r.returncode == 0, r.stderr
    back = read_gguf(tmp_path / "m.gguf")
    assert not any(is_adapter_key(k) for k in back.state_dict)
    torch.testing.assert_close(logits(build_model(back.config, back.state_dict), ids), want, atol=ATOL, rtol=0)


# -- SmolLM2 ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_hf_dir(tmp_path_factory):
    """`arlm export smollm2 --to hf` through the command line (the Q4_1 GGUF dequantized to float32)."""
    from arlm.cli import main

    out = tmp_path_factory.mktemp("smollm2") / "hf"
    assert main(["export", "smollm2", "--to", "hf", str(out)]) == 0
    return out


@pytest.mark.slow
def test_smollm2_to_hf_gives_transformers_the_same_logits(smollm2, smollm2_hf_dir):
    """(b) SmolLM2 exported to HF: transformers' logits on its prompts equal arlm's float32."""
    config = json.loads((smollm2_hf_dir / "config.json").read_text())
    assert (config["model_type"], config["tie_word_embeddings"], config["num_key_value_heads"]) == ("llama", True, 3)
    hf = transformers_model(smollm2_hf_dir)
    for prompt in ("The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n"):
        ids = torch.tensor([smollm2.tokenizer.encode(prompt)])
        torch.testing.assert_close(logits(hf, ids), logits(smollm2.model, ids), atol=ATOL, rtol=0)
    ids = fresh_ids(smollm2.model.config.vocab_size, 400, (1, 48))
    torch.testing.assert_close(logits(hf, ids), logits(smollm2.model, ids), atol=ATOL, rtol=0)


@pytest.mark.slow
def test_smollm2_hf_tokenizer_and_chat_template(smollm2, smollm2_hf_dir):
    """(e) SmolLM2's exported tokenizer encodes as arlm's does and its chat template renders
    as arlm's renderer does."""
    import transformers

    theirs = transformers.AutoTokenizer.from_pretrained(str(smollm2_hf_dir))
    for text in ("Hello world 12345  x\n\n  y", "héllo <|im_start|>user\nhi<|im_end|>", "ÿ€😀"):
        assert theirs.encode(text) == smollm2.tokenizer.encode(text)
    for add in (True, False):
        assert theirs.apply_chat_template(MESSAGES[1:], tokenize=False, add_generation_prompt=add) == \
            smollm2.apply_chat_template(MESSAGES[1:], add_generation_prompt=add)


PROMPT = "The capital of France is Paris, and the capital of Germany is"


def greedy(model: torch.nn.Module, tokenizer: Tokenizer, prompt_ids: list[int], n: int = 16) -> list[int]:
    """arlm's n greedy tokens after `prompt_ids` (its engine, float32, KV-cached)."""
    from arlm.llm import LLM
    from arlm.sampling import SamplingParams

    llm = LLM(LoadedModel(model, tokenizer, None, "export", "gguf", Path(".")))
    return llm.generate([prompt_ids], SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))[0].token_ids


@dataclasses.dataclass
class ReadBack:
    """An exported GGUF as arlm's reader gives it back: what the tests compare, computed once."""

    path: Path
    config: ModelConfig
    chat_template: str | None
    tokenizer: Tokenizer
    logits: torch.Tensor  # [1, T, vocab] on PROMPT
    greedy: list[int]  # 16 tokens after PROMPT


@pytest.fixture(scope="module")
def smollm2_gguf(smollm2, tmp_path_factory):
    """kind -> SmolLM2 exported to GGUF of that type (from the float32 model arlm loaded) and
    read back by `read_gguf`, each made once."""
    from arlm.loading import build_model

    directory, made = tmp_path_factory.mktemp("smollm2-gguf"), {}

    def read_back(kind: str) -> ReadBack:
        if kind not in made:
            path = export_loaded(smollm2.loaded, "gguf", directory / f"smollm2-{kind}.gguf", kind).path
            g = read_gguf(path)
            tok, model = Tokenizer.from_gguf_fields(g.tokenizer_fields), build_model(g.config, g.state_dict)
            prompt = tok.encode(PROMPT)
            made[kind] = ReadBack(path, g.config, g.chat_template, tok, logits(model, torch.tensor([prompt])),
                                  greedy(model, tok, prompt))
        return made[kind]
    return read_back


@pytest.mark.slow
@pytest.mark.parametrize("kind, tol", [("f16", 5e-3), ("q8_0", 6e-2)])
def test_smollm2_to_gguf_reads_back(smollm2, smollm2_gguf, kind, tol):
    """(c) SmolLM2 -> GGUF F16 / Q8_0 -> arlm's reader: the same config, tokenizer and chat
    template; logits within `tol` of the largest; the same 16 greedy tokens as the source."""
    from arlm.sampling import SamplingParams

    got = smollm2_gguf(kind)
    assert_same_config(got.config, smollm2.model.config)
    assert got.chat_template == smollm2.chat_template
    prompt = smollm2.tokenizer.encode(PROMPT)
    assert got.tokenizer.encode(PROMPT) == prompt
    assert (got.tokenizer.bos_id, got.tokenizer.eos_ids) == (smollm2.tokenizer.bos_id, smollm2.tokenizer.eos_ids)
    want = logits(smollm2.model, torch.tensor([prompt]))
    assert (got.logits - want).abs().max() <= tol * want.abs().max(), (got.logits - want).abs().max()
    source = smollm2.generate([prompt], SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    assert got.greedy == source[0].token_ids


def llama_cpp(monkeypatch):
    """llama-cpp-python over the llama.cpp that benchmarks/build_peers.sh builds (its AMX-free
    build in build/llama.cpp), or a skip where it is not installed."""
    lib = ROOT / "build" / "llama.cpp" / "bin"
    if "LLAMA_CPP_LIB_PATH" not in os.environ and lib.is_dir():
        monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(lib))
    try:
        return pytest.importorskip("llama_cpp")
    except OSError as e:  # installed, its library not found
        pytest.skip(f"llama_cpp cannot load its library ({e}); set LLAMA_CPP_LIB_PATH")


def llama_cpp_greedy(module, path: Path, prompt_ids: list[int], n: int = 16) -> list[int]:
    llm = module.Llama(model_path=str(path), n_ctx=256, n_threads=2, n_threads_batch=2, verbose=False)
    out = []
    for token in llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        out.append(token)
        if len(out) == n:
            break
    llm.close()
    return out


@pytest.mark.slow
def test_llama_cpp_runs_the_exported_smollm2(smollm2_gguf, monkeypatch):
    """(d) llama.cpp loads the F16 export (metadata, vocabulary, permuted q/k rows) and its 16
    greedy tokens equal arlm's on the same file; its tokenizer splits the prompt as arlm's."""
    module = llama_cpp(monkeypatch)
    f16 = smollm2_gguf("f16")
    prompt = f16.tokenizer.encode(PROMPT)
    assert module.Llama(model_path=str(f16.path), vocab_only=True, verbose=False).tokenize(
        PROMPT.encode(), add_bos=False, special=True) == prompt
    assert llama_cpp_greedy(module, f16.path, prompt) == f16.greedy


@pytest.mark.slow  # (~12 s on 2 busy cores: llama.cpp's start and two engines)
def test_llama_cpp_runs_an_exported_checkpoint(bpe_tokenizer, tmp_path, monkeypatch, capfd):
    """(d) The same for a from-scratch Llama checkpoint with GQA and its trained BPE vocabulary;
    the tokens are also the checkpoint's own (arlm on the file and llama.cpp agree on any file
    of ours, permuted or not: the source pins the layout down)."""
    module = llama_cpp(monkeypatch)
    from arlm.loading import build_model

    source = write_tiny_checkpoint(tmp_path / "ckpt", "llama-gqa", bpe_tokenizer, 370)
    out = tmp_path / "tiny.gguf"
    assert run_arlm(capfd, "export", str(tmp_path / "ckpt"), "--to", "gguf", str(out)).returncode == 0
    g = read_gguf(out)
    text = "The model runs a prompt: 12345 <|im_start|>user"
    assert module.Llama(model_path=str(out), vocab_only=True, verbose=False).tokenize(
        text.encode(), add_bos=True, special=True) == bpe_tokenizer.encode(text)  # (BOS added by both)
    prompt = bpe_tokenizer.encode("The model runs a prompt")
    theirs = llama_cpp_greedy(module, out, prompt)
    assert theirs == greedy(build_model(g.config, g.state_dict), bpe_tokenizer, prompt)
    assert theirs == greedy(source, bpe_tokenizer, prompt)


# -- bad input ---------------------------------------------------------------------------------------------

def test_bad_inputs_fail_in_one_line_and_write_nothing(bpe_tokenizer, tmp_path, capfd):
    """(f) A missing checkpoint, an unknown format, a type the format has not, an output that
    cannot be written or is taken, a model or tokenizer the format cannot express: one line, a
    non-zero exit, and nothing left in the output's directory."""
    from arlm.train.data import char_tokenizer

    write_tiny_checkpoint(tmp_path / "ckpt", "llama-gqa", bpe_tokenizer, 380)
    gpt2 = tiny_config("gpt2-nobias-gqa", bpe_tokenizer.vocab_size)
    save_checkpoint(tmp_path / "gpt2", Transformer(gpt2), gpt2, bpe_tokenizer)
    chars = char_tokenizer("abcdefgh \n")
    small = ModelConfig.llama(vocab_size=chars.vocab_size, n_layer=1, n_head=2, n_kv_heads=2, d_model=32, d_ff=64, max_seq_len=16)
    save_checkpoint(tmp_path / "chars", Transformer(small), small, chars)
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    out = tmp_path / "out"
    cases = {  # args -> (exit code, a phrase of the message)
        ("nope", "--to", "hf", str(out)): (1, "unknown model"),
        ("ckpt", "--to", "onnx", str(out)): (2, "invalid choice"),
        ("ckpt", "--to", "hf", str(out), "--type", "q8_0"): (2, "does not apply"),
        ("ckpt", "--to", "hf", str(tmp_path / "file" / "out")): (1, "is not a directory"),
        ("ckpt", "--to", "gguf", str(tmp_path / "file" / "out.gguf")): (1, "is not a directory"),
        ("ckpt", "--to", "hf", str(tmp_path / "taken")): (1, "not an empty directory"),
        ("ckpt", "--to", "gguf", str(tmp_path / "taken")): (1, "is a directory"),
        ("gpt2", "--to", "gguf", str(out)): (1, "no GGUF architecture has learned positions"),
        ("chars", "--to", "gguf", str(out)): (1, "not byte-level BPE"),
    }
    before = sorted(p.name for p in tmp_path.iterdir())
    for args, (code, phrase) in cases.items():
        args = (str(tmp_path / args[0]) if args[0] != "nope" else str(tmp_path / "nope"), *args[1:])
        r = run_arlm(capfd, "export", *args)
        assert r.returncode == code and phrase in r.stderr, (args, r.returncode, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == before, args
    assert (tmp_path / "taken" / "x").exists() and (tmp_path / "file").read_text() == "not a directory"


@pytest.mark.parametrize("damage", [b"", b"[1, 2]", b'{"model": "none"}', b"\xff\xfe"])
def test_a_damaged_tokenizer_file_is_named(damage, bpe_tokenizer, tmp_path, capfd):
    write_tiny_checkpoint(tmp_path / "ckpt", "llama-gqa", bpe_tokenizer, 400)
    (tmp_path / "ckpt" / "tokenizer.json").write_bytes(damage)
    r = run_arlm(capfd, "export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "out"))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"arlm: error: {tmp_path / 'ckpt' / 'tokenizer.json'} is not a readable tokenizer.json (" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage, reason", [(b"[1, 2]", "is not an arlm checkpoint"),
                                           (b"{", "arlm.json is not readable checkpoint metadata"),
                                           (b"\xff\xfe", "arlm.json is not readable checkpoint metadata")])
def test_damaged_checkpoint_metadata_is_named(damage, reason, bpe_tokenizer, tmp_path, capfd):
    write_tiny_checkpoint(tmp_path / "ckpt", "llama-gqa", bpe_tokenizer, 410)
    (tmp_path / "ckpt" / "arlm.json").write_bytes(damage)
    r = run_arlm(capfd, "export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "out"))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"arlm: error: {tmp_path / 'ckpt'}") and reason in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("to", ["hf", "gguf"])
def test_a_failure_midway_leaves_nothing(to, bpe_tokenizer, tmp_path, capfd, monkeypatch):
    """A write that fails after its first bytes (a full disk) leaves no file, directory or temp
    file behind, and says so in one line."""
    import arlm.export.gguf as gguf_export
    import arlm.export.hf as hf_export

    write_tiny_checkpoint(tmp_path / "ckpt", "llama-gqa", bpe_tokenizer, 390)

    def fail(*args, **kwargs):
        path = next(a for a in args if isinstance(a, str))
        Path(path).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_export, "save_file", fail)
    monkeypatch.setattr(gguf_export, "write_gguf", lambda tmp, *a, **k: fail(tmp))
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / ("out" if to == "hf" else "out.gguf")
    r = run_arlm(capfd, "export", str(tmp_path / "ckpt"), "--to", to, str(out))
    assert r.returncode == 1 and "No space left" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == before
