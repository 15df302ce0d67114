"""The sizes users run: arlm beside llama.cpp on the same GGUF, for each shape and type that
benchmarks/make_gguf.py makes (random weights in real shapes, quantized by llama-quantize).

    .venv/bin/python benchmarks/sizes.py [--shapes llama-3.2-1b,llama-3.2-3b] [--types Q4_K_M,Q8_0,Q4_0]
        [--rounds 3] [--threads 2] [--parts decode1,decode8,prefill,start,rss,deep] [--json OUT]

Needs llama.cpp's tools in build/llama.cpp/bin (benchmarks/build_peers.sh) and llama-cpp-python
(the same build) for the start-up part. Files missing from --gguf-dir are made first.

Each round runs arlm and llama.cpp one after the other, the order reversed every other round;
the figures are the rounds' medians, and arlm / llama.cpp beside them. The start-up rounds run
first, before this process loads the model for the speed rounds (its weights on huge pages, as
the server and the API hold them: beside the page cache's copy of the file, a second one that
would push an 8B file out of a small machine's page cache):
- decode1: batch-1 decode tokens/s, 128 greedy tokens (EOS ignored: random weights). arlm: its
  engine in this process, stepped (benchmarks/run.py's `engine_run`) after a 4-token prompt,
  decode steps only; llama.cpp: `llama-bench -n 128` (tg128, after an empty prompt).
- decode8: 8 sequences of 4 prompt tokens and 128 new ones each, decode steps only, total
  tokens/s. arlm: the engine with 8 requests; llama.cpp: `llama-batched-bench -npp 4 -ntg 128
  -npl 8` (its speed_tg).
- prefill: one 512-token prompt (real text), tokens/s. arlm: the engine's first step;
  llama.cpp: `llama-bench -p 512` (pp512).
- start: process start -> first generated token, the file in the OS page cache (warm), as
  benchmarks/startup.py measures it: `arlm generate --model FILE --max-new-tokens 1` against a
  Python process that loads the file with llama-cpp-python and samples one token. Also once per
  file on a file never loaded: arlm with an empty model cache (a fresh ARLM_CACHE, the built
  kernels linked in), so its layout cache is built; llama.cpp keeps no cache, so its "first"
  figure is one more run of its ordinary load. arlm's warm runs are greedy `arlm generate` runs
  on a file whose plan its earlier runs wrote: they run without torch (arlm.bare).
- rss: the peak resident memory (the kernel's max RSS) of those same start-up processes.
- deep (not in the default parts: its prompts take ~20 s a round at 1B, minutes at 8B): batch-1
  decode tokens/s at a depth of 4,096 tokens, 32 greedy tokens after a prompt of 4,096 (real
  text) where the attention reads a long cache. arlm: its engine in this process, the decode
  steps only (`engine_run`: the prompt's prefill step untimed); llama.cpp:
  `llama-bench -p 0 -n 32 -d 4096` (tg32 @ d4096).

And, from the decode1 figures, the bytes one decode step reads and the share of the host's
read rate each engine reaches (bytes per step x steps per second / read rate). The read rate is
the best of several 1 GiB reads (a torch.sum on --threads threads; run.py's
`memory_bandwidth_gbs`), measured at the start of this run and again after each round (a file's
share is against the best read up to its last round: one read at the start ran at 55 GB/s on a host
that gave 95 in the reads before and after). Bytes per step:
- arlm: `arlm.quant.weight_bytes(model)` (every weight but the gathered embedding table;
  a tied head's table counted once) plus its KV cache bytes per token x the mean context;
- llama.cpp: every tensor's bytes in the file, except token_embd when the file has its own
  output.weight (then the embedding's rows are only gathered), plus an F16 KV cache (its
  default) x the same mean context.
The mean context of the 128 decode steps is taken as 4 + 128 / 2 tokens for both.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import arlm  # noqa: E402

if __name__ == "__main__":
    arlm.prefer_huge_pages()  # as the arlm command does, before torch loads

import make_gguf  # noqa: E402
from arlm.llm import LLM  # noqa: E402
from arlm.quant import weight_bytes  # noqa: E402
from arlm.runtime import runtime  # noqa: E402
from arlm.sampling import SamplingParams  # noqa: E402
from bench_args import positive_int  # noqa: E402
from run import engine_run, memory_bandwidth_gbs, prompt_ids  # noqa: E402
from shared import cpu_line  # noqa: E402
from startup import ARLM, LLAMA_CPP, PROMPT, timed  # noqa: E402

BIN = ROOT / "build" / "llama.cpp" / "bin"
BENCH, BATCHED = BIN / "llama-bench", BIN / "llama-batched-bench"
DEFAULT_PARTS = ("decode1", "decode8", "prefill", "start", "rss")
PARTS = (*DEFAULT_PARTS, "deep")
NEW_TOKENS, PROMPT_TOKENS, PREFILL_TOKENS, BATCH = 128, 4, 512, 8
DEPTH, DEEP_TOKENS = 4096, 32  # the "deep" part: decode after a prompt of DEPTH tokens
MEAN_CONTEXT = PROMPT_TOKENS + NEW_TOKENS / 2
# The rows of the table: key, label, short label (the ratios' table)
ROWS = [("decode1", "decode b1 tok/s", "b1"), ("decode8", f"decode b{BATCH} tok/s", f"b{BATCH}"),
        ("prefill", f"prefill {PREFILL_TOKENS} tok/s", f"pp{PREFILL_TOKENS}"),
        ("start_warm", "start->1st token warm s", "start"), ("start_first", "start->1st token first load s", "start1"),
        ("rss_warm", "peak RSS warm MB", "rss"), ("rss_first", "peak RSS first load MB", "rss1"),
        ("bytes_per_step", "bytes / decode step MB", "bytes"), ("read_share", "share of read rate", "share"),
        ("deep", f"decode b1 at depth {DEPTH} tok/s", "deep")]
# The keys each part measures
PART_KEYS = {"decode1": ("decode1", "read_share"), "decode8": ("decode8",), "prefill": ("prefill",),
             "start": ("start_warm", "start_first"), "rss": ("rss_warm", "rss_first"), "deep": ("deep",)}


def llama_cpp_speeds(path: Path, threads: int, parts: set[str]) -> dict[str, float]:
    """llama.cpp's decode1 / prefill (one llama-bench run), decode8 (llama-batched-bench) and deep
    (llama-bench at a depth), tokens/s."""
    got: dict[str, float] = {}
    if parts & {"decode1", "prefill"}:
        n = NEW_TOKENS if "decode1" in parts else 0
        p = PREFILL_TOKENS if "prefill" in parts else 0
        out = subprocess.run([str(BENCH), "-m", str(path), "-t", str(threads), "-p", str(p), "-n", str(n), "-r", "1",
                              "-o", "json"], capture_output=True, text=True, check=True).stdout
        for r in json.loads(out):
            got["prefill" if r["n_prompt"] else "decode1"] = r["avg_ts"]
    if "decode8" in parts:
        ctx = BATCH * (PROMPT_TOKENS + NEW_TOKENS)
        out = subprocess.run([str(BATCHED), "-m", str(path), "-t", str(threads), "-c", str(ctx), "-npp",
                              str(PROMPT_TOKENS), "-ntg", str(NEW_TOKENS), "-npl", str(BATCH), "--output-format",
                              "jsonl"], capture_output=True, text=True, check=True).stdout
        got["decode8"] = json.loads(out.strip().splitlines()[-1])["speed_tg"]
    if "deep" in parts:
        out = subprocess.run([str(BENCH), "-m", str(path), "-t", str(threads), "-p", "0", "-n", str(DEEP_TOKENS),
                              "-d", str(DEPTH), "-r", "1", "-o", "json"], capture_output=True, text=True,
                             check=True).stdout
        got["deep"] = json.loads(out)[0]["avg_ts"]
    return got


def arlm_speeds(llm: LLM, parts: set[str]) -> dict[str, float]:
    """arlm's decode1 / decode8 / prefill through its engine in this process, tokens/s."""
    got: dict[str, float] = {}
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [prompt_ids(llm, PROMPT_TOKENS, seed) for seed in range(BATCH)]
    for kind, batch in (("decode1", prompts[:1]), ("decode8", prompts)):
        if kind in parts:
            r = engine_run(llm, batch, params)
            got[kind] = r["decode_tokens"] / r["decode_s"]
    if "prefill" in parts:
        ids = prompt_ids(llm, PREFILL_TOKENS, 0)
        r = engine_run(llm, [ids], SamplingParams(max_new_tokens=1), steps=1)
        got["prefill"] = PREFILL_TOKENS / r["prefill_s"]
    if "deep" in parts:
        ids = prompt_ids(llm, DEPTH, 1)
        if len(ids) < DEPTH:
            raise RuntimeError(f"the text gave {len(ids)} tokens, not {DEPTH}")
        r = engine_run(llm, [ids], SamplingParams(max_new_tokens=DEEP_TOKENS + 1, temperature=0.0, ignore_eos=True))
        got["deep"] = r["decode_tokens"] / r["decode_s"]
    return got


def start_commands(path: Path, threads: int, activations: str) -> dict[str, list[str]]:
    return {"arlm": ARLM + ["generate", PROMPT, "--model", str(path), "--max-new-tokens", "1", "--temperature", "0",
                            "--threads", str(threads), "--activations", activations],
            "llama.cpp": [sys.executable, "-c", LLAMA_CPP.format(threads=threads), str(path), PROMPT]}


def first_load(cmd: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS MB) of `cmd` with an empty model cache: a fresh ARLM_CACHE whose
    kernels are the ones already built (so only the model's layout is built, not the kernels)."""
    kernels = Path(os.environ.get("ARLM_CACHE", Path.home() / ".cache" / "arlm")) / "kernels"
    with tempfile.TemporaryDirectory() as tmp:
        if kernels.exists():
            (Path(tmp) / "kernels").symlink_to(kernels)
        return timed(cmd, {**os.environ, "ARLM_CACHE": tmp})


def llama_cpp_bytes_per_step(path: Path) -> int:
    """The file's tensor bytes one llama.cpp decode step reads, KV excluded (see the module doc)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    skip = {"token_embd.weight"} if "output.weight" in tensors else set()
    return sum(n for name, n in tensors.items() if name not in skip)


def kv_bytes_per_token_f16(llm: LLM) -> int:
    c = llm.model.config
    d_head = c.head_size or c.d_model // c.n_head
    return c.n_layer * 2 * c.n_kv_heads * d_head * 2


def measure_file(path: Path, args, parts: set[str]) -> dict:
    """Every measure of one file: {"arlm": {...}, "llama.cpp": {...}} of medians, and the rounds."""
    lib = os.environ.get("LLAMA_CPP_LIB_PATH", str(BIN))
    env = {"arlm": None, "llama.cpp": {**os.environ, "LLAMA_CPP_LIB_PATH": lib}}
    start = bool(parts & {"start", "rss"})  # (one set of start-up runs measures both)
    cmds = start_commands(path, args.threads, args.activations)
    runs: dict[str, dict[str, list[float]]] = {"arlm": {}, "llama.cpp": {}}

    def rounds(measure) -> None:  # engines alternated, the order reversed every other round
        for r in range(args.rounds):
            for engine in (["arlm", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "arlm"]):
                for k, v in measure(engine).items():
                    runs[engine].setdefault(k, []).append(v)
            print(f"  round {r}: " + json.dumps({e: {k: round(v[-1], 2) for k, v in d.items()}
                                                  for e, d in runs.items()}), flush=True)

    first: dict[str, dict[str, float]] = {"arlm": {}, "llama.cpp": {}}
    if start:  # before this process loads the model: its copy of the weights (on huge pages, as the
        # server and the API hold them) would push the files out of the page cache on a small machine
        for engine in cmds:  # (warm-ups: arlm's first run builds the file's layout cache)
            timed(cmds[engine], env[engine])
        rounds(lambda engine: dict(zip(("start_warm", "rss_warm"), timed(cmds[engine], env[engine]))))
        # once per file: arlm's first load builds its layout cache; llama.cpp has none to build
        first["arlm"]["start_first"], first["arlm"]["rss_first"] = first_load(cmds["arlm"])
        first["llama.cpp"]["start_first"], first["llama.cpp"]["rss_first"] = timed(cmds["llama.cpp"], env["llama.cpp"])
    llm = LLM.load(str(path), activations=args.activations)  # (builds the layout cache, if not yet built)
    speed_parts = parts & {"decode1", "decode8", "prefill", "deep"}
    if speed_parts:
        arlm_speeds(llm, speed_parts | {"decode1"})  # (a warm-up: the first steps build the kernels' scratch)

        def speeds(engine: str) -> dict[str, float]:
            got = (arlm_speeds(llm, speed_parts) if engine == "arlm"
                   else llama_cpp_speeds(path, args.threads, speed_parts))
            if "decode1" in speed_parts and engine == "llama.cpp":  # the host's read rate swings
                args.read_gbs = max(args.read_gbs, memory_bandwidth_gbs())  # between minutes: the best seen
            return got

        rounds(speeds)
    got = {e: {k: statistics.median(v) for k, v in d.items()} | first[e] for e, d in runs.items()}
    got["arlm"]["bytes_per_step"] = weight_bytes(llm.model) + llm.engine.cache.bytes_per_token * MEAN_CONTEXT
    got["llama.cpp"]["bytes_per_step"] = llama_cpp_bytes_per_step(path) + kv_bytes_per_token_f16(llm) * MEAN_CONTEXT
    for e in got:
        if "decode1" in got[e]:
            got[e]["read_share"] = got[e]["bytes_per_step"] * got[e]["decode1"] / (args.read_gbs * 1e9)
    wanted = {"bytes_per_step"} | {k for part in parts for k in PART_KEYS[part]}
    got = {e: {k: v for k, v in d.items() if k in wanted} for e, d in got.items()}
    del llm
    gc.collect()
    return {**got, "runs": runs}


def show(name: str, size: int, got: dict) -> None:
    print(f"{name} ({size / 1e6:.0f} MB file)")
    print(f"  {'':32} {'arlm':>10} {'llama.cpp':>10} {'arlm/llama.cpp':>15}")
    for key, label, _ in ROWS:
        a, b = got["arlm"].get(key), got["llama.cpp"].get(key)
        if a is None or b is None:
            continue
        scale = 1e-6 if key == "bytes_per_step" else 1
        fmt = "{:10.3f}" if key in ("read_share", "start_warm", "start_first") else "{:10.1f}"
        print(f"  {label:32} {fmt.format(a * scale)} {fmt.format(b * scale)} {a / b:14.2f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="llama-3.2-1b,llama-3.2-3b",
                   help=f"comma-separated, of: {', '.join(make_gguf.SHAPES)}")
    p.add_argument("--types", default="Q4_K_M,Q8_0,Q4_0", help="comma-separated llama-quantize types")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                   help=f"comma-separated, of: {', '.join(PARTS)} (default: %(default)s)")
    p.add_argument("--gguf-dir", type=Path, default=make_gguf.DEFAULT_OUT, help="where make_gguf.py keeps its files")
    p.add_argument("--activations", choices=("int8x2", "int8"), default="int8x2",
                   help="arlm's activation precision: int8x2 (the default: float32's answers) or int8 (one 8-bit "
                        "pass, as llama.cpp takes its activations)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    shapes, kinds, parts = args.shapes.split(","), args.types.split(","), set(args.parts.split(","))
    if unknown := [s for s in shapes if s not in make_gguf.SHAPES]:
        p.error(f"--shapes: unknown {', '.join(unknown)}")
    if unknown := set(kinds) - make_gguf.file_types():
        p.error(f"--types: unknown {', '.join(sorted(unknown))}")
    if unknown := parts - set(PARTS):
        p.error(f"--parts: unknown {', '.join(sorted(unknown))} (known: {', '.join(PARTS)})")
    for tool in (BENCH, BATCHED, make_gguf.DEFAULT_QUANTIZE):
        if not tool.exists():
            print(f"{tool} is missing: benchmarks/build_peers.sh builds it", file=sys.stderr)
            return 1
    runtime().threads.pin(args.threads)  # (torch's threads too: the read rate below runs on them)
    if parts & {"start", "rss"}:  # arlm's greedy starts run without torch (arlm.bare): its library built first
        from arlm.bare import library
        from arlm.kernels import layout

        if library.build(layout.header(), wait=True) is None:
            print("arlm.bare's library did not build: arlm's starts take the torch path", file=sys.stderr)
    args.read_gbs = memory_bandwidth_gbs()
    print(f"CPU: {cpu_line()}; threads {args.threads}; arlm activations {args.activations}; "
          f"best read rate {args.read_gbs:.1f} GB/s", flush=True)
    results = {}
    for shape in shapes:
        for path in make_gguf.make(shape, kinds, args.gguf_dir.expanduser(), make_gguf.DEFAULT_QUANTIZE):
            name = path.stem
            print(f"{name}:", flush=True)
            results[name] = measure_file(path, args, parts)
            show(name, path.stat().st_size, results[name])
            if "decode1" in parts:
                print(f"  (best read rate so far {args.read_gbs:.1f} GB/s)", flush=True)
    if len(results) > 1:
        keys = [(k, short) for k, _, short in ROWS if any(k in r["arlm"] for r in results.values())]
        print(f"arlm / llama.cpp\n  {'':24}" + "".join(f"{short:>8}" for _, short in keys))
        for name, r in results.items():
            print(f"  {name:24}" + "".join(f"{r['arlm'][k] / r['llama.cpp'][k]:8.2f}" for k, _ in keys))
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps({"cpu": cpu_line(), "threads": args.threads, "read_gbs": args.read_gbs,
                                   "results": results}, indent=1))
        tmp.replace(out)  # (atomic)
    return 0


if __name__ == "__main__":
    sys.exit(main())
