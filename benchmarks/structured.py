"""The cost of structured outputs per token: decode with a JSON-schema grammar beside the same
decode without one, at batch 1 and 32, alternating, medians.

    .venv/bin/python benchmarks/structured.py [--batches 1,32] [--rounds 3]

SmolLM2 on its default path. Each round runs B chat prompts with a JSON schema (an array of 30
to 40 strings: long outputs, every token through the grammar), for two schemas (SCHEMAS), sampled
at temperature 1 with a seed per row, then the same B prompts without the grammar for exactly as
many tokens each (ignore_eos, max_new_tokens = that row's guided length). The figure is the engine's step time
per generated token (prefill steps apart), guided over plain; the grammar's work (the masks of
the rows that have one, applied inside the sampler, and feeding each drawn token to its matcher)
is the difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from arlm.llm import LLM  # noqa: E402
from arlm.sampling import SamplingParams  # noqa: E402
from arlm.structured import StructuredOutput  # noqa: E402
from run import machine  # noqa: E402

# Two grammars: strings of any length (llguidance's precomputed "slices" answer most of a string's
# mask), and strings of at most 12 characters (a bounded lexeme: every mask walks the token trie).
SCHEMAS = {
    "free strings": {"type": "object", "properties": {"words": {"type": "array", "minItems": 30, "maxItems": 40,
                                                                "items": {"type": "string"}}},
                     "required": ["words"], "additionalProperties": False},
    "strings of <= 12 chars": {"type": "object", "properties": {"words": {
        "type": "array", "minItems": 30, "maxItems": 40, "items": {"type": "string", "maxLength": 12}}},
        "required": ["words"], "additionalProperties": False},
}
SCHEMA = SCHEMAS["strings of <= 12 chars"]


def decode_seconds(engine, prompts, params) -> tuple[float, int, list[list[int]]]:
    """(seconds in decode steps, tokens they sampled, outputs) for the prompts run together."""
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    seconds, tokens = 0.0, 0
    while any(not r.finished for r in reqs):
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if not engine.last_step.prompt_tokens:
            seconds += dt
            tokens += len(outs)
    return seconds, tokens, [r.output_ids for r in reqs]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,32")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(f"machine: {machine()}")
    llm = LLM.load("smollm2")
    engine = llm.engine
    for (name, schema), B in [(kv, int(b)) for kv in SCHEMAS.items() for b in args.batches.split(",")]:
        prompts = [llm.tokenizer.encode(llm.apply_chat_template(
            [{"role": "user", "content": f"List words about topic {i} as JSON."}])) for i in range(B)]
        ratios, guided_ms, plain_ms = [], [], []
        for r in range(args.rounds):
            spec = StructuredOutput("json_schema", schema)
            gp = [SamplingParams(max_new_tokens=400, temperature=1.0, seed=100 * r + i, structured=spec) for i in range(B)]
            gs, gt, outs = decode_seconds(engine, prompts, gp)
            pp = [SamplingParams(max_new_tokens=len(o), temperature=1.0, seed=100 * r + i, ignore_eos=True)
                  for i, o in enumerate(outs)]
            ps, pt, _ = decode_seconds(engine, prompts, pp)
            guided_ms.append(gs / gt * 1e3 * B)  # ms per step (B tokens a step)
            plain_ms.append(ps / pt * 1e3 * B)
            ratios.append((gs / gt) / (ps / pt))
            print(f"  {name}, batch {B} round {r}: guided {gt} tokens, {guided_ms[-1]:.2f} ms/step; plain {pt} tokens, "
                  f"{plain_ms[-1]:.2f} ms/step; overhead {ratios[-1] - 1:+.1%}", flush=True)
        print(f"{name}, batch {B}: ms per decode step guided {statistics.median(guided_ms):.2f}, plain "
              f"{statistics.median(plain_ms):.2f}: the grammar costs {statistics.median(ratios) - 1:+.1%} a step "
              f"(median of {args.rounds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
