"""nanoGPT's CPU recipe for character-level tiny Shakespeare: arlm beside a nanoGPT reference.

    .venv/bin/python benchmarks/train_shakespeare_char.py [--family gpt2 llama] [--threads 2]
        [--dtype auto|float32|bfloat16] [--compile] [--reference-steps 2000] [--out out/bench_train]

The recipe (nanoGPT's README, training on a CPU): 4 layers, 4 heads, d_model 128, context 64,
batch 12, 2000 iterations, lr 1e-3 with 100 warmup steps and cosine decay to 1e-4, AdamW betas
(0.9, 0.99), weight decay 0.1, dropout 0, gradient clipping 1.0, no biases. nanoGPT reports a
validation loss of 1.88 for it; on a 2-core machine like this one it reached 1.886 at step 2000 in
169 s (74-83 ms per iteration, ~9,500 training tokens/s).

arlm trains it twice, as the GPT-2 style (learned positions, LayerNorm, GELU) and the Llama style
(RoPE, RMSNorm, SwiGLU, at the same parameter count). Beside them, in the same run, trains the
peer: nanoGPT's model (its `GPT`: the same modules, names and initialization), written out here
from its published design because nanoGPT is not a package, driven the way nanoGPT's train.py
drives it on a CPU (float32, eager, AdamW without fusing, a batch stacked from the token file and
the loss read back every iteration, as the recipe's --log_interval=1 does).

Reported for each: validation loss at step 2000, as nanoGPT measures it (the mean over 20
batches, under the run's precision) and over the whole validation split in float32 (every
64-token window: the number the 20-batch estimate scatters around); training tokens/s (steps
only, after the first log window: compilation and warm-up excluded); wall time of the whole run
(evaluations every 250 steps, checkpoints, compilation included); the load average while it ran.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from arlm.llm import LLM  # noqa: E402
from arlm.loading import load_model  # noqa: E402
from arlm.sampling import SamplingParams  # noqa: E402
from arlm.train import TokenData, TrainConfig, lr_at, prepare, train  # noqa: E402
from arlm.train.trainer import autocast_dtype  # noqa: E402
from bench_args import int_range, positive_int  # noqa: E402

NANOGPT_VAL_LOSS = 1.88  # nanoGPT's README
NANOGPT_TOKENS_PER_S = 9_500  # the same recipe on a machine like this one (169 s, 74-83 ms/iter)

RECIPE = dict(n_layer=4, n_head=4, d_model=128, context_length=64, batch_size=12, grad_accum=1,
              max_steps=2000, lr=1e-3, min_lr=1e-4, warmup_steps=100, beta1=0.9, beta2=0.99,
              weight_decay=0.1, dropout=0.0, grad_clip=1.0, bias=False, eval_interval=250, eval_batches=20,
              log_interval=50, seed=1337)


def machine() -> dict:
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version()}


@torch.no_grad()
def full_val_loss(model: nn.Module, val: np.ndarray, T: int) -> float:
    """Mean next-token loss over every non-overlapping T-token window of the validation split (float32)."""
    n = (len(val) - 1) // T
    x = torch.from_numpy(val[: n * T].astype(np.int64)).view(n, T)
    y = torch.from_numpy(val[1: n * T + 1].astype(np.int64)).view(n, T)
    was_training = model.training
    model.eval()
    total = sum(F.cross_entropy(model(x[i:i + 256]).flatten(0, 1), y[i:i + 256].flatten(), reduction="sum").item()
                for i in range(0, n, 256))
    model.train(was_training)
    return total / (n * T)


# -- the peer: nanoGPT's model and loop ------------------------------------------------------------

class RefAttention(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class RefBlock(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d, bias=False), RefAttention(d, n_head)
        self.ln_2 = nn.LayerNorm(d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(), nn.Linear(4 * d, d, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class RefGPT(nn.Module):
    """nanoGPT's GPT at bias=False, dropout=0: wte tied to lm_head, N(0, 0.02) init, and the
    residual output projections at 0.02 / sqrt(2 * n_layer)."""

    def __init__(self, vocab: int, n_layer: int, n_head: int, d: int, block_size: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block_size, d)
        self.h = nn.ModuleList(RefBlock(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d, bias=False)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith("attn.c_proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def nanogpt_reference(data_dir: Path, steps: int) -> dict:
    """Train the peer with nanoGPT's loop; tokens/s over steps 50.., val losses at the end."""
    cfg = TrainConfig(**{**RECIPE, "max_steps": steps})
    data = TokenData.open(data_dir)
    train_data = data.splits["train"]
    T, B = cfg.context_length, cfg.batch_size
    torch.manual_seed(cfg.seed)
    model = RefGPT(data.vocab_size, cfg.n_layer, cfg.n_head, cfg.d_model, T)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))  # nanoGPT fuses only on CUDA

    def get_batch(split: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(split) - T, (B,))
        x = torch.stack([torch.from_numpy(split[i:i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(split[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
        return x, y

    t_start = time.perf_counter()
    t_train, t_mark = 0.0, None
    for it in range(steps):
        if it == 50:
            t_mark = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(it, cfg)
        x, y = get_batch(train_data)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    t_train = time.perf_counter() - (t_mark or t_start)
    with torch.no_grad():  # nanoGPT's estimate: 20 random batches
        model.eval()
        val20 = float(np.mean([F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                               for x, y in (get_batch(data.splits["val"]) for _ in range(cfg.eval_batches))]))
    return {"family": "nanoGPT reference", "params": sum(p.numel() for p in model.parameters()), "compile": False,
            "dtype": "float32", "threads": torch.get_num_threads(), "steps": steps, "val_loss_run": val20,
            "val_loss_full": full_val_loss(model, np.asarray(data.splits["val"]), T),
            "tokens_per_s": (steps - 50) * B * T / t_train, "wall_s": time.perf_counter() - t_start}


# -- arlm ------------------------------------------------------------------------------------------

def run_arlm(family: str, data_dir: Path, out_root: Path, steps: int, compile: bool, dtype: str) -> dict:
    cfg = TrainConfig(**{**RECIPE, "max_steps": steps}, family=family, data_dir=str(data_dir),
                      out_dir=str(out_root / family), compile=compile, dtype=dtype, progress=True, plot=True)
    result = train(cfg, overwrite=True)
    windows = [r["tokens_per_s"] for r in result.history if r["kind"] == "train"][1:]
    model = load_model(str(out_root / family / "latest")).model
    return {"family": family, "params": model.num_params(), "compile": compile,
            "dtype": str(autocast_dtype(cfg, torch.device("cpu")) or "float32").replace("torch.", ""),
            "threads": torch.get_num_threads(), "steps": steps,
            "val_loss_run": result.evals[-1]["val_loss"],  # 20 fixed batches, under the run's autocast
            "val_loss_full": full_val_loss(model, np.asarray(TokenData.open(data_dir).splits["val"]),
                                           cfg.context_length),
            "tokens_per_s": result.tokens_per_s,
            # Per log window (50 steps), after the first: robust to another process's burst of load.
            "tokens_per_s_median_window": float(np.median(windows)) if windows else math.nan,
            "wall_s": result.wall_s, "checkpoint": str(out_root / family / "latest")}


def run_arlm_ddp(family: str, data_dir: Path, out_root: Path, steps: int, dtype: str, procs: int) -> dict:
    """The same recipe under `torchrun`: `procs` processes of one thread, each taking 12 / procs
    sequences of the global batch of 12 (so the optimizer sees the same batches' gradient)."""
    import subprocess

    out = out_root / f"{family}-ddp{procs}"
    cfg = TrainConfig(**{**RECIPE, "max_steps": steps, "batch_size": RECIPE["batch_size"] // procs,
                         "grad_accum": procs}, family=family, data_dir=str(data_dir), out_dir=str(out),
                      dtype=dtype, threads=1, progress=False)
    flags = [f"--{k}={v}" for k, v in cfg.to_dict().items() if v is not None]
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
                    "-m", "arlm", "train", *flags, "--overwrite"], check=True, cwd=ROOT,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")})
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    windows = [r["tokens_per_s"] for r in records if r["kind"] == "train"][1:]
    model = load_model(str(out / "latest")).model
    return {"family": f"{family} DDP {procs}x1", "params": model.num_params(), "compile": False,
            "dtype": str(autocast_dtype(cfg, torch.device("cpu")) or "float32").replace("torch.", ""),
            "threads": f"{procs} procs x 1", "steps": steps,
            "val_loss_run": [r for r in records if r["kind"] == "eval"][-1]["val_loss"],
            "val_loss_full": full_val_loss(model, np.asarray(TokenData.open(data_dir).splits["val"]),
                                           cfg.context_length),
            "tokens_per_s": len(windows) / sum(1 / w for w in windows),  # steps-weighted mean of the windows
            "tokens_per_s_median_window": float(np.median(windows)), "wall_s": wall, "cpu_s": math.nan,
            "checkpoint": str(out / "latest")}


def samples(checkpoint: str, n: int = 3) -> list[str]:
    """Text from the checkpoint through arlm's generation path (prefill, then KV-cached decode)."""
    llm = LLM.load(checkpoint, quantize=None)  # the trained float32 weights as they are
    window = llm.model.config.max_seq_len
    params = [SamplingParams(max_new_tokens=window - 1, temperature=0.8, top_p=1.0, seed=seed) for seed in range(n)]
    return [llm.generate(["\n"], p)[0].text for p in params]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", nargs="*", default=["gpt2", "llama"], choices=["gpt2", "llama"],
                    help="arlm's model styles to train (none: the reference alone)")
    # tokens/s is measured after the first log window (50 steps, warm-up): a run needs more steps.
    min_steps = RECIPE["log_interval"] + 1
    ap.add_argument("--steps", type=int_range(min_steps), default=2000)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="arlm's autocast dtype (auto: bfloat16 on CPUs with AVX512-BF16 or AMX, else float32)")
    ap.add_argument("--compile", action="store_true", help="torch.compile arlm's model")
    ap.add_argument("--threads", type=positive_int, default=os.cpu_count(), help="torch threads (default: all cores)")
    ap.add_argument("--reference-steps", type=int_range(0), default=None, help="steps of the nanoGPT reference "
                    "(default: --steps; 0 skips it)")
    # K splits the recipe's batch evenly, so the optimizer still sees 12 sequences a step.
    ddp_procs = [k for k in range(1, RECIPE["batch_size"] + 1) if RECIPE["batch_size"] % k == 0]
    ap.add_argument("--ddp", type=int, default=0, choices=[0, *ddp_procs], metavar="K",
                    help=f"also train the GPT-2 style under torchrun: K processes of one thread each "
                    f"(K one of {', '.join(map(str, ddp_procs))}; 0: no DDP run)")
    ap.add_argument("--seed", type=int_range(0, 2**32 - 1), default=RECIPE["seed"],
                    help="seeds arlm's runs and the reference")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench_train")
    args = ap.parse_args()
    if args.reference_steps is not None and 0 < args.reference_steps < min_steps:
        ap.error(f"argument --reference-steps: expected 0 (no reference) or an integer >= {min_steps}, "
                 f"got {args.reference_steps}")
    torch.set_num_threads(args.threads)
    RECIPE["seed"] = args.seed
    ref_steps = args.steps if args.reference_steps is None else args.reference_steps

    data_dir = args.out / "data"
    if not (data_dir / "meta.json").exists():
        prepare([ROOT / "data" / "tinyshakespeare.txt"], data_dir, tokenizer="char")
    report = {"machine": machine(), "recipe": RECIPE, "runs": []}
    print(json.dumps(report["machine"]), file=sys.stderr)

    def timed(fn, *a) -> dict:
        load, cpu = os.getloadavg()[0], time.process_time()
        run = fn(*a)
        # CPU seconds of this process: with one thread, what the wall time would be on an idle
        # machine (the two differ by the time other processes held the core).
        run.update(loadavg_start=load, loadavg_end=os.getloadavg()[0])
        run.setdefault("cpu_s", time.process_time() - cpu)
        print(json.dumps(run), file=sys.stderr)
        report["runs"].append(run)
        return run

    for family in args.family:
        timed(run_arlm, family, data_dir, args.out, args.steps, args.compile, args.dtype)
    if args.ddp:
        timed(run_arlm_ddp, "gpt2", data_dir, args.out, args.steps, args.dtype, args.ddp)
    if ref_steps:
        timed(nanogpt_reference, data_dir, ref_steps)
    arlm_runs = [r for r in report["runs"] if "checkpoint" in r]
    report["samples"] = samples(arlm_runs[0]["checkpoint"]) if arlm_runs else []

    ref = next((r for r in report["runs"] if r["family"] == "nanoGPT reference"), None)
    print(f"\n| model | precision, threads | val loss @{args.steps}: 20 batches / full split | training tokens/s "
          "| x nanoGPT reference | x nanoGPT published | wall s (CPU s) | load avg |")
    print("|---|---|---|---|---|---|---|---|")
    for r in report["runs"]:
        name = r["family"] + (" (compiled)" if r["compile"] else "")
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}" if ref else "-"
        print(f"| {name}, {r['params'] / 1e6:.2f}M | {r['dtype']}, {r['threads']} | {r['val_loss_run']:.4f} / "
              f"{r['val_loss_full']:.4f} | {r['tokens_per_s']:,.0f} | {ratio} | "
              f"{r['tokens_per_s'] / NANOGPT_TOKENS_PER_S:.2f} | {r['wall_s']:.0f} ({r['cpu_s']:.0f}) | "
              f"{r['loadavg_start']:.1f}-{r['loadavg_end']:.1f} |")
    print(f"\nnanoGPT published: val loss {NANOGPT_VAL_LOSS}, ~{NANOGPT_TOKENS_PER_S:,} tokens/s "
          f"(target for arlm: >= {1.5 * NANOGPT_TOKENS_PER_S:,.0f})")
    for s in report["samples"]:
        print("\n---" + s)
    out = args.out / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
