"""The cost of structured outputs per token: decode with a JSON-schema grammar beside the same
decode without one, at batch 1 and 32, alternating, medians.

    .venv/bin/python benchmarks/structured.py [--batches 1,32] [--rounds 3]

SmolLM2 on its default path. Each round runs B chat prompts with a JSON schema (an array of 30
to 40 strings: long outputs, every token through the grammar), for two schemas (SCHEMAS), sampled
at temperature 1 with a seed per row, then the same B prompts without the grammar for exactly as
many tokens each (ignore_eos, max_new_tokens = that row's guided length). Two figures: the
engine's step time per generated token (prefill steps apart), guided over plain, whose difference
is the grammar's work (noisy on a shared machine: two runs minutes apart); and the time the guided
steps spent inside that work (the masks, the lazy rows' checks and redraws, feeding each drawn
token to its matcher: `GrammarClock`) over the rest of those steps, measured in the same steps.
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

from arlm.engine import sampler  # noqa: E402
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


class GrammarClock:
    """Seconds inside the engine's grammar work (the eager masks, the lazy rows' checks and
    redraws, feeding the drawn tokens to the matchers), by wrapping those functions of the
    sampler (arlm.engine.sampler looks them up as module globals at each call)."""

    def __init__(self) -> None:
        self.seconds, self._depth = 0.0, 0
        for name in ("mask_grammar", "redraw_refused", "advance_grammars"):
            setattr(sampler, name, self._timed(getattr(sampler, name)))

    def _timed(self, fn):
        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:  # (a redraw masks: counted once)
                    self.seconds += time.perf_counter() - t0
        return wrapped


def decode_seconds(engine, prompts, params, clock: GrammarClock) -> tuple[float, int, list[list[int]], float]:
    """(seconds in decode steps, tokens they sampled, outputs, seconds of those steps inside the
    grammar's work) for the prompts run together."""
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    seconds, tokens, grammar = 0.0, 0, 0.0
    while any(not r.finished for r in reqs):
        t0, g0 = time.perf_counter(), clock.seconds
        outs = engine.step()
        dt = time.perf_counter() - t0
        if not engine.last_step.prompt_tokens:
            seconds += dt
            tokens += len(outs)
            grammar += clock.seconds - g0
    return seconds, tokens, [r.output_ids for r in reqs], grammar


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--top-p", type=float, default=1.0,
                   help="1 (default): temperature alone, the grammar checks each drawn token and masks only "
                        "when it refuses one; below 1 every step masks first (a filter must see the mask)")
    p.add_argument("--no-prefetch", action="store_true",
                   help="compute the masks of rows that mask first after the forward pass, on the engine's thread "
                        "(the A side of the prefetch's A/B: by default they are computed on the mask thread during "
                        "the forward pass, sampler.PrefetchedMasks)")
    args = p.parse_args()
    if args.no_prefetch:
        sampler.PrefetchedMasks.start = classmethod(lambda cls, batch, grammars: None)
    print(f"machine: {machine()}, masks {'after' if args.no_prefetch else 'beside'} the forward pass")
    llm = LLM.load("smollm2")
    engine = llm.engine
    clock = GrammarClock()
    for (name, schema), B in [(kv, int(b)) for kv in SCHEMAS.items() for b in args.batches.split(",")]:
        prompts = [llm.tokenizer.encode(llm.apply_chat_template(
            [{"role": "user", "content": f"List words about topic {i} as JSON."}])) for i in range(B)]
        ratios, guided_ms, plain_ms, shares = [], [], [], []
        for r in range(args.rounds):
            spec = StructuredOutput("json_schema", schema)
            gp = [SamplingParams(max_new_tokens=400, temperature=1.0, top_p=args.top_p, seed=100 * r + i,
                                 structured=spec) for i in range(B)]
            gs, gt, outs, inside = decode_seconds(engine, prompts, gp, clock)
            pp = [SamplingParams(max_new_tokens=len(o), temperature=1.0, top_p=args.top_p, seed=100 * r + i,
                                 ignore_eos=True) for i, o in enumerate(outs)]
            ps, pt, _, _ = decode_seconds(engine, prompts, pp, clock)
            guided_ms.append(gs / gt * 1e3 * B)  # ms per step (B tokens a step)
            plain_ms.append(ps / pt * 1e3 * B)
            ratios.append((gs / gt) / (ps / pt))
            shares.append(inside / (gs - inside))  # the grammar's own time over the rest of the step
            print(f"  {name}, batch {B} round {r}: guided {gt} tokens, {guided_ms[-1]:.2f} ms/step; plain {pt} tokens, "
                  f"{plain_ms[-1]:.2f} ms/step; overhead {ratios[-1] - 1:+.1%}; inside the grammar's work "
                  f"{inside / gt * 1e3 * B:.2f} ms/step = {shares[-1]:.1%} of the rest", flush=True)
        print(f"{name}, batch {B}, top_p {args.top_p}: ms per decode step guided {statistics.median(guided_ms):.2f}, "
              f"plain {statistics.median(plain_ms):.2f}: the grammar costs {statistics.median(ratios) - 1:+.1%} a step; "
              f"its own work {statistics.median(shares):.1%} (medians of {args.rounds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
