"""Decode beside busy neighbours: arlm's adaptive thread width against a fixed width (what arlm
did before it watched the machine) and llama.cpp, with 0, 1, ... N busy processes on N cores.

    .venv/bin/python benchmarks/shared.py [--rounds 3] [--busy 0,1,2] [--max-new-tokens 128]
        [--server] [--llama-bench PATH]

Each neighbour is a pure-Python spin loop (`while True: pass`), started before a measurement and
killed after it. Each measurement is a fresh process: `arlm generate "The cat sat on the"
--max-new-tokens 128 --temperature 0 --json` (decode tokens/s from its stats), adaptive
(the default) and `--threads N` (pinned at the machine's width: the fixed setting), alternating;
llama.cpp's `llama-bench -n 128 -p 0` on the same GGUF where --llama-bench (or `make
bench-peers`) gives the binary. --server adds `arlm serve`'s aggregate tokens/s for 8 concurrent
clients (64 tokens each), adaptive and pinned. Medians of the rounds; the ratio to the quiet
figure is what a neighbour leaves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_args import positive_int  # noqa: E402

PROMPT = "The cat sat on the"


def cpu_line() -> str:
    flags = set()
    name = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
           if f in flags]
    return f"{name}, {os.cpu_count()} cores, {' '.join(isa)}"


def neighbours(n: int) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    time.sleep(0.5)  # (running before the measurement starts)
    return procs


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def arlm_decode(max_new_tokens: int, threads: int | None) -> tuple[float, str]:
    """(decode tokens/s, the threads the stats report) of one `arlm generate` process."""
    cmd = [sys.executable, "-m", "arlm", "generate", PROMPT, "--max-new-tokens", str(max_new_tokens),
           "--temperature", "0", "--ignore-eos", "--json"] + (["--threads", str(threads)] if threads else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"arlm generate failed: {r.stderr.strip()[-500:]}")
    stats = json.loads(r.stdout)["stats"]
    t = stats["threads"]
    return stats["decode_tokens_per_s"], f"{t['width']}/{t['widest']} (narrowest {t['narrowest']})"


def llama_decode(binary: str, gguf: str, max_new_tokens: int, threads: int) -> float:
    r = subprocess.run([binary, "-m", gguf, "-p", "0", "-n", str(max_new_tokens), "-t", str(threads), "-r", "1",
                        "-o", "json"], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {r.stderr.strip()[-500:]}")
    return float(json.loads(r.stdout)[0]["avg_ts"])


def serve_throughput(threads: int | None, clients: int = 8, max_tokens: int = 64) -> tuple[float, int]:
    """(aggregate tokens/s of `clients` concurrent streams against a fresh `arlm serve`, the
    times its thread width changed)."""
    from serve import free_port, load, run_server, stop

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "arlm", "serve", "--port", str(port)] + (["--threads", str(threads)] if threads else [])
    proc = run_server(cmd, dict(os.environ), url)
    try:
        prompts = [f"{PROMPT} {i}" for i in range(clients)]
        asyncio.run(load(url, "smollm2", prompts[:1], 4, concurrent=True))  # warm up
        tps = asyncio.run(load(url, "smollm2", prompts, max_tokens, concurrent=True))["tokens_per_s"]
        import httpx

        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        changes = int(float(next(ln.split()[1] for ln in metrics.splitlines()
                                 if ln.startswith("arlm_thread_width_changes_total"))))
        return tps, changes
    finally:
        stop(proc)


def main() -> int:
    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--busy", default=",".join(str(i) for i in range(cores + 1)),
                   help="numbers of busy neighbours, comma-separated (default: 0..cores)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--server", action="store_true", help="also arlm serve's 8-client throughput")
    p.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary (default: build/llama.cpp)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    try:
        busy = [int(x) for x in args.busy.split(",")]
        if any(b < 0 for b in busy):
            raise ValueError
    except ValueError:
        p.error(f"--busy: comma-separated counts >= 0, got {args.busy!r}")
    binary = args.llama_bench or str(ROOT / "build" / "llama.cpp" / "bin" / "llama-bench")
    if not os.path.exists(binary):
        binary = None
    gguf = None
    if binary:
        from arlm.loading import resolve_model_path

        gguf = str(resolve_model_path("smollm2"))
    print(f"CPU: {cpu_line()}; llama.cpp: {binary or 'not built (make bench-peers)'}", flush=True)
    results: dict = {}
    for b in busy:
        runs: dict[str, list[float]] = {}
        widths = []
        for r in range(args.rounds):
            order = [("arlm adaptive", None), ("arlm pinned", cores)]
            if r % 2:
                order.reverse()
            for name, threads in order:
                procs = neighbours(b)
                try:
                    tps, width = arlm_decode(args.max_new_tokens, threads)
                finally:
                    stop_all(procs)
                runs.setdefault(name, []).append(tps)
                if threads is None:
                    widths.append(width)
            if binary:
                procs = neighbours(b)
                try:
                    runs.setdefault("llama.cpp", []).append(llama_decode(binary, gguf, args.max_new_tokens, cores))
                finally:
                    stop_all(procs)
            if args.server:
                for name, threads in (("serve 8 clients adaptive", None), ("serve 8 clients pinned", cores)):
                    procs = neighbours(b)
                    try:
                        tps, changes = serve_throughput(threads)
                    finally:
                        stop_all(procs)
                    runs.setdefault(name, []).append(tps)
                    if threads is None:
                        widths.append(f"serve: {changes} width changes")
        results[b] = {k: statistics.median(v) for k, v in runs.items()}
        print(f"{b} busy: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in results[b].items())
              + f"; adaptive widths {widths}", flush=True)
    if 0 in results:
        for b in busy:
            kept = {k: results[b][k] / results[0][k] for k in results[b] if results[0].get(k)}
            line = ", ".join(f"{k} keeps {v:.2f}" for k, v in kept.items())
            if "llama.cpp" in results[b]:
                line += f"; arlm adaptive / llama.cpp {results[b]['arlm adaptive'] / results[b]['llama.cpp']:.2f}x"
            print(f"{b} busy: {line}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps({"cpu": cpu_line(), "results": results}, indent=1))
        tmp.replace(path)  # (atomic)
    return 0


if __name__ == "__main__":
    sys.exit(main())
