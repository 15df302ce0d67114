"""Shared fixtures: SmolLM2 loaded once per session by arlm and by HF transformers, tiny random models;
and what keeps outcomes independent of the machine's load (a fixed thread width, fixed step costs).

HF transformers is the reference (a test-only dependency). Loading SmolLM2 from its GGUF costs
~7 s in arlm (float32) and ~25 s in HF (it dequantizes every tensor), so each is loaded once per
session. SmolLM2 on its default path (4-bit blocks from the model cache) loads at once and reads
under 0.18 of the float32 path's weight bytes per token (test_quant.py), so it decodes several
times faster: tests that need a real model's text, not the float32 reference, use that one
(`smollm2_default`).
"""

from __future__ import annotations

import math
import os
import subprocess

import pytest
import torch

from arlm.engine.speculative import StepCost
from arlm.runtime import runtime

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The AMX tile kernel is opt-in for users (it did not pay here); the suite turns it on where the
# CPU has it, so the bit-equality tests (a row batched = the row alone) compare it with VNNI.
os.environ.setdefault("ARLM_AMX", "1")
# `arlm generate` without torch (arlm.bare) serves a command only once its plan and library are
# there, which earlier commands write: off, so that every test's command takes one path whatever
# ran before it. tests/test_bare.py turns it on where it tests it.
os.environ["ARLM_BARE"] = "0"
# Two cores on the reference machine; more threads only contend with each other on its small
# matmuls. OMP_NUM_THREADS, when set, wins (1 is the better choice on a machine already busy).
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 0)) or min(2, os.cpu_count() or 1))


def _pin_thread_width() -> None:
    """Every engine step in this process at torch's width, whatever else the machine runs.

    Unpinned, the process's governor (arlm.threads, the runtime's) narrows the steps while other
    processes are runnable, so the width of a test's steps, and with it the summation order of
    torch's own float32 ops, would follow the machine's load. The governor's narrowing is
    tested on its own with fake probes (test_threads.py), and there outputs are shown not to
    depend on the width."""
    runtime().threads.pin(torch.get_num_threads())


_pin_thread_width()


# -- SmolLM2 ---------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def smollm2_path():
    from arlm.loading import resolve_model_path

    return resolve_model_path("smollm2")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """arlm's `LLM` over SmolLM2-135M-Instruct (float32), loaded once."""
    from arlm.llm import LLM

    return LLM.load(str(smollm2_path), quantize=None)  # float32: the reference comparisons need it


@pytest.fixture(scope="session")
def smollm2_default(smollm2_path):
    """arlm's `LLM` over SmolLM2 as `LLM.load("smollm2")` configures it (4-bit/int8 blocks, 8-bit
    activations, the native decode step), loaded once: tests must not change its model."""
    from arlm.llm import LLM

    return LLM.load(str(smollm2_path))


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """HF transformers' LlamaForCausalLM from the same GGUF file (float32, eval), loaded once."""
    import accelerate  # noqa: F401  (HF's GGUF loading needs it; `make test` installs it)
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


# -- the command line, in this process ----------------------------------------------------------------

def run_arlm(capfd, *args: str) -> subprocess.CompletedProcess:
    """`arlm *args` through `arlm.cli.main` in this process, its output read from capfd: what
    `python -m arlm *args` prints and returns, without a new interpreter and its imports. (The
    console script and `python -m arlm` themselves are run in test_cli.py.)"""
    from arlm.cli import main

    capfd.readouterr()  # (what the test printed before)
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out = capfd.readouterr()
    return subprocess.CompletedProcess(["arlm", *args], code, out.out, out.err)


# -- tiny random models ----------------------------------------------------------------------------

def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Overwrite every parameter with fresh random values of a useful scale, in place.

    HF's init leaves biases at 0 and norm weights at 1, so a swapped or dropped bias or norm
    weight would go unnoticed; its std-0.02 weights give near-uniform logits, so near-ties would
    hide errors. Here norms are 1 + noise, biases are noise, weights keep activations O(1), and
    the logits end up O(1..10) with clear gaps between tokens.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            if p.ndim == 1 and name.endswith("weight"):  # the only 1-D weights are norms
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim == 1:
                p.copy_(0.2 * noise)
            elif "wte" in name or "wpe" in name or "embed" in name or "tok_emb" in name or "pos_emb" in name:
                p.copy_(0.5 * noise)
            else:  # a projection: GPT-2's Conv1D is [in, out], nn.Linear is [out, in]
                fan_in = p.shape[0] if "transformer.h." in name else p.shape[1]
                gain = 3.0 if name.startswith("lm_head") else 1.0  # spread the logits
                p.copy_(gain * noise / math.sqrt(fan_in))
    return model


def hf_gpt2(seed: int = 0, tie: bool = True, activation: str = "gelu_new", **overrides):
    """A random-init HF GPT2LMHeadModel (float32, eval, eager attention)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = dict(vocab_size=211, n_embd=64, n_layer=3, n_head=4, n_positions=64, n_inner=96,
               layer_norm_epsilon=1e-5, activation_function=activation, tie_word_embeddings=tie,
               bos_token_id=0, eos_token_id=1, attn_implementation="eager")
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**cfg))
    return randomize_(model, seed).eval()


def hf_llama(seed: int = 0, n_head: int = 6, n_kv_heads: int = 2, tie: bool = False, **overrides):
    """A random-init HF LlamaForCausalLM (float32, eval, eager attention); GQA by default."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=199, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
               num_attention_heads=n_head, num_key_value_heads=n_kv_heads, max_position_embeddings=64,
               rms_norm_eps=1e-5, rope_theta=5000.0, tie_word_embeddings=tie, bos_token_id=0,
               eos_token_id=1, pad_token_id=None, attn_implementation="eager")
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    return randomize_(model, seed).eval()


def hf_family(kind: str, seed: int = 0, **overrides):
    """A random-init HF model of a later Llama-shaped family (float32, eval, eager attention):
    "qwen2" (q/k/v biases), "qwen3" (q/k norms, head_dim 32 of hidden 96), "llama3" (llama3
    RoPE scaling, short original context so every band is used), "gemma3" (Gemma 3's text
    model: every switch, 7 layers with a sliding window of 8 on all but the 6th)."""
    import transformers as tf

    base = dict(vocab_size=199, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
                bos_token_id=0, eos_token_id=1, pad_token_id=None, attn_implementation="eager")
    if kind == "qwen2":
        cls, cfg = tf.Qwen2ForCausalLM, tf.Qwen2Config(**{**base, "rope_parameters": {"rope_theta": 5000.0,
                                                                                      "rope_type": "default"},
                                                          **overrides})
    elif kind == "qwen3":
        cls, cfg = tf.Qwen3ForCausalLM, tf.Qwen3Config(**{**base, "head_dim": 32, "tie_word_embeddings": True,
                                                          **overrides})
    elif kind == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        cls, cfg = tf.LlamaForCausalLM, tf.LlamaConfig(**{**base, "rope_parameters": rope, **overrides})
    elif kind == "gemma3":
        gemma = {**base, "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
                 "sliding_window": 8, "query_pre_attn_scalar": 24, "tie_word_embeddings": True,
                 "rms_norm_eps": 1e-6}
        cls, cfg = tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(**{**gemma, **overrides})
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    return randomize_(cls(cfg), seed).eval()


def arlm_from_hf(hf_model):
    """The same weights in an arlm Transformer, through the public loading path."""
    from arlm.loading import build_model
    from arlm.loading.hf import config_from_hf, hf_to_arlm

    config = config_from_hf(hf_model.config.to_dict())
    return build_model(config, hf_to_arlm(hf_model.state_dict(), config))


@pytest.fixture(scope="session")
def tiny_llama():
    """(hf, arlm) pair: random Llama with GQA (6 query heads, 2 KV heads), untied head."""
    hf = hf_llama(seed=1)
    return hf, arlm_from_hf(hf)


# -- speculative decoding: step costs that do not follow the clock --------------------------------

# Step times by step size (any unit), of the shape `StepCost` describes for a CPU: an extra token
# costs ~0.2 of a step at one sequence (the weights are streamed once for all rows), and nearly a
# whole token's share from ~8 tokens on. Drafts pay for a request alone, rarely beside many others.
STEP_TIMES = {1: 1.0, 2: 1.2, 4: 1.6, 8: 2.4, 16: 4.4, 32: 8.4, 64: 16.4}


class FixedStepCost(StepCost):
    """A `StepCost` that keeps the step times it is given (default `STEP_TIMES`) and ignores the
    engine's own observations.

    An engine's `StepCost` learns from the wall time of its steps, and adaptive drafting
    (`SpeculativeConfig(adaptive=True)`, the default) drafts by it: on a loaded machine an
    extra row looks nearly as dear as a whole step and the rule drafts nothing. With this one
    the rule drafts the same on any machine, at any load."""

    def __init__(self, times: dict[int, float] | None = None) -> None:
        super().__init__()
        for n, t in (STEP_TIMES if times is None else times).items():
            super().observe(n, t)

    def observe(self, tokens: int, seconds: float) -> None:
        pass  # (a step's wall time: the machine's load, not the test's input)
