"""Peak memory per process of DDP against FSDP2 (`--fsdp`), both on 2 processes (gloo, CPU).

    .venv/bin/python benchmarks/fsdp_memory.py [--init-from smollm2] [--context-length 128]
        [--steps 3] [--nproc 2]

Each mode runs `arlm train` under torchrun on the same settings: --init-from (default SmolLM2-135M,
its weights dequantized to float32 on every rank), batch 1, grad_accum = the process count,
float32, one evaluation batch a rank, on tiny Shakespeare tokenized with the model's tokenizer.
Every rank reports its peak RSS (the kernel's VmHWM) three times: after loading and wrapping the
model (every rank holds the whole float32 model before FSDP shards it: the same in both modes),
then, the peak reset (/proc/self/clear_refs), over training alone (forward, backward, AdamW,
up to the final checkpoint), and over the final save (under FSDP rank 0 gathers the full weights
and optimizer state). Printed: the figures per rank and mode, and the FSDP/DDP ratio of the
training peaks.

As a worker (RANK set by torchrun) it trains and writes its figures as JSON; nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def peak_mib() -> float:
    """The peak RSS since the process started or the last reset_peak()."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # (Linux >= 4.0: VmHWM := VmRSS)


def worker(report: str, argv: list[str]) -> None:
    from arlm.cli import entry
    from arlm.train import trainer

    figures = {}
    save, configure_optimizer = trainer._save, trainer.configure_optimizer

    def measured_configure_optimizer(*args, **kwargs):  # called just after the model is wrapped
        figures["load_peak_mib"] = peak_mib()
        reset_peak()
        return configure_optimizer(*args, **kwargs)

    def measured_save(*args, **kwargs):  # the first save is the final one (--eval-interval 0)
        figures["train_peak_mib"] = peak_mib()
        reset_peak()
        return save(*args, **kwargs)

    trainer._save, trainer.configure_optimizer = measured_save, measured_configure_optimizer
    sys.argv = ["arlm", "train", *argv]
    try:
        entry()
    except SystemExit as e:
        if e.code:
            raise
    figures["save_peak_mib"] = peak_mib()
    Path(f"{report}-{os.environ['RANK']}.json").write_text(json.dumps(figures))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--init-from", default="smollm2")
    p.add_argument("--context-length", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()

    from arlm.train import prepare
    from arlm.train.data import default_corpus

    work = Path(tempfile.mkdtemp(prefix="fsdp_memory_"))
    corpus = work / "corpus.txt"
    corpus.write_text(default_corpus().read_text(encoding="utf-8")[:50_000], encoding="utf-8")
    prepare([corpus], work / "data", tokenizer=args.init_from)
    settings = ["--init-from", args.init_from, "--data-dir", str(work / "data"), "--context-length",
                str(args.context_length), "--batch-size", "1", "--grad-accum", str(args.nproc), "--max-steps",
                str(args.steps), "--eval-interval", "0", "--eval-batches", str(args.nproc), "--log-interval", "1",
                "--dtype", "float32", "--progress", "false", "--plot", "false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    rows = {}
    for mode, flags in (("ddp", []), ("fsdp", ["--fsdp"])):
        report = work / mode
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               __file__, "--worker", str(report), *settings, "--out-dir", str(work / f"out_{mode}"), *flags]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode:
            sys.exit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
        rows[mode] = [json.loads(Path(f"{report}-{r}.json").read_text()) for r in range(args.nproc)]
        losses = [json.loads(line)["loss"] for line in (work / f"out_{mode}" / "metrics.jsonl").read_text().splitlines()
                  if json.loads(line)["kind"] == "train"]
        print(f"{mode}: losses {', '.join(f'{x:.4f}' for x in losses)}")

    print(f"\n{args.init_from}, context {args.context_length}, batch 1 x {args.nproc} processes, float32, "
          f"{args.steps} steps; peak RSS per process (MiB)")
    print(f"{'mode':6} {'rank':>4} {'load':>6} {'training':>9} {'save':>6}")
    for mode, ranks in rows.items():
        for r, f in enumerate(ranks):
            print(f"{mode:6} {r:>4} {f['load_peak_mib']:>6.0f} {f['train_peak_mib']:>9.0f} {f['save_peak_mib']:>6.0f}")
    ddp = max(f["train_peak_mib"] for f in rows["ddp"])
    fsdp = max(f["train_peak_mib"] for f in rows["fsdp"])
    print(f"\ntraining peak, largest rank: fsdp / ddp = {fsdp / ddp:.2f} ({fsdp:.0f} / {ddp:.0f} MiB)")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3:])
    else:
        main()
