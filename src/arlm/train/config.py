"""`TrainConfig`: every setting of a training run in one typed dataclass.

A run's settings come from the defaults below, then a TOML or YAML file (flat `key = value`
pairs named like the fields), then command-line overrides. An unknown key is an error at every
layer. The defaults are nanoGPT's CPU recipe for character-level tiny Shakespeare.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ConfigError


# The projections a LoRA adapter can target (Llama's names; gate is the gated MLPs' only).
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    # data and output
    data_dir: str = _f("out/data/tinyshakespeare_char", "prepared data (`arlm prepare`)")
    out_dir: str = _f("out/train", "checkpoints, metrics.jsonl and loss.png go here")
    init_from: str = _f("scratch", "scratch, or pretrained weights: smollm2, a .gguf, an HF dir, an arlm checkpoint")

    # model shape (from scratch only; a pretrained model brings its own)
    family: str = _f("gpt2", "gpt2 (learned positions, LayerNorm, GELU) or llama (RoPE, RMSNorm, SwiGLU)")
    n_layer: int = _f(4, "transformer blocks")
    n_head: int = _f(4, "query heads")
    n_kv_heads: int | None = _f(None, "key/value heads (GQA/MQA); default n_head")
    d_model: int = _f(128, "residual stream width")
    d_ff: int | None = _f(None, "MLP hidden width; default 4*d_model (gpt2), 8/3*d_model rounded up to 32 (llama)")
    context_length: int = _f(64, "tokens per training sequence (and the model's context window from scratch)")
    bias: bool = _f(False, "biases in linears and norms (GPT-2 has them; nanoGPT drops them: a bit better, faster)")
    gelu_approximate: str = _f("none", "gpt2's GELU: none (exact, nanoGPT's; ~3x faster on CPU) or tanh (GPT-2's)")
    dropout: float = _f(0.0, "dropout on embeddings, attention and residual branches")

    # batch
    batch_size: int = _f(12, "sequences per micro-batch, per process")
    grad_accum: int = _f(1, "micro-batches per optimizer step, over all processes (a multiple of their number)")
    max_steps: int = _f(2000, "optimizer steps")

    # optimizer and schedule: AdamW, linear warmup then cosine decay to min_lr
    lr: float = _f(1e-3, "peak learning rate")
    min_lr: float = _f(1e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = _f(100, "linear warmup steps")
    lr_decay_steps: int | None = _f(None, "step where the cosine reaches min_lr; default max_steps")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.99, "AdamW beta2")
    weight_decay: float = _f(0.1, "AdamW weight decay, on matrices and embeddings only")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this; 0 disables")

    # low-rank adapters (arlm.train.lora): train them alone, the model's weights frozen
    lora_rank: int = _f(0, "LoRA rank r; 0: fine-tune every weight")
    lora_alpha: float | None = _f(None, "LoRA scale alpha (the adapters add alpha / r * B A x); default 2 * lora_rank")
    lora_targets: str = _f(",".join(LORA_TARGETS), "the projections that get adapters, comma-separated: "
                           + ", ".join(LORA_TARGETS))

    # evaluation, logging, checkpoints
    eval_interval: int = _f(250, "evaluate (and save) every N steps; 0: only at the end")
    eval_batches: int = _f(20, "batches per split in an evaluation")
    log_interval: int = _f(10, "read the loss back from the device every N steps (a host sync)")
    save_interval: int | None = _f(None, "save the latest checkpoint every N steps; default eval_interval")

    # system
    device: str = _f("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = _f("auto", "autocast dtype: auto (bfloat16 where the GPU or CPU has it natively, else "
                            "float32), float32, bfloat16, float16")
    compile: bool = _f(False, "torch.compile each transformer block (one compiled graph serves them all)")
    fsdp: bool = _f(False, "under torchrun, shard parameters, gradients and optimizer state over the processes "
                           "(FSDP2) instead of replicating them (DDP)")
    fused_adamw: bool = _f(True, "use the fused AdamW kernel where torch has one")
    seed: int = _f(1337, "seeds initialization, dropout and batch sampling")
    threads: int = _f(0, "torch intra-op threads; 0 leaves torch's default")
    progress: bool = _f(True, "show a progress bar (a line per log_interval when not a terminal)")
    plot: bool = _f(True, "write loss.png at the end")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # (nan passes every comparison below: a run of nan losses)
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{f.name} must be a finite number, got {value}")
        positive = ("n_layer", "n_head", "d_model", "context_length", "batch_size", "grad_accum",
                    "max_steps", "eval_batches", "log_interval")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("n_kv_heads", "d_ff", "lr_decay_steps"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_interval", "threads", "lr", "min_lr", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.save_interval is not None and self.save_interval < 0:
            raise ConfigError(f"save_interval must not be negative, got {self.save_interval}")
        if self.family not in ("gpt2", "llama"):
            raise ConfigError(f"family must be 'gpt2' or 'llama', got {self.family!r}")
        if self.gelu_approximate not in ("none", "tanh"):
            raise ConfigError(f"gelu_approximate must be 'none' or 'tanh', got {self.gelu_approximate!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise ConfigError("beta1 and beta2 must be in [0, 1)")
        if self.lora_rank < 0:
            raise ConfigError(f"lora_rank must not be negative, got {self.lora_rank}")
        if self.lora_alpha is not None and self.lora_alpha <= 0:
            raise ConfigError(f"lora_alpha must be positive, got {self.lora_alpha}")
        if not self.lora_rank:  # (else they would be ignored: every weight fine-tuned, no adapter)
            for name in ("lora_alpha", "lora_targets"):
                if getattr(self, name) != getattr(TrainConfig, name):
                    raise ConfigError(f"{name} applies with lora_rank > 0 (LoRA): set lora_rank, or drop {name}")
        targets = [t.strip() for t in self.lora_targets.split(",")]
        if not all(t in LORA_TARGETS for t in targets):
            raise ConfigError(f"lora_targets must name some of {', '.join(LORA_TARGETS)}, got {self.lora_targets!r}")
        if self.min_lr > self.lr:
            raise ConfigError(f"min_lr ({self.min_lr}) is above lr ({self.lr})")

    @property
    def decay_steps(self) -> int:
        return self.max_steps if self.lr_decay_steps is None else self.lr_decay_steps

    @property
    def checkpoint_interval(self) -> int:
        return self.eval_interval if self.save_interval is None else self.save_interval

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "TrainConfig":
        """Build from typed values (a parsed file, a checkpoint's record); checks names and types."""
        return cls(**_checked(data, source))


# The settings that shape the model: a checkpoint resumes only under the same values.
MODEL_SHAPE_KEYS = ("init_from", "family", "n_layer", "n_head", "n_kv_heads", "d_model", "d_ff",
                    "context_length", "bias", "gelu_approximate", "lora_rank", "lora_alpha", "lora_targets")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): nanoGPT's schedule.

    Linear warmup to `lr` over `warmup_steps`, cosine decay to `min_lr` at `decay_steps`, then
    `min_lr`. A pure function of the step, so a resumed run needs no scheduler state beyond it.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    if step >= cfg.decay_steps:
        return cfg.min_lr
    ratio = (step - cfg.warmup_steps) / max(1, cfg.decay_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - cfg.min_lr)


# -- reading settings ------------------------------------------------------------------------------

def _hints() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _base_type(hint: Any) -> tuple[type, bool]:
    """int | None -> (int, True); bool -> (bool, False)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args:
        return args[0], True
    return hint, False


def _checked(data: dict[str, Any], source: str) -> dict[str, Any]:
    hints = _hints()
    unknown = sorted(set(data) - set(hints))
    if unknown:
        raise ConfigError(f"unknown key(s) in {source}: {', '.join(unknown)} (see `arlm train --help`)")
    return {k: _check_type(k, v, hints[k], source) for k, v in data.items()}


def _check_type(name: str, value: Any, hint: Any, source: str) -> Any:
    kind, optional = _base_type(hint)
    if value is None and optional:
        return None
    ok = (isinstance(value, bool) if kind is bool else
          isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
          isinstance(value, int) and not isinstance(value, bool) if kind is int else
          isinstance(value, kind))
    if not ok:
        raise ConfigError(f"{name} in {source} must be {kind.__name__}, got {value!r}")
    return float(value) if kind is float else value


def parse_value(name: str, text: str) -> Any:
    """A command-line string -> the field's type ('none' for an optional field)."""
    hints = _hints()
    if name not in hints:
        raise ConfigError(f"unknown setting {name!r}")
    kind, optional = _base_type(hints[name])
    if optional and text.lower() in ("none", "null"):
        return None
    try:
        if kind is bool:
            lowered = text.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError
            return lowered in ("true", "1", "yes", "on")
        return kind(text)
    except ValueError:
        raise ConfigError(f"--{name.replace('_', '-')}: expected {kind.__name__}, got {text!r}") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A flat mapping of settings from a .toml, .yaml or .yml file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    if path.suffix == ".toml":
        try:  # (tomllib, yaml: only a config file needs them, and `arlm --help` imports this module)
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib

        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
    elif path.suffix in (".yaml", ".yml"):
        import yaml  # (as tomllib above)

        try:
            data = yaml.safe_load(raw) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    else:
        raise ConfigError(f"config file {path} must end in .toml, .yaml or .yml")
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of settings")
    nested = [k for k, v in data.items() if isinstance(v, dict)]
    if nested:
        raise ConfigError(f"{path}: settings are flat key = value pairs, got table(s) {', '.join(nested)}")
    return data


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the file at `path`, then `overrides` (already typed, see `parse_value`)."""
    values = _checked(read_config_file(path), str(path)) if path is not None else {}
    values.update(_checked(overrides or {}, "the command line"))
    return TrainConfig(**values)
