"""Speculative decoding: plain vs speculative in the same run, SmolLM2-135M-Instruct, beside llama.cpp.

    LLAMA_CPP_LIB_PATH=build/llama.cpp/bin .venv/bin/python benchmarks/speculative.py \
        [--model smollm2] [--threads 2] [--repeats 3] [--max-tokens 128] [--clients 1,8,32] [--skip-llama-cpp]
        [--skip-http] [--self-draft 10] [--batch 1,8] [--modes greedy,t=0.7] [--per-prompt]
        [--step-cost [--step-cost-model M]]
        [--json out.json]

Two prompt sets, each sent through the model's chat template:
(a) input-grounded: rewrite or correct a given paragraph, edit a given code snippet, answer by
    quoting a given passage (the output copies from the prompt: prompt lookup's case);
(b) free text: open questions, stories, explanations.

1. In process (`LLM.generate`), greedy and sampled (temperature 0.7, seeded), batch 1 (each
   prompt alone, one after another) and batch 8 (the set in one call): plain, prompt lookup
   (`--speculative ngram`, adaptive) and, at batch 1, a self-draft (the model's first N layers and
   its head). Plain and speculative runs alternate, `--repeats` times; medians. Reported: output
   tokens/s over the wall clock (prefill included), the ratio to plain, the ratio of decode
   tokens/s alone (the steps that computed no prompt token), the draft tokens accepted over
   those verified, and the tokens a verifying sequence gained per target pass; --per-prompt: also
   each prompt's own (batch 1).
2. llama.cpp on the same GGUF (llama-cpp-python, built by `make bench-peers`), batch 1: plain and
   its prompt-lookup decoding (`LlamaPromptLookupDecoding`, 10 draft tokens: its default), fed
   arlm's token ids, greedy and sampled at 0.7, tokens/s over the wall clock.
0. (--step-cost) one forward pass of 1, 8 and 32 sequences feeding 1..8 tokens each, relative
   to one token each: what verification costs on this CPU.
3. `arlm serve` with and without `--speculative ngram` (both up, loads alternating), 1, 8 and
   32 concurrent streaming clients over set (a) then (b), greedy: output tokens/s.

--model takes parts 1 and 2 to another model (part 3 serves smollm2): a 1B-wide step's costs with
a model that copies, benchmarks/widen_gguf.py's SmolLM2 in Llama 3.2 1B's widths (random weights,
make_gguf.py's, copy nothing: their drafts are never accepted).
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

from bench_args import positive_int, positive_int_list  # noqa: E402

PARAGRAPHS = [
    "The committee met on Tuesday to discuss the budget for the new library. After a long debate, they agreed "
    "to fund the project, but only if the city council approves the plan by the end of the month. The library "
    "will have three floors, a reading garden on the roof and a room for children's stories on Saturday "
    "mornings. Construction is expected to start in the spring and to take about two years, during which the "
    "old library on Main Street will stay open with shorter hours.",
    "Our team shipped the new search feature last week. Early numbers show that users find what they need "
    "faster, and support tickets about search have dropped by a third since the release. The next step is to "
    "add filters for date and author, which many customers have asked for. We also plan to improve the "
    "results for misspelled words, because about one search in ten contains a typo.",
    "The river flooded twice this spring. Farmers along the valley lost part of their crops, and the county "
    "has asked the state for emergency funds to repair the roads and the old stone bridge. Volunteers filled "
    "sandbags for three days, and the school gym served as a shelter for families whose homes were under "
    "water. Engineers say a new levee would protect the town, but it would cost more than the county spends "
    "on roads in five years.",
]
CODE = [
    "def total(items):\n    s = 0\n    for x in items:\n        if x.qty <= 0:\n            continue\n"
    "        s = s + x.price * x.qty\n    if s > 100:\n        s = s * 0.9\n    return s\n\n\n"
    "def average(items):\n    if not items:\n        return 0\n    return total(items) / len(items)\n",
    "function greet(name) {\n  const message = 'Hello, ' + name + '!';\n  console.log(message);\n  return message;\n}\n\n"
    "function farewell(name) {\n  const message = 'Goodbye, ' + name + '.';\n  console.log(message);\n"
    "  return message;\n}\n",
]
PASSAGE = ("The Amazon rainforest covers much of the Amazon basin of South America. The basin spans about seven "
           "million square kilometres, of which about five and a half million are covered by the rainforest. "
           "The region includes territory belonging to nine nations, and the majority of the forest lies in "
           "Brazil, with sixty percent of the rainforest.")
GROUNDED = [
    f"Rewrite this text in the past tense, keeping everything else the same:\n\n{PARAGRAPHS[1]}",
    f"Correct the spelling mistakes in this text:\n\n"
    f"{PARAGRAPHS[0].replace('the ', 'teh ').replace('agreed', 'agred').replace('three', 'thre')}",
    f"Repeat this text exactly:\n\n{PARAGRAPHS[2]}",
    f"Rename the variable s to subtotal in this code and return the whole code:\n\n{CODE[0]}",
    f"Add a comment above each function in this code and return the whole code:\n\n{CODE[1]}",
    f"Quote the sentence from the passage that says how large the basin is.\n\n{PASSAGE}",
    f"Replace every 'the' with 'this' in the following text:\n\n{PARAGRAPHS[0]}",
    f"Make this text more formal without changing its facts:\n\n{PARAGRAPHS[2]}",
]
FREE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "What are three good habits for learning a new language? Explain each.",
    "Describe a walk through a busy market in the morning.",
    "Why is the sky blue? Answer in a paragraph.",
    "Give me a plan for a weekend trip to the mountains.",
    "Write a poem about autumn leaves.",
    "What should I consider when buying a used bicycle?",
]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run_arlm(llm, texts: list[str], params, batch: int, speculative) -> dict:
    """Generate every text (alone, or `batch` at a time); tokens, seconds and speculation counts."""
    t0 = time.perf_counter()
    tokens = proposed = accepted = passes = decode_tokens = 0
    decode_seconds = 0.0
    calls = []  # each generate call's own figures (batch 1: each prompt's)
    for i in range(0, len(texts), batch):
        t1 = time.perf_counter()
        out = llm.generate(texts[i:i + batch], params, speculative=speculative)
        n = sum(len(c.token_ids) for c in out)
        tokens += n
        s = out[0].stats
        proposed, accepted, passes = proposed + s.spec_proposed, accepted + s.spec_accepted, passes + s.spec_passes
        decode_tokens, decode_seconds = decode_tokens + s.decode_tokens, decode_seconds + s.decode_seconds
        calls.append({"tokens": n, "seconds": time.perf_counter() - t1, "proposed": s.spec_proposed,
                      "accepted": s.spec_accepted, "passes": s.spec_passes,
                      "decode_tokens_per_s": s.decode_tokens / s.decode_seconds if s.decode_seconds else 0.0})
    return {"tokens": tokens, "seconds": time.perf_counter() - t0, "proposed": proposed, "accepted": accepted,
            "passes": passes, "decode_tokens_per_s": decode_tokens / decode_seconds if decode_seconds else 0.0,
            "calls": calls}


def summarize(runs: list[dict]) -> dict:
    r = {"tokens_per_s": median([x["tokens"] / x["seconds"] for x in runs]),
         "decode_tokens_per_s": median([x["decode_tokens_per_s"] for x in runs]),
         "tokens": runs[-1]["tokens"]}
    p, a, n = (sum(x[k] for x in runs) for k in ("proposed", "accepted", "passes"))
    r["acceptance"] = a / p if p else None
    r["tokens_per_pass"] = (a + n) / n if n else None
    return r


def bench_in_process(args) -> dict:
    from arlm.engine.speculative import SpeculativeConfig
    from arlm.llm import LLM
    from arlm.sampling import SamplingParams

    llm = LLM.load(args.model)
    sets = {"grounded": GROUNDED, "free": FREE}
    texts = {k: [llm.apply_chat_template([{"role": "user", "content": t}]) for t in v] for k, v in sets.items()}
    modes = {"greedy": dict(temperature=0.0), "t=0.7": dict(temperature=0.7, top_p=1.0, seed=1)}
    modes = {m: modes[m] for m in args.modes}
    methods = {"plain": False, "ngram": "ngram"}
    if args.self_draft:  # adaptive, the rule keeps it off (it never pays here); so also always 2 tokens
        methods[f"self:{args.self_draft}"] = SpeculativeConfig(f"self:{args.self_draft}")
        methods[f"self:{args.self_draft} k=2"] = SpeculativeConfig(f"self:{args.self_draft}",
                                                                   num_speculative_tokens=2, adaptive=False)
    llm.generate(texts["free"][0], SamplingParams(max_new_tokens=16, temperature=0))  # warm-up
    results: dict = {}
    for set_name in sets:
        for mode, kw in modes.items():
            params = SamplingParams(max_new_tokens=args.max_tokens, **kw)
            for batch in args.batch:
                runs: dict[str, list[dict]] = {m: [] for m in methods}
                for _ in range(args.repeats):  # alternating: drift in the machine's speed hits all alike
                    for m, spec in methods.items():
                        if batch > 1 and m.startswith("self"):
                            continue
                        runs[m].append(run_arlm(llm, texts[set_name], params, batch, spec))
                row = {m: summarize(r) for m, r in runs.items() if r}
                for m in row:
                    row[m]["ratio"] = row[m]["tokens_per_s"] / row["plain"]["tokens_per_s"]
                    row[m]["decode_ratio"] = row[m]["decode_tokens_per_s"] / row["plain"]["decode_tokens_per_s"]
                results[f"{set_name} {mode} batch {batch}"] = row
                print_row(f"{set_name} {mode} batch {batch}", row)
                if args.per_prompt and batch == 1:  # each prompt alone: its ratios, medians of the repeats
                    for i, text in enumerate(sets[set_name]):
                        prow = {m: summarize([x["calls"][i] for x in r]) for m, r in runs.items() if r}
                        for m in prow:
                            prow[m]["ratio"] = prow[m]["tokens_per_s"] / prow["plain"]["tokens_per_s"]
                            prow[m]["decode_ratio"] = (prow[m]["decode_tokens_per_s"]
                                                       / prow["plain"]["decode_tokens_per_s"])
                        results[f"{set_name} {mode} batch 1 prompt {i}"] = {"prompt": text[:60], **prow}
                        print_row(f"  {i}: {text[:24]!r}", prow)
    return results


def print_row(name: str, row: dict) -> None:
    parts = []
    for m, r in row.items():
        extra = (f" acc {r['acceptance']:.2f} tpp {r['tokens_per_pass']:.2f}" if r.get("acceptance") is not None
                 else "")
        parts.append(f"{m} {r['tokens_per_s']:.1f} tok/s ({r['ratio']:.2f}x, decode {r['decode_ratio']:.2f}x{extra})")
    print(f"{name:<28} " + " | ".join(parts), flush=True)


def bench_step_cost(args) -> dict:
    """What verifying costs: one forward pass (block table, LM head on every position) of S
    sequences at position ~200, each feeding 1..8 tokens, relative to 1 token each."""
    import torch

    from arlm.kv_cache import KVCache
    from arlm.llm import LLM

    llm = LLM.load(args.step_cost_model)
    native, cfg = llm.runner.native, llm.model.config
    cache = KVCache.pool(cfg, 32 * 16, 16, llm.kv_dtype)
    results: dict = {}

    def step(seqs: int, per: int) -> float:
        table = torch.arange(seqs * 16).view(seqs, 16)
        tokens = torch.randint(0, 1000, (seqs * per,))
        seq = torch.arange(seqs).repeat_interleave(per)
        pos = (200 + torch.arange(per)).repeat(seqs)
        times = []
        with torch.inference_mode():
            for _ in range(7):
                t0 = time.perf_counter()
                x = native.embed(tokens)
                native.forward(x, cache.k, cache.v, table, seq, pos, cache.format)
                native.head(x)
                times.append(time.perf_counter() - t0)
        return median(times)

    for seqs in (1, 8, 32):
        base = step(seqs, 1)
        row = {per: step(seqs, per) / base for per in (1, 2, 3, 4, 5, 6, 8)}
        results[seqs] = {"one_token_ms": 1000 * base, "relative": row}
        print(f"{seqs:>2} sequences: one token each {1000 * base:.1f} ms; tokens each -> relative cost: "
              + " ".join(f"{k}:{v:.2f}" for k, v in row.items()), flush=True)
    return results


def bench_llama_cpp(args) -> dict:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from arlm.llm import render_chat
    from arlm.loading import load_model, resolve_model_path

    loaded = load_model(args.model)  # (its tokenizer and chat template)
    tok, template = loaded.tokenizer, loaded.chat_template
    gguf = str(resolve_model_path(args.model))
    kw = dict(model_path=gguf, n_ctx=2048, n_batch=512, n_threads=args.threads, n_threads_batch=args.threads, seed=1,
              verbose=False)
    engines = {"llama.cpp": Llama(**kw),
               "llama.cpp lookup": Llama(**kw, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))}
    eos = set(tok.eos_ids)
    results: dict = {}
    for set_name, prompts in (("grounded", GROUNDED), ("free", FREE)):
        ids = [tok.encode(render_chat(template, [{"role": "user", "content": t}])) for t in prompts]
        for mode, temp in ((m, t) for m, t in (("greedy", 0.0), ("t=0.7", 0.7)) if m in args.modes):
            runs: dict[str, list[float]] = {k: [] for k in engines}
            for _ in range(args.repeats):
                for name, llm in engines.items():
                    t0, n = time.perf_counter(), 0
                    for p in ids:
                        for i, t in enumerate(llm.generate(p, temp=temp, top_k=0 if temp else 1, top_p=1.0,
                                                           min_p=0.0, repeat_penalty=1.0, reset=True)):
                            n += 1
                            if t in eos or i + 1 >= args.max_tokens:
                                break
                    runs[name].append(n / (time.perf_counter() - t0))
            row = {k: median(v) for k, v in runs.items()}
            results[f"{set_name} {mode} batch 1"] = row
            print(f"{set_name} {mode} batch 1".ljust(28) + " " +
                  " | ".join(f"{k} {v:.1f} tok/s" for k, v in row.items()), flush=True)
    return results


async def _stream(client, url: str, prompt: str, max_tokens: int) -> int:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return tokens


async def _load(url: str, prompts: list[str], max_tokens: int) -> float:
    import httpx

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(_stream(client, url, p, max_tokens) for p in prompts))
        return sum(tokens) / (time.perf_counter() - t0)


def bench_http(args) -> dict:
    from serve import free_port, run_server, stop

    from arlm.llm import render_chat
    from arlm.loading import load_model

    template = load_model("smollm2").chat_template
    servers = {}
    results: dict = {}
    try:
        for name, extra in (("plain", []), ("ngram", ["--speculative", "ngram"])):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
            servers[name] = url, run_server([sys.executable, "-m", "arlm", "serve", "--model", "smollm2", "--port",
                                             str(port), "--kv-cache-memory", "1GiB", *extra], env, url)
        for set_name, prompts in (("grounded", GROUNDED), ("free", FREE)):
            texts = [render_chat(template, [{"role": "user", "content": t}]) for t in prompts]
            for url, _ in servers.values():
                asyncio.run(_load(url, texts[:2], 8))  # warm-up
            for c in args.clients:
                batch = [texts[i % len(texts)] for i in range(c)]
                runs: dict[str, list[float]] = {k: [] for k in servers}
                for _ in range(args.repeats):
                    for name, (url, _) in servers.items():
                        runs[name].append(asyncio.run(_load(url, batch, args.max_tokens)))
                row = {k: median(v) for k, v in runs.items()}
                row["ratio"] = row["ngram"] / row["plain"]
                results[f"{set_name} {c} clients"] = row
                print(f"serve {set_name} {c:>2} clients: plain {row['plain']:.1f} tok/s | ngram {row['ngram']:.1f} "
                      f"tok/s ({row['ratio']:.2f}x)", flush=True)
    finally:
        for _, proc in servers.values():
            stop(proc)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--max-tokens", type=positive_int, default=160)
    p.add_argument("--clients", type=positive_int_list, default="1,8,32")
    p.add_argument("--self-draft", type=int, default=10, help="layers of the self-draft rows (0: skip them)")
    p.add_argument("--batch", type=positive_int_list, default="1,8", help="in-process batch sizes (default: 1,8)")
    p.add_argument("--modes", type=lambda t: t.split(","), default="greedy,t=0.7",
                   help="in-process sampling modes, of greedy,t=0.7 (default: both)")
    p.add_argument("--per-prompt", action="store_true", help="batch 1: also each prompt's ratios")
    p.add_argument("--skip-llama-cpp", action="store_true")
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--skip-in-process", action="store_true")
    p.add_argument("--step-cost", action="store_true", help="first, time one pass of 1..8 tokens per sequence")
    p.add_argument("--model", default="smollm2",
                   help="the in-process and llama.cpp runs' model, a name or GGUF file: e.g. "
                        "benchmarks/widen_gguf.py's SmolLM2 in Llama 3.2 1B's widths (the HTTP runs serve smollm2) "
                        "(default: smollm2)")
    p.add_argument("--step-cost-model", default="smollm2",
                   help="--step-cost's model: a name or GGUF file, e.g. benchmarks/make_gguf.py's 1B shape "
                        "(random weights: its cost, not its acceptance, means something) (default: smollm2)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    from arlm.loading import resolve_model_path
    from arlm.loading.errors import LoadError

    for flag, model in (("--model", args.model), ("--step-cost-model", args.step_cost_model)):
        try:
            resolve_model_path(model)
        except LoadError as e:
            p.error(f"{flag}: {e}")
    import torch

    torch.set_num_threads(args.threads)
    from run import machine  # (benchmarks/run.py: the CPU, cores, torch and Python versions)

    out: dict = {**machine(), "max_tokens": args.max_tokens}
    if args.step_cost:
        print("== the cost of verifying: tokens per sequence in one pass ==", flush=True)
        out["step_cost"] = bench_step_cost(args)
    if not args.skip_in_process:
        print("== arlm, in process (LLM.generate): output tokens/s, wall clock ==", flush=True)
        out["arlm"] = bench_in_process(args)
    if not args.skip_llama_cpp:
        print("== llama.cpp (llama-cpp-python), batch 1 ==", flush=True)
        try:
            out["llama.cpp"] = bench_llama_cpp(args)
        except ImportError as e:
            print(f"llama.cpp: skipped ({e}; build it with `make bench-peers`)")
    if not args.skip_http:
        print("== arlm serve: concurrent streaming clients, greedy ==", flush=True)
        out["serve"] = bench_http(args)
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
