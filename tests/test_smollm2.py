"""SmolLM2-135M-Instruct from its GGUF: arlm against HF transformers loading the same file.

Tolerances: logits within 1e-3 relative (max |Δ| <= 1e-3 * max |HF logits|) on several prompts;
greedy generation of 64 tokens identical token for token, both stopping at the same EOS.
"""

from __future__ import annotations

import pytest
import torch

from arlm.sampling import SamplingParams


pytestmark = pytest.mark.slow  # a subprocess or a model load per test

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea, there lived",
    "<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n<|im_start|>assistant\n",
]


def test_config_matches_hf(smollm2, hf_smollm2):
    c, h = smollm2.model.config, hf_smollm2.config
    assert (c.vocab_size, c.n_layer, c.n_head, c.n_kv_heads, c.d_model, c.d_ff, c.max_seq_len) == (
        h.vocab_size, h.num_hidden_layers, h.num_attention_heads, h.num_key_value_heads, h.hidden_size,
        h.intermediate_size, h.max_position_embeddings)
    assert c.rope_theta == h.rope_parameters["rope_theta"]
    assert c.norm_eps == pytest.approx(h.rms_norm_eps, rel=1e-6)
    assert c.tie_embeddings == h.tie_word_embeddings


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_hf(smollm2, hf_smollm2, prompt):
    ids = torch.tensor([smollm2.tokenizer.encode(prompt)])
    with torch.no_grad():
        ref = hf_smollm2(ids).logits.float()
        got = smollm2.model(ids)
    scale = ref.abs().max().item()
    assert scale > 5.0
    err = (got - ref).abs().max().item()
    assert err <= 1e-3 * scale, f"max |Δ| = {err:.3g} vs max |logit| = {scale:.3g}"
    # The same next-token ranking, not just close numbers.
    assert torch.equal(got[0, -1].topk(5).indices, ref[0, -1].topk(5).indices)


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_greedy_64_tokens_match_hf_generate(smollm2, hf_smollm2, prompt):
    """arlm's KV-cached greedy decode == HF generate (with its cache), both stopping at EOS 2."""
    ids = smollm2.tokenizer.encode(prompt)
    eos = smollm2.tokenizer.eos_ids
    assert eos == [hf_smollm2.generation_config.eos_token_id]
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf_smollm2.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=64,
                                  eos_token_id=eos[0], pad_token_id=eos[0])
    ref = out[0, len(ids):].tolist()
    engine = smollm2.engine  # the engine `LLM.generate` runs, with the tokenizer's EOS ids
    req = engine.add_request(ids, SamplingParams(temperature=0, max_new_tokens=64))
    try:
        while not req.finished:
            engine.step()
    finally:
        engine.abort(req.request_id)  # (the LLM is shared by the session's tests)
    assert req.output_ids == ref
    assert req.finish_reason == ("eos" if ref[-1] in eos else "length")
