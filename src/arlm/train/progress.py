"""What a person watches during a run: a progress bar, a JSONL metrics log, a loss-curve PNG."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from ..files import atomic_write, atomic_write_text

METRICS_FILE, PLOT_FILE = "metrics.jsonl", "loss.png"


class MetricsLog:
    """Appends one JSON object per line: {"kind": "train"|"eval", "step": ..., ...}.

    A resumed run first drops the records past its starting step, which the interrupted run
    wrote after its last checkpoint, so the log reads as one run.
    """

    def __init__(self, path: str | Path, resume_step: int | None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records: list[dict] = []
        if resume_step is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a kill
                if record.get("step", 0) <= resume_step:
                    self.records.append(record)
        # (atomic: a run killed here keeps the log it had, not half of it)
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records))

    def write(self, record: dict) -> None:
        self.records.append(record)
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")


def format_seconds(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """A tqdm bar on a terminal (step, loss, lr, tokens/s, ETA); one line per log otherwise."""

    def __init__(self, start_step: int, max_steps: int, enabled: bool) -> None:
        self.enabled, self.max_steps = enabled, max_steps
        self.bar = None
        self.t0, self.step0 = time.perf_counter(), start_step
        self.paused = 0.0  # seconds spent in evaluation and saving, kept out of the ETA
        if enabled and sys.stderr.isatty():
            self.bar = tqdm(total=max_steps, initial=start_step, unit="step", dynamic_ncols=True,
                            file=sys.stderr, desc="train")

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def log(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        stats = f"loss {loss:.4f} | lr {lr:.2e} | {tokens_per_s:,.0f} tok/s"
        if self.bar is not None:
            self.bar.set_postfix_str(stats, refresh=False)
            return
        elapsed = time.perf_counter() - self.t0 - self.paused
        eta = elapsed / max(1, step - self.step0) * (self.max_steps - step)
        print(f"step {step:>{len(str(self.max_steps))}}/{self.max_steps} | {stats} | eta {format_seconds(eta)}",
              file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def plot_losses(records: list[dict], path: str | Path, title: str = "") -> Path:
    """Training loss (per log interval) and evaluation losses against the step, as a PNG."""
    # (matplotlib with pyplot: ~0.5 s, paid only when the plot is written)
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig, ax = plt.subplots(figsize=(8, 5))
    if train:
        ax.plot(*zip(*train), label="train (batch)", alpha=0.6, linewidth=1)
    if evals:
        ax.plot([r["step"] for r in evals], [r["train_loss"] for r in evals], "o-", label="train (eval)")
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
    return Path(path)
