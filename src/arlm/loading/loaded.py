"""`LoadedModel`: a model as `load_model` hands it over, wherever its weights came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..config import ModelConfig
from ..model import Transformer
from ..tokenizer import Tokenizer


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer | None
    chat_template: str | None
    name: str
    source: str  # "gguf", "hf" or "checkpoint"
    path: Path
    # Loaded with the file's quantized blocks as they are (load_model(quantized=True)); the
    # tensors arlm had to round again, where the file's type has no kernel.
    quantized: bool = False
    requantized: list[str] = field(default_factory=list)
    # A layout cache's mapped weights.bin (a uint8 tensor) that the model's tensors point into;
    # None for a model loaded otherwise (arlm.bare.write records tensors as offsets into it).
    weights: object = None

    @property
    def config(self) -> ModelConfig:
        return self.model.config
