"""Shared fixtures: SmolLM2 loaded once per session by arlm and by HF transformers, tiny random models.

HF transformers is the reference (a test-only dependency). Loading SmolLM2 from its GGUF costs
~7 s in arlm and ~25 s in HF (it dequantizes every tensor), so each is loaded once per session.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two cores on the reference machine; more threads only contend with each other on its small
# matmuls. OMP_NUM_THREADS, when set, wins (1 is the better choice on a machine already busy).
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 0)) or min(2, os.cpu_count() or 1))


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
