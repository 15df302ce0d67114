"""`arlm export`: a model arlm loads (an arlm checkpoint, a .gguf file, an HF directory, a known
name) written for other tools: an HF transformers directory (`hf.py`) or a llama.cpp GGUF file
(`gguf.py`).

The model is loaded in float32 (a GGUF's quantized blocks dequantized), its config mapped to the
target's architecture (`family.py`: or refused in one line naming what the target lacks), and
written atomically: the GGUF through a temp file renamed into place, the HF directory built
beside its path and renamed into place, so a failure leaves nothing. The output is checked before
the model is loaded, so a bad path fails at once.

Importing this package imports no torch (the CLI's parser reads `FORMATS`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .family import CANNOT_EXPRESS, ExportError

# --to -> the --type values it takes, its default first (HF: the safetensors' dtype; GGUF: the
# matrices' type, as convert_hf_to_gguf.py's --outtype).
FORMATS = {"hf": ("f32", "f16", "bf16"), "gguf": ("f16", "q8_0", "f32")}

__all__ = ["CANNOT_EXPRESS", "ExportError", "Exported", "FORMATS", "export_loaded", "export_model"]


@dataclass
class Exported:
    path: Path
    format: str  # "hf" or "gguf"
    architecture: str  # config.json's model_type, or general.architecture
    type: str  # a FORMATS value
    source: str  # the model arlm loaded: gguf, hf or checkpoint
    n_params: int

    def summary(self) -> str:
        return (f"wrote {self.path} ({self.format}: {self.architecture}, {self.type}, "
                f"{self.n_params / 1e6:.1f}M parameters, from a {self.source} model)")


def check_output(out: Path, to: str) -> None:
    """ExportError where `out` cannot be written: before the model is loaded."""
    parent = out.absolute().parent
    if not parent.is_dir():
        raise ExportError(f"cannot write {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK):
        raise ExportError(f"cannot write {out}: {parent} is not writable")
    if to == "hf" and (out.is_file() or out.is_symlink() or (out.is_dir() and any(out.iterdir()))):
        raise ExportError(f"{out} exists and is not an empty directory: remove it or name another")
    if to == "gguf" and out.is_dir():
        raise ExportError(f"{out} is a directory: name the .gguf file to write")


def _check_type(to: str, kind: str | None) -> str:
    if to not in FORMATS:
        raise ExportError(f"unknown format {to!r} (hf or gguf)")
    kind = kind or FORMATS[to][0]
    if kind not in FORMATS[to]:
        raise ExportError(f"--type {kind} does not apply to {to} (it takes {', '.join(FORMATS[to])})")
    return kind


def export_model(spec: str, to: str, out: str | Path, kind: str | None = None) -> Exported:
    """Write the model `spec` names (what `arlm.loading.load_model` takes) to `out` in format `to`
    ("hf": a directory; "gguf": a file), its weights as `kind` (FORMATS; default the first)."""
    kind = _check_type(to, kind)
    check_output(Path(out), to)
    from ..loading import load_model  # (imports torch)

    return export_loaded(load_model(spec), to, out, kind)  # (float32)


def export_loaded(loaded, to: str, out: str | Path, kind: str | None = None) -> Exported:
    """`export_model` for a model already loaded (`arlm.loading.LoadedModel`, float weights)."""
    from ..files import atomic_directory, atomic_write
    from .family import gguf_architecture, hf_model_type

    kind = _check_type(to, kind)
    if loaded.quantized:
        raise ExportError("export takes a model loaded as floats (load_model(spec), not quantized=True)")
    out = Path(out)
    check_output(out, to)
    model, config = loaded.model, loaded.config
    if to == "hf":
        from .hf import DTYPES, write_hf_dir

        arch = hf_model_type(config)
        atomic_directory(out, lambda tmp: write_hf_dir(tmp, model, arch, DTYPES[kind], loaded.tokenizer,
                                                       loaded.chat_template))
    else:
        from .gguf import byte_level_vocab, write_gguf

        arch = gguf_architecture(config)
        vocab = byte_level_vocab(loaded.tokenizer, config.vocab_size)
        atomic_write(out, lambda tmp: write_gguf(tmp, model, arch, kind, vocab, loaded.tokenizer,
                                                 loaded.chat_template, loaded.name))
    return Exported(out, to, arch, kind, loaded.source, model.num_params())
