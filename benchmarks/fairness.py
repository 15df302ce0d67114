"""One client's request beside 8 ordinary streams: what the scheduler's sharing rules buy.

    .venv/bin/python benchmarks/fairness.py [--threads 1] [--rounds 3]

In process, SmolLM2 on arlm serve's path (int8 weights and activations, the paged pool). Two
parts:

1. Step costs, the rules' premise: a decode step of 8 greedy rows alone, then beside k tokens of
   a long prompt (plain, and keeping every position's logits as echo with logprobs does), and
   with 16 or 24 decoding rows (one request's n = 16 choices beside the 8).
2. The 8 streams (chat prompts, 32 greedy tokens each) alone, and started just after one hostile
   request: a 4,000-token prompt, the same with every position's logprobs (echo), or n = 16
   sampled choices. Each with the rules (`EngineConfig.long_prefill_tokens=128`,
   `group_rows=4`: arlm serve's defaults) and without them (prompts take the whole
   `max_num_batched_tokens`, every choice steps: vLLM's policy). The figure: the 8 streams' wall
   time over their time alone, medians of alternating rounds, and the hostile request's own time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from arlm.engine import Engine, EngineConfig  # noqa: E402
from arlm.llm import LLM  # noqa: E402
from arlm.runtime import runtime  # noqa: E402
from arlm.sampling import SamplingParams  # noqa: E402
from run import machine  # noqa: E402

PROMPTS = ["The cat sat on the", "Once upon a time", "def fibonacci(n):", "The capital of France is",
           "1, 2, 3, 4,", "Hello, my name is", "In 1492, Columbus", "The best way to learn Python is"]
GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0)
RULES = dict(long_prefill_tokens=128, group_rows=4)


def step_ms(llm: LLM, decoding: int, extra: int = 0, prompt_logprobs: int | None = None, steps: int = 15) -> float:
    """Median ms of a step with `decoding` greedy rows and `extra` tokens of a long prompt."""
    rng = random.Random(0)
    engine = Engine(llm.runner, llm.tokenizer.eos_ids, EngineConfig(kv_cache_tokens=16384, enable_prefix_caching=False))
    for _ in range(decoding):
        engine.add_request([rng.randrange(1000, 40000) for _ in range(30)],
                           SamplingParams(max_new_tokens=1000, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    times = []
    for _ in range(steps):
        r = None
        if extra:
            r = engine.add_request([rng.randrange(1000, 40000) for _ in range(extra + 1)],
                                   SamplingParams(max_new_tokens=1, prompt_logprobs=prompt_logprobs))
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        if r is not None:
            engine.abort(r.request_id)
    return statistics.median(times) * 1e3


def scenario(llm: LLM, hostile: str | None, rules: bool) -> tuple[float, float]:
    """(seconds until the 8 streams are done, seconds until the hostile request is), the
    hostile request added one step before them."""
    tok = llm.tokenizer
    engine = Engine(llm.runner, tok.eos_ids, EngineConfig(kv_cache_tokens=16384, **(RULES if rules else {})))
    t0 = time.perf_counter()
    hostile_reqs = []
    if hostile is not None:
        long_ids = (tok.encode("The quick brown fox jumps over the lazy dog, and the dog does not mind. ") * 300)[:4000]
        if hostile == "n=16":
            chat = tok.encode(llm.apply_chat_template([{"role": "user", "content": "Write a story."}]))
            hostile_reqs = [engine.add_request(chat, SamplingParams(max_new_tokens=256, temperature=1.0, seed=s),
                                               group="call") for s in range(16)]
        else:
            hostile_reqs = [engine.add_request(long_ids, SamplingParams(
                max_new_tokens=1, prompt_logprobs=5 if hostile == "echo 4,000" else None))]
        engine.step()  # (the streams arrive while its first step runs)
    streams = [engine.add_request(tok.encode(llm.apply_chat_template([{"role": "user", "content": p}])), GREEDY)
               for p in PROMPTS]
    streams_done = hostile_done = None
    while engine.has_unfinished():
        engine.step()
        now = time.perf_counter() - t0
        if streams_done is None and all(r.finished for r in streams):
            streams_done = now
        if hostile_done is None and all(r.finished for r in hostile_reqs):
            hostile_done = now
    return streams_done, hostile_done or 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1, help="the engine's threads (default 1: arlm serve's tests pin 1)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    runtime().threads.pin(args.threads)
    print(f"machine: {machine()}, engine threads {args.threads}")
    llm = LLM.load("smollm2")
    print("1. step costs (ms, medians of 15 steps)")
    print(f"  8 decoding rows: {step_ms(llm, 8):.1f}")
    for k in (4, 8, 16, 128):
        print(f"  8 rows + {k} long-prompt tokens: {step_ms(llm, 8, k):.1f}; keeping their logits "
              f"(echo with logprobs): {step_ms(llm, 8, k, prompt_logprobs=5):.1f}")
    for rows in (16, 24):
        print(f"  {rows} decoding rows: {step_ms(llm, rows):.1f}")
    print("2. the 8 streams beside one hostile request: their time over their time alone (the hostile's own s)")
    cases = [(h, rules) for h in ("prompt 4,000", "echo 4,000", "n=16") for rules in (True, False)]
    alone: list[float] = []
    got: dict[tuple, list[tuple[float, float]]] = {c: [] for c in cases}
    for _ in range(args.rounds):
        alone.append(scenario(llm, None, True)[0])
        for c in cases:
            got[c].append(scenario(llm, *c))
            alone.append(scenario(llm, None, True)[0])
    base = statistics.median(alone)
    print(f"  alone: {base:.2f} s (median of {len(alone)})")
    for (h, rules), runs in got.items():
        ratio = statistics.median(s / base for s, _ in runs)
        own = statistics.median(t for _, t in runs)
        print(f"  beside {h:13} {'with the rules' if rules else 'without (whole budgets, every choice)':40} "
              f"{ratio:5.2f}x   (hostile done in {own:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
