"""Start-up and memory: arlm beside llama.cpp (llama-cpp-python) on the same GGUF, one run.

    LLAMA_CPP_LIB_PATH=build/llama.cpp/bin .venv/bin/python benchmarks/startup.py [--repeat 5] [--model gemma3-270m]

Each measure is a fresh process, run --repeat times alternating arlm and the peer, medians
reported (the file and the caches warm: every run after the first):
- process start -> first generated token: `arlm generate "The cat sat on the" --max-new-tokens 1`
  (the process exits right after printing it), and a Python process that loads the file with
  llama-cpp-python, evaluates the same prompt and samples one token;
- peak resident memory of each (the kernel's max RSS for the child);
- the same for `arlm generate --quantize none` (the float32 path: the weights once, ~540 MB);
- `arlm serve` ready to answer: process start -> GET /health answers 200.
The first run after install (native kernels compiled, the bare library and the model cache built)
is measured once, separately, with an empty ARLM_CACHE; and once with those built but no model
cache: the first load of a file after the first, its command handed over to the bare path.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from arlm.loading import resolve_model_path  # noqa: E402

ARLM = [sys.executable, "-m", "arlm"]
PROMPT = "The cat sat on the"
LLAMA_CPP = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads={threads}, n_threads_batch={threads}, verbose=False)
llm.eval(llm.tokenize(sys.argv[2].encode(), add_bos=False))
print(llm.detokenize([llm.sample(temp=0.0)]).decode(errors="replace"))
"""


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, int]:
    """(wall seconds, peak RSS in MB) of one child process, which must succeed. The peak is GNU
    time's (%M, from its own small process): this process's wait4 would floor it at this
    process's RSS (Linux carries a parent's high-water mark through fork and exec)."""
    with tempfile.NamedTemporaryFile("r") as peak:
        t0 = time.perf_counter()
        proc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", peak.name, *cmd], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, env=env)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.decode(errors='replace')[-500:]}")
        return wall, int(peak.read().split()[-1]) // 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_ready(model: str, env: dict | None = None) -> tuple[float, int]:
    """Seconds from `arlm serve` starting to /health answering 200, and its RSS then (MB)."""
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen(ARLM + ["serve", "--model", model, "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("arlm serve exited before it was ready")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.02)
        ready = time.perf_counter() - t0
        rss = 0
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                rss = int(line.split()[1]) // 1024
        return ready, rss
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-first-run", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--model", default="smollm2", help="a known model name or GGUF path")
    args = ap.parse_args()
    gguf = str(resolve_model_path(args.model))  # (a path: the first-run measures move ARLM_CACHE)
    generate = ARLM + ["generate", PROMPT, "--model", gguf, "--max-new-tokens", "1", "--temperature", "0"]
    peer = [sys.executable, "-c", LLAMA_CPP.format(threads=args.threads), gguf, PROMPT]
    try:
        subprocess.run(peer, check=True, capture_output=True)
    except subprocess.CalledProcessError as e:
        print(f"llama.cpp: not available ({e.stderr.decode()[-200:].strip()}); `make bench-peers` builds it",
              file=sys.stderr)
        peer = None
    timed(generate)  # warm: the file, the kernels and the model cache
    runs: dict[str, list[tuple[float, int]]] = {"arlm": [], "arlm --quantize none": [], "llama.cpp": [],
                                                "arlm serve": []}
    for _ in range(args.repeat):  # alternating, so drift hits every side alike
        runs["arlm"].append(timed(generate))
        if peer:
            runs["llama.cpp"].append(timed(peer))
        runs["arlm --quantize none"].append(timed(generate + ["--quantize", "none"]))
        runs["arlm serve"].append(serve_ready(gguf))
    results = {name: {"seconds": statistics.median(r[0] for r in v), "peak_rss_mb": statistics.median(r[1] for r in v),
                      "runs": v} for name, v in runs.items() if v}
    if not args.skip_first_run:
        with tempfile.TemporaryDirectory() as tmp:
            # (the first run also builds the bare library, in the background unless told to wait: waiting,
            # the next row's command finds it and runs as a user's second file does, handed over to it)
            env = {**os.environ, "ARLM_CACHE": tmp, "ARLM_BARE_BUILD_WAIT": "1"}
            wall, rss = timed(generate, env)
            results["arlm, first run (builds kernels, bare library, model cache)"] = {"seconds": wall, "peak_rss_mb": rss}
            shutil.rmtree(Path(tmp) / "models")
            wall, rss = timed(generate, env)
            results["arlm, model cache empty (kernels built)"] = {"seconds": wall, "peak_rss_mb": rss}
    print(f"{'':48} {'start -> 1st token / ready':>26} {'peak RSS':>10}")
    for name, r in results.items():
        label = "ready to answer" if name == "arlm serve" else "first token"
        print(f"{name:48} {r['seconds']:>17.2f} s ({label[:5]}) {r['peak_rss_mb']:>7} MB")
    if "llama.cpp" in results:
        a, p = results["arlm"], results["llama.cpp"]
        print(f"arlm / llama.cpp: time {a['seconds'] / p['seconds']:.2f}x, peak RSS {a['peak_rss_mb'] / p['peak_rss_mb']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
