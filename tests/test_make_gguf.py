"""benchmarks/make_gguf.py writes what arlm reads back as the shape it was asked for: a tiny
Llama 3 shape's F16 file loads with the config, the random weights (q/k rows permuted by the
writer and un-permuted by arlm's loader: exactly the draw, F16 values), SmolLM2's real
tokenizer padded with reserved control tokens, and finite logits. (llama-quantize's types are
checked by loading the real shapes, benchmarks/sizes.py: they need a llama.cpp build.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import make_gguf  # noqa: E402

TINY = make_gguf.Shape("llama", "Tiny Llama 3", d_model=64, n_layer=2, n_head=4, n_kv_heads=2, d_ff=128,
                       vocab_size=49152 + 3, context_length=512, rope_theta=500000.0, norm_eps=1e-5, head_dim=16,
                       llama3_rope=make_gguf.LLAMA32_ROPE)


def test_tiny_llama3_loads_with_its_weights_and_real_tokenizer(tmp_path, smollm2_default):
    from arlm.loading import load_model

    path = make_gguf.write_f16(TINY, tmp_path / "tiny-F16.gguf", seed=7)
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-F16.gguf"]  # (no temporary left)
    loaded = load_model(str(path), quantized=False)
    c = loaded.config
    assert (c.vocab_size, c.n_layer, c.n_head, c.n_kv_heads, c.d_model, c.d_ff, c.tie_embeddings) == \
        (49155, 2, 4, 2, 64, 128, True)
    assert c.rope_scaling["factors"] == make_gguf.llama3_rope_factors(TINY).tolist()

    # q, k and v rows in HF's order again, each the writer's draw, F16 values exactly
    wqkv = loaded.model.blocks[1].attn.wqkv.weight
    want = [make_gguf.draw(f"blk.1.attn_{p}.weight", (n * 16, 64), seed=7) for p, n in (("q", 4), ("k", 2), ("v", 2))]
    assert torch.equal(wqkv, torch.from_numpy(np.concatenate(want)).float())

    # SmolLM2's vocabulary and merges, then the converter's padding (UNUSED: vocabulary entries,
    # not special tokens; no merge makes them, so text never encodes to them)
    tok, smol = loaded.tokenizer, smollm2_default.tokenizer
    padding = {f"[PAD{i}]": i for i in range(49152, 49155)}
    assert tok.backend.get_vocab() == {**smol.backend.get_vocab(), **padding}
    assert set(tok.backend.get_added_tokens_decoder()) == set(smol.backend.get_added_tokens_decoder())
    text = "The cat sat on the mat, 1234 times. <|im_start|>"
    assert tok.encode(text) == smol.encode(text) and (tok.bos_id, tok.eos_ids) == (smol.bos_id, smol.eos_ids)

    with torch.no_grad():
        logits = loaded.model(torch.tensor([tok.encode(text)]))
    assert logits.shape[-1] == 49155 and torch.isfinite(logits).all()
