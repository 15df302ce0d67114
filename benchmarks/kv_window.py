"""Attention sinks along a stream: perplexity of a long text through a windowed KV cache.

    .venv/bin/python benchmarks/kv_window.py [--tokens 12288] [--window 1024] [--sinks 4]

SmolLM2 on its default path reads the first `--tokens` tokens of tinyshakespeare as one stream
and scores every token three ways, each keeping at most sinks + window tokens of context:
(a) sinks + window (`perplexity.stream_nll`: the first S tokens and the last W, StreamingLLM),
(b) the window alone (S = 0), (c) today's context shift, recomputing the last half of a full
window (along a stream that is strided perplexity with context S + W and stride (S + W) / 2);
and, where the stream fits the model's context, (d) full attention. Prints the perplexity over
the stream and over each quarter of it, and the wall time of each run (all on this machine's
threads; (a) and (b) run the stream in chunks of 512 tokens, (c) recomputes every token about
twice).

Then generation (`--generate N`, default 4x the window): N tokens from a short prompt, greedy,
one sequence, each method on its own paged engine, timing every step: (a) and (b) as above,
(c) `context_shift` on a cache of sinks + window tokens (rounded up to a block), (d) full
attention on a cache that holds all N (where N fits the model's context). Prints the median ms
per token over each quarter of the generation and the most KV blocks each held, and writes both
curves to an SVG (`--svg`, default docs/kv_window.svg).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from arlm.engine import Engine, EngineConfig  # noqa: E402
from arlm.kv_cache import kv_dtype_name  # noqa: E402
from arlm.llm import LLM  # noqa: E402
from arlm.perplexity import evaluate, stream_nll  # noqa: E402
from arlm.sampling import SamplingParams  # noqa: E402
from arlm.settings import KV_SINKS  # noqa: E402
from bench_args import positive_int  # noqa: E402
from run import machine  # noqa: E402


def ppl(nll) -> float:
    return math.exp(float(np.mean(nll)))


BS = 16  # the paged engines' block size


def generation_times(llm, prompt: list[int], n: int, window: int = 0, sinks: int = 0,
                     cache_tokens: int | None = None, context_shift: bool = False) -> tuple[np.ndarray, int]:
    """Seconds per generated token (the engine steps' wall time, one token each, the first the
    prefill's) of n greedy tokens after `prompt`, and the most KV blocks the sequence held."""
    if cache_tokens is None:
        cache_tokens = -(-sinks // BS) * BS + -(-(window + 512) // BS) * BS + 2 * BS
    engine = Engine(llm.runner, llm.tokenizer.eos_ids,
                    EngineConfig(block_size=BS, kv_cache_tokens=cache_tokens, max_num_seqs=1,
                                 max_num_batched_tokens=512, enable_prefix_caching=False, kv_dtype=llm.kv_dtype,
                                 kv_window=window, kv_sinks=sinks))
    req = engine.add_request(prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
                             context_shift=context_shift)
    times, most, pending, empty = [], 0, 0.0, 0
    while not req.finished:
        t0 = time.perf_counter()
        outs = engine.step()
        pending += time.perf_counter() - t0  # a step that samples nothing (a recomputation) counts to the next
        for out in outs:
            if out.error is not None:
                raise RuntimeError(out.error)
        empty += not outs
        if outs:
            times.extend([pending / len(outs)] * len(outs))
            pending = 0.0
        most = max(most, engine.scheduler.pool.num_used)
    if empty:
        print(f"  ({empty} steps sampled no token: their time is counted to the next token's)")
    return np.asarray(times), most


def nice_step(top: float) -> float:
    """A tick step of 1, 2 or 5 times a power of ten giving 4 to 10 ticks up to `top`."""
    step = 10.0 ** math.floor(math.log10(top / 4))
    for m in (1, 2, 5, 10):
        if top / (m * step) <= 10:
            return m * step
    return 10 * step


def svg_charts(panels: list[dict], width: int = 720, height: int = 260) -> str:
    """Line charts stacked in one SVG: each panel {title, xlabel, ylabel, series: {name: (xs, ys)}}."""
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#7f7f7f"]
    left, right, top, bottom = 64, 170, 30, 44
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height * len(panels)}" '
           f'font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/>']
    for k, panel in enumerate(panels):
        y0 = k * height
        xs_all = np.concatenate([np.asarray(x, float) for x, _ in panel["series"].values()])
        ys_all = np.concatenate([np.asarray(y, float) for _, y in panel["series"].values()])
        x_step, y_step = nice_step(float(xs_all.max())), nice_step(float(ys_all.max()))
        x_lo, x_hi = 0.0, x_step * math.ceil(float(xs_all.max()) / x_step)
        y_lo, y_hi = 0.0, y_step * math.ceil(float(ys_all.max()) / y_step)
        pw, ph = width - left - right, height - top - bottom

        def px(x, y):
            return (left + (x - x_lo) / (x_hi - x_lo) * pw,
                    y0 + top + ph - (min(y, y_hi) - y_lo) / (y_hi - y_lo) * ph)

        out.append(f'<text x="{left}" y="{y0 + 18}" font-weight="bold">{panel["title"]}</text>')
        out.append(f'<rect x="{left}" y="{y0 + top}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
        for xv in np.arange(x_lo, x_hi + x_step / 2, x_step):
            gx, _ = px(xv, y_lo)
            out.append(f'<line x1="{gx:.1f}" y1="{y0 + top}" x2="{gx:.1f}" y2="{y0 + top + ph}" stroke="#eee"/>')
            out.append(f'<text x="{gx:.1f}" y="{y0 + top + ph + 15}" text-anchor="middle">{xv:g}</text>')
        for yv in np.arange(y_lo, y_hi + y_step / 2, y_step):
            _, gy = px(x_lo, yv)
            out.append(f'<line x1="{left}" y1="{gy:.1f}" x2="{left + pw}" y2="{gy:.1f}" stroke="#eee"/>')
            out.append(f'<text x="{left - 6}" y="{gy + 4:.1f}" text-anchor="end">{yv:g}</text>')
        out.append(f'<text x="{left + pw / 2}" y="{y0 + height - 8}" text-anchor="middle">{panel["xlabel"]}</text>')
        out.append(f'<text transform="translate(14,{y0 + top + ph / 2}) rotate(-90)" text-anchor="middle">'
                   f'{panel["ylabel"]}</text>')
        for j, (name, (xs, ys)) in enumerate(panel["series"].items()):
            pts = " ".join(f"{a:.1f},{b:.1f}" for a, b in (px(x, y) for x, y in zip(xs, ys)))
            out.append(f'<polyline points="{pts}" fill="none" stroke="{colors[j % 4]}" stroke-width="1.8"/>')
            ly = y0 + top + 14 + 18 * j
            out.append(f'<line x1="{left + pw + 10}" y1="{ly - 4}" x2="{left + pw + 30}" y2="{ly - 4}" '
                       f'stroke="{colors[j % 4]}" stroke-width="3"/>')
            out.append(f'<text x="{left + pw + 36}" y="{ly}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def binned(values: np.ndarray, size: int, fn=np.median) -> tuple[np.ndarray, np.ndarray]:
    """(bin centres, fn of each bin of `size` values)."""
    n = -(-len(values) // size)
    return (np.minimum(np.arange(n) * size + size / 2, len(values)),
            np.array([fn(values[i * size:(i + 1) * size]) for i in range(n)]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=positive_int, default=12288)
    p.add_argument("--window", type=positive_int, default=1024)
    p.add_argument("--sinks", type=int, default=KV_SINKS)
    p.add_argument("--kv-dtype", default="auto")
    p.add_argument("--generate", type=int, default=None, help="tokens to generate (default: 4x the window)")
    p.add_argument("--rounds", type=positive_int, default=2,
                   help="generation runs per method, alternating; each token's time is the median over them")
    p.add_argument("--svg", default=str(ROOT / "docs" / "kv_window.svg"))
    p.add_argument("--json", default=None, help="write the figures and both curves here")
    args = p.parse_args()
    print(f"machine: {machine()}")
    llm = LLM.load("smollm2", kv_dtype=args.kv_dtype)
    text = (ROOT.parent / "shared" / "data" / "tinyshakespeare.txt").read_text()
    ids = llm.tokenizer.encode(text)[:args.tokens]
    W, S = args.window, args.sinks
    print(f"{len(ids)} tokens of tinyshakespeare, window {W}, sinks {S}, KV cache {kv_dtype_name(llm.kv_dtype)} "
          f"(the model's context: {llm.context_length})")
    runs = [("(a) sinks + window", lambda: stream_nll(llm, ids, W, S)),
            ("(b) window alone", lambda: stream_nll(llm, ids, W, 0)),
            ("(c) context shift", lambda: np.asarray(evaluate(llm, ids, context=S + W, stride=(S + W) // 2).nll))]
    if len(ids) <= llm.context_length:
        runs.append(("(d) full attention", lambda: np.asarray(evaluate(llm, ids, context=len(ids),
                                                                       stride=len(ids)).nll)))
    ppl_series = {}
    for name, run in runs:
        t0 = time.perf_counter()
        nll = run()
        seconds = time.perf_counter() - t0
        q = len(nll) // 4
        quarters = ", ".join(f"{ppl(nll[i * q:(i + 1) * q]):.2f}" for i in range(4))
        print(f"{name:20s} perplexity {ppl(nll):8.3f}   by quarter: {quarters}   {seconds:6.1f} s", flush=True)
        ppl_series[name] = binned(nll, 512, lambda v: math.exp(float(np.mean(v))))

    n = args.generate or 4 * W
    prompt = ids[:32]
    shift_cache = -(-(S + W) // BS) * BS + BS  # max_model_len = the blocks but one: S + W rounded up
    gens = [("(a) sinks + window", dict(window=W, sinks=S)), ("(b) window alone", dict(window=W, sinks=0)),
            ("(c) context shift", dict(cache_tokens=shift_cache, context_shift=True))]
    if len(prompt) + n <= llm.context_length:
        gens.append(("(d) full attention", dict(cache_tokens=-(-(len(prompt) + n) // BS) * BS + 2 * BS)))
    print(f"generation: {n} tokens after a {len(prompt)}-token prompt, greedy, one sequence, {args.rounds} alternating "
          f"runs each; ms per token (median by quarter), most KV blocks held ({BS} tokens each)")
    runs_ms: dict[str, list[np.ndarray]] = {name: [] for name, _ in gens}
    blocks = {}
    for _ in range(args.rounds):
        for name, kw in gens:
            times, blocks[name] = generation_times(llm, prompt, n, **kw)
            runs_ms[name].append(times[1:] * 1e3)  # the first token's time is the prefill's
    time_series = {}
    for name, _ in gens:
        ms, most = np.median(np.stack(runs_ms[name]), axis=0), blocks[name]
        q = len(ms) // 4
        quarters = ", ".join(f"{np.median(ms[i * q:(i + 1) * q]):.2f}" for i in range(4))
        print(f"{name:20s} ms/token by quarter: {quarters}   mean {ms.mean():.2f} (max {ms.max():.1f})   "
              f"{1e3 / ms.mean():.1f} tokens/s   blocks {most}", flush=True)
        time_series[name] = binned(ms, 64, np.mean)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine(), "tokens": len(ids), "window": W, "sinks": S, "generate": n,
            "perplexity": {k: [x.tolist(), y.tolist()] for k, (x, y) in ppl_series.items()},
            "ms_per_token": {k: [x.tolist(), y.tolist()] for k, (x, y) in time_series.items()}}))
    if args.svg:
        Path(args.svg).write_text(svg_charts([
            {"title": f"Perplexity along {len(ids)} tokens of tinyshakespeare (window {W}, sinks {S}), "
                      "per 512 tokens", "xlabel": "token position", "ylabel": "perplexity", "series": ppl_series},
            {"title": f"Time per generated token (mean over 64), {machine()['cpu']}, {machine()['threads']} threads", "xlabel": "tokens generated",
             "ylabel": "ms per token", "series": time_series}]))
        print(f"wrote {args.svg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
