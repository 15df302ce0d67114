"""The compiled decode step (`--compile`) and the CUDA-graph path's static KV length, on CPU; and
`benchmarks/gpu.py` itself (`--device cpu --smoke`), so that a session with a GPU does not spend
its few minutes on a bug in the script.

Tolerances: a compiled step is compared with the eager step token for token (greedy, 24 steps,
ragged prompts) and its logits within 1e-4 of the largest; the static KV length is the same math
over more (masked) slots, so its tokens must be identical.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from arlm.engine import Engine, EngineConfig, ModelRunner, decode_step, prefill
from arlm.kv_cache import KVCache
from arlm.sampling import SamplingParams

from test_generate import random_prompts, tiny_gqa

ROOT = Path(__file__).resolve().parents[1]
STEPS = 24


@pytest.fixture(scope="module")
def tiny():
    return tiny_gqa()


def greedy(model, prompts, decode_fn, static_kv_len=False):
    """The engine's greedy tokens with `decode_fn` as its rows path's step (as `LLM.configure(compile=True)`)."""
    engine = Engine(ModelRunner(model, decode_fn, static_kv_len), (), EngineConfig(block_size=None))
    return engine.generate(prompts, SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True))


def first_step_logits(model, prompts, decode_fn, static_kv_len):
    """Logits of one decode step after prefill, for the same ragged batch."""
    B, longest = len(prompts), max(map(len, prompts))
    cache = KVCache.contiguous(model.config, B, longest + STEPS)
    padded = torch.tensor([p + [0] * (longest - len(p)) for p in prompts])
    with torch.inference_mode():
        first = prefill(model, cache, padded, torch.arange(longest).expand(B, longest),
                        torch.tensor([len(p) - 1 for p in prompts]), longest)
        tokens = first.argmax(-1, keepdim=True)
        pos = torch.tensor([[len(p)] for p in prompts])
        kv_len = cache.capacity if static_kv_len else longest + 1
        return decode_fn(model, cache, tokens, pos, kv_len=kv_len)


def test_static_kv_len_equals_growing_kv_len(tiny):
    """The CUDA-graph path attends over the whole preallocated cache every step (masked)."""
    prompts = random_prompts([5, 17, 9])
    assert greedy(tiny, prompts, decode_step, static_kv_len=True) == greedy(tiny, prompts, decode_step)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cpu-default", "cuda-graph-flavour"])
def test_compiled_decode_step_equals_eager(tiny, mode):
    """`--compile` on CPU (dynamic shapes) and the CUDA path's compile call (reduce-overhead,
    fullgraph: a graph break fails here rather than on the GPU; off CUDA it runs without graphs)."""
    torch._dynamo.reset()
    static = mode == "cuda-graph-flavour"
    compiled = (torch.compile(decode_step, mode="reduce-overhead", fullgraph=True) if static
                else torch.compile(decode_step, dynamic=True))
    prompts = random_prompts([5, 17, 9], seed=1)
    ref = first_step_logits(tiny, prompts, decode_step, static)
    got = first_step_logits(tiny, prompts, compiled, static)
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    assert greedy(tiny, prompts, compiled, static_kv_len=static) == greedy(tiny, prompts, decode_step, static)
    torch._dynamo.reset()


@pytest.mark.slow
def test_gpu_script_smoke_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--smoke",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("OK")
    import json

    res = json.loads(out.read_text())
    assert res["ok"] and res["smoke"] and res["logits_rel_err_fp32"] == 0.0
    assert res["decode_bf16-cudagraph_b2_tokens_per_s"] > 0 and res["train_gpt2_124m"]["tokens_per_s"] > 0


def test_gpu_script_bad_device_is_one_line():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "nonsense"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--device" in proc.stderr
