"""KV-cache formats side by side: decode speed at long context, arlm's caches beside llama.cpp's.

    LLAMA_CPP_LIB_PATH=$PWD/build/llama.cpp/bin .venv/bin/python benchmarks/kv_cache.py \
        [--contexts 512,2048,8000] [--batch 8] [--batch-context 2048] [--new-tokens 32] [--repeat 3]
        [--formats float32,float16,int8,int4] [--skip-llama-cpp | --llama-cpp-caches f16,q8_0,q4_0]
        [--json out.json]

SmolLM2-135M-Instruct on its default path (the GGUF's quantized weights, 8-bit activations taken
twice). A decode step streams every weight and the row's whole cache once, so past a few thousand
tokens the cache's bytes dominate; that is what the formats change.

Method, per context C (largest first): the first C tokens of tinyshakespeare are prefilled once
into a float32 cache; the float16 / int8 / int4 caches are that cache converted (rounded, or
quantized by `kv_cache.quantize_rows`, what the kernels write), so every format decodes after
the same prompt. Then, repeatedly and alternating between engines, `--new-tokens` greedy tokens
are decoded at position C through the native rows step (the engine's decode path for a static
batch: `NativeLlama.decode` + the head), each round overwriting the slots the previous one wrote.
Batch 8 at `--batch-context` copies that prefix into 8 rows. llama.cpp (when `make bench-peers`
built it) runs the same prompt with flash attention and its f16, q8_0 and q4_0 caches, decoding
at position C after truncating its cache there (llama-cpp-python's `n_tokens`); its binding runs
one sequence, so it has no batch-8 figure here. Medians of the rounds; ratios are against
arlm's float16 cache (the default) and llama.cpp's q8_0 cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import arlm  # noqa: E402

arlm.prefer_huge_pages()  # (as the arlm command does: huge pages for weights and the KV cache, before torch loads)

import torch  # noqa: E402
sys.path.insert(0, str(ROOT / "benchmarks"))

from arlm.kv_cache import KVCache, kv_dtype_name, parse_kv_dtype, quantize_rows  # noqa: E402
from arlm.llm import LLM  # noqa: E402
from arlm.loading import resolve_model_path  # noqa: E402
from bench_args import positive_int  # noqa: E402
from run import machine  # noqa: E402

LLAMA_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}  # GGML_TYPE_*


def convert(cache: KVCache, config, dtype, rows: int, length: int) -> KVCache:
    """A `dtype` cache of `rows` rows holding the first `length` slots of `cache`'s row 0."""
    out = KVCache.contiguous(config, rows, cache.capacity, dtype)
    k, v = cache.k[:, :1, :, :length].float(), cache.v[:, :1, :, :length].float()
    if out.quantized:
        k, v = quantize_rows(k, out.dtype), quantize_rows(v, out.dtype, value=True)
    out.k[:, :, :, :length] = k.to(out.k.dtype)
    out.v[:, :, :, :length] = v.to(out.v.dtype)
    return out


def arlm_round(llm: LLM, cache: KVCache, context: int, new_tokens: int, first: int) -> float:
    """Decode tokens/s (all rows) of `new_tokens` greedy steps at positions context.. of every row."""
    native, rows = llm.runner.native, cache.batch_size
    tok = torch.full((rows,), first, dtype=torch.long)
    x = torch.empty(rows, llm.model.config.d_model)
    logits = torch.empty(rows, llm.model.config.vocab_size)
    t0 = time.perf_counter()
    for s in range(new_tokens):
        pos = torch.full((rows,), context + s, dtype=torch.long)
        native.embed(tok, out=x)
        native.decode(x, cache.k, cache.v, pos, context + s + 1, cache.format)
        tok = native.head(x, logits).argmax(-1)
    return rows * new_tokens / (time.perf_counter() - t0)


def llama_cpp_engines(gguf: Path, prompt: list[int], threads: int, n_ctx: int, types: list[str]) -> dict:
    try:
        from llama_cpp import Llama
    except (ImportError, OSError):
        return {}
    engines = {}
    for name in types:
        t = LLAMA_TYPES[name]
        llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
                    flash_attn=True, type_k=t, type_v=t, verbose=False)
        t0 = time.perf_counter()
        llm.eval(prompt)
        print(f"  llama.cpp {name} cache: prefilled {len(prompt)} tokens in {time.perf_counter() - t0:.1f} s",
              flush=True)
        engines[f"llama.cpp {name}"] = llm
    return engines


def llama_round(llm, context: int, new_tokens: int, first: int) -> float:
    llm.n_tokens = context  # the next eval truncates its cache here
    tok = first
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        llm.eval([tok])
        tok = llm.sample(temp=0.0)
    return new_tokens / (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="512,2048,8000")
    p.add_argument("--batch", type=positive_int, default=8)
    p.add_argument("--batch-context", type=positive_int, default=2048)
    p.add_argument("--new-tokens", type=positive_int, default=32)
    p.add_argument("--repeat", type=positive_int, default=3)
    p.add_argument("--formats", default="float32,float16,int8,int4")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--skip-llama-cpp", action="store_true")
    p.add_argument("--llama-cpp-caches", default=",".join(LLAMA_TYPES),
                   help="llama.cpp's cache types to run (its q4_0 prefill of 8,000 tokens takes ~5 min)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    contexts = sorted({int(c) for c in args.contexts.split(",")}, reverse=True)
    formats = [parse_kv_dtype(f) for f in args.formats.split(",")]
    llama_types = [t for t in args.llama_cpp_caches.split(",") if t]
    if unknown := [t for t in llama_types if t not in LLAMA_TYPES]:
        p.error(f"--llama-cpp-caches: unknown {', '.join(unknown)} (expected some of {', '.join(LLAMA_TYPES)})")
    longest = max(contexts + [args.batch_context])
    res: dict = {"machine": machine(), "cpu_flags": cpu_flags(), "new_tokens": args.new_tokens,
                 "repeat": args.repeat, "results": []}
    print(f"machine: {res['machine']}\nCPU flags: {res['cpu_flags']}", flush=True)

    llm = LLM.load("smollm2")
    config = llm.model.config
    text = (ROOT.parent / "shared" / "data" / "tinyshakespeare.txt").read_text()
    prompt = llm.tokenizer.encode(text)[:longest]
    capacity = longest + args.new_tokens
    base = KVCache.contiguous(config, 1, capacity, torch.float32)
    t0 = time.perf_counter()
    with torch.inference_mode():
        logits = llm.runner.forward_flat(base, prompt, list(range(longest)), [0] * longest, [[0]], [longest - 1])
    first = int(logits.argmax(-1)[0])
    print(f"arlm: prefilled {longest} tokens into a float32 cache in {time.perf_counter() - t0:.1f} s", flush=True)
    caches = {kv_dtype_name(f): convert(base, config, f, 1, longest) for f in formats}
    batched = {kv_dtype_name(f): convert(base, config, f, args.batch, args.batch_context) for f in formats}
    del base
    peers = {} if args.skip_llama_cpp else llama_cpp_engines(resolve_model_path("smollm2"), prompt, args.threads,
                                                               capacity + 8, llama_types)

    def measure(label: str, cases: dict, rows: int, context: int) -> None:
        rates: dict[str, list[float]] = {name: [] for name in cases}
        with torch.inference_mode():
            for run in cases.values():  # warm-up: buffers, the threads
                run()
            for _ in range(args.repeat):
                for name, run in cases.items():
                    rates[name].append(run())
        med = {name: statistics.median(r) for name, r in rates.items()}
        ref, peer = med.get("float16"), med.get("llama.cpp q8_0")
        print(f"\n{label} (batch {rows}, context {context}): decode tokens/s, median of {args.repeat}")
        for name, m in med.items():
            vs = f"  {m / ref:5.2f}x float16" if ref and not name.startswith("llama") else ""
            vs += f"  {m / peer:5.2f}x llama.cpp q8_0" if peer and not name.startswith("llama") else ""
            bpt = (f"{caches[name].bytes_per_token:6d} B/token" if name in caches else
                   f"{'':6s}         ")
            print(f"  {name:16s} {m:8.1f}  {bpt}{vs}  (runs: {', '.join(f'{r:.1f}' for r in rates[name])})",
                  flush=True)
        res["results"].append({"batch": rows, "context": context, "tokens_per_s": med, "runs": rates})

    for context in contexts:
        cases = {name: (lambda c=c: arlm_round(llm, c, context, args.new_tokens, first)) for name, c in caches.items()}
        cases.update({name: (lambda e=e: llama_round(e, context, args.new_tokens, first)) for name, e in peers.items()})
        measure("batch 1", cases, 1, context)
    cases = {name: (lambda c=c: arlm_round(llm, c, args.batch_context, args.new_tokens, first))
             for name, c in batched.items()}
    measure(f"batch {args.batch}", cases, args.batch, args.batch_context)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


def cpu_flags() -> str:
    caps = getattr(torch.cpu, "get_capabilities", dict)()
    return " ".join(k for k, v in sorted(caps.items()) if v is True and k.startswith(("avx", "amx", "fma")))


if __name__ == "__main__":
    sys.exit(main())
