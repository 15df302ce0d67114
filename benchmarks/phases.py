"""Where a decode step's time goes: wall time per pass of arlm's native step, by batch and context.

    .venv/bin/python benchmarks/phases.py [--model smollm2|PATH.gguf] [--threads 2] [--kv-dtype int8]
        [--cases 1x8000] [--prefill 512] [--json build/phases.json]

Runs a CPU model (default `LLM.load("smollm2")`: 4-bit layers, Q8_0 head, 8-bit activations,
float16 KV cache, or --kv-dtype's: a quantized cache holds random rows quantized as the kernels
write them; --model any other name or GGUF file, e.g. benchmarks/make_gguf.py's shapes) through the native decode step the engine runs for a static batch (the model
runner's `NativeLlama`: embed, `decode`, `head`) at a fixed position, with the native step's own
per-pass timer on (`torch.ops.arlm.decode_profile`): norms, the q/k/v, output, gate/up and down
linears, attention (RoPE, the cache write and the attention itself), SiLU, and the final
norm + LM head. For each linear it prints the rate at which it streams its weights (GB/s: the
bytes its layers hold / its time; the memory-bound figure at batch 1) and the multiply-accumulate
rate (GMAC/s), and for attention the rate at which it reads the cached K/V (GB/s); "other" is the rest of the step (embedding
lookup, op dispatch). Each case is the best of --repeat runs of --steps steps.

The timer is in every build of the kernels, off until this switches it on: the step it times is
the one the engine runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from arlm.kv_cache import KVCache, kv_dtype_name, quantize_rows  # noqa: E402
from arlm.llm import LLM  # noqa: E402
from bench_args import SMOLLM2_MAX_SEQ_LEN, positive_int  # noqa: E402

PHASES = ["norm1", "qkv", "attention", "wo", "norm2", "gate_up", "silu", "down", "head"]


def weight_bytes_of(module: torch.nn.Module) -> int:
    """Bytes a module's weights hold (every parameter and buffer, each once)."""
    tensors = {id(t): t for t in list(module.parameters()) + list(module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def run_case(llm: LLM, batch: int, context: int, steps: int, repeat: int) -> dict:
    """One BATCHxCONTEXT case."""
    model, cfg = llm.model, llm.model.config
    native = llm.runner.native
    if native is None or llm.runner.decode_fn is not None:
        raise SystemExit("phases.py: the native step does not apply here (it needs the native kernels on CPU)")
    cache = KVCache.contiguous(cfg, batch, context + 1, dtype=llm.kv_dtype)
    if cache.quantized:  # random rows, quantized as the kernels write them
        for layer in range(cfg.n_layer):
            shape = (batch, cfg.n_kv_heads, context + 1, cfg.head_dim)
            cache.k[layer] = quantize_rows(torch.randn(shape), cache.dtype)
            cache.v[layer] = quantize_rows(torch.randn(shape), cache.dtype, value=True)
    else:
        cache.k.normal_()
        cache.v.normal_()
    tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=torch.Generator().manual_seed(0))
    pos = torch.full((batch,), context)
    # The runner's rows step (ModelRunner._decode_rows): embeddings, the layer stack and the head
    # into buffers kept from step to step.
    x, logits = torch.empty(batch, cfg.d_model), torch.empty(batch, cfg.vocab_size)

    def step():
        native.embed(tokens, out=x)
        native.decode(x, cache.k, cache.v, pos, context + 1, cache.format)
        native.head(x, logits)

    best = None
    with torch.inference_mode():
        for _ in range(3):
            step()
        for _ in range(repeat):
            torch.ops.arlm.decode_profile(True)
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            total = (time.perf_counter() - t0) / steps
            phases = (torch.ops.arlm.decode_profile(False) / steps).tolist()
            if best is None or total < best[0]:
                best = (total, phases)
    total, phases = best
    d, hd, H, Hkv, L = cfg.d_model, cfg.head_dim, cfg.n_head, cfg.n_kv_heads, cfg.n_layer
    dff = model.blocks[0].mlp.down.in_features
    macs = {"qkv": (H + 2 * Hkv) * hd * d * L, "wo": d * H * hd * L, "gate_up": 2 * dff * d * L,
            "down": d * dff * L, "head": cfg.vocab_size * d}
    kv_bytes = cache.bytes_per_token * (context + 1) * batch
    held = {"qkv": [b.attn.wqkv for b in model.blocks], "wo": [b.attn.wo for b in model.blocks],
            "gate_up": [b.mlp.gate_up for b in model.blocks], "down": [b.mlp.down for b in model.blocks],
            "head": [model.lm_head]}
    weight_bytes = {name: sum(weight_bytes_of(m) for m in layers) for name, layers in held.items()}
    out = {"batch": batch, "context": context, "step_ms": 1e3 * total,
           "phases_ms": {name: 1e3 * t for name, t in zip(PHASES, phases)},
           "other_ms": 1e3 * (total - sum(phases))}
    def rate(amount: float, name: str) -> float:  # a pass the step did not run natively reads 0 s
        seconds = phases[PHASES.index(name)]
        return amount / seconds / 1e9 if seconds > 0 else float("nan")

    out["gmac_per_s"] = {name: rate(batch * n, name) for name, n in macs.items()}
    out["weight_bytes"] = weight_bytes
    out["weights_gb_per_s"] = {name: rate(n, name) for name, n in weight_bytes.items()}
    out["attention_kv_gb_per_s"] = rate(kv_bytes, "attention")
    return out


def prefill_passes(llm: LLM, tokens: int, repeat: int) -> dict:
    """A prompt of `tokens` random ids through the engine's first step (its prefill), the native
    timer on: ms per pass, best of `repeat` by the whole step."""
    from run import engine_run  # (benchmarks/run.py)

    from arlm.sampling import SamplingParams

    ids = torch.randint(0, llm.model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    best = None
    for _ in range(repeat + 1):  # (the first: the kernels' scratch for this many rows)
        torch.ops.arlm.decode_profile(True)
        r = engine_run(llm, [ids], SamplingParams(max_new_tokens=1), steps=1)
        phases = torch.ops.arlm.decode_profile(False).tolist()
        if best is None or r["prefill_s"] < best[0]:
            best = (r["prefill_s"], phases)
    total, phases = best
    return {"tokens": tokens, "prefill_ms": 1e3 * total, "tokens_per_s": tokens / total,
            "phases_ms": {name: 1e3 * t for name, t in zip(PHASES, phases)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="a model name or GGUF file (default: %(default)s)")
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--steps", type=positive_int, default=40)
    ap.add_argument("--repeat", type=positive_int, default=5)
    ap.add_argument("--kv-dtype", default="auto", choices=("auto", "float32", "float16", "int8", "int4"),
                    help="KV cache dtype (default: what LLM.load picks, float16 on this path)")
    ap.add_argument("--cases", default="1x32,1x512,8x32,32x32",
                    help="comma-separated BATCHxCONTEXT cases (default: %(default)s)")
    ap.add_argument("--prefill", type=int, default=0,
                    help="also time a prompt of this many tokens through the engine's first step, by pass")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = ap.parse_args()
    if args.prefill < 0:
        ap.error(f"--prefill: expected a token count >= 0, got {args.prefill}")
    try:
        cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
        if any(len(c) != 2 or min(c) < 1 for c in cases):
            raise ValueError
    except ValueError:
        ap.error(f"--cases: expected BATCHxCONTEXT[,...] with positive integers, got {args.cases!r}")
    def check_window(window: int) -> None:  # the cache holds the context and the step's token
        if max(c for _, c in cases) >= window:
            ap.error(f"--cases: CONTEXT must be below the model's window of {window} tokens "
                     f"(its cache holds CONTEXT + 1), got {args.cases!r}")

    if args.model == "smollm2":
        check_window(SMOLLM2_MAX_SEQ_LEN)  # before the load
    torch.set_num_threads(args.threads)
    llm = LLM.load(args.model, kv_dtype=args.kv_dtype)
    check_window(llm.model.config.max_seq_len)
    print(f"arlm {llm.quantization} weights, KV cache {kv_dtype_name(llm.kv_dtype)}, "
          f"{args.threads} threads; ms per step (best of {args.repeat} x {args.steps} steps)")
    results = [run_case(llm, b, c, args.steps, args.repeat) for b, c in cases]
    names = [f"b{r['batch']} ctx{r['context']}" for r in results]
    print(f"{'pass':10s}" + "".join(f"{n:>14s}" for n in names))
    for name in PHASES:
        print(f"{name:10s}" + "".join(f"{r['phases_ms'][name]:14.2f}" for r in results))
    print(f"{'other':10s}" + "".join(f"{r['other_ms']:14.2f}" for r in results))
    print(f"{'step':10s}" + "".join(f"{r['step_ms']:14.2f}" for r in results))
    print("weights GB/s")
    for name in ("qkv", "wo", "gate_up", "down", "head"):
        print(f"{name:10s}" + "".join(f"{r['weights_gb_per_s'][name]:14.1f}" for r in results))
    print("GMAC/s")
    for name in ("qkv", "wo", "gate_up", "down", "head"):
        print(f"{name:10s}" + "".join(f"{r['gmac_per_s'][name]:14.1f}" for r in results))
    print(f"{'K/V GB/s':10s}" + "".join(f"{r['attention_kv_gb_per_s']:14.1f}" for r in results))
    prefill = prefill_passes(llm, args.prefill, args.repeat) if args.prefill else None
    if prefill:
        print(f"prefill of {args.prefill} tokens: {prefill['prefill_ms']:.0f} ms ({prefill['tokens_per_s']:.1f} tok/s); "
              "ms by pass: " + " ".join(f"{n} {t:.0f}" for n, t in prefill["phases_ms"].items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": args.threads, "kv_dtype": kv_dtype_name(llm.kv_dtype),
                                         "cases": results, "prefill": prefill}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
