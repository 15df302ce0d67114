"""arlm's own checkpoints: a directory holding

    arlm.json          {"format": "arlm-checkpoint", "version": 1, "model": {...ModelConfig...},
                        "step": int, "metrics": {...}, "chat_template": str | null, ...}
    model.safetensors  the weights, in our parameter names (tied head stored once)
    tokenizer.json     HF tokenizers JSON (with our BOS/EOS metadata)

Training state (optimizer, scheduler, RNG) lives beside them in `train_state.pt`, written by the
trainer. Every file is written atomically: temp file in the same directory, fsync, rename.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ..config import ConfigError, ModelConfig
from ..tokenizer import Tokenizer
from .errors import LoadError

FORMAT = "arlm-checkpoint"
META_FILE, WEIGHTS_FILE, TOKENIZER_FILE = "arlm.json", "model.safetensors", "tokenizer.json"


# atomic_write's temp files, ".<name>.<8 random characters>.tmp" beside <name> (hex digits; the
# wider alphabet also matches mkstemp's names, which a writer killed mid-save may leave behind).
TMP_PATTERN = re.compile(r"\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp")


def _create_tmp(path: Path) -> str:
    """A new, empty temp file beside `path`. Unlike mkstemp's (always 0600), it is created 0666
    less the umask, like any other file, so a checkpoint or dataset is readable by whom the user
    meant; the rename keeps the mode."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return str(tmp)
        except FileExistsError:
            continue


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Call write(tmp_path), fsync it, then rename over `path`: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _create_tmp(path)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def remove_stale_tmp(directory: str | Path, names: Iterable[str]) -> list[Path]:
    """Delete the temp files that a killed atomic_write of any of `names` left in `directory`.

    Only for a directory that no other process is writing: a live writer's temp file looks the same.
    """
    names, removed = set(names), []
    for f in Path(directory).glob(".*.tmp"):
        m = TMP_PATTERN.fullmatch(f.name)
        if m and m["name"] in names and f.is_file():
            f.unlink(missing_ok=True)
            removed.append(f)
    return removed


def is_checkpoint_dir(path: Path) -> bool:
    return (path / META_FILE).is_file()


def save_checkpoint(directory: str | Path, model: torch.nn.Module, config: ModelConfig,
                    tokenizer: Tokenizer | None, extra: dict[str, Any] | None = None,
                    chat_template: str | None = None) -> None:
    """Write weights, tokenizer and metadata; `arlm.json` goes last so a reader never sees a
    checkpoint whose metadata points at weights that are not there yet."""
    from safetensors.torch import save_file

    directory = Path(directory)
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)
    atomic_write(directory / WEIGHTS_FILE, lambda tmp: save_file(state, tmp))
    if tokenizer is not None:
        atomic_write_text(directory / TOKENIZER_FILE, tokenizer.to_json())
    meta = {"format": FORMAT, "version": 1, "model": config.to_dict(), "chat_template": chat_template,
            **(extra or {})}
    atomic_write_text(directory / META_FILE, json.dumps(meta, indent=2))


def read_checkpoint(directory: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer | None, str | None]:
    from safetensors.torch import load_file

    directory = Path(directory)
    try:
        meta = json.loads((directory / META_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoadError(f"{directory / META_FILE} is not readable checkpoint metadata ({e})") from None
    if meta.get("format") != FORMAT:
        raise LoadError(f"{directory} is not an arlm checkpoint")
    try:
        config = ModelConfig.from_dict(meta["model"])
    except (ConfigError, KeyError, TypeError) as e:
        raise LoadError(f"{directory}: bad model config in checkpoint ({e})") from None
    try:
        state = load_file(str(directory / WEIGHTS_FILE))
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise LoadError(f"{directory / WEIGHTS_FILE} is not readable ({e})") from None
    tok_path = directory / TOKENIZER_FILE
    tokenizer = Tokenizer.from_file(tok_path) if tok_path.exists() else None
    return config, state, tokenizer, meta.get("chat_template")
