"""arlm's own checkpoints: a directory holding

    arlm.json          {"format": "arlm-checkpoint", "version": 1, "model": {...ModelConfig...},
                        "step": int, "metrics": {...}, "chat_template": str | null, ...}
    model.safetensors  the weights, in our parameter names (tied head stored once)
    tokenizer.json     HF tokenizers JSON (with our BOS/EOS metadata)

Training state (optimizer, scheduler, RNG) lives beside them in `train_state.pt`, written by the
trainer. Every file is written atomically (arlm.files: temp file in the same directory, fsync,
rename).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..config import ConfigError, ModelConfig
from ..files import atomic_write, atomic_write_text
from ..tokenizer import Tokenizer
from .adapters import merge_state
from .errors import LoadError

FORMAT = "arlm-checkpoint"
META_FILE, WEIGHTS_FILE, TOKENIZER_FILE = "arlm.json", "model.safetensors", "tokenizer.json"


def is_checkpoint_dir(path: Path) -> bool:
    return (path / META_FILE).is_file()


def save_checkpoint(directory: str | Path, model: torch.nn.Module | dict[str, torch.Tensor], config: ModelConfig,
                    tokenizer: Tokenizer | None, extra: dict[str, Any] | None = None,
                    chat_template: str | None = None) -> None:
    """Write weights, tokenizer and metadata; `arlm.json` goes last so a reader never sees a
    checkpoint whose metadata points at weights that are not there yet. `model`: a module, or its state dict."""
    directory = Path(directory)
    weights = model if isinstance(model, dict) else model.state_dict()
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in weights.items()}
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)
    atomic_write(directory / WEIGHTS_FILE, lambda tmp: save_file(state, tmp))
    if tokenizer is not None:
        atomic_write_text(directory / TOKENIZER_FILE, tokenizer.to_json())
    meta = {"format": FORMAT, "version": 1, "model": config.to_dict(), "chat_template": chat_template,
            **(extra or {})}
    atomic_write_text(directory / META_FILE, json.dumps(meta, indent=2))


def read_meta(directory: Path) -> dict[str, Any]:
    """A checkpoint's arlm.json; LoadError where it is unreadable or not an arlm checkpoint's."""
    try:
        meta = json.loads((directory / META_FILE).read_text())
    except (OSError, ValueError) as e:  # (json's errors, and bytes that are not UTF-8)
        raise LoadError(f"{directory / META_FILE} is not readable checkpoint metadata ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise LoadError(f"{directory} is not an arlm checkpoint")
    return meta


def read_checkpoint(directory: str | Path, merge_lora: bool = True
                    ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer | None, str | None]:
    """(config, weights, tokenizer, chat template). A LoRA run's checkpoint (arlm.json's "lora")
    holds adapters beside the frozen weights: merged into them (merge_lora), or left apart for
    training to resume (arlm.train.lora)."""
    directory = Path(directory)
    meta = read_meta(directory)
    try:
        config = ModelConfig.from_dict(meta["model"])
    except (ConfigError, KeyError, TypeError) as e:
        raise LoadError(f"{directory}: bad model config in checkpoint ({e})") from None
    try:
        state = load_file(str(directory / WEIGHTS_FILE))
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise LoadError(f"{directory / WEIGHTS_FILE} is not readable ({e})") from None
    if meta.get("lora") and merge_lora:
        state = merge_state(state, config, meta["lora"])
    tok_path = directory / TOKENIZER_FILE
    tokenizer = Tokenizer.from_file(tok_path) if tok_path.exists() else None
    return config, state, tokenizer, meta.get("chat_template")
