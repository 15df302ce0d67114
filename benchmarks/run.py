"""The decode/prefill benchmark harness: arlm beside its peers on the same SmolLM2 weights, one run.

    .venv/bin/python benchmarks/run.py [--threads 2] [--json out.json] [--skip-hf]

Measures this machine's memory read bandwidth and fp32 matmul peak, then for arlm (int8 default
path and fp32 path), HF transformers (fp32) and, when `llama_cpp` is importable (`make
bench-peers`), llama.cpp on the same GGUF with the same thread count:
  decode tokens/s at batch 1 (short prompt, and 512 tokens of context), batch 8, batch 32;
  prefill tokens/s for a 512-token prompt (time to first token, as a user sees it).
Prints each ratio arlm/peer and the fraction of the bandwidth ceiling each decode reaches
(bytes of weights + KV read per step / step time / measured bandwidth), and the most batch 32
could gain over batch 1 if only its linear layers cost time (their share of a batch-32 step, from
the native step's pass timer: benchmarks/phases.py).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import arlm  # noqa: E402

if __name__ == "__main__":  # (other benchmarks import this module after torch)
    arlm.prefer_huge_pages()  # as the arlm command does: huge pages for weights and the KV cache, before torch loads

import torch  # noqa: E402
sys.path.insert(0, str(ROOT / "benchmarks"))

from arlm.llm import LLM  # noqa: E402
from arlm.loading import resolve_model_path  # noqa: E402
from arlm.quant import weight_bytes  # noqa: E402
from arlm.sampling import SamplingParams  # noqa: E402
from bench_args import SMOLLM2_MAX_SEQ_LEN, int_range, positive_int  # noqa: E402

LLAMA_CPP_N_CTX = 1024  # llama.cpp's context: the 512-token prompt and its decode tokens must fit


def machine() -> dict:
    model = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpu": model, "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version()}


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def memory_bandwidth_gbs() -> float:
    """Read bandwidth: sum a 1 GiB float32 tensor (read once, no writes)."""
    x = torch.ones(2**28)
    x.sum()
    return x.numel() * 4 / best_of(lambda: x.sum(), 5) / 1e9


def matmul_gflops(n: int = 2048) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    return 2 * n**3 / best_of(lambda: a @ b, 5) / 1e9


def prompt_ids(llm: LLM, n: int, seed: int) -> list[int]:
    """n token ids of real text (tiny Shakespeare), a different window per seed."""
    text = (ROOT / "data" / "tinyshakespeare.txt").read_text()
    ids = llm.tokenizer.encode(text[seed * 5000: seed * 5000 + 8 * n + 400])
    return ids[:n]


def engine_run(llm: LLM, prompts: list[list[int]], params: SamplingParams, steps: int | None = None) -> dict:
    """One static batch through `llm.engine`, the engine `LLM.generate` runs (a contiguous cache
    sized for the batch, the same runner), stepped here so that prefill and decode are timed
    apart: the first step computes every prompt (and samples each one's first token), every
    later step decodes one token per running request. `steps`: stop after that many steps."""
    engine = llm.engine
    reqs = [engine.add_request(p, params) for p in prompts]
    prefill_s, decode_s, decode_steps, decode_tokens = 0.0, 0.0, 0, 0
    try:
        for i in itertools.count():
            if all(r.finished for r in reqs) or i == steps:
                break
            engine.step()
            step = engine.last_step
            if i == 0:
                if step.prompt_tokens != sum(map(len, prompts)):
                    raise RuntimeError(f"the first step computed {step.prompt_tokens} prompt tokens, not every prompt")
                prefill_s = step.seconds
            else:
                if step.prompt_tokens:
                    raise RuntimeError("a decode step computed prompt tokens")
                decode_s += step.seconds
                decode_steps += 1
                decode_tokens += step.sampled
    finally:
        for r in reqs:
            engine.abort(r.request_id)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "decode_steps": decode_steps,
            "decode_tokens": decode_tokens, "kv_cache_bytes": engine.cache.nbytes,
            "cache_capacity": engine.cache.capacity}


def arlm_decode(llm: LLM, prompts: list[list[int]], new_tokens: int, repeat: int = 1) -> dict:
    """Best of `repeat` runs (decode and prefill each at their fastest)."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    # Warm-up: the same batch (the cache it is sized for, the prefill's shapes) for a prefill and
    # one decode step; the timed runs then reuse that cache.
    engine_run(llm, prompts, params, steps=2)
    runs = [engine_run(llm, prompts, params) for _ in range(repeat)]
    best = min(runs, key=lambda r: r["decode_s"] / r["decode_steps"])
    prefill_s = min(r["prefill_s"] for r in runs)
    # K/V bytes a decode step reads on average: every row's context, the prompt and half the new tokens.
    kv_per_step = best["kv_cache_bytes"] / best["cache_capacity"] * (len(prompts[0]) + new_tokens / 2)
    return {"tokens_per_s": best["decode_tokens"] / best["decode_s"], "step_s": best["decode_s"] / best["decode_steps"],
            "prefill_tokens_per_s": sum(map(len, prompts)) / prefill_s, "kv_bytes_per_step": kv_per_step}


def linears_share_s(llm: LLM, rows: int) -> float | None:
    """Seconds of a `rows`-row native decode step (context 32) spent in its linear layers (q/k/v,
    output, gate/up, down, LM head), from the step's own per-pass timer (benchmarks/phases.py);
    None where the native step does not run."""
    from phases import run_case

    try:
        r = run_case(llm, rows, 32, steps=20, repeat=3)
    except SystemExit:
        return None
    return sum(r["phases_ms"][p] for p in ("qkv", "wo", "gate_up", "down", "head")) / 1e3


def hf_load():
    from transformers import AutoModelForCausalLM

    path = resolve_model_path("smollm2")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def hf_decode(model, prompts: list[list[int]], new_tokens: int, repeat: int = 1) -> dict:
    """HF generate, greedy, EOS off; decode time = total - time to first token."""
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=mask)
    with torch.inference_mode():
        model.generate(ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=4, min_new_tokens=4,
                       do_sample=False, eos_token_id=None, pad_token_id=0)
        ttft = best_of(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw), repeat)
        total = best_of(lambda: model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw),
                        repeat)
    step = (total - ttft) / (new_tokens - 1)
    return {"tokens_per_s": len(prompts) / step, "step_s": step,
            "prefill_tokens_per_s": ids.numel() / ttft}


def llama_cpp_decode(gguf: Path, prompt: list[int], new_tokens: int, threads: int, repeat: int = 1) -> dict | None:
    try:
        from llama_cpp import Llama
    except (ImportError, OSError):  # not installed, or its shared library not found
        return None
    llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=LLAMA_CPP_N_CTX,
                n_batch=512, verbose=False)
    llm.eval(prompt[:8])
    prefill_s, decode_s = [], []
    for _ in range(repeat):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        tok = llm.sample(temp=0.0)
        t1 = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval([tok])
            tok = llm.sample(temp=0.0)
        t2 = time.perf_counter()
        prefill_s.append(t1 - t0)
        decode_s.append(t2 - t1)
    return {"tokens_per_s": (new_tokens - 1) / min(decode_s), "step_s": min(decode_s) / (new_tokens - 1),
            "prefill_tokens_per_s": len(prompt) / min(prefill_s)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Decode rates are (n - 1) tokens over the steps after the first, so n >= 2; the largest n
    # still fits its prompt (512 or 16 tokens) in llama.cpp's context and in SmolLM2's window.
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--new-tokens", type=int_range(2, LLAMA_CPP_N_CTX - 512 + 1), default=128,
                    help="decode tokens per run at batch 1")
    ap.add_argument("--batch-new-tokens", type=int_range(2, SMOLLM2_MAX_SEQ_LEN - 16), default=32,
                    help="decode tokens per run at batch 8/32")
    ap.add_argument("--repeat", type=positive_int, default=3, help="runs per case; each engine's best is reported")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res: dict = {"machine": machine(), "load_average": os.getloadavg()}
    print(f"machine: {res['machine']}  load average: {res['load_average']}")
    res["memory_read_gbs"] = memory_bandwidth_gbs()
    res["matmul_fp32_gflops"] = matmul_gflops()
    print(f"memory read bandwidth {res['memory_read_gbs']:.1f} GB/s, fp32 matmul {res['matmul_fp32_gflops']:.0f} GFLOP/s")

    base = LLM.load("smollm2", quantize=None)
    fast = LLM(base.loaded)
    fast.model = copy.deepcopy(base.model)
    fast.configure(quantize="auto")
    engines = {f"arlm-{fast.quantization or 'fp32'}": fast, "arlm-fp32": base}
    short = [prompt_ids(base, 16, s) for s in range(32)]
    long = [prompt_ids(base, 512, 0)]
    cases = {"b1_short": (short[:1], args.new_tokens), "b1_ctx512": (long, args.new_tokens),
             "b8": (short[:8], args.batch_new_tokens), "b32": (short[:32], args.batch_new_tokens)}

    figures: dict[str, dict] = {}
    for name, llm in engines.items():
        wbytes = weight_bytes(llm.model)
        for case, (prompts, n) in cases.items():
            r = arlm_decode(llm, prompts, n, args.repeat)
            r["bandwidth_fraction"] = (wbytes + r["kv_bytes_per_step"]) / r["step_s"] / (res["memory_read_gbs"] * 1e9)
            figures[f"{name}/{case}"] = r
            print(f"{name:10s} {case:10s} decode {r['tokens_per_s']:7.1f} tok/s  step {r['step_s'] * 1e3:6.1f} ms  "
                  f"{r['bandwidth_fraction'] * 100:5.1f}% of bandwidth ceiling")
        figures[f"{name}/prefill512"] = {"tokens_per_s": figures[f"{name}/b1_ctx512"]["prefill_tokens_per_s"]}
        print(f"{name:10s} prefill512 {figures[f'{name}/prefill512']['tokens_per_s']:7.1f} tok/s")

    peers: dict[str, dict] = {}
    gguf = resolve_model_path("smollm2")
    for case in ("b1_short", "b1_ctx512"):
        prompts, n = cases[case]
        r = llama_cpp_decode(gguf, prompts[0], n, args.threads, args.repeat)
        if r is None:
            print("llama.cpp: llama_cpp not importable (make bench-peers builds it; `make bench` points "
                  "LLAMA_CPP_LIB_PATH at build/llama.cpp/bin); skipped")
            break
        peers[f"llama.cpp/{case}"] = r
        print(f"llama.cpp  {case:10s} decode {r['tokens_per_s']:7.1f} tok/s  prefill {r['prefill_tokens_per_s']:.1f} tok/s")
    if "llama.cpp/b1_ctx512" in peers:
        peers["llama.cpp/prefill512"] = {"tokens_per_s": peers["llama.cpp/b1_ctx512"]["prefill_tokens_per_s"]}
    if not args.skip_hf:
        hf = hf_load()
        for case, (prompts, n) in cases.items():
            r = hf_decode(hf, prompts, n, args.repeat)
            peers[f"hf-fp32/{case}"] = r
            print(f"hf-fp32    {case:10s} decode {r['tokens_per_s']:7.1f} tok/s")
        peers["hf-fp32/prefill512"] = {"tokens_per_s": peers["hf-fp32/b1_ctx512"]["prefill_tokens_per_s"]}
        print(f"hf-fp32    prefill512 {peers['hf-fp32/prefill512']['tokens_per_s']:7.1f} tok/s")

    ratios: dict[str, float] = {}
    for key, r in figures.items():
        engine, case = key.split("/")
        for peer in ("hf-fp32", "llama.cpp"):
            if f"{peer}/{case}" in peers:
                ratios[f"{engine}/{peer}/{case}"] = r["tokens_per_s"] / peers[f"{peer}/{case}"]["tokens_per_s"]
    default = next(iter(engines))
    ratios[f"{default}/b32_over_b1"] = figures[f"{default}/b32"]["tokens_per_s"] / figures[f"{default}/b1_short"]["tokens_per_s"]
    # What batch 32 could reach at most against this run's batch 1: 32 rows a step, and a step no
    # faster than its linear layers (attention, norms, SiLU and sampling free).
    floor = linears_share_s(engines[default], 32)
    if floor:
        res["b32_linears_s"] = floor
        ratios[f"{default}/b32_over_b1_bound"] = 32 * figures[f"{default}/b1_short"]["step_s"] / floor
        print(f"\n{default}: batch 32's linear layers take {floor * 1e3:.1f} ms of a step; against this run's "
              f"batch-1 step ({figures[f'{default}/b1_short']['step_s'] * 1e3:.2f} ms) batch 32 could reach at "
              f"most {ratios[f'{default}/b32_over_b1_bound']:.2f}x batch 1's tokens/s with everything else free "
              f"(measured: {ratios[f'{default}/b32_over_b1']:.2f}x)")
    print("\nratios (arlm / peer; >1 means arlm is faster):")
    for k, v in ratios.items():
        print(f"  {k:40s} {v:6.2f}x")
    res.update(arlm=figures, peers=peers, ratios=ratios)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
