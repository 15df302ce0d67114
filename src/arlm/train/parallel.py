"""How the processes of a training run share the model: one type per mode behind one interface.

    Single      one process: the model as it is.
    Replicated  DDP (torchrun): every rank holds the whole model, gradients all-reduced.
    Sharded     FSDP2 (torchrun, `--fsdp`): `fully_shard` on each transformer block, then the root
                (embeddings, final norm, LM head): every rank holds 1/K of each parameter, its
                gradient and its AdamW state; a block's parameters are all-gathered just before
                its forward (and again for its backward) and its gradients reduce-scattered.

The trainer asks the mode to wrap the model (before the optimizer is built: FSDP2 replaces the
parameters with DTensor shards), for the context of each micro-step, and for the full state
dicts a checkpoint holds. Checkpoints are the same in every mode: full (unsharded) weights and an
optimizer state keyed by parameter index (`torch.optim.Optimizer.state_dict`'s format), so a run
saved by K processes resumes on any number, in any mode, and `arlm generate` loads it.

What the trainer needs from FSDP2 on CPU (gloo), checked on torch 2.13: reduce-scatter and
all-gather, `clip_grad_norm_` over DTensor gradients (the global norm: each rank's shard norms
are reduced), fused AdamW on DTensor parameters, autocast to bf16 around sharded modules, and
the full state dicts of torch.distributed.checkpoint. FSDP2's own MixedPrecisionPolicy (bf16
parameters, float32 reduce) runs there too but is not used: autocast over float32 shards keeps
DDP's numerics (norms and softmax in float32).
"""

from __future__ import annotations

import inspect
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist

from ..config import ConfigError


class Single:
    """One process: nothing to wrap, synchronise or gather."""

    def __init__(self, world_size: int = 1, device: torch.device | None = None) -> None:
        self.world_size, self.device = world_size, device

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the training step calls (the model itself, or a wrapper around it)."""
        return model

    def micro_step(self, step_model: torch.nn.Module, last: bool):
        """The context of one micro-step's forward and backward; `last`: the step's final one."""
        return nullcontext()

    def model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full weights (collective in a sharded run: every rank calls it; rank 0's is full)."""
        return model.state_dict()

    def optimizer_state_dict(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The full optimizer state, keyed by parameter index (collective, as model_state_dict)."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict) -> None:
        """Load a full, index-keyed optimizer state (from a run in any mode)."""
        optimizer.load_state_dict(state)


class Replicated(Single):
    """DDP: each rank a whole model; gradients all-reduced on the last micro-step only."""

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # The RoPE tables are constant buffers: no need to broadcast them every forward.
        no_buffer_sync = {"forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters
                          else "broadcast_buffers": False}
        return DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None, **no_buffer_sync)

    def micro_step(self, step_model: torch.nn.Module, last: bool):
        if last:
            return nullcontext()
        ddp_module = getattr(step_model, "_orig_mod", step_model)  # (through a torch.compile wrapper)
        return ddp_module.no_sync()


class Sharded(Single):
    """FSDP2: parameters, gradients and optimizer state sharded over the ranks (dim 0 of each)."""

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import fully_shard

        # Each block is its own unit (its all-gather overlaps the previous block's compute and its
        # full parameters are freed after it); the root takes what is left: the embeddings (with
        # a tied LM head, one parameter), the final norm and the head. Parameters stay float32:
        # the trainer's autocast decides the compute dtype, as in the other modes, so a sharded
        # run computes what DDP computes.
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)  # in place: the model's class becomes FSDP<Transformer>
        return model

    # micro_step: no gradient-sync pause. Under FSDP2 a paused micro-step keeps whole unsharded
    # gradients until the last one (set_requires_gradient_sync(False)); reduce-scattering every
    # micro-step keeps 1/K of them, the point of sharding, at one reduce-scatter a micro-step.

    def model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=_full_on_cpu())

    def optimizer_state_dict(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        by_name = get_optimizer_state_dict(model, optimizer, options=_full_on_cpu())  # {} on ranks > 0
        if not by_name:
            return {}
        index = _param_index(model, optimizer)
        return {"state": {index[name]: s for name, s in by_name["state"].items()},
                "param_groups": [{**g, "params": [index[name] for name in g["params"]]}
                                 for g in by_name["param_groups"]]}

    def load_optimizer_state_dict(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        name = {i: n for n, i in _param_index(model, optimizer).items()}
        by_name = {"state": {name[i]: s for i, s in state["state"].items()},
                   "param_groups": [{**g, "params": [name[i] for i in g["params"]]} for g in state["param_groups"]]}
        # Every rank read the whole checkpoint: each keeps its own shard of every state tensor.
        set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def _full_on_cpu():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _param_index(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameter name -> its index in the optimizer's state dict (groups in order, then params)."""
    names = {id(p): n for n, p in model.named_parameters()}  # a tied parameter: its first name
    order = (p for group in optimizer.param_groups for p in group["params"])
    return {names[id(p)]: i for i, p in enumerate(order)}


def for_run(fsdp: bool, world_size: int, device: torch.device, *, eval_batches: int, dtype: str,
            compile: bool) -> Single:
    """The mode a run trains in; a combination it cannot run raises ConfigError (one line)."""
    if not fsdp:
        return Replicated(world_size, device) if world_size > 1 else Single(world_size, device)
    if world_size == 1:
        # The same training, unsharded: a config written for a sharded run still runs (and resumes) here.
        print("--fsdp: one process, nothing to shard: training unsharded "
              "(run under `torchrun --nproc-per-node K` to shard over K processes)", file=sys.stderr)
        return Single(world_size, device)
    if not dist.is_available():
        raise ConfigError("--fsdp needs torch.distributed, which this torch build lacks")
    if dtype == "float16":
        raise ConfigError("--fsdp with --dtype float16 is not supported (its gradient scaler is untested on "
                          "sharded gradients): use bfloat16 or float32")
    if compile:
        raise ConfigError("--fsdp with --compile is not supported yet: drop one of them")
    if eval_batches % world_size:
        # Every forward of a sharded model is collective: each rank must run as many as the others.
        raise ConfigError(f"--fsdp needs eval_batches ({eval_batches}) a multiple of the number of processes "
                          f"({world_size})")
    return Sharded(world_size, device)
