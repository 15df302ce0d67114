"""What watches the engine's steps (arlm/engine/hooks.py), each hook alone: the three calls in
order with what they promise, the engine's own hooks (step counters, thread width, step-cost
clock, a window's RoPE tables), and the raw logits a hook that reads them is handed."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from arlm.config import ModelConfig
from arlm.engine import Engine, EngineConfig
from arlm.engine.hooks import StepClockHook, StepHook, ThreadWidthHook, WindowRopeHook
from arlm.engine.speculative import StepCost
from arlm.model import Transformer
from arlm.runtime import Runtime
from arlm.sampling import SamplingParams
from arlm.threads import ThreadGovernor

from conftest import randomize_

PAGED = dict(block_size=8, kv_cache_tokens=512, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    config = ModelConfig.llama(vocab_size=97, n_layer=2, n_head=4, n_kv_heads=2, d_model=64, d_ff=96,
                               max_seq_len=128, rope_theta=10000.0, tie_embeddings=False)
    torch.manual_seed(0)
    return randomize_(Transformer(config), 0).eval()


class Recorder(StepHook):
    """Every call, with what the batch looked like at that moment."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def scheduled(self, engine, batch) -> None:
        self.calls.append(("scheduled", [s.num_computed for s in batch.seqs], list(batch.num_tokens)))

    def forwarded(self, engine, batch) -> None:
        self.calls.append(("forwarded", [s.num_computed for s in batch.seqs]))

    def stepped(self, engine, result) -> None:
        self.calls.append(("stepped", result.prompt_tokens, [(o.request_id, o.token_id) for o in result.outputs],
                           tuple(result.logits.shape), result.seconds))


def test_hooks_see_each_phase_in_order(tiny):
    """A hook gets scheduled -> forwarded -> stepped once a step: the batch before the step moved
    it on (num_computed unchanged until stepped), the step's outputs exactly as `step` returns
    them, prompt tokens counted on the prefill step only; removed, it hears nothing more."""
    engine = Engine(tiny, (), EngineConfig(**PAGED))
    rec = engine.hooks.add(Recorder())
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=3, temperature=0.0))
    returned = []
    while engine.has_unfinished():
        returned.append([(o.request_id, o.token_id) for o in engine.step()])
    names = [c[0] for c in rec.calls]
    assert names == ["scheduled", "forwarded", "stepped"] * 3
    steps = [rec.calls[i:i + 3] for i in range(0, 9, 3)]
    assert steps[0][0][1:] == ([0], [5]) and steps[0][1][1] == [0]  # the prompt, nothing computed yet
    assert [s[2][1] for s in steps] == [5, 0, 0]  # prompt tokens: the prefill step's only
    assert [s[2][2] for s in steps] == returned
    assert all(s[2][3] == (1, tiny.config.vocab_size) and s[2][4] > 0 for s in steps)
    assert engine.last_step.prompt_tokens == 0 and engine.stats.steps == 3  # (StepStatsHook)
    engine.hooks.remove(rec)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, temperature=0.0))
    assert len(rec.calls) == 9 and rec not in engine.hooks


class LogitsReader(StepHook):
    reads_logits = True

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []

    def stepped(self, engine, result) -> None:
        self.logits.append(result.logits.clone())


def test_a_hook_that_reads_logits_gets_the_models_own(tiny):
    """With a logit bias (the sampler adjusts the logits in place), a hook that reads them gets
    the model's logits, not the adjusted ones; the tokens are the same as without the hook."""
    favoured = 11
    params = SamplingParams(max_new_tokens=4, temperature=0.0, logit_bias={favoured: 100.0})
    prompt = [3, 1, 4, 1, 5]
    plain = Engine(tiny, (), EngineConfig(**PAGED)).generate([prompt], params)
    engine = Engine(tiny, (), EngineConfig(**PAGED))
    reader = engine.hooks.add(LogitsReader())
    assert engine.hooks.reads_logits
    assert engine.generate([prompt], params) == plain == [[favoured] * 4]
    with torch.inference_mode():
        ref = tiny(torch.tensor([prompt]))[0, -1]
    torch.testing.assert_close(reader.logits[0][0], ref, atol=1e-4, rtol=0)  # no +100 on `favoured`
    engine.hooks.remove(reader)
    assert not engine.hooks.reads_logits


def test_thread_width_hook_samples_once_a_step(tiny):
    """The engine's governor (from its runtime) samples after each forward pass: a neighbour
    busy at every sample narrows the next steps to the core it leaves."""
    samples = []

    def probe():
        samples.append(1)
        return 1  # one other task runnable, at every sample

    width = torch.get_num_threads()
    try:
        gov = ThreadGovernor(widest=2, every=1, window=2, probe=probe)
        gov.cores = 2
        engine = Engine(tiny, (), EngineConfig(**PAGED), runtime=Runtime(threads=gov))
        assert any(isinstance(h, ThreadWidthHook) and h.governor is gov for h in engine.hooks._hooks)
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0.0))
        assert len(samples) == engine.stats.steps == 4
        assert gov.width == 1 and gov.changes == 1
    finally:
        torch.set_num_threads(width)


def test_step_clock_hook_times_decode_steps_once_something_drafts():
    """The step-cost clock observes decode-only steps, from the first one that drafted on, by
    their size; prompt steps never."""
    cost = StepCost()
    hook = StepClockHook()
    engine = SimpleNamespace(step_cost=cost)  # (the hook reads the engine's table at each step)

    def result(num_tokens, prompt_tokens, drafted, seconds):
        batch = SimpleNamespace(num_tokens=num_tokens, prompt_tokens=prompt_tokens, drafted=drafted)
        return SimpleNamespace(batch=batch, prompt_tokens=prompt_tokens, seconds=seconds)

    hook.stepped(engine, result([1, 1], 0, [], 0.01))  # nothing speculates yet: not timed
    assert cost.times == {}
    hook.stepped(engine, result([4, 1], 0, ["a request"], 0.02))
    hook.stepped(engine, result([30, 1], 30, ["a request"], 0.5))  # a prompt step: not a decode's time
    hook.stepped(engine, result([1, 1], 0, [], 0.01))  # timed now that the table has entries
    assert cost.times == {5: 0.02, 2: 0.01}


def test_window_rope_hook_grows_the_tables_on_demand(tiny):
    """A windowed request past the model's context: the RoPE tables double (at least to the
    positions the step needs), their first rows unchanged, and the cache is told."""
    model = copy.deepcopy(tiny)  # (its tables grow)
    engine = Engine(model, (), EngineConfig(block_size=8, kv_cache_tokens=512, kv_window=16, kv_sinks=4,
                                            max_num_batched_tokens=16))
    assert any(isinstance(h, WindowRopeHook) for h in engine.hooks._hooks)
    m = engine.model
    cos, n = m.rope_cos.clone(), m.rope_cos.shape[0]
    hook = WindowRopeHook()
    batch = SimpleNamespace(seqs=[SimpleNamespace(num_computed=n - 1)], num_tokens=[1])
    hook.scheduled(engine, batch)
    assert m.rope_cos.shape[0] == n  # position n - 1 is in the table
    batch.seqs[0].num_computed = n + 5
    hook.scheduled(engine, batch)
    assert m.rope_cos.shape[0] == 2 * n and torch.equal(m.rope_cos[:n], cos)
    assert engine.cache.rope[0] is m.rope_cos
    batch.seqs[0].num_computed = 5 * n
    hook.scheduled(engine, batch)
    assert m.rope_cos.shape[0] == 5 * n + 1


def test_window_rope_hook_keeps_the_models_rope_scaling():
    """A model with Llama 3's scaled RoPE: the grown tables are its own, scaled, longer (the
    first rows unchanged), not plain RoPE's."""
    from conftest import arlm_from_hf, hf_family

    model = arlm_from_hf(hf_family("llama3", seed=5))
    engine = Engine(model, (), EngineConfig(block_size=8, kv_cache_tokens=512, kv_window=16, kv_sinks=4,
                                            max_num_batched_tokens=16))
    m = engine.model
    cos, n = m.rope_cos.clone(), m.rope_cos.shape[0]
    WindowRopeHook().scheduled(engine, SimpleNamespace(seqs=[SimpleNamespace(num_computed=n + 3)], num_tokens=[1]))
    assert m.rope_cos.shape[0] == 2 * n and torch.equal(m.rope_cos[:n], cos)
