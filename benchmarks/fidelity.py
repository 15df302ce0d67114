"""How faithful each precision choice is to float32, beside llama.cpp on the same GGUF, in one run.

    LLAMA_CPP_LIB_PATH=build/llama.cpp/bin .venv/bin/python benchmarks/fidelity.py [--max-tokens N] [--json out]
        [--model gemma3-270m --configs "float32;default (int8x2)"]

Two measures, both against arlm's float32 path (`--quantize none`) on the model's own file
(SmolLM2's by default; `--model` any other GGUF, which skips the answers: they are SmolLM2's):

1. Next-token distributions (`arlm perplexity --kl-divergence`'s code): over tiny Shakespeare's
   last 10% and a second text (Python's own textwrap.py: code and docstrings), sliding windows
   of 512 tokens, stride 256. Mean and 99th-percentile KL(float32 || config), top-1 agreement,
   mean |delta log p| of the text's token, perplexity. llama.cpp's logits are read through
   llama-cpp-python (`make bench-peers`) for the same token ids and windows and go through the
   same functions (`arlm.perplexity.kl_positions`).
2. Answers: greedy replies (first 16 tokens) to the chat questions in
   tests/data/chat_questions.json, compared with the float32 answers stored there; llama.cpp
   answers the same prompt token ids.

Each arlm configuration's speed goes in the same table: decode tokens/s at batch 1 (a 64-token
prompt, 64 new tokens) and prefill tokens/s (a 512-token prompt), medians of --repeat runs.
`--write-answers` regenerates the float32 answers file (only when the questions change).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import textwrap
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from arlm import perplexity as ppl  # noqa: E402
from arlm.llm import LLM  # noqa: E402
from arlm.loading import resolve_model_path  # noqa: E402
from arlm.sampling import SamplingParams  # noqa: E402

QUESTIONS = ROOT / "tests" / "data" / "chat_questions.json"
ANSWER_TOKENS = 16

# name -> LLM.load keyword arguments. "default" is what `arlm generate` runs.
CONFIGS = {
    "float32": dict(quantize=None),
    "default (int8x2)": dict(),
    "int8": dict(activations="int8"),
    "int8, KV float32": dict(activations="int8", kv_dtype="float32"),
    "int8, prefill float32": dict(activations="int8", matmul_path="float32"),
    # the matrix paths of the prompt's passes (issue 21); the default is vnni on AVX-512 VNNI CPUs
    "matmul avx2": dict(matmul_path="avx2"),
    "matmul bf16": dict(matmul_path="bf16"),
    "matmul float32": dict(matmul_path="float32"),
}

def texts(max_tokens: int | None) -> dict[str, str]:
    shakespeare = (ROOT / "data" / "tinyshakespeare.txt").read_text()
    return {"tiny Shakespeare, last 10%": shakespeare[int(0.9 * len(shakespeare)):],
            "textwrap.py (Python 3.11)": Path(textwrap.__file__).read_text()}


def chat_prompts(llm: LLM) -> list[list[int]]:
    questions = json.loads(QUESTIONS.read_text())["questions"]
    return [llm.tokenizer.encode(llm.apply_chat_template([{"role": "user", "content": q["question"]}]))
            for q in questions]


def arlm_answers(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=ANSWER_TOKENS, temperature=0.0)
    return [c.token_ids for c in llm.generate(prompts, params)]


def speed(llm: LLM, repeat: int) -> dict:
    g = torch.Generator().manual_seed(0)
    short = torch.randint(1000, 20000, (64,), generator=g).tolist()
    long = torch.randint(1000, 20000, (512,), generator=g).tolist()
    decode, prefill = [], []
    for _ in range(repeat):
        (c,) = llm.generate([short], SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True))
        decode.append(c.stats.decode_tokens_per_s)
        (c,) = llm.generate([long], SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
        prefill.append(c.stats.prefill_tokens_per_s)
    return {"decode_tokens_per_s": statistics.median(decode), "prefill_tokens_per_s": statistics.median(prefill)}


class LlamaCpp:
    """llama.cpp on the same file through llama-cpp-python, fed arlm's token ids."""

    def __init__(self, gguf: Path, context: int, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_ctx=max(context, 1024), n_batch=512, n_ubatch=512,
                         logits_all=True, n_threads=threads, n_threads_batch=threads, verbose=False)

    def window_logits(self, token_ids: list[int], wins):
        for w in wins:
            self.llm.reset()
            self.llm.eval(token_ids[w.begin:w.end])
            scores = np.asarray(self.llm.scores[:w.length], dtype=np.float32)
            yield w, scores[w.first - 1 - w.begin:w.end - 1 - w.begin]

    def answers(self, prompts: list[list[int]], eos: set[int]) -> list[list[int]]:
        out = []
        for p in prompts:
            reply: list[int] = []
            for tok in self.llm.generate(p, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
                if tok in eos:
                    reply.append(tok)
                    break
                reply.append(tok)
                if len(reply) >= ANSWER_TOKENS:
                    break
            out.append(reply)
        return out


def kl_from(base: np.ndarray, token_ids: list[int], wins, pairs) -> dict:
    per, row = [], 0
    for w, logits in pairs:
        targets = token_ids[w.first:w.end]
        per.append(ppl.kl_positions(base[row:row + w.n_scored], logits, targets))
        row += w.n_scored
    return ppl.summarize_kl({k: np.concatenate([p[k] for p in per]) for k in per[0]})


def matches(answers: list[list[int]], reference: list[list[int]]) -> int:
    return sum(a[:ANSWER_TOKENS] == r[:ANSWER_TOKENS] for a, r in zip(answers, reference))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="a known model name or GGUF path (answers: smollm2 only)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--stride", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=None, help="only the first N tokens of each text")
    ap.add_argument("--configs", default=";".join(CONFIGS), help="semicolon-separated names from: " + "; ".join(CONFIGS))
    ap.add_argument("--repeat", type=int, default=3, help="speed runs per configuration (median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=str(ROOT / "build" / "fidelity"), help="where the float32 logits go")
    ap.add_argument("--skip-kl", action="store_true")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--write-answers", action="store_true", help="store the float32 answers in " + str(QUESTIONS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gguf = resolve_model_path(args.model)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in args.configs.split(";") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}")
    results: dict[str, dict] = {}

    smollm2 = args.model == "smollm2"
    reference = json.loads(QUESTIONS.read_text())["questions"] if QUESTIONS.exists() and smollm2 else None
    token_texts: dict[str, list[int]] = {}
    bases: dict[str, np.ndarray] = {}
    for name in ["float32"] + [n for n in names if n != "float32"]:
        llm = LLM.load(str(gguf), **CONFIGS[name])
        r = results.setdefault(name, {"config": ppl.run_config(llm)})
        if not token_texts:
            for label, text in texts(args.max_tokens).items():
                ids = llm.tokenizer.encode(text)
                token_texts[label] = ids[:args.max_tokens] if args.max_tokens else ids
        prompts = chat_prompts(llm) if reference or (args.write_answers and smollm2) else []
        if prompts:
            answers = arlm_answers(llm, prompts)
            if name == "float32" and args.write_answers:
                data = json.loads(QUESTIONS.read_text())
                for q, a in zip(data["questions"], answers):
                    q["float32_token_ids"], q["float32_answer"] = a, llm.tokenizer.decode(a, skip_special_tokens=True)
                QUESTIONS.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
                reference = data["questions"]
            ref = [q["float32_token_ids"] for q in reference]
            r["answers_match"] = matches(answers, ref)
            r["answers"] = [llm.tokenizer.decode(a, skip_special_tokens=True) for a in answers]
            print(f"{name}: {r['answers_match']}/{len(ref)} answers as float32's", flush=True)
        if not args.skip_kl:
            for label, ids in token_texts.items():
                path = work / f"float32-{abs(hash((label, len(ids), args.context, args.stride))) % 10**8}.lgp"
                if name == "float32":
                    res = ppl.evaluate(llm, ids, args.context, args.stride, save_logits=path)
                    bases[label] = ppl.read_logits(path)
                else:
                    res = ppl.evaluate(llm, ids, args.context, args.stride, base=bases[label])
                r.setdefault("texts", {})[label] = {"perplexity": res.perplexity, "kl": res.kl,
                                                    "tokens": len(ids)}
                kl = res.kl or {}
                print(f"{name} | {label}: ppl {res.perplexity:.4f}"
                      + (f", KL mean {kl['mean_kl']:.6f} p99 {kl['p99_kl']:.6f}, top-1 {kl['top1_agreement']:.2f}%"
                         if kl else ""), flush=True)
        r.update(speed(llm, args.repeat))
        print(f"{name}: decode {r['decode_tokens_per_s']:.1f} tok/s, prefill {r['prefill_tokens_per_s']:.1f} tok/s",
              flush=True)
        del llm

    if not args.skip_llama_cpp:
        try:
            peer = LlamaCpp(gguf, args.context, args.threads)
        except (ImportError, OSError) as e:
            print(f"llama.cpp: not available ({e}); `make bench-peers` builds it", file=sys.stderr)
            peer = None
        if peer is not None:
            r = results["llama.cpp"] = {"config": {"model": str(gguf.name), "kv_dtype": "float16 (its default)"}}
            if reference:
                llm = LLM.load(str(gguf), quantize=None)
                answers = peer.answers(chat_prompts(llm), set(llm.tokenizer.eos_ids))
                r["answers_match"] = matches(answers, [q["float32_token_ids"] for q in reference])
                r["answers"] = [llm.tokenizer.decode(a, skip_special_tokens=True) for a in answers]
                print(f"llama.cpp: {r['answers_match']}/{len(reference)} answers as float32's", flush=True)
            if not args.skip_kl:
                for label, ids in token_texts.items():
                    wins = ppl.windows(len(ids), args.context, args.stride)
                    kl = kl_from(bases[label][1], ids, wins, peer.window_logits(ids, wins))
                    r.setdefault("texts", {})[label] = {"perplexity": kl["perplexity"], "kl": kl, "tokens": len(ids)}
                    print(f"llama.cpp | {label}: ppl {kl['perplexity']:.4f}, KL mean {kl['mean_kl']:.6f} "
                          f"p99 {kl['p99_kl']:.6f}, top-1 {kl['top1_agreement']:.2f}%", flush=True)

    print("\n| configuration | text | KL mean | KL p99 | top-1 % | mean abs dlogp | perplexity |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        for label, t in r.get("texts", {}).items():
            kl = t["kl"]
            if kl:
                print(f"| {name} | {label} | {kl['mean_kl']:.2e} | {kl['p99_kl']:.2e} | {kl['top1_agreement']:.2f} "
                      f"| {kl['mean_abs_delta_logp']:.4f} | {t['perplexity']:.3f} |")
            else:
                print(f"| {name} | {label} | 0 | 0 | 100 | 0 | {t['perplexity']:.3f} |")
    print("\n| configuration | answers as float32's | decode tok/s (batch 1) | prefill tok/s (512) |")
    print("| --- | --- | --- | --- |")
    n = len(reference) if reference else 0
    for name, r in results.items():
        dec = f"{r['decode_tokens_per_s']:.1f}" if "decode_tokens_per_s" in r else "-"
        pre = f"{r['prefill_tokens_per_s']:.1f}" if "prefill_tokens_per_s" in r else "-"
        print(f"| {name} | {r.get('answers_match', '-')}/{n} | {dec} | {pre} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0]
                                               .strip(" :\t") if os.path.exists("/proc/cpuinfo") else "",
                                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
