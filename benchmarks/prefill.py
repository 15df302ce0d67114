"""Prefill and large batches against the machine's matrix peak: arlm's matrix paths beside
llama.cpp and CTranslate2 on the same weights, and torch's own matmul peak on the same shapes.

    .venv/bin/python benchmarks/prefill.py [--rounds 5] [--threads 2] [--prompt 512] [--paths all]
        [--batch 32] [--ttft 2000] [--ttft-paths auto,bf16] [--llama-bench PATH] [--llama-server PATH]
        [--ct2 DIR] [--json F]

Each measurement is a fresh process, and the rounds alternate between the contenders (a noisy
machine drifts between runs: medians of the rounds are the figures):

- arlm, for each matrix path this CPU runs (`--matmul-path vnni|avx2|bf16|float32`): a prefill of
  --prompt random token ids (the same ids everywhere), the median of 3 after a warm-up; the
  integer paths with each of --activations (int8x2, the default: float32's answers; int8: one
  8-bit pass, as llama.cpp and CTranslate2 take their activations);
- llama.cpp: `llama-bench -p PROMPT -n 0 -r 3` on the same GGUF (`make bench-peers` builds it;
  llama.cpp 0.3.36's AMX kernels crash on some Xeons: build it without them there, issue 21);
- CTranslate2 int8 (`ctranslate2`, a model directory converted from the same weights by
  benchmarks/build_ct2.py: `--ct2 DIR`, default build/peers/smollm2-ct2-int8): the same ids,
  `generate_batch(max_length=1)` - the prompt's forward pass and one decode step;
- arlm's default path at batch --batch: that many prompts of 32-64 tokens, 64 new tokens each,
  aggregate tokens/s over the wall clock (prefill included);
- with --ttft N: time to first token of an N-token prompt (token ids) through `arlm serve` (with
  each --matmul-path of --ttft-paths), streamed, a fresh prompt each time (no prefix cache hit),
  beside llama.cpp's `llama-server` where its binary is found.

Then torch's own peak on the model's prefill shapes (M = --prompt rows against each linear's
weights: q/k/v, output, gate/up, down): float32 and bfloat16 `torch.mm` and int8
`torch._int_mm` (oneDNN: AMX tiles where the CPU has them), as GFLOP/s (2 per multiply-add).
arlm's effective rate is 2 x its matrix multiply-adds per token x tokens/s, against the peak of
the precision its path multiplies in (vnni and avx2: int8; bf16; float32). The CPU's model and
flags are printed with the figures.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_args import positive_int  # noqa: E402
from shared import cpu_line  # noqa: E402

PATHS = ("vnni", "avx2", "bf16", "float32")
PRECISION = {"vnni": "int8", "avx2": "int8", "bf16": "bf16", "float32": "float32"}
CT2_DIR = ROOT / "build/peers/smollm2-ct2-int8"


def prompt_ids(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1000, 20000) for _ in range(n)]


def layer_shapes(cfg) -> list[tuple[int, int]]:
    """(K, N) of one layer's matrices as arlm multiplies them: q/k/v, output, gate/up, down."""
    d, hd = cfg.d_model, cfg.head_dim
    return [(d, (cfg.n_head + 2 * cfg.n_kv_heads) * hd), (cfg.n_head * hd, d), (d, 2 * cfg.d_ff), (cfg.d_ff, d)]


# -- workers: each runs in its own process and prints one JSON line ---------------------------------

def worker_arlm(path: str, activations: str, prompt: int, threads: int) -> dict:
    sys.path.insert(0, str(ROOT / "src"))
    from arlm.runtime import runtime
    from arlm.llm import LLM
    from arlm.sampling import SamplingParams

    runtime().threads.pin(threads)
    llm = LLM.load("smollm2", matmul_path=path, activations=activations)
    ids = prompt_ids(prompt, 0)
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([ids], one)  # warm-up
    rates = [llm.generate([ids], one)[0].stats.prefill_tokens_per_s for _ in range(3)]
    return {"tokens_per_s": statistics.median(rates), "path": llm.matmul_path, "isa": llm.matmul_isa,
            "macs_per_token": sum(k * n for k, n in layer_shapes(llm.model.config)) * llm.model.config.n_layer}


def worker_batch(batch: int, threads: int) -> dict:
    sys.path.insert(0, str(ROOT / "src"))
    from arlm.runtime import runtime
    from arlm.llm import LLM
    from arlm.sampling import SamplingParams

    runtime().threads.pin(threads)
    llm = LLM.load("smollm2")
    prompts = [prompt_ids(32 + (i * 7) % 33, 100 + i) for i in range(batch)]
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    out = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": sum(len(c.token_ids) for c in out) / seconds, "path": llm.matmul_path}


def worker_ct2(model_dir: str, prompt: int, threads: int) -> dict:
    import ctranslate2

    vocab = json.loads((Path(model_dir) / "vocabulary.json").read_text())  # token strings in id order
    tokens = [vocab[i] for i in prompt_ids(prompt, 0)]
    gen = ctranslate2.Generator(model_dir, device="cpu", compute_type="int8", intra_threads=threads)

    def once() -> float:
        t0 = time.perf_counter()
        gen.generate_batch([tokens], max_length=1, include_prompt_in_result=False, beam_size=1)
        return prompt / (time.perf_counter() - t0)

    once()
    return {"tokens_per_s": statistics.median(once() for _ in range(3))}


def worker_peaks(prompt: int, threads: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    from arlm.loading import load_model

    torch.set_num_threads(threads)
    shapes = layer_shapes(load_model("smollm2", quantized=True).model.config)
    flops = sum(2 * prompt * k * n for k, n in shapes)
    out = {}
    for name in ("float32", "bf16", "int8"):
        if name == "int8":
            ops = [(torch.randint(-128, 127, (prompt, k), dtype=torch.int8),
                    torch.randint(-128, 127, (k, n), dtype=torch.int8)) for k, n in shapes]
            mm = torch._int_mm
        else:
            dtype = torch.float32 if name == "float32" else torch.bfloat16
            ops = [(torch.randn(prompt, k).to(dtype), torch.randn(k, n).to(dtype)) for k, n in shapes]
            mm = torch.mm
        for a, b in ops:
            mm(a, b)
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            for a, b in ops:
                mm(a, b)
            times.append(time.perf_counter() - t0)
        out[name] = flops / statistics.median(times) / 1e9
    return out


def run_worker(*args: str, timeout: float = 900) -> dict | None:
    r = subprocess.run([sys.executable, __file__, "--worker", *args], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    if r.returncode != 0:
        print(f"  ({' '.join(args)} failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode})")
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- peers ------------------------------------------------------------------------------------------

def gguf_path() -> str:
    sys.path.insert(0, str(ROOT / "src"))
    from arlm.loading import resolve_model_path

    return str(resolve_model_path("smollm2"))


def llama_bench(binary: str, prompt: int, threads: int) -> float | None:
    r = subprocess.run([binary, "-m", gguf_path(), "-p", str(prompt), "-n", "0", "-r", "3", "-t", str(threads),
                        "-o", "json"], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        print(f"  (llama-bench failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode})")
        return None
    return float(json.loads(r.stdout)[0]["avg_ts"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ttft(url: str, n: int, seeds: range, model: str) -> float:
    """Median seconds to the first streamed token of an n-token prompt (token ids), fresh each time."""
    import httpx

    times: list[float] = []
    for seed in seeds:
        body = {"model": model, "prompt": prompt_ids(n, seed), "max_tokens": 1, "temperature": 0, "stream": True}
        t0 = time.perf_counter()
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    times.append(time.perf_counter() - t0)
                    break
    if not times:
        raise RuntimeError(f"{url} streamed no token")
    return statistics.median(times)


def serve_ttft(cmd: list[str], port: int, n: int, rounds: int, model: str) -> float | None:
    import httpx
    from serve import wait_healthy

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, proc)
        except RuntimeError as e:
            print(f"  ({Path(cmd[0]).name} {cmd[1:3]}: {e})")
            return None
        try:
            ttft(url, 64, range(900, 901), model)  # warm-up
            return ttft(url, n, range(1000, 1000 + rounds), model)
        except (httpx.HTTPError, RuntimeError) as e:
            print(f"  ({Path(cmd[0]).name}: {e})")
            return None
    finally:
        proc.kill()
        proc.wait()


# -- main -------------------------------------------------------------------------------------------

def median_or_none(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1)
    ap.add_argument("--prompt", type=positive_int, default=512, help="prefill length (tokens)")
    ap.add_argument("--paths", default="all", help="arlm matrix paths, comma-separated (default: all it runs here)")
    ap.add_argument("--activations", default="int8x2,int8", help="the integer paths' activation modes")
    ap.add_argument("--batch", type=int, default=32, help="the large-batch case's rows (0: skip)")
    ap.add_argument("--ttft", type=int, default=0, help="time to first token of a prompt this long via serve (0: skip)")
    ap.add_argument("--ttft-paths", default="auto", help="arlm serve's --matmul-path for --ttft, comma-separated")
    ap.add_argument("--llama-bench", default=None, help="llama-bench binary (default: build/llama.cpp/bin)")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: build/llama.cpp/bin)")
    ap.add_argument("--ct2", default=str(CT2_DIR), help="CTranslate2 int8 model directory")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        kind, *rest = args.worker
        fn = {"arlm": worker_arlm, "batch": worker_batch, "ct2": worker_ct2, "peaks": worker_peaks}[kind]
        print(json.dumps(fn(*[int(v) if v.isdigit() else v for v in rest])))
        return 0

    sys.path.insert(0, str(ROOT / "src"))
    from arlm import kernels

    paths = [p for p in (PATHS if args.paths == "all" else args.paths.split(","))]
    runnable = [p for p in paths if kernels.matmul_path_error(p) is None]
    for p in sorted(set(paths) - set(runnable), key=paths.index):
        print(f"arlm --matmul-path {p}: skipped ({kernels.matmul_path_error(p)})")
    bench = args.llama_bench or shutil.which("llama-bench") or str(ROOT / "build/llama.cpp/bin/llama-bench")
    bench = bench if Path(bench).exists() else None
    try:
        import ctranslate2  # noqa: F401
        ct2 = args.ct2 if Path(args.ct2, "model.bin").exists() else None
        if ct2 is None:
            print(f"CTranslate2: skipped (no converted model in {args.ct2}: benchmarks/build_ct2.py)")
    except ImportError:
        ct2 = None
        print("CTranslate2: skipped (pip install ctranslate2==4.8.5)")
    if bench is None:
        print("llama.cpp: skipped (no llama-bench; `make bench-peers` builds it)")
    cpu = cpu_line()
    print(f"CPU: {cpu}; {args.threads} threads; prompt {args.prompt} tokens; {args.rounds} rounds")

    contenders = [(p, a) for p in runnable for a in (args.activations.split(",") if p in ("vnni", "avx2")
                                                      else ["int8x2"])]
    name = {c: f"arlm-{c[0]}" + ("" if c[1] == "int8x2" else f"-{c[1]}") for c in contenders}
    results: dict[str, list] = {name[c]: [] for c in contenders}
    results.update({"llama.cpp": [], "ctranslate2-int8": [], "batch": [], "peaks": []})
    info: dict[str, dict] = {}
    for rnd in range(args.rounds):
        for c in contenders:
            r = run_worker("arlm", c[0], c[1], str(args.prompt), str(args.threads))
            if r:
                results[name[c]].append(r["tokens_per_s"])
                info[name[c]] = r
        if bench:
            results["llama.cpp"].append(llama_bench(bench, args.prompt, args.threads))
        if ct2:
            r = run_worker("ct2", ct2, str(args.prompt), str(args.threads))
            results["ctranslate2-int8"].append(r and r["tokens_per_s"])
        if args.batch:
            r = run_worker("batch", str(args.batch), str(args.threads))
            results["batch"].append(r and r["tokens_per_s"])
        r = run_worker("peaks", str(args.prompt), str(args.threads))
        if r:
            results["peaks"].append(r)
        print(f"round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in results.items()
                                               if v and isinstance(v[-1], float)), flush=True)

    peaks = {k: statistics.median(r[k] for r in results["peaks"]) for k in ("float32", "bf16", "int8")} \
        if results["peaks"] else {}
    llama, ct = median_or_none(results["llama.cpp"]), median_or_none(results["ctranslate2-int8"])
    print(f"\nprefill of {args.prompt} tokens, tokens/s (medians of {args.rounds} rounds; CPU: {cpu}):")
    if peaks:
        print("torch's own peak on the same shapes, GFLOP/s: " + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()))
    summary: dict = {"cpu": cpu, "threads": args.threads, "prompt": args.prompt, "rounds": args.rounds,
                     "peaks_gflops": peaks, "llama.cpp": llama, "ctranslate2-int8": ct, "arlm": {}}
    for c in contenders:
        key, p = name[c], c[0]
        tps = median_or_none(results[key])
        if tps is None:
            continue
        macs = info[key]["macs_per_token"]
        eff = 2 * macs * tps / 1e9
        peak = peaks.get(PRECISION[p])
        line = f"  {key:17s} ({info[key]['isa']}): {tps:7.0f}  = {eff:.0f} GFLOP/s effective"
        if peak:
            line += f", {eff / peak:.0%} of torch's {PRECISION[p]} peak"
        if llama:
            line += f" | {tps / llama:.2f}x llama.cpp"
        if ct:
            line += f" | {tps / ct:.2f}x CTranslate2 int8"
        print(line)
        summary["arlm"][key] = {"tokens_per_s": tps, "isa": info[key]["isa"], "effective_gflops": eff,
                                "fraction_of_peak": eff / peak if peak else None, "runs": results[key]}
    if llama:
        print(f"  llama.cpp llama-bench -p {args.prompt}: {llama:7.0f}  (runs {results['llama.cpp']})")
    if ct:
        print(f"  CTranslate2 int8: {ct:7.0f}  (runs {results['ctranslate2-int8']})")
    batch = median_or_none(results["batch"])
    if batch:
        print(f"batch {args.batch} x 64 new tokens, arlm default path: {batch:.0f} tokens/s aggregate")
        summary["batch"] = {"rows": args.batch, "tokens_per_s": batch}
    if args.ttft:
        t_paths = {}
        for path in args.ttft_paths.split(","):
            port = free_port()
            t_paths[path] = serve_ttft([sys.executable, "-m", "arlm", "serve", "--port", str(port), "--threads",
                                        str(args.threads), "--matmul-path", path], port, args.ttft, 3, "smollm2")
        t_arlm = t_paths[args.ttft_paths.split(",")[0]]
        server = args.llama_server or shutil.which("llama-server") or str(ROOT / "build/llama.cpp/bin/llama-server")
        t_llama = None
        if Path(server).exists():
            port = free_port()
            t_llama = serve_ttft([server, "-m", gguf_path(), "--port", str(port), "-t", str(args.threads),
                                  "-c", str(max(4096, 2 * args.ttft)), "--no-webui"], port, args.ttft, 3, "smollm2")
        else:
            print("llama-server: skipped (no binary; `make bench-peers` builds it)")
        print(f"time to first token, {args.ttft}-token prompt via the server: "
              + ", ".join(f"arlm serve --matmul-path {p} {t * 1e3 if t else float('nan'):.0f} ms"
                          for p, t in t_paths.items())
              + (f", llama-server {t_llama * 1e3:.0f} ms ({t_llama / t_arlm:.2f}x arlm's first)" if t_llama and t_arlm
                 else ""))
        summary["ttft"] = {"prompt": args.ttft, "arlm_s": t_paths, "llama_server_s": t_llama}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(args.json.suffix + ".tmp")
        tmp.write_text(json.dumps(summary, indent=1))
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
