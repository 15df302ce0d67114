"""`arlm serve --replicas N` on this machine, measured beside one `arlm serve` process.

    .venv/bin/python benchmarks/cluster.py [--parts routing,scaling,ingress] [--rounds 2]

Three parts (each setup's server started for it, the setups alternated round by round, medians
over the rounds reported):

- routing: the prefix-cache hit rate and time to first token of a multi-turn trace with the
  prefix router, with Ray Serve's own power-of-two-choices router, and in one process, on the
  same trace. N conversations (--conversations), each with a system prompt of its own
  (~--prefix-tokens tokens), run concurrently, each sending its turns (--turns) one after another
  through the Responses API (streamed; the previous turns re-sent as input, as agents do); every
  turn's first-token time and its `usage.input_tokens_details.cached_tokens` are recorded. Hit
  rate: cached / input tokens over the turns after each conversation's first (the first can hit
  nothing); time to first token over all turns, and over those later turns ("later": the turns a
  router places by prefix; the first turns are one burst whatever the router). 2 replicas x 1 thread (prefix router, then power-of-two) and one process with 2
  threads, each replica's KV pool --kv-cache-tokens (the single process's twice that): a pool
  that holds about half the conversations, as a loaded server's does; with pools that hold every
  conversation, any router's replicas soon each hold every prefix.
- scaling: aggregate tokens/s, time to first token (p50, p95) and the gap between a stream's
  tokens (p50) at 1/8/32/64 clients (--clients), each client streaming 64-token completions of its
  own prompts one after another for --seconds: one process x 2 threads against 2 replicas x 1
  thread (this machine's cores either way), and one process x 1 thread against one replica x 1
  thread behind the ingress (the same engine: the difference is the ingress's cost, Ray Serve's
  proxy, the ingress replica and a streaming handle call per request, and Ray's processes on the
  same cores).
- ingress: what one ingress replica routes when the replicas behind it cost nothing: a stub
  replica (no model; it answers every request at once with --stub-chunks server-sent events)
  behind the same Ingress and prefix router, 64 clients for --seconds; beside it the same stub
  as a plain Starlette app under uvicorn (no Ray), the ceiling of this machine's client. On 2
  cores the client, Ray's proxy, the ingress and the stub share the machine: a floor for the
  ingress's capacity, not its ceiling.
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
from serve import PROMPTS, free_port, one_stream, percentile, run_server, stop  # noqa: E402

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
            "ttft_p50": statistics.median(ttfts), "ttft_p95": percentile(ttfts, 0.95),
            # (the turns a router can place by prefix; the first turns are one burst for any router)
            "later_ttft_p50": statistics.median(r[1] for r in later) if later else float("nan"),
            "later_ttft_p95": percentile([r[1] for r in later], 0.95) if later else float("nan"), "seconds": wall}


def start(extra: list[str], threads: int, kv_tokens: int) -> tuple[str, object]:
    """An `arlm serve` with these flags on a free port, healthy: (url, process)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = run_server([sys.executable, "-m", "arlm", "serve", "--model", MODEL, "--port", str(port),
                       "--kv-cache-tokens", str(kv_tokens), *extra], env, url)
    return url, proc


def rounds_of(setups: list, rounds: int) -> list[list]:
    """The setups' order in each round: as given, then reversed, and so on (a drift skews all alike)."""
    return [setups if r % 2 == 0 else setups[::-1] for r in range(rounds)]


def medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def part_routing(args) -> dict:
    setups = [("2 replicas, prefix router", ["--replicas", "2", "--threads-per-replica", "1"]),
              ("2 replicas, power-of-two", ["--replicas", "2", "--threads-per-replica", "1",
                                            "--replica-router", "power-of-two"]),
              ("1 process, 2 threads", [])]
    runs: dict[str, list[dict]] = {name: [] for name, _ in setups}
    for order in rounds_of(setups, args.rounds):
        for name, extra in order:
            url, proc = start(extra, 1 if extra else 2, args.kv_cache_tokens * (1 if extra else 2))
            try:
                asyncio.run(trace(url, 2, 1, 64))  # warm-up (its own prompts)
                runs[name].append(asyncio.run(trace(url, args.conversations, args.turns, args.prefix_tokens)))
            finally:
                stop(proc)
                time.sleep(2)
            print(f"routing, {name}: {runs[name][-1]}", flush=True)
    results = {name: medians(r) for name, r in runs.items()}
    single = results["1 process, 2 threads"]["hit_rate"]
    print(f"\n== routing: {args.conversations} conversations x {args.turns} turns, ~{args.prefix_tokens}-token "
          f"system prompts each; medians of {args.rounds} round(s) ==")
    print(f"{'setup':>28} {'hit rate':>9} {'vs 1 proc':>10} {'TTFT p50 s':>11} {'TTFT p95 s':>11} "
          f"{'later p50 s':>12} {'later p95 s':>12} {'wall s':>7}")
    for name, r in results.items():
        print(f"{name:>28} {r['hit_rate']:>9.3f} {r['hit_rate'] / max(single, 1e-9):>10.2f} {r['ttft_p50']:>11.3f} "
              f"{r['ttft_p95']:>11.3f} {r['later_ttft_p50']:>12.3f} {r['later_ttft_p95']:>12.3f} {r['seconds']:>7.1f}")
    return {"medians": results, "runs": runs}


async def clients_for(url: str, clients: int, seconds: float, max_tokens: int = 64) -> dict:
    """`clients` clients, each streaming completions of its own prompts one after another until
    `seconds` have passed (the requests running then finish)."""
    import httpx

    ttfts, gaps, tokens = [], [], 0

    async def client_loop(client, c: int) -> None:
        nonlocal tokens
        k = 0
        while time.perf_counter() < deadline:
            prompt = f"Client {c}, request {k}: {PROMPTS[(c + k) % len(PROMPTS)]}"
            ttft, n, _, g = await one_stream(client, url, MODEL, prompt, max_tokens)
            ttfts.append(ttft)
            gaps.extend(g)
            tokens += n
            k += 1

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter()
        deadline = t0 + seconds
        await asyncio.gather(*(client_loop(client, c) for c in range(clients)))
        wall = time.perf_counter() - t0
    return {"tokens_per_s": tokens / wall, "ttft_p50": statistics.median(ttfts), "ttft_p95": percentile(ttfts, 0.95),
            "gap_p50": statistics.median(gaps), "gap_p95": percentile(gaps, 0.95), "requests": len(ttfts)}


def part_scaling(args) -> dict:
    setups = [("1 process x 2 threads", [], 2),
              ("2 replicas x 1 thread", ["--replicas", "2", "--threads-per-replica", "1"], 1),
              ("1 process x 1 thread", ["--threads", "1"], 1),
              ("1 replica x 1 thread", ["--replicas", "1", "--threads-per-replica", "1"], 1),
              ("1 replica x 2 threads", ["--replicas", "1", "--threads-per-replica", "2"], 2)]
    setups = [s for s in setups if s[0] in args.setups]
    runs: dict[tuple[str, int], list[dict]] = {}
    for order in rounds_of(setups, args.rounds):
        for name, extra, threads in order:
            url, proc = start(extra, threads, args.kv_cache_tokens * (2 if "2 threads" in name else 1))
            try:
                asyncio.run(clients_for(url, 2, 2.0))  # warm-up
                for c in args.clients:
                    r = asyncio.run(clients_for(url, c, args.seconds))
                    runs.setdefault((name, c), []).append(r)
                    print(f"scaling, {name}, {c} clients: {r}", flush=True)
            finally:
                stop(proc)
                time.sleep(2)
    results = {key: medians(r) for key, r in runs.items()}
    base = setups[0][0]
    print(f"\n== scaling: clients streaming 64-token completions for {args.seconds:g} s; medians of {args.rounds} "
          f"round(s) ==")
    print(f"{'setup':>24} {'clients':>7} {'tok/s':>8} {'vs 1 proc':>9} {'TTFT p50 s':>11} {'TTFT p95 s':>11} "
          f"{'gap p50 ms':>11} {'gap p95 ms':>11}")
    for c in args.clients:
        for name, _, _ in setups:
            r = results[(name, c)]
            print(f"{name:>24} {c:>7} {r['tokens_per_s']:>8.1f} {r['tokens_per_s'] / results[(base, c)]['tokens_per_s']:>9.2f} "
                  f"{r['ttft_p50']:>11.3f} {r['ttft_p95']:>11.3f} {1e3 * r['gap_p50']:>11.1f} {1e3 * r['gap_p95']:>11.1f}")
    print("\nthe ingress's cost (1 replica x 1 thread minus 1 process x 1 thread: the same engine):")
    for c in args.clients if ("1 replica x 1 thread", args.clients[0]) in results else ():
        a, b = results[("1 replica x 1 thread", c)], results[("1 process x 1 thread", c)]
        print(f"  {c:>3} clients: TTFT p50 {1e3 * (a['ttft_p50'] - b['ttft_p50']):+.1f} ms, "
              f"gap p50 {1e3 * (a['gap_p50'] - b['gap_p50']):+.2f} ms, tok/s x{a['tokens_per_s'] / b['tokens_per_s']:.2f}")
    return {"medians": {f"{n} @ {c}": r for (n, c), r in results.items()},
            "runs": {f"{n} @ {c}": r for (n, c), r in runs.items()}}


def serve_stub(port: int, chunks: int, direct: bool) -> None:
    """(A subprocess of the ingress part.) A stub replica answering each request with `chunks`
    server-sent events at once: behind the Ingress and the prefix router on Ray Serve, or (direct)
    as a Starlette app under uvicorn."""
    import signal
    import threading

    events = [b'data: {"choices":[{"index":0,"text":"x"}]}\n\n'] * chunks + [b"data: [DONE]\n\n"]
    if direct:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        async def complete(request):
            await request.body()

            async def gen():
                for e in events:
                    yield e
            return StreamingResponse(gen(), media_type="text/event-stream")

        async def health(request):
            return JSONResponse({"status": "ok"})

        app = Starlette(routes=[Route("/v1/completions", complete, methods=["POST"]), Route("/health", health)])
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="error")
        return
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, RequestRouterConfig

    from arlm.serve.cluster import Ingress

    @serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=4096)
    class Stub:
        async def handle(self, method, path, query, headers, body, prefix=None, replica=None):
            if path == "/health":
                yield {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
                yield {"type": "http.response.body", "body": b'{"status":"ok"}', "more_body": False}
                return
            yield {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            for i, e in enumerate(events):
                yield {"type": "http.response.body", "body": e, "more_body": i < len(events) - 1}

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options=HTTPOptions(host="127.0.0.1", port=port))
    router = RequestRouterConfig(request_router_class="arlm.serve.cluster:PrefixRouter")
    # (named as arlm's replica deployment: the ingress's /health counts that one's replicas)
    stub = Stub.options(name="EngineReplica", request_router_config=router)
    serve.run(Ingress.bind(stub.bind(), 1), name="arlm", route_prefix="/")
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait()
    serve.shutdown()
    ray.shutdown()


async def hammer(url: str, clients: int, seconds: float) -> dict:
    """`clients` clients posting completions one after another for `seconds`: requests/s and events/s."""
    import httpx

    done, events = 0, 0
    body = json.dumps({"model": MODEL, "prompt": "Hi", "stream": True}).encode()

    async def loop(client) -> None:
        nonlocal done, events
        while time.perf_counter() < deadline:
            async with client.stream("POST", f"{url}/v1/completions", content=body,
                                     headers={"content-type": "application/json"}, timeout=120) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    events += line.startswith("data: {")
            done += 1

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter()
        deadline = t0 + seconds
        await asyncio.gather(*(loop(client) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"requests_per_s": done / wall, "events_per_s": events / wall}


def part_ingress(args) -> dict:
    runs: dict[tuple[str, int], list[dict]] = {}
    setups = [("ingress + stub replica (Ray Serve)", False), ("stub alone (uvicorn, no Ray)", True)]
    for order in rounds_of(setups, args.rounds):
        for name, direct in order:
            for chunks in (1, args.stub_chunks):
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                proc = run_server([sys.executable, __file__, "--stub-server", str(port), "--stub-chunks", str(chunks),
                                   *(["--direct"] if direct else [])], dict(os.environ), url)
                try:
                    asyncio.run(hammer(url, 8, 1.0))  # warm-up
                    r = asyncio.run(hammer(url, 64, args.seconds))
                finally:
                    stop(proc)
                    time.sleep(2)
                runs.setdefault((name, chunks), []).append(r)
                print(f"ingress, {name}, {chunks} event(s) a request: {r}", flush=True)
    results = {key: medians(r) for key, r in runs.items()}
    print(f"\n== ingress: 64 clients for {args.seconds:g} s against a stub replica; medians of {args.rounds} round(s) ==")
    print(f"{'setup':>36} {'events/request':>14} {'requests/s':>11} {'events/s':>9}")
    for (name, chunks), r in results.items():
        print(f"{name:>36} {chunks:>14} {r['requests_per_s']:>11.1f} {r['events_per_s']:>9.1f}")
    return {"medians": {f"{n}, {c} events": r for (n, c), r in results.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="routing,scaling,ingress",
                    help="which parts, comma-separated: routing, scaling, ingress (default: all three)")
    ap.add_argument("--rounds", type=positive_int, default=2, help="rounds of every setup, alternated (default: 2)")
    ap.add_argument("--conversations", type=positive_int, default=16)
    ap.add_argument("--turns", type=positive_int, default=6)
    ap.add_argument("--prefix-tokens", type=positive_int, default=1000)
    ap.add_argument("--kv-cache-tokens", type=positive_int, default=12288,
                    help="each 1-thread replica's KV pool in tokens (a 2-thread process gets twice as many: the same "
                         "memory); the default holds about half the routing trace's conversations per replica")
    ap.add_argument("--clients", default="1,8,32,64", help="scaling: client counts (default: 1,8,32,64)")
    ap.add_argument("--setups", default="1 process x 2 threads,2 replicas x 1 thread,1 process x 1 thread,"
                                        "1 replica x 1 thread",
                    help="scaling: which setups, comma-separated, ratios to the first in the default order (default: the four "
                         "named; also '1 replica x 2 threads')")
    ap.add_argument("--seconds", type=float, default=15.0, help="scaling and ingress: seconds a level runs (default: 15)")
    ap.add_argument("--stub-chunks", type=positive_int, default=64,
                    help="ingress: events a stub response streams (beside 1 event; default: 64)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--stub-server", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--direct", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stub_server:
        serve_stub(args.stub_server, args.stub_chunks, args.direct)
        return
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := set(parts) - {"routing", "scaling", "ingress"}:
        ap.error(f"--parts: unknown part(s) {', '.join(sorted(unknown))} (routing, scaling, ingress)")
    try:
        args.clients = [int(c) for c in args.clients.split(",")]
        assert all(c > 0 for c in args.clients)
    except (ValueError, AssertionError):
        ap.error(f"--clients: expected positive integers separated by commas, got {args.clients!r}")
    args.setups = [x.strip() for x in args.setups.split(",") if x.strip()]
    known = {"1 process x 2 threads", "2 replicas x 1 thread", "1 process x 1 thread", "1 replica x 1 thread",
             "1 replica x 2 threads"}
    if not args.setups or set(args.setups) - known:
        ap.error(f"--setups: expected names among {', '.join(sorted(known))}")
    if not args.seconds > 0:
        ap.error(f"--seconds: expected a positive number, got {args.seconds}")
    out = {}
    for part in parts:
        out[part] = {"routing": part_routing, "scaling": part_scaling, "ingress": part_ingress}[part](args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
