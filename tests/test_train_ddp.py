"""DDP: `arlm train` on 2 ranks under `torchrun --nproc_per_node=2` (gloo, CPU; the command through its
main(), in a script that then lists the rank's threads) against one process.

Both runs take the same global batch per step: 2 micro-batches of 4 sequences, accumulated in
one process, one per rank under DDP (each rank draws its micro-batch of the global batch, and the
gradients are all-reduced once per step). Tolerance: every step's loss and every final weight
within 1e-6. The runs differ only in summation order (the all-reduce against accumulation, one
thread per rank against two); measured: losses equal, weights within 1.2e-7 after 6 steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_train import SHAKESPEARE, max_weight_diff, tiny

from arlm.train import prepare, train
from arlm.train.checkpoints import LATEST

REPO = Path(__file__).resolve().parents[1]


# Run under torchrun: `arlm train ARGS...` through its main(), then record the native threads left in
# this process (a gloo thread still running into interpreter shutdown can abort a finished run: a
# worker that releases a collective's tensors then needs the GIL: "terminate called without an
# active exception").
TRAIN_THEN_THREADS = """
import glob, json, os, sys
from arlm.cli import main
code = main(sys.argv[2:])
names = sorted(open(f).read().strip() for f in glob.glob("/proc/self/task/*/comm"))
with open(os.path.join(sys.argv[1], f"threads-{os.environ['RANK']}.json"), "w") as fh:
    json.dump(names, fh)
raise SystemExit(code)
"""


@pytest.mark.slow
def test_two_ranks_equal_one_process_with_the_same_global_batch(tmp_path):
    """`arlm train` on 2 ranks equals one process; and train() frees its process group before it
    returns, so no gloo thread outlives it on either rank (one torchrun run for both checks)."""
    (tmp_path / "corpus.txt").write_text(SHAKESPEARE[:20_000], encoding="utf-8")
    prepare([tmp_path / "corpus.txt"], tmp_path / "data", tokenizer="char")
    cfg = tiny(tmp_path / "data", tmp_path / "ddp", grad_accum=2, batch_size=4, max_steps=6, eval_interval=3,
               threads=0)
    args = [f"--{k}={v}" for k, v in cfg.to_dict().items() if v is not None]
    (tmp_path / "run.py").write_text(TRAIN_THEN_THREADS, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(tmp_path / "run.py"), str(tmp_path), "train", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        names = json.loads((tmp_path / f"threads-{rank}.json").read_text())
        assert not [n for n in names if "gloo" in n], (rank, names)

    single = train(tiny(tmp_path / "data", tmp_path / "single", grad_accum=2, batch_size=4, max_steps=6,
                        eval_interval=3))
    records = [json.loads(line) for line in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    ddp_losses = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
    assert list(ddp_losses) == list(single.losses) == [1, 2, 3, 4, 5, 6]
    for step, loss in single.losses.items():
        assert abs(ddp_losses[step] - loss) <= 1e-6, (step, ddp_losses[step], loss)
    ddp_evals = [r["val_loss"] for r in records if r["kind"] == "eval"]
    assert all(abs(a - b["val_loss"]) <= 1e-6 for a, b in zip(ddp_evals, single.evals, strict=True))
    assert max_weight_diff(tmp_path / "ddp" / LATEST, tmp_path / "single" / LATEST) <= 1e-6
    # Rank 0 alone wrote: one metrics log, one set of checkpoints.
    assert len(list((tmp_path / "ddp").glob("ckpt-*"))) == 1
