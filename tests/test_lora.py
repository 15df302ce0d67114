"""LoRA (arlm.train.lora): adapters alone train, and merged they are the model they trained.

References and tolerances:
- step 0: the adapted model's logits equal the base model's bit for bit (B starts at zero);
- training: every base weight stays bit for bit what it was, every adapter's B moves, and the
  optimizer holds state for the adapters alone;
- merging (W + alpha / r * B A, on the module and on a checkpoint's state dict): logits within 1e-5
  of the adapted model's (float32; the merged product sums in another order);
- resume: N steps in one run against N/2, a stop and N/2 resumed: every step's loss and every
  adapter within 1e-6 (CPU, float32, dropout on), as tests/test_train.py checks full training.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from arlm.config import ConfigError, ModelConfig
from arlm.loading import load_model
from arlm.loading.adapters import merge_state
from arlm.model import Transformer
from arlm.train import TokenData, TrainConfig, next_token_loss, prepare, train
from arlm.train import lora
from arlm.train.checkpoints import LATEST
from arlm.train.data import default_corpus
from arlm.train.trainer import configure_optimizer
from conftest import run_arlm


def tiny_model(family: str, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig.for_family(family, vocab_size=53, n_layer=2, n_head=4, n_kv_heads=2,
                                              d_model=32, d_ff=64, max_seq_len=32)).train()


def adapters(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if lora.is_adapter_key(k)}


def randomize_adapters_(model, seed: int) -> None:
    """Non-zero B everywhere, as after training, with a clear effect on the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_step_zero_is_the_base_model(family):
    model = tiny_model(family)
    idx = torch.randint(0, 53, (2, 12))
    with torch.no_grad():  # (the same norm and RoPE code on both sides: no gradient is wanted of either)
        base = model(idx)
    targets = "q,k,v,o,up,down" if family == "gpt2" else lora.TARGETS
    lora.apply(model, rank=4, targets=targets)
    with torch.no_grad():
        assert torch.equal(model(idx), base)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(lora.is_adapter_key(n) for n in trainable)
    per_block = {n.split(".", 2)[2] for n in trainable}
    want = {"attn.wqkv.lora_A.q", "attn.wqkv.lora_A.k", "attn.wqkv.lora_A.v", "attn.wo.lora_A.o", "mlp.down.lora_A.down"}
    want |= {"mlp.up.lora_A.up"} if family == "gpt2" else {"mlp.gate_up.lora_A.gate", "mlp.gate_up.lora_A.up"}
    assert {n for n in per_block if ".lora_A." in n} == want


def test_targets_are_checked():
    with pytest.raises(ConfigError, match="lora_targets"):
        TrainConfig(lora_rank=4, lora_targets="q,proj")
    with pytest.raises(ConfigError, match="lora_targets"):
        lora.apply(tiny_model("llama"), rank=4, targets="bogus")
    with pytest.raises(ConfigError, match="no projection"):  # GPT-2's MLP has no gate
        lora.apply(tiny_model("gpt2"), rank=4, targets="gate")
    model = lora.apply(tiny_model("gpt2"), rank=4)  # the default (every target): those the model has
    assert model.lora["targets"] == ["q", "k", "v", "o", "up", "down"]


@pytest.mark.parametrize("setting", [{"lora_alpha": 8.0}, {"lora_targets": "q,v"}])
def test_lora_settings_without_a_rank_are_refused_not_ignored(setting):
    (name,) = setting
    with pytest.raises(ConfigError, match=f"{name} applies with lora_rank > 0"):
        TrainConfig(**setting)
    TrainConfig(lora_rank=2, **setting)


def test_only_adapters_train_and_the_optimizer_holds_only_theirs():
    model = tiny_model("llama")
    lora.apply(model, rank=4, alpha=8.0, targets="q,v,gate,down")
    frozen = {k: v.clone() for k, v in model.state_dict().items() if not lora.is_adapter_key(k)}
    before = adapters(model)
    optimizer = configure_optimizer(model, TrainConfig(lr=1e-2), torch.device("cpu"))
    seq = torch.randint(0, 53, (4, 17))
    for _ in range(3):
        next_token_loss(model, seq[:, :-1], seq[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen.items())
    assert all(after[k].abs().max() > 0 and not torch.equal(after[k], before[k]) for k in before if ".lora_B." in k)
    adapter_params = {id(p) for n, p in model.named_parameters() if lora.is_adapter_key(n)}
    assert {id(p) for p in optimizer.state} == adapter_params
    assert len(adapter_params) == 2 * 4 * 2  # (A, B) x 4 targets x 2 layers
    assert all(p.grad is None for n, p in model.named_parameters() if not lora.is_adapter_key(n))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_merge_equals_the_adapted_model(family):
    model = tiny_model(family).eval()
    lora.apply(model, rank=3, alpha=5.0, targets="q,k,o,up,down" if family == "gpt2" else "k,v,gate,up")
    randomize_adapters_(model, 1)
    idx = torch.randint(0, 53, (2, 12))
    with torch.no_grad():
        adapted = model(idx)
        state = model.state_dict()
        meta = lora.checkpoint_meta(model)["lora"]
        merged_state = merge_state(state, model.config, meta)
        merged = lora.merge(model)
        out = merged(idx)
    assert (adapted - tiny_model(family).eval()(idx)).abs().max() > 0.1  # the adapters matter
    assert not any(isinstance(m, lora.LoRALinear) for m in merged.modules())
    assert type(merged) is Transformer and not any(lora.is_adapter_key(k) for k in merged.state_dict())
    torch.testing.assert_close(out, adapted, rtol=0, atol=1e-5)
    plain = Transformer(merged.config)
    plain.load_state_dict(merged_state)
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(idx), adapted, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def char_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    (root / "corpus.txt").write_text(default_corpus().read_text(encoding="utf-8")[:40_000], encoding="utf-8")
    prepare([root / "corpus.txt"], root / "char", tokenizer="char")
    return root / "char"


def tiny_run(data_dir: Path, out_dir: Path, **overrides) -> TrainConfig:
    base = dict(data_dir=str(data_dir), out_dir=str(out_dir), family="llama", n_layer=2, n_head=2, d_model=32,
                context_length=16, batch_size=4, max_steps=6, warmup_steps=2, lr=3e-3, min_lr=3e-4, eval_interval=3,
                eval_batches=2, log_interval=1, progress=False, plot=False, threads=1, dtype="float32",
                lora_rank=4, lora_alpha=8.0, lora_targets="q,v,up,down")
    return TrainConfig(**{**base, **overrides})


def test_a_lora_run_saves_resumes_and_loads_merged(char_data, tmp_path, capfd):
    full = train(tiny_run(char_data, tmp_path / "full", lora_rank=0, lora_alpha=None, lora_targets=",".join(lora.TARGETS),
                          max_steps=4, eval_interval=4))  # (a full fine-tune: no LoRA setting applies)
    src = str(tmp_path / "full" / LATEST)
    common = dict(init_from=src, dropout=0.1, grad_accum=2, lr_decay_steps=8, eval_interval=4)
    straight = train(tiny_run(char_data, tmp_path / "a", max_steps=8, **common))
    first = train(tiny_run(char_data, tmp_path / "b", max_steps=4, **common))
    second = train(tiny_run(char_data, tmp_path / "b", max_steps=8, **common), resume=True)
    assert straight.evals[0]["val_loss"] == pytest.approx(full.evals[-1]["val_loss"], abs=1e-6)  # step 0: the base
    resumed = {**first.losses, **second.losses}
    for step, loss in straight.losses.items():
        assert resumed[step] == pytest.approx(loss, abs=1e-6), step
    saved_a, saved_b = (load_file(str(tmp_path / d / LATEST / "model.safetensors")) for d in ("a", "b"))
    adapter_keys = [k for k in saved_a if lora.is_adapter_key(k)]
    assert len(adapter_keys) == 2 * 4 * 2
    assert max((saved_a[k] - saved_b[k]).abs().max().item() for k in adapter_keys) <= 1e-6
    base = load_file(str(tmp_path / "full" / LATEST / "model.safetensors"))
    assert all(torch.equal(saved_a[k], base[k]) for k in base)  # the frozen weights, as the base had them
    meta = json.loads((tmp_path / "a" / LATEST / "arlm.json").read_text())
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "up", "down"]}

    # Loaded for generation: a plain model, merged, whose logits are the adapted model's.
    loaded = load_model(str(tmp_path / "a" / LATEST)).model
    assert not any(isinstance(m, lora.LoRALinear) for m in loaded.modules())
    adapted = load_model(src).model
    lora.apply(adapted, rank=4, alpha=8.0, targets="q,v,up,down")
    lora.load_adapters(adapted, {k: saved_a[k] for k in adapter_keys})
    idx = torch.randint(0, TokenData.open(char_data).vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx), adapted.eval()(idx), rtol=0, atol=1e-5)

    proc = run_arlm(capfd, "generate", "ROMEO:", "--model", str(tmp_path / "a" / LATEST), "--max-new-tokens", "8",
                    "--seed", "0")
    assert proc.returncode == 0 and proc.stdout.startswith("ROMEO:"), proc.stderr

    with pytest.raises(ConfigError, match="lora_rank=4 there, 8 here"):
        train(tiny_run(char_data, tmp_path / "b", max_steps=10, lora_rank=8, **common), resume=True)

