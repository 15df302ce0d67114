"""The protocols agents speak, beside Chat Completions on the same server: streams of OpenAI's
Responses API and Anthropic's Messages at N concurrent clients (output tokens/s, time to first
token), alternating with Chat Completions' in rounds; then embeddings/s at batch 1 and 32, beside
llama.cpp's server (`--embeddings --pooling mean`) when its binary is found.

    .venv/bin/python benchmarks/protocols.py [--clients 8] [--max-tokens 64] [--rounds 3] [--threads 2]
                                             [--llama-server PATH]

Each request is a different prompt, greedy; token counts come from each protocol's usage, the first
token's time from its first text event. Medians over the rounds. The server runs without prefix
caching: the three protocols render the same conversations to the same prompt tokens.
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
from serve import PROMPTS, find_llama_server, free_port, percentile, run_server, stop  # noqa: E402

MODEL = "smollm2"


def body(protocol: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    """(path, request) of one streamed greedy request in `protocol`."""
    messages = [{"role": "user", "content": prompt}]
    if protocol == "chat":
        return "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                                        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if protocol == "responses":
        return "/v1/responses", {"model": MODEL, "input": prompt, "max_output_tokens": max_tokens, "temperature": 0,
                                 "stream": True, "store": False}
    return "/v1/messages", {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True}


def first_text(protocol: str, event: dict) -> bool:
    if protocol == "chat":
        return bool(event.get("choices") and event["choices"][0]["delta"].get("content"))
    if protocol == "responses":
        return event.get("type") == "response.output_text.delta"
    return event.get("type") == "content_block_delta"


def output_tokens(protocol: str, event: dict) -> int | None:
    if protocol == "chat":
        return event["usage"]["completion_tokens"] if event.get("usage") else None
    if protocol == "responses":
        if event.get("type") in ("response.completed", "response.incomplete"):
            return event["response"]["usage"]["output_tokens"]
        return None
    return event["usage"]["output_tokens"] if event.get("type") == "message_delta" else None


async def one(client, url: str, protocol: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    path, req = body(protocol, prompt, max_tokens)
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", url + path, json=req, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and first_text(protocol, event):
                ttft = time.perf_counter() - t0
            n = output_tokens(protocol, event)
            tokens = n if n is not None else tokens
    return ttft if ttft is not None else float("nan"), tokens


async def level(url: str, protocol: str, clients: int, max_tokens: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(one(client, url, protocol, PROMPTS[i % len(PROMPTS)], max_tokens)
                                      for i in range(clients)))
        wall = time.perf_counter() - t0
    ttfts = [r[0] for r in runs]
    return {"tokens_per_s": sum(r[1] for r in runs) / wall, "ttft_median": statistics.median(ttfts),
            "ttft_p95": percentile(ttfts, 0.95)}


async def embeddings(url: str, inputs: list[str], batch: int, model: str = MODEL) -> float:
    """Inputs embedded per second: `batch` inputs a request, requests one after another."""
    import httpx

    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        for i in range(0, len(inputs), batch):
            r = await client.post(url + "/v1/embeddings", json={"model": model, "input": inputs[i:i + batch]},
                                  timeout=600)
            r.raise_for_status()
        return len(inputs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=positive_int, default=8)
    ap.add_argument("--max-tokens", type=positive_int, default=64)
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--embedding-inputs", type=positive_int, default=64)
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary (default: PATH, then build/llama.cpp/bin)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    # (no prefix caching: the protocols render the same prompts, and a later one would find them cached)
    server = run_server([sys.executable, "-m", "arlm", "serve", "--model", MODEL, "--port", str(port),
                         "--no-prefix-caching"], env, url)
    results: dict = {"streams": {}, "embeddings": {}}
    try:
        protocols = ("chat", "responses", "messages")
        asyncio.run(level(url, "chat", 2, 8))  # warm-up
        runs = {p: [] for p in protocols}
        for _ in range(args.rounds):
            for p in protocols:
                runs[p].append(asyncio.run(level(url, p, args.clients, args.max_tokens)))
        print(f"\n== {args.clients} concurrent streams, up to {args.max_tokens} tokens, greedy; medians of "
              f"{args.rounds} alternating rounds ==")
        print(f"{'protocol':>10} {'tok/s':>8} {'TTFT p50 s':>11} {'TTFT p95 s':>11} {'tok/s vs chat':>14}")
        chat = statistics.median(r["tokens_per_s"] for r in runs["chat"])
        for p in protocols:
            med = {k: statistics.median(r[k] for r in runs[p]) for k in runs[p][0]}
            results["streams"][p] = med
            print(f"{p:>10} {med['tokens_per_s']:>8.1f} {med['ttft_median']:>11.3f} {med['ttft_p95']:>11.3f} "
                  f"{med['tokens_per_s'] / chat:>14.2f}")
        inputs = [PROMPTS[i % len(PROMPTS)] for i in range(args.embedding_inputs)]
        for batch in (1, 32):
            results["embeddings"][f"arlm batch {batch}"] = asyncio.run(embeddings(url, inputs, batch))
    finally:
        stop(server)
    binary = find_llama_server(args.llama_server)
    if binary is None:
        print("\nllama.cpp: skipped (no llama-server: pass --llama-server PATH or build it with `make bench-peers`)")
    else:
        from arlm.loading import resolve_model_path

        port = free_port()
        lurl = f"http://127.0.0.1:{port}"
        lenv = {**os.environ, "LD_LIBRARY_PATH": f"{Path(binary).parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
        proc = run_server([binary, "-m", str(resolve_model_path(MODEL)), "-t", str(args.threads), "--embeddings",
                           "--pooling", "mean", "-c", "8192", "-b", "2048", "-ub", "2048", "--host", "127.0.0.1",
                           "--port", str(port)], lenv, lurl)
        try:
            for batch in (1, 32):
                results["embeddings"][f"llama.cpp batch {batch}"] = asyncio.run(embeddings(lurl, inputs, batch))
        finally:
            stop(proc)
    print(f"\n== embeddings: {args.embedding_inputs} inputs (a sentence each), inputs/s ==")
    for name, rate in results["embeddings"].items():
        print(f"{name:>20} {rate:>8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
