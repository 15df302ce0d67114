"""Issue-2 baseline: arlm beside HF transformers on the same SmolLM2-135M-Instruct weights, one run.

    .venv/bin/python benchmarks/decode.py [--threads 2] [--repeat 5] [--json out.json]

Both sides run float32 on the CPU with the same torch thread count, from the same GGUF file.
  prefill: one forward pass over a 512-token prompt, tokens/s. arlm: `prefill` into a KVCache;
    HF: `model(ids, use_cache=True, logits_to_keep=1)`, the pass its `generate` makes first.
  decode: batch 1, 128 new tokens, greedy, EOS ignored. arlm: `Generation`; HF: `generate` with
    its KV cache. Both are timed the same way, whole calls: (128 - 1) new tokens / (time for 128
    new tokens - time for 1), so the prompt's prefill and per-call setup cancel out.
Each side is warmed up once; each figure is the best of --repeat rounds that alternate arlm and HF
(so load from elsewhere on a shared machine hits both alike). Prints arlm/HF ratios and the load
average at the start and the end.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # HF's GGUF dequantization progress bar

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from arlm.generate import Generation, prefill  # noqa: E402
from arlm.kv_cache import KVCache  # noqa: E402
from arlm.loading import load_model, resolve_model_path  # noqa: E402
from arlm.sampling import SamplingParams  # noqa: E402
from bench_args import SMOLLM2_MAX_SEQ_LEN, int_range, positive_int  # noqa: E402

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a wooden screw press into a system that could "
        "produce books faster and more cheaply than scribes ever had. Within fifty years, presses were "
        "running in more than two hundred cities across Europe, and the number of books in circulation "
        "grew from thousands to millions. ")


def cpu_model() -> str:
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def best_times(fns: dict, repeat: int) -> dict:
    """Best wall time of each zero-argument fn over `repeat` rounds, after one warm-up call each.

    The rounds interleave the fns (a, b, a, b, ...) so that a load change on a shared machine
    hits arlm and HF alike and their ratio stays meaningful.
    """
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Decode is timed as (N - 1) tokens / (time for N - time for 1), so N >= 2; the short prompt
    # (under 16 tokens) and its N new tokens stay inside SmolLM2's window, as the long prompt does.
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--prompt-tokens", type=int_range(1, SMOLLM2_MAX_SEQ_LEN), default=512)
    ap.add_argument("--new-tokens", type=int_range(2, SMOLLM2_MAX_SEQ_LEN - 16), default=128)
    ap.add_argument("--repeat", type=positive_int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = resolve_model_path("smollm2")
    ours = load_model(str(path), dtype=torch.float32)
    model = ours.model
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    hf_gen = copy.deepcopy(hf.generation_config)
    hf_gen.eos_token_id, hf_gen.pad_token_id = None, 2  # EOS ignored, as arlm's ignore_eos

    long_ids = ours.tokenizer.encode(TEXT * (args.prompt_tokens // 60 + 2))[: args.prompt_tokens]
    assert len(long_ids) == args.prompt_tokens
    short_ids = ours.tokenizer.encode("The history of the printing press")
    P, N = args.prompt_tokens, args.new_tokens

    # -- prefill -------------------------------------------------------------------------------
    cache = KVCache.for_model(model.config, 1, P)
    tokens = torch.tensor([long_ids])
    pos, last = torch.arange(P)[None], torch.tensor([P - 1])

    def arlm_prefill():
        with torch.inference_mode():
            return prefill(model, cache, tokens, pos, last, kv_len=P)

    def hf_prefill():
        with torch.inference_mode():
            return hf(tokens, use_cache=True, logits_to_keep=1).logits

    diff = (arlm_prefill()[0] - hf_prefill()[0, -1]).abs().max().item()
    t = best_times({"arlm": arlm_prefill, "hf": hf_prefill}, args.repeat)
    t_arlm_prefill, t_hf_prefill = t["arlm"], t["hf"]

    # -- decode --------------------------------------------------------------------------------
    x = torch.tensor([short_ids])

    def arlm_generate(n: int) -> list[int]:
        gen = Generation(model, [short_ids], SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
        for _ in gen:
            pass
        return gen.completions[0]

    def hf_generate(n: int) -> list[int]:
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=torch.ones_like(x), generation_config=hf_gen, do_sample=False,
                              max_new_tokens=n, min_new_tokens=n)
        return out[0, len(short_ids):].tolist()

    hf_tokens = hf_generate(N)
    assert len(hf_tokens) == N
    same_tokens = arlm_generate(N) == hf_tokens
    t = best_times({("arlm", 1): lambda: arlm_generate(1), ("hf", 1): lambda: hf_generate(1),
                    ("arlm", N): lambda: arlm_generate(N), ("hf", N): lambda: hf_generate(N)}, args.repeat)
    t_arlm = {n: t[("arlm", n)] for n in (1, N)}
    t_hf = {n: t[("hf", n)] for n in (1, N)}

    fig = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "threads": torch.get_num_threads(),
                    "load_average_start": load_start, "load_average_end": os.getloadavg()},
        "model": f"{path.name} (dequantized to float32)",
        "prefill": {"prompt_tokens": P, "arlm_tokens_per_s": P / t_arlm_prefill, "hf_tokens_per_s": P / t_hf_prefill},
        "decode": {"batch": 1, "prompt_tokens": len(short_ids), "new_tokens": N,
                   "arlm_tokens_per_s": (N - 1) / (t_arlm[N] - t_arlm[1]),
                   "hf_tokens_per_s": (N - 1) / (t_hf[N] - t_hf[1])},
        "checks": {"prefill_last_logits_max_abs_diff": diff, "decode_tokens_identical": same_tokens},
    }
    for phase in ("prefill", "decode"):
        f = fig[phase]
        f["ratio_arlm_over_hf"] = f["arlm_tokens_per_s"] / f["hf_tokens_per_s"]

    m = fig["machine"]
    print(f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, transformers {m['transformers']}, "
          f"{m['threads']} threads, 1-min load average {load_start[0]:.2f} at the start, "
          f"{m['load_average_end'][0]:.2f} at the end")
    print(f"prefill ({P} tokens):           arlm {fig['prefill']['arlm_tokens_per_s']:8.1f} tok/s | "
          f"HF {fig['prefill']['hf_tokens_per_s']:8.1f} tok/s | arlm/HF {fig['prefill']['ratio_arlm_over_hf']:.2f}")
    print(f"decode (batch 1, {N} new tokens): arlm {fig['decode']['arlm_tokens_per_s']:8.1f} tok/s | "
          f"HF {fig['decode']['hf_tokens_per_s']:8.1f} tok/s | arlm/HF {fig['decode']['ratio_arlm_over_hf']:.2f}")
    print(f"checks: prefill logits max |diff| {diff:.2e}; greedy tokens identical: {same_tokens}")
    if args.json:
        args.json.write_text(json.dumps(fig, indent=2) + "\n")


if __name__ == "__main__":
    main()
