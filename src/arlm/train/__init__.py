"""Training: `prepare` a corpus into token files, then `train` (teacher-forced, resumable, DDP).

    from arlm.train import TrainConfig, prepare, train

    prepare(["data/tinyshakespeare.txt"], "out/data/shakespeare_char", tokenizer="char")
    result = train(TrainConfig(data_dir="out/data/shakespeare_char", out_dir="out/run"))

    # chat fine-tuning: only the assistant turns are learned (arlm.train.chat)
    prepare_chat(["chats.jsonl"], "out/data/chats", tokenizer="smollm2", context_length=512)
    train(TrainConfig(data_dir="out/data/chats", init_from="smollm2", context_length=512, out_dir="out/sft"))
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["TrainConfig", "load_config", "lr_at", "prepare", "prepare_chat", "TokenData", "ChatData", "train",
           "TrainResult", "next_token_loss"]

_WHERE = {"TrainConfig": "config", "load_config": "config", "lr_at": "config", "prepare": "data",
          "prepare_chat": "data", "TokenData": "data", "ChatData": "data", "train": "trainer",
          "TrainResult": "trainer", "next_token_loss": "trainer"}


def __getattr__(name: str) -> Any:
    # Deferred so that `arlm --help` (which registers the train flags) does not import torch.
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(name)
