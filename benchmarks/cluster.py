"""`arlm serve --replicas 2` on this machine: the prefix-cache hit rate and time to first token of a
multi-turn trace with the prefix router, with Ray Serve's own power-of-two-choices router, and in
one process, all on the same trace.

    .venv/bin/python benchmarks/cluster.py [--conversations 16] [--turns 6] [--prefix-tokens 1000]

The trace: N conversations, each with a system prompt of its own (~--prefix-tokens tokens), run
concurrently, each sending its turns one after another through the Responses API (streamed; the
previous turns re-sent as input, as agents do); every turn's first-token time and its
`usage.input_tokens_details.cached_tokens` are recorded. Hit rate: cached / input tokens over the
turns after each conversation's first (the first can hit nothing). Servers: 2 replicas x 1 thread
(prefix router, then power-of-two), and one process with 2 threads, one after another, each
replica's KV pool --kv-cache-tokens (the single process's twice that): a pool that holds about
half the conversations, as a loaded server's does; with pools that hold every conversation, any
router's replicas soon each hold every prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_args import positive_int  # noqa: E402
from serve import free_port, percentile, run_server, stop  # noqa: E402

MODEL = "smollm2"
WORDS = ("parcel courier depot invoice customs route pallet tracking warehouse delivery address signature "
         "refund weight label carrier schedule").split()


def system_prompt(c: int, tokens: int) -> str:
    """A conversation's own system prompt of about `tokens` tokens (words of this trade, its number first)."""
    words = [WORDS[(c * 7 + i * 3) % len(WORDS)] for i in range(tokens)]
    return f"Desk {c}. You answer questions about shipments. Notes: " + " ".join(words)


async def turn(client, url: str, instructions: str, history: list[dict], question: str) -> tuple[float, dict, str]:
    body = {"model": MODEL, "instructions": instructions, "input": history + [{"role": "user", "content": question}],
            "max_output_tokens": 12, "temperature": 0, "stream": True, "store": False}
    t0 = time.perf_counter()
    ttft, usage, text = None, {}, ""
    async with client.stream("POST", f"{url}/v1/responses", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event.get("type") == "response.output_text.delta":
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text += event["delta"]
            elif event.get("type") in ("response.completed", "response.incomplete"):
                usage = event["response"]["usage"]
    return (ttft if ttft is not None else time.perf_counter() - t0), usage, text


async def trace(url: str, conversations: int, turns: int, prefix_tokens: int) -> dict:
    import httpx

    records: list[tuple[int, float, int, int]] = []  # (turn, ttft, input tokens, cached tokens)

    async def conversation(client, c: int) -> None:
        instructions, history = system_prompt(c, prefix_tokens), []
        for t in range(turns):
            question = f"Question {t}: where is parcel {c}-{t}?"
            ttft, usage, text = await turn(client, url, instructions, history, question)
            records.append((t, ttft, usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]))
            history += [{"role": "user", "content": question}, {"role": "assistant", "content": text}]

    limits = httpx.Limits(max_connections=conversations + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(client, c) for c in range(conversations)))
        wall = time.perf_counter() - t0
    later = [r for r in records if r[0] > 0]
    ttfts = [r[1] for r in records]
    return {"hit_rate": sum(r[3] for r in later) / max(1, sum(r[2] for r in later)),
            "ttft_p50": statistics.median(ttfts), "ttft_p95": percentile(ttfts, 0.95), "seconds": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=positive_int, default=16)
    ap.add_argument("--turns", type=positive_int, default=6)
    ap.add_argument("--prefix-tokens", type=positive_int, default=1000)
    ap.add_argument("--kv-cache-tokens", type=positive_int, default=12288,
                    help="each replica's KV pool in tokens (the single process gets twice as many: the same memory); "
                         "the default holds about half the trace's conversations per replica")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    setups = {"2 replicas, prefix router": ["--replicas", "2", "--threads-per-replica", "1"],
              "2 replicas, power-of-two": ["--replicas", "2", "--threads-per-replica", "1",
                                           "--replica-router", "power-of-two"],
              "1 process, 2 threads": []}
    results = {}
    for name, extra in setups.items():
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        threads = "1" if extra else "2"
        env = {**os.environ, "OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
        pool = str(args.kv_cache_tokens * (1 if extra else 2))
        proc = run_server([sys.executable, "-m", "arlm", "serve", "--model", MODEL, "--port", str(port),
                           "--kv-cache-tokens", pool, *extra], env, url)
        try:
            asyncio.run(trace(url, 2, 1, 64))  # warm-up (its own prompts)
            results[name] = asyncio.run(trace(url, args.conversations, args.turns, args.prefix_tokens))
        finally:
            stop(proc)
            time.sleep(2)
        print(f"{name}: {results[name]}", flush=True)
    single = results["1 process, 2 threads"]["hit_rate"]
    print(f"\n== {args.conversations} conversations x {args.turns} turns, ~{args.prefix_tokens}-token system "
          f"prompts each ==")
    print(f"{'setup':>28} {'hit rate':>9} {'vs 1 proc':>10} {'TTFT p50 s':>11} {'TTFT p95 s':>11} {'wall s':>7}")
    for name, r in results.items():
        print(f"{name:>28} {r['hit_rate']:>9.3f} {r['hit_rate'] / max(single, 1e-9):>10.2f} {r['ttft_p50']:>11.3f} "
              f"{r['ttft_p95']:>11.3f} {r['seconds']:>7.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
