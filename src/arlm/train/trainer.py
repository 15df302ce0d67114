"""Teacher-forced parallel training of the one `Transformer`.

Each step feeds whole sequences through the model in one pass under the causal mask; position t
is trained to predict token t+1, so a sequence of T tokens gives T next-token losses at once:
L = -1/(B*T) * sum_{b,t} log P(x[b, t+1] | x[b, <=t]). On chat data (supervised fine-tuning,
arlm.train.chat) the sum runs over the learned targets alone (the assistant turns), the mean over
a micro-batch's number of them, in training and in evaluation; each conversation of a packed row
attends to itself only, its positions counted from 0.

The loop is nanoGPT's: gradient accumulation over micro-batches, AdamW (weight decay on matrices
only), warmup + cosine learning rate, gradient clipping, bf16 autocast where the device has it,
optional torch.compile, periodic evaluation and checkpoints. Under torchrun it runs DDP: every
rank draws its own micro-batches of the global batch, gradients are all-reduced on the last
micro-step only, and rank 0 alone logs and writes checkpoints. With `fsdp` the ranks shard the
model, its gradients and optimizer state instead (FSDP2; arlm.train.parallel).
"""

from __future__ import annotations

import gc
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import kernels
from ..config import ConfigError, ModelConfig
from ..files import unwritable_directory
from ..loading import build_model, load_model
from ..loading.adapters import split_state
from ..model import Transformer, compute_weight
from . import checkpoints, lora, parallel
from .config import MODEL_SHAPE_KEYS, TrainConfig, lr_at
from .data import IGNORE, SPLITS, Batch, DataError, TokenData
from .loss import linear_cross_entropy
from .optim import AdamW, ShadowAdamW
from .progress import METRICS_FILE, PLOT_FILE, MetricsLog, Progress, plot_losses

EVAL_STREAM = 2**31 - 1  # seeds the fixed evaluation batches apart from the training ones


@dataclass
class Distributed:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    owns_group: bool = False  # this run joined the process group, so it leaves it too

    @property
    def main(self) -> bool:
        return self.rank == 0


@dataclass
class TrainResult:
    step: int
    out_dir: Path
    history: list[dict] = field(default_factory=list)  # the metrics.jsonl records of this run
    best_val_loss: float = math.inf
    wall_s: float = 0.0
    train_s: float = 0.0  # time in training steps alone (no evaluation, saving or compilation)
    tokens_per_s: float = 0.0  # training tokens / train_s, after the first (warm-up) log interval

    @property
    def losses(self) -> dict[int, float]:
        """step -> training loss, for every logged step."""
        return {r["step"]: r["loss"] for r in self.history if r["kind"] == "train"}

    @property
    def evals(self) -> list[dict]:
        return [r for r in self.history if r["kind"] == "eval"]


# -- pieces ----------------------------------------------------------------------------------------

def next_token_loss(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor,
                    input_pos: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                    fused: bool = True) -> torch.Tensor:
    """Mean cross-entropy of the logits against the next token, over the targets that are not
    IGNORE (every one in text data; the assistant tokens in chat data). One forward pass.

    idx, targets: [B, T] with targets[:, t] = the token after idx[:, t]; input_pos, doc_ids: a
    packed batch's (`Batch`, `Transformer.forward`). At least one target must be learned. fused:
    the LM head and the loss taken together, a chunk of rows at a time (arlm.train.loss); else
    the logits whole (FSDP2: the head's weight is a shard outside the model's forward).
    """
    if fused:
        hidden = model(idx, input_pos=input_pos, doc_ids=doc_ids, head=False)  # [B, T, d_model]
        head = unwrap(model).lm_head
        return linear_cross_entropy(hidden.flatten(0, 1), head.weight, targets.flatten(),
                                    weight_lowp=compute_weight(head, hidden))
    logits = model(idx, input_pos=input_pos, doc_ids=doc_ids)  # [B, T, V], float32
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def batch_loss(model: torch.nn.Module, batch: Batch, fused: bool = True) -> torch.Tensor:
    return next_token_loss(model, batch.x, batch.y, batch.input_pos, batch.doc_ids, fused)


def fused_loss(cfg: TrainConfig, ddp: Distributed) -> bool:
    """The head and loss fused (arlm.train.loss) unless FSDP2 shards the head's weight."""
    return not (cfg.fsdp and ddp.world_size > 1)


def unwrap(model: torch.nn.Module) -> Transformer:
    """The Transformer inside DDP and torch.compile wrappers."""
    while not isinstance(model, Transformer):
        model = getattr(model, "_orig_mod", None) or model.module
    return model


def model_config_from_scratch(cfg: TrainConfig, vocab_size: int) -> ModelConfig:
    d_ff = cfg.d_ff
    if d_ff is None and cfg.family == "llama":
        # SwiGLU has three matrices; 8/3 * d keeps its size that of a 4 * d GELU MLP (Llama's rule).
        d_ff = -(-8 * cfg.d_model // 3 // 32) * 32
    overrides = dict(vocab_size=vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_kv_heads=cfg.n_kv_heads,
                     d_model=cfg.d_model, d_ff=d_ff, max_seq_len=cfg.context_length, bias=cfg.bias,
                     gelu_approximate=cfg.gelu_approximate, dropout=cfg.dropout)
    return ModelConfig.for_family(cfg.family, **overrides)


def configure_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device,
                        shadow_weights: bool = False) -> AdamW:
    """AdamW with weight decay on matrices and embeddings (dim >= 2), not on biases and norms.
    shadow_weights: ShadowAdamW, which keeps the bf16 weights the forward pass multiplies with
    (arlm.train.optim; `use_shadow_weights` says where it applies)."""
    params = [p for p in model.parameters() if p.requires_grad]  # a tied head appears once
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if shadow_weights:
        return ShadowAdamW(model, groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    # The fused kernel updates every parameter in one launch (CPU and CUDA): no per-tensor loop.
    fused = cfg.fused_adamw and device.type in ("cpu", "cuda")
    return AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused or None)


def use_shadow_weights(cfg: TrainConfig, device: torch.device, amp_dtype: torch.dtype | None,
                       world_size: int) -> bool:
    """Whether the step trains through bf16 shadow weights (arlm.train.optim): bf16 autocast on
    CPU with the native kernels, one process, no gradient accumulation or torch.compile, the fused
    AdamW allowed; elsewhere torch's AdamW over the float32 weights under autocast."""
    return (device.type == "cpu" and amp_dtype == torch.bfloat16 and world_size == 1 and cfg.grad_accum == 1
            and not cfg.compile and cfg.fused_adamw and kernels.train_kernels_available())


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for plain float32. `auto`: bf16 where the device has it natively."""
    if cfg.dtype == "auto":
        native = torch.cuda.is_bf16_supported() if device.type == "cuda" else kernels.cpu_has_native_bf16()
        return torch.bfloat16 if native else None
    return None if cfg.dtype == "float32" else getattr(torch, cfg.dtype)


# Below this many positions a CPU step runs attention in the math kernel (two bf16 matmuls around
# a softmax), from it on in flash attention: under bf16 autocast torch 2.13's two trade places
# with the sequence length (benchmarks/train_speed.py --parts, SmolLM2's heads: the math kernel
# 1.4-1.5x faster at 64-128 positions, flash 1.5x at 256, 2.7x at 512, 5.3x at 1,024; with flash
# at 64 positions the Shakespeare recipe ran at 0.56x (GPT-2) and 0.72x (Llama) of the math
# kernel's tokens/s: benchmarks/train_ab.py, docs/benchmarks.md).
FLASH_ATTENTION_FROM = 256


@contextmanager
def mixed_precision(device: torch.device, dtype: torch.dtype | None, seq_len: int | None = None):
    """The context a forward pass runs in: autocast to `dtype` (None: plain float32), and on CPU
    the attention kernel for sequences of `seq_len` positions (None: torch's choice)."""
    if dtype is None:
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        if device.type == "cpu" and seq_len is not None and seq_len < FLASH_ATTENTION_FROM:
            with sdpa_kernel([SDPBackend.MATH]):
                yield
        else:
            yield


def resolve_device(spec: str, local_rank: int) -> torch.device:
    if spec == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device {spec} requested but no CUDA device is available")
        return torch.device("cuda", local_rank) if spec == "cuda" else torch.device(spec)
    return torch.device(spec)


def set_dropout(model: Transformer, p: float) -> None:
    """Apply dropout `p` to a model built with another (a pretrained model is built with 0)."""
    model.config.dropout = p
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = p
        elif hasattr(m, "dropout") and isinstance(m.dropout, float):
            m.dropout = p


def sample_step_offsets(data: TokenData, cfg: TrainConfig, step: int) -> np.ndarray:
    """Window starts for step `step`, [grad_accum, batch_size]: all the global batch's micro-batches.

    A pure function of (seed, step): a resumed run draws the same batches, and K processes draw
    between them the same global batch as one process (rank r takes micro-batches r, r+K, ...).
    """
    rng = np.random.default_rng([cfg.seed, step])
    count = cfg.grad_accum * cfg.batch_size
    return data.offsets("train", count, cfg.context_length, rng).reshape(cfg.grad_accum, cfg.batch_size)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: TokenData, cfg: TrainConfig, device: torch.device,
             amp_dtype: torch.dtype | None, ddp: Distributed) -> dict[str, float]:
    """Mean loss over the same `eval_batches` batches of each split every time (shared by ranks)."""
    was_training = model.training
    model.eval()
    losses = {}
    for i, split in enumerate(SPLITS):
        rng = np.random.default_rng([cfg.seed, EVAL_STREAM, i])
        offsets = data.offsets(split, cfg.eval_batches * cfg.batch_size, cfg.context_length, rng)
        offsets = offsets.reshape(cfg.eval_batches, cfg.batch_size)
        total = torch.zeros((), device=device)
        for b in range(ddp.rank, cfg.eval_batches, ddp.world_size):
            batch = data.batch(split, offsets[b], cfg.context_length, device)
            with mixed_precision(device, amp_dtype, cfg.context_length):
                total += batch_loss(model, batch, fused=fused_loss(cfg, ddp)).float()
        if ddp.world_size > 1:
            dist.all_reduce(total)
        losses[split] = total.item() / cfg.eval_batches
    model.train(was_training)
    return losses


def check_resumable(saved: dict, cfg: TrainConfig, where: Path) -> None:
    """A checkpoint resumes only under the settings that shaped its model."""
    defaults = TrainConfig()  # (a key a checkpoint from before it lacks took its default)
    diffs = [f"{k}={saved.get(k, getattr(defaults, k))!r} there, {getattr(cfg, k)!r} here" for k in MODEL_SHAPE_KEYS
             if saved.get(k, getattr(defaults, k)) != getattr(cfg, k)]
    if diffs:
        raise ConfigError(f"checkpoint {where} comes from an incompatible config: {'; '.join(diffs)}")


def check_tokenizer(data: TokenData, model_config: ModelConfig, tokenizer, source: str, fix: str | None = None) -> None:
    """The data must be tokenized the way the pretrained (or resumed) model expects; `fix` says
    what to do about it (default: prepare the data with the model's tokenizer)."""
    fix = fix or f"prepare it with `arlm prepare --tokenizer {source}`"
    if data.vocab_size > model_config.vocab_size:
        raise DataError(f"data in {data.path} has a vocabulary of {data.vocab_size}, more than the "
                        f"{model_config.vocab_size} of {source}; {fix}")
    if tokenizer is not None and tokenizer.backend.get_vocab() != data.tokenizer.backend.get_vocab():
        raise DataError(f"data in {data.path} was not tokenized with the tokenizer of {source}; {fix}")


def init_model(cfg: TrainConfig, data: TokenData, device: torch.device) -> tuple[Transformer, str | None]:
    """A fresh model sized by `cfg`, or pretrained weights (`init_from`) with dropout from `cfg`."""
    if cfg.init_from == "scratch":
        return Transformer(model_config_from_scratch(cfg, data.vocab_size)).to(device), None
    loaded = load_model(cfg.init_from)
    check_tokenizer(data, loaded.config, loaded.tokenizer, cfg.init_from)
    if cfg.context_length > loaded.config.max_seq_len:
        raise ConfigError(f"context_length {cfg.context_length} exceeds the context window "
                          f"({loaded.config.max_seq_len}) of {cfg.init_from}")
    model = loaded.model.to(device=device, dtype=torch.float32)
    set_dropout(model, cfg.dropout)
    return model, loaded.chat_template


def setup_distributed(cfg: TrainConfig) -> tuple[Distributed, torch.device]:
    """Join the torchrun process group if there is one (gloo on CPU, nccl on CUDA)."""
    ddp = Distributed(int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)),
                      int(os.environ.get("WORLD_SIZE", 1)))
    device = resolve_device(cfg.device, ddp.local_rank)
    if ddp.world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # DDP imports torch.distributed.nn.functional, whose functions take `group.WORLD` as a
        # default argument, bound at import. Imported after init_process_group, those defaults
        # hold the group for the life of the interpreter: destroy_process_group cannot free it,
        # and its gloo worker threads live on into interpreter shutdown, where the first one to
        # release a finished collective's tensors needs the GIL and aborts the process
        # ("terminate called without an active exception"). Imported first, the defaults are None.
        # (Not at the top: a torch built without distributed support cannot import it; DDP alone needs it.)
        import torch.distributed.nn.functional  # noqa: F401

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        ddp.owns_group = True
    return ddp, device


def leave_distributed(ddp: Distributed) -> None:
    """Free the process group this run joined, and with it the backend's threads.

    After a run that finished, every rank has passed the final barrier. Freeing the group runs
    its destructor, which drains the work queue and joins the worker threads; they may need the
    GIL to release tensors that Python made, which they can take now, while the interpreter is
    fully alive, and not during its shutdown (an abort). gc.collect() frees anything that still
    holds the group through a reference cycle (the DDP wrapper, an exception's traceback).
    """
    if ddp.owns_group and dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()


# -- the run ---------------------------------------------------------------------------------------

def train(cfg: TrainConfig, resume: bool = False, overwrite: bool = False) -> TrainResult:
    """Run training as `cfg` says; with `resume`, continue from `out_dir/latest` exactly."""
    ddp, device = setup_distributed(cfg)
    try:
        return _train(cfg, resume, overwrite, ddp, device)
    finally:
        leave_distributed(ddp)


def _train(cfg: TrainConfig, resume: bool, overwrite: bool, ddp: Distributed, device: torch.device) -> TrainResult:
    """The loop: each step, then its log line, evaluation and checkpoint where they are due
    (`Run`'s phases); evaluating and saving are kept out of the training time."""
    t_start = time.perf_counter()
    run = Run.open(cfg, resume, overwrite, ddp, device)
    if run.start_step == 0 and cfg.eval_interval:
        run.evaluate(0)
    window = LogWindow(device, run.tokens_per_step)
    for step in range(run.start_step, cfg.max_steps):
        lr = run.train_step(step, window.loss_sum)
        done = step + 1
        window.steps += 1
        run.progress.step()
        if done % cfg.log_interval == 0 or done == cfg.max_steps:
            run.log(done, lr, window)
        evaluated = done == cfg.max_steps or (cfg.eval_interval and done % cfg.eval_interval == 0)
        saving = done == cfg.max_steps or (cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0)
        if evaluated or saving:
            t_pause = time.perf_counter()
            run.evaluate_and_save(done, evaluated, saving)
            run.progress.paused += time.perf_counter() - t_pause
            window.t0 += time.perf_counter() - t_pause  # evaluation and saving are not training time
    return run.finish(window, t_start)


class LogWindow:
    """The steps since the last log line: their loss, summed on the device (read back once a
    window: the host sync), and their time; and the run's training time and tokens, the first
    window (warm-up, compilation) left out unless it is the only one."""

    def __init__(self, device: torch.device, tokens_per_step: int) -> None:
        self.loss_sum = torch.zeros((), device=device)
        self.tokens_per_step = tokens_per_step
        self.t0, self.steps = time.perf_counter(), 0
        self.warm, self.train_s, self.train_tokens = False, 0.0, 0
        self.first = (0.0, 0)  # (seconds, tokens) of the warm-up window

    def close(self, ddp: Distributed) -> tuple[float, float]:
        """End the window: (its mean loss over every rank, its tokens a second); `restart` then
        starts the next."""
        if ddp.world_size > 1:
            dist.all_reduce(self.loss_sum)
            self.loss_sum /= ddp.world_size
        mean_loss = self.loss_sum.item() / self.steps  # the host sync of this window
        elapsed = time.perf_counter() - self.t0
        tokens = self.steps * self.tokens_per_step
        if self.warm:
            self.train_s += elapsed
            self.train_tokens += tokens
        else:
            self.first = (elapsed, tokens)
        self.warm = True
        return mean_loss, tokens / elapsed

    def restart(self) -> None:
        self.loss_sum.zero_()
        self.t0, self.steps = time.perf_counter(), 0

    def rate(self) -> tuple[float, float]:
        """(seconds, tokens a second) of training after warm-up (the first window's alone where
        there was no other)."""
        train_s, tokens = (self.train_s, self.train_tokens) if self.train_s or self.first[0] <= 0 else self.first
        return train_s, tokens / train_s if train_s else 0.0


@dataclass
class Run:
    """One training run's parts (`Run.open`), shared by its phases: a step (`train_step`), a log
    line (`log`), evaluation and checkpoints (`evaluate_and_save`), the end (`finish`)."""

    cfg: TrainConfig
    ddp: Distributed
    device: torch.device
    data: TokenData
    out_dir: Path
    model: Transformer
    step_model: torch.nn.Module  # the model as each step calls it (wrapped by DDP or FSDP)
    mode: parallel.Single
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    amp_dtype: torch.dtype | None
    chat_template: str | None
    start_step: int
    result: TrainResult
    metrics: MetricsLog | None  # rank 0's metrics file
    progress: Progress

    @classmethod
    def open(cls, cfg: TrainConfig, resume: bool, overwrite: bool, ddp: Distributed, device: torch.device) -> Run:
        """Check the run's settings and directory, build (or resume) the model, its optimizer and
        its state; ConfigError naming the flag where the run cannot start."""
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if cfg.grad_accum % ddp.world_size:
            raise ConfigError(f"grad_accum ({cfg.grad_accum}) must be a multiple of the number of processes "
                              f"({ddp.world_size})")
        data = TokenData.open(cfg.data_dir)
        data.check_context(cfg.context_length)
        out_dir = Path(cfg.out_dir)
        if (why := unwritable_directory(out_dir)) is not None:
            raise ConfigError(f"--out-dir {out_dir} cannot be written: {why}")
        if not resume and not overwrite and checkpoints.pointer_target(out_dir) is not None:
            raise ConfigError(f"{out_dir} already holds a training run: pass --resume to continue it, "
                              "--overwrite to start over, or another --out-dir")
        ckpt = checkpoints.load_latest(out_dir) if resume else None
        model, chat_template = _resumed_model(cfg, data, ckpt, out_dir, device) if ckpt is not None else \
            _new_model(cfg, data, device)
        model.train()
        mode = parallel.for_run(cfg.fsdp, ddp.world_size, device, eval_batches=cfg.eval_batches, dtype=cfg.dtype,
                                compile=cfg.compile)
        step_model = mode.wrap(model)  # before the optimizer: FSDP2 replaces the parameters with shards
        amp_dtype = autocast_dtype(cfg, device)
        optimizer = configure_optimizer(model, cfg, device, use_shadow_weights(cfg, device, amp_dtype, ddp.world_size))
        scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
        start_step, best_val = 0, math.inf
        if ckpt is not None:
            start_step, best_val = _restore_state(ckpt, cfg, ddp, mode, model, optimizer, scaler, out_dir)
            del ckpt  # the weights now live in the model
        else:
            torch.manual_seed(cfg.seed + ddp.rank)  # dropout masks differ between ranks
        if cfg.compile:
            compile_blocks(model)
        metrics = MetricsLog(out_dir / METRICS_FILE, resume_step=start_step if resume else None) if ddp.main else None
        progress = Progress(start_step, cfg.max_steps, cfg.progress and ddp.main)
        run = cls(cfg, ddp, device, data, out_dir, model, step_model, mode, optimizer, scaler, amp_dtype,
                  chat_template, start_step, TrainResult(start_step, out_dir, best_val_loss=best_val), metrics,
                  progress)
        progress.note(run.summary())
        return run

    @property
    def accum(self) -> int:
        """Micro-steps a step on this rank."""
        return self.cfg.grad_accum // self.ddp.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.context_length * self.cfg.grad_accum

    def summary(self) -> str:
        """The run's first line: the model, the data, the processes and a step's size."""
        cfg, model, mc, data = self.cfg, self.model, self.model.config, self.data
        return (f"{mc.family} model, {model.num_params() / 1e6:.2f}M parameters "
                + (f"({sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6:.2f}M of them in rank-"
                   f"{cfg.lora_rank} LoRA adapters, the rest frozen) " if cfg.lora_rank else "") +
                f"({mc.n_layer} layers, {mc.n_head} heads, d_model {mc.d_model}) | "
                f"data {data.meta['train_tokens']:,} train / {data.meta['val_tokens']:,} val tokens, "
                f"vocab {data.vocab_size} | "
                f"{self.ddp.world_size} x {self.device.type} "
                f"{str(self.amp_dtype or torch.float32).replace('torch.', '')} | "
                f"{self.tokens_per_step:,} tokens/step ({cfg.grad_accum} x {cfg.batch_size} x {cfg.context_length})")

    def record(self, entry: dict) -> None:
        self.result.history.append(entry)
        if self.metrics is not None:
            self.metrics.write(entry)

    def train_step(self, step: int, loss_sum: torch.Tensor) -> float:
        """One optimizer step over this rank's micro-batches, their loss added to `loss_sum`;
        the step's learning rate."""
        cfg, ddp, optimizer, scaler, accum = self.cfg, self.ddp, self.optimizer, self.scaler, self.accum
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = sample_step_offsets(self.data, cfg, step)
        for micro in range(accum):
            batch = self.data.batch("train", offsets[micro * ddp.world_size + ddp.rank], cfg.context_length,
                                    self.device)
            # DDP all-reduces gradients on the last micro-step only; the others accumulate locally.
            with self.mode.micro_step(self.step_model, last=micro == accum - 1):
                with mixed_precision(self.device, self.amp_dtype, cfg.context_length):
                    loss = batch_loss(self.step_model, batch, fused=fused_loss(cfg, ddp)) / accum
                scaler.scale(loss).backward()
            loss_sum += loss.detach()
        if cfg.grad_clip:
            scaler.unscale_(optimizer)
            # (Sharded: the norm of DTensor gradients is the global one, every rank's shards reduced.)
            optimizer.clip_grad_norm_(cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return lr

    def log(self, done: int, lr: float, window: LogWindow) -> None:
        """The log line of the steps up to `done`: their mean loss and rate, recorded and shown."""
        mean_loss, tokens_per_s = window.close(self.ddp)
        self.record({"kind": "train", "step": done, "loss": mean_loss, "lr": lr, "tokens_per_s": tokens_per_s})
        self.progress.log(done, mean_loss, lr, tokens_per_s)
        window.restart()

    def evaluate(self, step: int) -> dict[str, float]:
        losses = evaluate(self.model, self.data, self.cfg, self.device, self.amp_dtype, self.ddp)
        self.record({"kind": "eval", "step": step, "val_loss": losses["val"], "val_ppl": math.exp(losses["val"]),
                     "train_loss": losses["train"]})
        return losses

    def evaluate_and_save(self, done: int, evaluated: bool, saving: bool) -> None:
        """The evaluation and the checkpoint due after step `done` (a best one marked as such)."""
        result, progress = self.result, self.progress
        is_best = False
        if evaluated:
            losses = self.evaluate(done)
            is_best = losses["val"] < result.best_val_loss
            result.best_val_loss = min(result.best_val_loss, losses["val"])
            progress.note(f"step {done}: val loss {losses['val']:.4f} (ppl {math.exp(losses['val']):.2f}), "
                          f"train loss {losses['train']:.4f}" + (" [best]" if is_best else ""))
        if saving:
            where = _save(self.out_dir, done, self.model, self.model.config, self.data, self.chat_template, self.cfg,
                          self.optimizer, self.scaler, result.best_val_loss, is_best, result.history, self.ddp,
                          self.mode)
            if where is not None:
                progress.note(f"step {done}: saved {where}")

    def finish(self, window: LogWindow, t_start: float) -> TrainResult:
        """The run's result (its rate after warm-up, its wall time), the loss plot; every rank
        leaves together."""
        cfg, result = self.cfg, self.result
        self.progress.close()
        result.step = max(self.start_step, cfg.max_steps)
        result.train_s, result.tokens_per_s = window.rate()
        if self.ddp.main and cfg.plot and result.history:
            plot_losses(self.metrics.records if self.metrics else result.history, self.out_dir / PLOT_FILE,
                        title=f"{self.model.config.family} {self.model.num_params() / 1e6:.2f}M, "
                              f"{Path(cfg.data_dir).name}")
        if self.ddp.world_size > 1:
            dist.barrier()  # leave together: a rank that tears down while rank 0 still saves can abort it
        result.wall_s = time.perf_counter() - t_start
        return result


def _resumed_model(cfg: TrainConfig, data: TokenData, ckpt: checkpoints.TrainCheckpoint, out_dir: Path,
                   device: torch.device) -> tuple[Transformer, str | None]:
    """The checkpoint's model (and its adapters) and chat template, checked against this run."""
    check_resumable(ckpt.state.get("train_config", {}), cfg, ckpt.path)
    check_tokenizer(data, ckpt.config, ckpt.tokenizer, f"the run in {out_dir}",
                    "resume on the data the run was trained on, or start a new run (another --out-dir)")
    weights, adapters = split_state(ckpt.weights)
    model = build_model(ckpt.config, weights, device)
    set_dropout(model, cfg.dropout)
    if cfg.lora_rank:
        lora.apply(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
        lora.load_adapters(model, adapters)
    return model, ckpt.chat_template


def _new_model(cfg: TrainConfig, data: TokenData, device: torch.device) -> tuple[Transformer, str | None]:
    """A model to train from `cfg` (from scratch or a base model) and its chat template."""
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model, chat_template = init_model(cfg, data, device)
    # Chat data was rendered with a template (perhaps --chat-template's): the model learns
    # that one, so its checkpoints carry it for `arlm chat`.
    chat_template = data.meta.get("chat_template") or chat_template
    if cfg.lora_rank:  # (after the weights' seed: the adapters' init draws from it too)
        lora.apply(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    return model, chat_template


def _restore_state(ckpt: checkpoints.TrainCheckpoint, cfg: TrainConfig, ddp: Distributed, mode: parallel.Single,
                   model: Transformer, optimizer, scaler: torch.amp.GradScaler, out_dir: Path) -> tuple[int, float]:
    """The optimizer's, the scaler's and the RNGs' state from the checkpoint; (its step, its best
    validation loss)."""
    mode.load_optimizer_state_dict(model, optimizer, ckpt.state["optimizer"])
    if ckpt.state.get("scaler"):
        scaler.load_state_dict(ckpt.state["scaler"])
    start_step, best_val = ckpt.step, ckpt.state["best_val_loss"]
    if start_step >= cfg.max_steps:
        raise ConfigError(f"the run in {out_dir} is at step {start_step} already: --max-steps {cfg.max_steps} "
                          "leaves nothing to train (raise it to go on)")
    _restore_rng(ckpt.state.get("rng", []), ddp, cfg, start_step)
    return start_step, best_val


def compile_blocks(model: Transformer) -> None:
    """torch.compile each block on its own ("regional" compilation): every block runs the same code,
    so one compiled graph serves all of them (and a second the first layer under LoRA, whose input
    needs no gradient), compiled in a fraction of the whole model's time and as fast after
    (docs/benchmarks.md, issue 46). The fused head and loss stay eager."""
    for block in model.blocks:
        block.compile()


def _save(out_dir: Path, step: int, model: Transformer, model_config: ModelConfig, data: TokenData,
          chat_template: str | None, cfg: TrainConfig, optimizer, scaler, best_val: float, is_best: bool,
          history: list[dict], ddp: Distributed, mode: parallel.Single) -> Path | None:
    # Collective under FSDP (every rank gathers with the others); full on rank 0 alone.
    weights, optimizer_state = mode.model_state_dict(model), mode.optimizer_state_dict(model, optimizer)
    rng = _rng_state()
    if ddp.world_size > 1:  # every rank's RNG (dropout), so a resumed run continues each stream
        gathered: list = [None] * ddp.world_size
        dist.all_gather_object(gathered, rng)
        rng = gathered
    else:
        rng = [rng]
    if not ddp.main:
        return None
    last_eval = next((r for r in reversed(history) if r["kind"] == "eval" and r["step"] == step), None)
    metrics = {k: v for k, v in (last_eval or {}).items() if k not in ("kind", "step")}
    meta = {"step": step, "metrics": metrics, "train_config": cfg.to_dict(),
            "data": {"dir": str(data.path), "tokenizer": data.meta.get("tokenizer")}, **lora.checkpoint_meta(model)}
    state = {"step": step, "optimizer": optimizer_state,
             "scaler": scaler.state_dict() if scaler.is_enabled() else None, "rng": rng,
             "best_val_loss": best_val, "world_size": ddp.world_size, "train_config": cfg.to_dict()}
    return checkpoints.save(out_dir, step, weights, model_config, data.tokenizer, chat_template, meta, state,
                            is_best)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng(states: list[dict], ddp: Distributed, cfg: TrainConfig, step: int) -> None:
    if len(states) == ddp.world_size:
        torch.set_rng_state(states[ddp.rank]["torch"])
        if "cuda" in states[ddp.rank] and torch.cuda.is_available():
            torch.cuda.set_rng_state(states[ddp.rank]["cuda"])
    else:  # a different number of processes: fresh, distinct dropout streams
        torch.manual_seed(cfg.seed + 1000 * step + ddp.rank)
