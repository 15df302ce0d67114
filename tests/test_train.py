"""Training: data preparation, the teacher-forced loss, the causal mask, the loop, checkpoints.

References and tolerances:
- the training loss against cross-entropy computed by hand (float64 log-softmax) on the same
  logits: 1e-6;
- the causal mask: changing token j leaves the loss at every position before j - 1 unchanged
  (1e-6) and changes the ones after (so the check can fail);
- resume: N steps in one run against N/2, a stop and N/2 resumed: every step's loss and every
  final weight within 1e-6 (CPU, float32, dropout on, so the RNG state must be restored too);
- a run killed (SIGKILL) mid-save: the previous checkpoint still loads, and resuming from it ends
  on the same weights as a run that was never killed (1e-6).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from arlm.cli import main as arlm_main
from arlm.config import ConfigError, ModelConfig
from arlm.loading import load_model
from arlm.model import Transformer
from arlm.train import TrainConfig, lr_at, next_token_loss, prepare, train
from arlm.train.checkpoints import BEST, LATEST, STATE_FILE
from arlm.train.config import load_config
from arlm.train.data import TokenData, default_corpus

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = default_corpus().read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def char_data(tmp_path_factory) -> Path:
    """The first 40,000 characters of tiny Shakespeare, character-level."""
    root = tmp_path_factory.mktemp("data")
    (root / "corpus.txt").write_text(SHAKESPEARE[:40_000], encoding="utf-8")
    prepare([root / "corpus.txt"], root / "char", tokenizer="char")
    return root / "char"


def tiny(data_dir: Path, out_dir: Path, **overrides) -> TrainConfig:
    """A model and run small enough for a test: 2 layers, d_model 32, 16-token context."""
    base = dict(data_dir=str(data_dir), out_dir=str(out_dir), n_layer=2, n_head=2, d_model=32, context_length=16,
                batch_size=4, max_steps=6, warmup_steps=2, lr=3e-3, min_lr=3e-4, eval_interval=3, eval_batches=2,
                log_interval=1, progress=False, plot=False, threads=1, dtype="float32")
    return TrainConfig(**{**base, **overrides})


def weights(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint_dir / "model.safetensors"))


def max_weight_diff(a: Path, b: Path) -> float:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


# -- data ------------------------------------------------------------------------------------------

def test_prepare_char_matches_nanogpt(tmp_path):
    meta = prepare([default_corpus()], tmp_path, tokenizer="char")
    data = TokenData.open(tmp_path)
    chars = sorted(set(SHAKESPEARE))
    assert meta["vocab_size"] == len(chars) == 65
    # nanoGPT's shakespeare_char: ids in sorted character order, cut at int(0.9 * n).
    assert (meta["train_tokens"], meta["val_tokens"]) == (1_003_854, 111_540)
    expected = np.array([chars.index(c) for c in SHAKESPEARE[:1000]])
    assert np.array_equal(np.asarray(data.splits["train"][:1000]), expected)
    assert data.splits["train"].dtype == np.uint16
    val_text = data.tokenizer.decode(np.asarray(data.splits["val"]).tolist())
    assert val_text == SHAKESPEARE[1_003_854:]


def test_prepare_bpe_vocab_size_and_round_trip(tmp_path):
    (tmp_path / "a.txt").write_text(SHAKESPEARE[:30_000], encoding="utf-8")
    (tmp_path / "b.txt").write_text(SHAKESPEARE[30_000:50_000], encoding="utf-8")
    meta = prepare([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "bpe", tokenizer="bpe", vocab_size=500)
    data = TokenData.open(tmp_path / "bpe")
    assert meta["vocab_size"] == data.tokenizer.vocab_size == 500
    ids = np.concatenate([data.splits["train"], data.splits["val"]]).tolist()
    eos = data.tokenizer.eos_id
    assert ids.count(eos) == 1  # one separator between the two documents
    cut = ids.index(eos)
    assert data.tokenizer.decode(ids[:cut]) == SHAKESPEARE[:30_000]
    assert data.tokenizer.decode(ids[cut + 1:]) == SHAKESPEARE[30_000:50_000]
    assert meta["train_tokens"] + meta["val_tokens"] < 50_000 / 2  # merges happened


@pytest.fixture(scope="module")
def smollm2_data(tmp_path_factory) -> Path:
    """6,000 characters of Shakespeare in SmolLM2's tokens (its tokenizer read from the GGUF)."""
    root = tmp_path_factory.mktemp("smol")
    (root / "corpus.txt").write_text(SHAKESPEARE[:6_000], encoding="utf-8")
    prepare([root / "corpus.txt"], root / "smollm2", tokenizer="smollm2")
    return root / "smollm2"


def test_prepare_with_a_model_tokenizer(smollm2_data):
    data = TokenData.open(smollm2_data)
    assert data.vocab_size == 49152 and data.meta["tokenizer"] == "smollm2"
    assert data.tokenizer.eos_ids == [2]
    ids = np.concatenate([data.splits["train"], data.splits["val"]]).tolist()
    assert data.tokenizer.decode(ids) == SHAKESPEARE[:6_000]
    assert ids[:3] == data.tokenizer.encode(SHAKESPEARE[:20])[:3]


@pytest.mark.parametrize("tokenizer", ["char", "smollm2"])
def test_vocab_size_is_refused_where_the_tokenizer_brings_its_own(tokenizer, tmp_path, capsys):
    (tmp_path / "corpus.txt").write_text(SHAKESPEARE[:1_000], encoding="utf-8")
    argv = ["prepare", str(tmp_path / "corpus.txt"), "--tokenizer", tokenizer, "--vocab-size", "300",
            "--out", str(tmp_path / "d")]
    assert arlm_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--vocab-size applies with --tokenizer bpe" in err, err
    assert not (tmp_path / "d").exists()


# -- configuration ---------------------------------------------------------------------------------

def test_config_file_then_overrides(tmp_path):
    (tmp_path / "run.toml").write_text('n_layer = 6\nlr = 3e-4\nfamily = "llama"\ncompile = true\n')
    (tmp_path / "run.yaml").write_text("n_layer: 6\nlr: 0.0003\nfamily: llama\ncompile: true\n")
    for name in ("run.toml", "run.yaml"):
        cfg = load_config(tmp_path / name, {"lr": 1e-3, "n_kv_heads": 2})
        assert (cfg.n_layer, cfg.lr, cfg.family, cfg.compile, cfg.n_kv_heads) == (6, 1e-3, "llama", True, 2)
        assert cfg.d_model == TrainConfig().d_model  # untouched keys keep their defaults
    (tmp_path / "bad.toml").write_text("n_layers = 6\n")
    with pytest.raises(ConfigError, match="unknown key.*n_layers"):
        load_config(tmp_path / "bad.toml")
    (tmp_path / "typo.toml").write_text('n_layer = "six"\n')
    with pytest.raises(ConfigError, match="n_layer.*must be int"):
        load_config(tmp_path / "typo.toml")
    with pytest.raises(ConfigError, match="unknown key.*n_embd"):
        load_config(None, {"n_embd": 8})


@pytest.mark.parametrize("flag", ["--lr", "--min-lr", "--grad-clip", "--weight-decay", "--lora-alpha"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_setting_that_is_not_a_finite_number_is_refused(flag, value, tmp_path, capsys):
    argv = ["train", flag, value, "--lora-rank", "2", "--data-dir", str(tmp_path / "none"), "--out-dir", str(tmp_path)]
    assert arlm_main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"arlm: error: {flag[2:].replace('-', '_')} must be a finite number, got {float(value)}", err


def test_resume_and_overwrite_together_are_refused(tmp_path, capsys):
    assert arlm_main(["train", "--resume", "--overwrite", "--out-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--overwrite: not allowed with argument --resume" in err, err


def test_a_meta_json_that_is_not_an_object_is_named(tmp_path, capsys):
    (tmp_path / "corpus.txt").write_text(SHAKESPEARE[:1_000], encoding="utf-8")
    prepare([tmp_path / "corpus.txt"], tmp_path / "d", tokenizer="char")
    (tmp_path / "d" / "meta.json").write_text("[1]")
    assert arlm_main(["train", "--data-dir", str(tmp_path / "d"), "--out-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"data in {tmp_path / 'd'} is incomplete or inconsistent" in err, err
    assert "meta.json is not readable" in err, err


def test_metrics_and_plot_are_rewritten_atomically(tmp_path, monkeypatch):
    """A write that fails partway (a full disk, a kill) through the resume's rewrite of
    metrics.jsonl or through loss.png leaves the file as it was, and no temp file."""
    import matplotlib.figure

    from arlm.train.progress import MetricsLog, plot_losses

    metrics, plot = tmp_path / "metrics.jsonl", tmp_path / "loss.png"
    records = [{"kind": "train", "step": s, "loss": 4.0 - s, "lr": 1e-3, "tokens_per_s": 1.0} for s in (1, 2, 3)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    plot.write_bytes(b"the last run's plot")
    before = {p: p.read_bytes() for p in (metrics, plot)}

    def half_then_full_disk(path, data, *args, **kwargs):
        with open(path, "w") as fh:
            fh.write(data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as mp:
        mp.setattr(Path, "write_text", half_then_full_disk)
        mp.setattr(matplotlib.figure.Figure, "savefig", lambda fig, fname, **kw: half_then_full_disk(fname, "PNG"))
        with pytest.raises(OSError, match="No space left"):
            MetricsLog(metrics, resume_step=2)
        with pytest.raises(OSError, match="No space left"):
            plot_losses(records, plot)
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert [r["step"] for r in MetricsLog(metrics, resume_step=2).records] == [1, 2]
    assert plot_losses(records, plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lr_schedule_is_nanogpts():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=100, max_steps=2000)
    assert lr_at(0, cfg) == pytest.approx(1e-3 * 1 / 101)
    assert lr_at(99, cfg) == pytest.approx(1e-3 * 100 / 101)
    assert lr_at(100, cfg) == pytest.approx(1e-3)
    assert lr_at(1050, cfg) == pytest.approx(1e-4 + 0.5 * 0.9e-3)  # halfway down the cosine
    assert lr_at(2000, cfg) == pytest.approx(1e-4)
    assert lr_at(5000, cfg) == pytest.approx(1e-4)


def test_weight_decay_on_matrices_only():
    from arlm.train.trainer import configure_optimizer

    model = Transformer(ModelConfig.gpt2(vocab_size=50, n_layer=2, n_head=2, d_model=16, max_seq_len=8))
    opt = configure_optimizer(model, TrainConfig(weight_decay=0.1), torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


# -- the objective ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_loss_is_mean_next_token_cross_entropy(family):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.for_family(family, vocab_size=37, n_layer=2, n_head=2, n_kv_heads=1,
                                               d_model=32, d_ff=64, max_seq_len=16))
    seq = torch.randint(0, 37, (3, 17))
    x, y = seq[:, :-1], seq[:, 1:]
    loss = next_token_loss(model, x, y)
    logits = model(x).double()  # [B, T, V]
    by_hand = -torch.log_softmax(logits, -1).gather(-1, y[..., None]).mean()
    assert loss.item() == pytest.approx(by_hand.item(), abs=1e-6)
    assert loss.item() == pytest.approx(math.log(37), abs=0.5)  # an untrained model is near uniform


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_future_tokens_never_change_earlier_losses(family):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.for_family(family, vocab_size=41, n_layer=2, n_head=4, n_kv_heads=2,
                                               d_model=32, d_ff=64, max_seq_len=32)).eval()
    seq = torch.randint(0, 41, (2, 25))
    T = seq.shape[1] - 1

    def per_position(s: torch.Tensor) -> torch.Tensor:  # [B, T]
        logits = model(s[:, :-1])
        return F.cross_entropy(logits.transpose(1, 2), s[:, 1:], reduction="none")

    base = per_position(seq)
    for j in (1, 7, 16, T):
        changed = seq.clone()
        changed[:, j] = (changed[:, j] + 1 + torch.arange(2)) % 41
        losses = per_position(changed)
        # Position t predicts token t+1 from tokens <= t: only t >= j - 1 may see the change.
        torch.testing.assert_close(losses[:, : j - 1], base[:, : j - 1], rtol=0, atol=1e-6)
        assert (losses[:, j - 1:] - base[:, j - 1:]).abs().max() > 1e-4


def test_overfits_a_single_batch(tmp_path):
    """A corpus whose train split is exactly one window: every step sees the same batch."""
    rng = np.random.default_rng(0)
    text = "".join(rng.choice(list("abcdefghij"), size=66))
    (tmp_path / "one.txt").write_text(text)
    prepare([tmp_path / "one.txt"], tmp_path / "data", tokenizer="char", val_fraction=0.5)
    cfg = tiny(tmp_path / "data", tmp_path / "run", context_length=32, max_steps=150, lr=1e-2, min_lr=1e-3,
               warmup_steps=10, eval_interval=0, log_interval=10, weight_decay=0.0)
    result = train(cfg)
    losses = list(result.losses.values())
    assert losses[0] > 1.5  # ~ln(10) at the start
    assert losses[-1] < 0.05


# -- the loop, checkpoints, resume -----------------------------------------------------------------

def test_run_writes_checkpoints_metrics_and_plot(char_data, tmp_path):
    result = train(tiny(char_data, tmp_path / "run", plot=True))
    out = tmp_path / "run"
    assert (out / LATEST).resolve().name == "ckpt-0000006"
    assert (out / BEST).is_symlink() and (out / BEST / STATE_FILE).is_file()
    assert sorted(p.name for p in out.glob("ckpt-*")) == sorted({(out / LATEST).resolve().name,
                                                                  (out / BEST).resolve().name})
    meta = json.loads((out / LATEST / "arlm.json").read_text())
    assert meta["step"] == 6 and meta["train_config"]["n_layer"] == 2
    assert meta["metrics"]["val_loss"] == pytest.approx(result.evals[-1]["val_loss"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 3, 6]
    assert all(r["val_ppl"] == pytest.approx(math.exp(r["val_loss"])) for r in records if r["kind"] == "eval")
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.evals[-1]["val_loss"] < result.evals[0]["val_loss"]


def test_bf16_autocast_tracks_float32(char_data, tmp_path):
    """Mixed precision (bf16 matmuls, float32 weights and loss) learns like float32."""
    runs = {dtype: train(tiny(char_data, tmp_path / dtype, dtype=dtype, max_steps=30, eval_interval=0,
                              log_interval=10))
            for dtype in ("float32", "bfloat16")}
    f32, bf16 = (runs[d].evals[-1]["val_loss"] for d in ("float32", "bfloat16"))
    assert f32 < math.log(TokenData.open(char_data).vocab_size) - 0.5  # it learned something
    assert abs(bf16 - f32) < 0.05, (bf16, f32)
    assert runs["bfloat16"].losses != runs["float32"].losses  # autocast did change the arithmetic


def test_auto_dtype_is_bf16_where_the_cpu_multiplies_bf16_natively():
    # Read from /proc/cpuinfo (cpu_flags.py), not from the predicate the trainer asks.
    from arlm.train.trainer import autocast_dtype
    from cpu_flags import native_bf16_expected

    cpu = torch.device("cpu")
    assert autocast_dtype(TrainConfig(dtype="auto"), cpu) == (torch.bfloat16 if native_bf16_expected() else None)
    assert autocast_dtype(TrainConfig(dtype="float32"), cpu) is None
    assert autocast_dtype(TrainConfig(dtype="bfloat16"), cpu) == torch.bfloat16


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_resume_continues_exactly(char_data, tmp_path, family):
    # Dropout on and two micro-batches per step: the RNG state and accumulation must survive too.
    common = dict(family=family, dropout=0.1, grad_accum=2, lr_decay_steps=8, eval_interval=4)
    straight = train(tiny(char_data, tmp_path / "a", max_steps=8, **common))
    first = train(tiny(char_data, tmp_path / "b", max_steps=4, **common))
    second = train(tiny(char_data, tmp_path / "b", max_steps=8, **common), resume=True)
    assert list(first.losses) == [1, 2, 3, 4] and list(second.losses) == [5, 6, 7, 8]
    resumed = {**first.losses, **second.losses}
    for step, loss in straight.losses.items():
        assert resumed[step] == pytest.approx(loss, abs=1e-6), step
    assert max_weight_diff(tmp_path / "a" / LATEST, tmp_path / "b" / LATEST) <= 1e-6
    # The metrics log of the resumed run reads as one run.
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == list(range(1, 9))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "arlm", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=300)


def cli_args(cfg: TrainConfig) -> list[str]:
    return ["train", *(f"--{k}={v}" for k, v in cfg.to_dict().items() if v is not None)]


# A subprocess's program, `python -c KILLED_SAVE STEP WHERE train ...`: it runs `arlm train ...` in
# its own process and sends itself SIGKILL while saving step STEP, at WHERE: "tmp" once
# train_state.pt's temp file is written but before its rename, "commit" once the step directory
# is complete but before `latest` moves. SIGKILL, as the OOM killer sends it: no handler runs,
# nothing is cleaned up. The save itself has no hook for this; the program wraps two of its steps.
KILLED_SAVE = """
import os, signal, sys
import arlm.train.checkpoints as ckpt
from arlm.cli import main

step_dir, where = ckpt.step_dir_name(int(sys.argv[1])), sys.argv[2]
write_file, point = ckpt.atomic_write, ckpt.atomic_symlink

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def atomic_write(path, write):
    def write_then_die(tmp):
        write(tmp)
        die()
    killing = where == "tmp" and path.name == ckpt.STATE_FILE and path.parent.name == step_dir
    write_file(path, write_then_die if killing else write)

def atomic_symlink(link, target):
    if where == "commit" and link.name == ckpt.LATEST and target == step_dir:
        die()
    point(link, target)

ckpt.atomic_write, ckpt.atomic_symlink = atomic_write, atomic_symlink
raise SystemExit(main(sys.argv[3:]))
"""


def run_killed_save(step: int, where: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KILLED_SAVE, str(step), where, *args], capture_output=True,
                          text=True, cwd=REPO, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["tmp", "commit"])
def test_killed_mid_save_leaves_the_previous_checkpoint(char_data, tmp_path, where):
    """SIGKILL while saving step 4 ('tmp': its last temp file written, not renamed; 'commit':
    its directory complete, `latest` not yet moved): step 2 stays loadable and resumable."""
    cfg = tiny(char_data, tmp_path / "killed", eval_interval=2)
    killed = run_killed_save(4, where, *cli_args(cfg))
    assert killed.returncode == -9, killed.stderr
    out = tmp_path / "killed"
    # The kill came where it was meant to: the half-written step 4 is on disk as a kill leaves it.
    half = out / "ckpt-0000004"
    temp_files = [f.name for f in half.glob(f".{STATE_FILE}.*.tmp")]
    if where == "tmp":
        assert not (half / STATE_FILE).exists() and len(temp_files) == 1, sorted(os.listdir(half))
    else:
        assert (half / STATE_FILE).is_file() and not temp_files and load_model(str(half)).model is not None
    assert (out / LATEST).resolve().name == "ckpt-0000002"
    assert load_model(str(out / LATEST)).model.config.n_layer == 2  # the generate path loads it

    assert arlm_main([*cli_args(cfg), "--resume"]) == 0  # (`arlm train --resume`, in this process)
    assert (out / LATEST).resolve().name == "ckpt-0000006"
    assert not list(out.glob("ckpt-0000004"))  # the half-written save was cleaned up
    reference = train(tiny(char_data, tmp_path / "reference", eval_interval=2))
    assert max_weight_diff(out / LATEST, tmp_path / "reference" / LATEST) <= 1e-6
    assert reference.step == 6


# -- using the result ------------------------------------------------------------------------------

def test_checkpoint_generates_through_the_kv_cache(char_data, tmp_path):
    from arlm.engine import Engine, EngineConfig
    from arlm.sampling import SamplingParams

    train(tiny(char_data, tmp_path / "run", max_steps=30, eval_interval=0, log_interval=10))
    loaded = load_model(str(tmp_path / "run" / LATEST))
    assert loaded.source == "checkpoint" and loaded.tokenizer.vocab_size == TokenData.open(char_data).vocab_size
    prompt = loaded.tokenizer.encode("ROMEO:\n")
    engine = Engine(loaded.model, config=EngineConfig(block_size=None))  # a contiguous cache, as LLM runs
    (res,) = engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0))
    # The same greedy tokens from the uncached model, one full forward pass per token.
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            seq.append(int(loaded.model(torch.tensor([seq]))[0, -1].argmax()))
    assert res == seq[len(prompt):]

    proc = run_cli("generate", "ROMEO:", "--model", str(tmp_path / "run" / LATEST), "--max-new-tokens", "20",
                   "--seed", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ROMEO:") and len(proc.stdout) > len("ROMEO:") + 10


def test_finetune_from_an_arlm_checkpoint(char_data, tmp_path):
    """init_from loads the weights: its first evaluation equals the source's last one."""
    source = train(tiny(char_data, tmp_path / "src", max_steps=4, eval_interval=4))
    tuned = train(tiny(char_data, tmp_path / "ft", init_from=str(tmp_path / "src" / LATEST), max_steps=2,
                       eval_interval=2, n_layer=1))  # shape settings are ignored: the checkpoint has its own
    assert tuned.evals[0]["val_loss"] == pytest.approx(source.evals[-1]["val_loss"], abs=1e-6)
    assert load_model(str(tmp_path / "ft" / LATEST)).model.config.n_layer == 2


@pytest.mark.slow
def test_finetune_smollm2(smollm2_data, tmp_path):
    cfg = tiny(smollm2_data, tmp_path / "ft", init_from="smollm2", context_length=32, batch_size=1,
               max_steps=2, eval_interval=2, eval_batches=1, lr=1e-5, min_lr=1e-6, warmup_steps=0)
    result = train(cfg)
    assert result.evals[0]["val_loss"] < 5.0  # a pretrained model (uniform would be ln 49152 = 10.8)
    loaded = load_model(str(tmp_path / "ft" / LATEST))
    assert loaded.config.n_layer == 30 and loaded.tokenizer.eos_ids == [2]
    assert loaded.chat_template and "im_start" in loaded.chat_template


# -- bad input: one line, non-zero exit ------------------------------------------------------------

def one_line_error(capsys, argv: list[str], match: str, code: int = 1) -> str:
    assert arlm_main(argv) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert match in err, err
    return err


def test_bad_input_is_one_clear_line(char_data, tmp_path, capsys):
    one_line_error(capsys, ["prepare", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "d")],
                   "corpus not found")
    (tmp_path / "empty.txt").write_text("  \n")
    one_line_error(capsys, ["prepare", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "d")], "corpus is empty")
    one_line_error(capsys, ["train", "--data-dir", str(tmp_path / "nothing")], "run `arlm prepare` first")
    base = ["train", "--data-dir", str(char_data), "--progress=false", "--plot=false", "--n-layer=1",
            "--d-model=16", "--n-head=2", "--batch-size=2", "--eval-batches=1"]
    one_line_error(capsys, base + ["--context-length=5000", "--out-dir", str(tmp_path / "r0")],
                   "longer than the data")
    one_line_error(capsys, base + ["--n-embd=16"], "unrecognized arguments", code=2)
    (tmp_path / "bad.toml").write_text("n_embd = 16\n")
    one_line_error(capsys, base + ["--config", str(tmp_path / "bad.toml")], "unknown key(s)")
    one_line_error(capsys, base + ["--resume", "--out-dir", str(tmp_path / "none")], "nothing to resume")
    assert arlm_main(base + ["--max-steps=2", "--out-dir", str(tmp_path / "r1")]) == 0
    done = [line for line in capsys.readouterr().err.splitlines() if "training tokens/s" in line]
    assert done and " 0 training tokens/s" not in done[0], done  # a one-window run still has a rate
    one_line_error(capsys, base + ["--max-steps=2", "--out-dir", str(tmp_path / "r1")], "already holds a training run")
    one_line_error(capsys, base[:-4] + ["--n-layer=2", "--d-model=16", "--n-head=2", "--batch-size=2",
                                        "--max-steps=4", "--resume", "--out-dir", str(tmp_path / "r1")],
                   "incompatible config: n_layer=1 there, 2 here")
    one_line_error(capsys, base + ["--init-from=smollm2", "--out-dir", str(tmp_path / "r2")],
                   "prepare it with `arlm prepare --tokenizer smollm2`")
    (tmp_path / "other.txt").write_text("0123456789 xyz\n" * 500)  # another character set
    prepare([tmp_path / "other.txt"], tmp_path / "other", tokenizer="char")
    other = ["train", "--data-dir", str(tmp_path / "other")] + base[3:]
    one_line_error(capsys, other + ["--max-steps=4", "--resume", "--out-dir", str(tmp_path / "r1")],
                   "was not tokenized with the tokenizer of the run in")
    one_line_error(capsys, base + ["--max-steps=1", "--resume", "--out-dir", str(tmp_path / "r1")],
                   "at step 2 already: --max-steps 1 leaves nothing to train")
    (tmp_path / "a_file").write_text("not a directory\n")
    one_line_error(capsys, base + ["--out-dir", str(tmp_path / "a_file")], "is a file")
    one_line_error(capsys, ["prepare", str(tmp_path / "other.txt"), "--out", str(tmp_path / "a_file")], "is a file")
    # a directory under a file: refused before the tokenizing or the training, nothing made
    one_line_error(capsys, ["prepare", str(tmp_path / "other.txt"), "--out", str(tmp_path / "a_file" / "d")],
                   "a_file is a file, not a directory")
    one_line_error(capsys, base + ["--out-dir", str(tmp_path / "a_file" / "run")], "a_file is a file, not a directory")
    one_line_error(capsys, ["prepare", str(tmp_path / "other.txt"), "--out", str(tmp_path / "d2"),
                            "--val-fraction", "0.00001"], "use a larger --val-fraction")
    one_line_error(capsys, ["generate", "hi", "--model", str(tmp_path / "r1")], "is a training run, not a model")
    (tmp_path / "r1" / "latest" / "train_state.pt").write_bytes(b"\x80\x02garbage")
    err = one_line_error(capsys, base + ["--max-steps=4", "--resume", "--out-dir", str(tmp_path / "r1")],
                         "is damaged or not an arlm training state")
    assert "weights_only" not in err
