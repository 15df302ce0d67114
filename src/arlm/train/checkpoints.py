"""Training checkpoints: one directory per save, `latest` and `best` pointers, resumable state.

    out_dir/
      ckpt-0001750/   an arlm checkpoint (arlm.json, model.safetensors, tokenizer.json) that
                      `arlm generate --model` loads, plus train_state.pt (optimizer, RNG, step)
      ckpt-0002000/
      latest -> ckpt-0002000
      best -> ckpt-0001750

A save writes a new step directory, every file atomically (temp file, fsync, rename), and only
then moves the `latest` symlink (a rename too, so atomic). A run killed mid-save leaves `latest`
on the previous, complete directory; the half-written one is unreferenced and the next save
removes it. Only the directories that `latest` and `best` point at are kept.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from ..files import atomic_symlink, atomic_write
from ..loading.checkpoint import META_FILE, read_checkpoint, save_checkpoint
from ..loading.errors import LoadError
from ..tokenizer import Tokenizer

STATE_FILE = "train_state.pt"
LATEST, BEST = "latest", "best"


def step_dir_name(step: int) -> str:
    return f"ckpt-{step:07d}"


def pointer_target(out_dir: str | Path, name: str = LATEST) -> Path | None:
    link = Path(out_dir) / name
    return link.resolve() if link.is_symlink() else None


@dataclass
class TrainCheckpoint:
    path: Path
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    chat_template: str | None
    state: dict[str, Any]  # train_state.pt: step, optimizer, rng, best_val_loss, train_config

    @property
    def step(self) -> int:
        return int(self.state["step"])


def save(out_dir: str | Path, step: int, model: torch.nn.Module | dict[str, torch.Tensor], config: ModelConfig,
         tokenizer: Tokenizer, chat_template: str | None, meta: dict[str, Any], state: dict[str, Any],
         best: bool) -> Path:
    """Write step `step` and point `latest` (and `best`, if `best`) at it; returns its directory.
    `model`: the model, or its full state dict (a sharded model's, gathered)."""
    out_dir = Path(out_dir)
    directory = out_dir / step_dir_name(step)
    if pointer_target(out_dir) != directory.resolve():
        if directory.exists():
            shutil.rmtree(directory)  # the remains of a save that was killed
        save_checkpoint(directory, model, config, tokenizer, extra=meta, chat_template=chat_template)
        atomic_write(directory / STATE_FILE, lambda tmp: torch.save(state, tmp))
        atomic_symlink(out_dir / LATEST, directory.name)
    if best:
        atomic_symlink(out_dir / BEST, directory.name)
    _prune(out_dir)
    return directory


def load_latest(out_dir: str | Path) -> TrainCheckpoint:
    """The checkpoint `out_dir/latest` points at, with its training state (for `--resume`)."""
    link = Path(out_dir) / LATEST
    if not (link / META_FILE).is_file() or not (link / STATE_FILE).is_file():
        raise LoadError(f"nothing to resume: no complete checkpoint at {link}")
    config, weights, tokenizer, template = read_checkpoint(link, merge_lora=False)  # (adapters apart)
    try:
        state = torch.load(link / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged pickle raises many kinds, some with advice that does not apply
        raise LoadError(f"{link / STATE_FILE} is damaged or not an arlm training state ({type(e).__name__}); "
                        "resume from an earlier checkpoint or start over") from None
    return TrainCheckpoint(link.resolve(), config, weights, tokenizer, template, state)


def _prune(out_dir: Path) -> None:
    keep = {p for p in (pointer_target(out_dir, LATEST), pointer_target(out_dir, BEST)) if p is not None}
    for d in out_dir.glob("ckpt-*"):
        if d.is_dir() and d.resolve() not in keep:
            shutil.rmtree(d, ignore_errors=True)
