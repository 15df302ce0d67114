"""benchmarks/widen_gguf.py: a model zero-padded to larger widths computes the same logits. A tiny
random Llama (make_gguf's writer) widened to twice its width, twice its query heads a KV group
(its KV heads kept in place, the target's extra KV heads empty) and 3x its FFN: arlm's float32
logits of both files agree to float rounding, and the widened file has the target's widths.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import make_gguf  # noqa: E402
import widen_gguf  # noqa: E402

SOURCE = make_gguf.Shape("llama", "Tiny Llama", d_model=64, n_layer=2, n_head=4, n_kv_heads=2, d_ff=96,
                         vocab_size=49152, context_length=512, rope_theta=10000.0, norm_eps=1e-5, head_dim=16)
WIDTHS = make_gguf.Shape("llama", "Wider Llama", d_model=128, n_layer=2, n_head=12, n_kv_heads=3, d_ff=288,
                         vocab_size=49152, context_length=512, rope_theta=10000.0, norm_eps=1e-5, head_dim=16)


def test_a_widened_model_computes_the_sources_logits(tmp_path):
    from arlm.loading import load_model

    src = make_gguf.write_f16(SOURCE, tmp_path / "tiny-F16.gguf", seed=3)
    wide = widen_gguf.write_widened(src, WIDTHS, tmp_path / "wide-F16.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-F16.gguf", "wide-F16.gguf"]  # (no temporary)
    a, b = load_model(str(src), quantized=False), load_model(str(wide), quantized=False)
    c = b.config
    assert (c.d_model, c.n_head, c.n_kv_heads, c.d_ff, c.n_layer, c.vocab_size) == (128, 12, 3, 288, 2, 49152)
    assert abs(c.norm_eps - 1e-5 * 64 / 128) < 1e-12  # (the file holds it as float32)
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = a.model(ids), b.model(ids)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_a_source_wider_than_the_target_is_refused(tmp_path):
    import pytest

    src = make_gguf.write_f16(WIDTHS, tmp_path / "wide-F16.gguf", seed=3)
    with pytest.raises(SystemExit, match="d_model 128 > 64"):
        widen_gguf.write_widened(src, SOURCE, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists() and not (tmp_path / "out.gguf.tmp").exists()
