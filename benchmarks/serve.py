"""Serving benchmark: arlm's engine and `arlm serve` under concurrent load, beside llama.cpp's server.

    .venv/bin/python benchmarks/serve.py [--threads 2] [--clients 1,8,32] [--max-tokens 64]
                                         [--llama-server PATH] [--skip-engine] [--skip-http] [--json out.json]
                                         [--model smollm2|PATH.gguf]

1. Engine alone (no HTTP), in this process: the forward pass of one decode step over the paged KV
   pool (the flattened batch through block tables, as `arlm serve` runs it) against the same step
   over a contiguous cache (by rows, as `LLM.generate` runs it), at batch 1, 8 and 32 with the
   same context; then a whole `Engine.step` over the pool (scheduler and sampling included); then
   prefix caching: requests that share a system prompt, prefill tokens and time with and without it.
2. HTTP: starts `arlm serve --threads THREADS` (pinned, as llama-server -t) and drives it with 1, 8 and 32 concurrent
   streaming clients, each a different prompt, greedy, exactly --max-tokens tokens (ignore_eos):
   total output tokens/s, median and p95 time to first token, and the ratio to serving the same
   requests one at a time. Then the same load against llama.cpp's server on the same GGUF
   (`llama-server -t THREADS -np 32 --cont-batching`) when its binary is found (--llama-server,
   PATH, or build/llama.cpp/bin/llama-server from `make bench-peers`); otherwise says it skipped.
   --model: the HTTP part on another GGUF, e.g. benchmarks/make_gguf.py's 1B shape (the sizes users
   run: issue 48), both servers on the same file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from bench_args import SMOLLM2_MAX_SEQ_LEN, int_range, positive_int, positive_int_list  # noqa: E402

ENGINE_STEP_NEW_TOKENS = 40  # what each request of the whole-Engine.step timing may generate

PROMPTS = [
    "The cat sat on the", "Once upon a time, in a small village,", "def fibonacci(n):",
    "The capital of France is", "Write a short poem about the sea.", "Hello, my name is",
    "In 1492, Columbus sailed", "The best way to learn a language is", "Water boils at",
    "Q: What is the tallest mountain on Earth?\nA:", "import numpy as np\n", "The quick brown fox",
    "My favourite season is autumn because", "Dear hiring manager,", "The mitochondria is",
    "To be or not to be,", "Photosynthesis is the process by which", "SELECT name FROM users WHERE",
    "The weather forecast for tomorrow says", "A good breakfast includes", "Rust and Python differ in",
    "<html>\n<head>\n<title>", "The first law of thermodynamics states", "There once was a dragon who",
    "To bake bread you need", "The stock market fell today after", "Translate to French: good morning =",
    "The history of the Roman Empire", "The answer to the ultimate question is", "git commit -m \"",
    "Roses are red, violets are blue,", "Chapter 1\n\nIt was a dark and stormy night",
]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


# -- 1. the engine alone ----------------------------------------------------------------------------

def median_time(fn, repeat: int = 10) -> float:
    return median_times([fn], repeat)[0]


def median_times(fns: list, repeat: int = 10) -> list[float]:
    """Median wall time of each fn, timed in turns so that a change in the machine's load
    (it is shared) hits them all alike."""
    for fn in fns:
        fn()
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def prefilled(engine, prompts: list[list[int]]):
    """Submit `prompts` (greedy, ENGINE_STEP_NEW_TOKENS each) and step until each has its first
    token: every request is then one decode away."""
    from arlm.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=ENGINE_STEP_NEW_TOKENS, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    while any(r.num_output_tokens == 0 for r in reqs):
        engine.step()
    return reqs


def forward_pass(engine):
    """The forward pass of the engine's next step alone (`ModelRunner.execute` on the batch its
    scheduler forms), with no sampling or bookkeeping after it: every call decodes the same token
    at the same position, rewriting the same K/V slots."""
    batch = engine.scheduler.schedule()
    assert len(batch) and all(batch.decodes(i) for i in range(len(batch))), "not a decode step"
    return lambda: engine.runner.execute(engine.cache, batch, by_rows=engine.config.contiguous)


def bench_engine(threads: int, context: int, quantize: str, kv_dtype: str = "auto") -> dict:
    import torch

    from arlm import kernels
    from arlm.engine import Engine, EngineConfig
    from arlm.llm import LLM
    from arlm.sampling import SamplingParams

    torch.set_num_threads(threads)
    if quantize == "auto":  # what `arlm serve --quantize auto` picks on CPU (serve/cli.py)
        quantize = "auto" if kernels.packed_available() else "int8"
    # prefill through the quantized kernels, as `arlm serve` runs it (serve/cli.py)
    llm = LLM.load("smollm2", quantize=quantize, kv_dtype=kv_dtype, matmul_path="vnni")
    cfg = llm.model.config
    out: dict = {"quantization": llm.quantization, "context": context, "decode": {}}
    print(f"\n== engine alone: decode step at {context} tokens of context, {threads} thread(s), "
          f"{llm.quantization or 'fp32'} weights, {str(llm.kv_dtype).removeprefix('torch.')} KV ==")
    print(f"{'batch':>5} {'contiguous ms':>14} {'paged ms':>9} {'paged/contig':>12} {'Engine.step ms':>15} {'tokens/s':>9}")
    for B in (1, 8, 32):
        g = torch.Generator().manual_seed(B)
        prompts = torch.randint(0, cfg.vocab_size, (B, context), generator=g).tolist()
        # The same decode step over both caches, through the same runner (one binding of the
        # native kernels): the contiguous cache's rows path (`LLM.generate`, `arlm generate`:
        # `NativeLlama.decode` where it applies) and the paged pool's flattened batch through
        # block tables (`arlm serve`: `NativeLlama.forward`).
        contiguous_engine = Engine(llm.runner, llm.tokenizer.eos_ids,
                                   EngineConfig(block_size=None, max_num_seqs=B, max_num_batched_tokens=B * context,
                                                kv_dtype=llm.kv_dtype))
        paged_engine = Engine(llm.runner, llm.tokenizer.eos_ids,
                              EngineConfig(kv_cache_tokens=B * (context + 64), kv_dtype=llm.kv_dtype))
        for e in (contiguous_engine, paged_engine):
            prefilled(e, prompts)
        contiguous, paged = median_times([forward_pass(contiguous_engine), forward_pass(paged_engine)])
        del contiguous_engine
        # A whole engine step over the pool: scheduling, the forward pass, per-request sampling, bookkeeping.
        step = median_time(paged_engine.step, repeat=10)
        out["decode"][B] = {"contiguous_ms": contiguous * 1e3, "paged_ms": paged * 1e3, "engine_step_ms": step * 1e3}
        print(f"{B:>5} {contiguous * 1e3:>14.1f} {paged * 1e3:>9.1f} {paged / contiguous:>12.2f} {step * 1e3:>15.1f} "
              f"{B / step:>9.1f}")

    # Prefix caching: 8 chat requests with the same long system prompt, submitted one by one.
    system = ("You are a helpful assistant for a hardware store. Answer in one short sentence, "
              "mention prices in dollars, never invent stock levels, and suggest one related item. ") * 4
    questions = ["Do you sell hammers?", "How much is a drill?", "I need nails.", "Any paint brushes?",
                 "Where are the screws?", "Do you cut keys?", "Is there a ladder?", "Got duct tape?"]
    prompts = [llm.tokenizer.encode(llm.apply_chat_template([{"role": "system", "content": system},
                                                              {"role": "user", "content": q}])) for q in questions]
    params = SamplingParams(max_new_tokens=1, temperature=0)
    results = {}
    for caching in (False, True):
        engine = Engine(llm.runner, llm.tokenizer.eos_ids,
                        EngineConfig(kv_cache_tokens=4096, enable_prefix_caching=caching, kv_dtype=llm.kv_dtype))
        t0 = time.perf_counter()
        firsts = [engine.generate([p], params)[0] for p in prompts]
        results[caching] = (engine.scheduler.stats.computed_tokens, time.perf_counter() - t0, firsts)
    assert results[True][2] == results[False][2], "prefix caching changed an output"
    (n_off, t_off, _), (n_on, t_on, _) = results[False], results[True]
    out["prefix_caching"] = {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                             "prefilled_without": n_off, "prefilled_with": n_on, "seconds_without": t_off,
                             "seconds_with": t_on}
    print(f"\n== prefix caching: {len(prompts)} requests sharing a {len(prompts[0]) - 10}-ish token system prompt ==")
    print(f"prefilled tokens {n_off} -> {n_on} ({n_off / n_on:.1f}x fewer), time to all first tokens "
          f"{t_off:.2f} s -> {t_on:.2f} s ({t_off / t_on:.1f}x), outputs identical")
    return out


# -- 2. over HTTP -----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout} s")


async def one_stream(client, url: str, model: str, prompt: str,
                     max_tokens: int) -> tuple[float, int, float, list[float]]:
    """(time to first token, tokens, total seconds, the gaps between chunks) of one streaming completion.

    Tokens are the server's count (the final chunk's usage, `stream_options.include_usage`), or
    max_tokens where the stream ended for length: not the chunks, as a server holds back a token
    that ends inside a UTF-8 character (or a stop string's prefix) and sends it with the next, so
    a model that emits byte tokens streams fewer chunks than tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    arrivals = []
    usage, finish = None, None
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"].get("completion_tokens")
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason") or finish
                if choice.get("text"):
                    arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    tokens = usage if usage is not None else max_tokens if finish == "length" else len(arrivals)
    return (arrivals[0] - t0 if arrivals else float("nan")), tokens, time.perf_counter() - t0, gaps


async def load(url: str, model: str, prompts: list[str], max_tokens: int, concurrent: bool) -> dict:
    import httpx

    # No keep-alive: a server that closes an idle connection races a client reusing it.
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter()
        if concurrent:
            runs = await asyncio.gather(*(one_stream(client, url, model, p, max_tokens) for p in prompts))
        else:
            runs = [await one_stream(client, url, model, p, max_tokens) for p in prompts]
        wall = time.perf_counter() - t0
    ttfts = [r[0] for r in runs]
    tokens = sum(r[1] for r in runs)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "ttft_median": statistics.median(ttfts), "ttft_p95": percentile(ttfts, 0.95)}


def run_level(url: str, model: str, c: int, max_tokens: int, sequential: bool) -> dict:
    """c concurrent clients, then (if asked) the same c requests one at a time."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(c)]
    result = asyncio.run(load(url, model, prompts, max_tokens, concurrent=True))
    seq = asyncio.run(load(url, model, prompts, max_tokens, concurrent=False)) if sequential and c > 1 else None
    result["sequential_tokens_per_s"] = seq["tokens_per_s"] if seq else result["tokens_per_s"] if c == 1 else None
    result["ratio_to_sequential"] = (result["tokens_per_s"] / result["sequential_tokens_per_s"]
                                     if result["sequential_tokens_per_s"] else None)
    return result


def print_table(name: str, max_tokens: int, rows: dict) -> None:
    print(f"\n== {name}: {max_tokens} tokens per request, greedy ==")
    print(f"{'clients':>7} {'tok/s':>8} {'TTFT p50 s':>11} {'TTFT p95 s':>11} {'one-at-a-time tok/s':>20} {'ratio':>6}")
    for c, r in rows.items():
        print(f"{c:>7} {r['tokens_per_s']:>8.1f} {r['ttft_median']:>11.3f} {r['ttft_p95']:>11.3f} "
              f"{r['sequential_tokens_per_s'] or float('nan'):>20.1f} {r['ratio_to_sequential'] or float('nan'):>6.2f}")


def find_llama_server(flag: str | None) -> str | None:
    for candidate in (flag, shutil.which("llama-server"), str(ROOT / "build/llama.cpp/bin/llama-server")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def run_server(cmd: list[str], env: dict, url: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, proc)
    except Exception:
        proc.kill()
        raise
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


def served_model(url: str) -> str:
    """The model id a server lists first (/v1/models), for its requests."""
    import httpx

    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def bench_http(args) -> dict:
    """Start the servers, then run each load level on each server in turn (arlm, llama.cpp, next
    level), so that the machine's changing load skews both alike."""
    from arlm.loading import resolve_model_path

    clients = args.clients
    servers: dict[str, tuple[str, subprocess.Popen]] = {}
    try:
        if args.servers in ("both", "arlm"):
            port = free_port()
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
            url = f"http://127.0.0.1:{port}"
            servers["arlm"] = url, run_server([sys.executable, "-m", "arlm", "serve", "--model", args.model,
                                               "--port", str(port), "--kv-cache-memory", "1GiB",
                                               "--quantize", args.quantize, "--threads", str(args.threads)],
                                              env, url)  # (pinned as llama-server's -t: the client is a neighbour)
        binary = find_llama_server(args.llama_server) if args.servers in ("both", "llama.cpp") else None
        if binary is None and args.servers != "arlm":
            print("\nllama.cpp: skipped (no llama-server: pass --llama-server PATH, put it on PATH, or build it "
                  "with `make bench-peers`)")
        if binary is not None:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            env = {**os.environ, "LD_LIBRARY_PATH": f"{Path(binary).parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
            slots = max(clients)
            servers["llama.cpp"] = url, run_server(
                [binary, "-m", str(resolve_model_path(args.model)), "-t", str(args.threads), "-np", str(slots),
                 "--cont-batching", "-c", str(slots * 256), "--host", "127.0.0.1", "--port", str(port)], env, url)
        results: dict[str, dict] = {name: {} for name in servers}
        ids = {name: served_model(url) for name, (url, _) in servers.items()}
        for name, (url, _) in servers.items():
            asyncio.run(load(url, ids[name], PROMPTS[:2], 8, concurrent=True))  # warm-up
        for c in clients:
            for name, (url, _) in servers.items():
                results[name][c] = run_level(url, ids[name], c, args.max_tokens, not args.no_sequential)
    finally:
        for _, proc in servers.values():
            stop(proc)
    for name in results:
        print_table("arlm serve" if name == "arlm" else f"llama.cpp server ({binary})", args.max_tokens, results[name])
    if len(results) == 2:
        print("\n== arlm / llama.cpp ==")
        for c in clients:
            a, l = results["arlm"][c], results["llama.cpp"][c]
            print(f"{c:>3} clients: throughput {a['tokens_per_s'] / l['tokens_per_s']:.2f}x, "
                  f"median TTFT {a['ttft_median']:.3f} s vs {l['ttft_median']:.3f} s")
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Upper limits: SmolLM2's window holds the engine part's context and the tokens its requests
    # generate, and each HTTP request's prompt (under 20 tokens; 64 are kept) and --max-tokens.
    p.add_argument("--threads", type=positive_int, default=2, help="torch / llama.cpp threads (default: 2)")
    p.add_argument("--clients", type=positive_int_list, default="1,8,32", help="concurrency levels (default: 1,8,32)")
    p.add_argument("--max-tokens", type=int_range(1, SMOLLM2_MAX_SEQ_LEN - 64), default=64)
    p.add_argument("--context", type=int_range(1, SMOLLM2_MAX_SEQ_LEN - ENGINE_STEP_NEW_TOKENS), default=128,
                   help="tokens of context for the engine decode step")
    p.add_argument("--llama-server", default=None, help="path to llama.cpp's llama-server binary")
    p.add_argument("--no-sequential", action="store_true", help="skip the one-at-a-time baseline")
    p.add_argument("--servers", default="both", choices=("both", "arlm", "llama.cpp"), help="which servers to load")
    p.add_argument("--kv-dtype", default="auto", choices=("auto", "float32", "float16"),
                   help="KV cache and pool dtype of the engine-alone part (default: what arlm serve picks)")
    p.add_argument("--quantize", default="auto", choices=("auto", "int8", "q4"),
                   help="weights for the engine alone and for arlm serve (default: arlm serve's own default)")
    p.add_argument("--model", default="smollm2",
                   help="the HTTP part's model for both servers: a name or GGUF file (default: smollm2)")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} (other work skews every number)")
    results = {}
    if not args.skip_engine:
        results["engine"] = bench_engine(args.threads, args.context, args.quantize, args.kv_dtype)
    if not args.skip_http:
        results["http"] = bench_http(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
