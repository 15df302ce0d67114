"""What a paged pool holds for a model with sliding-window layers (Gemma 3: 15 of 18 layers read
their last 512 positions): the context a KV budget holds with the sliding layers in blocks of
their own (KVCache.split) beside one pool of every layer, and the blocks one long request holds
in each as it grows. Checks that the split pool's greedy tokens are the contiguous cache's.

    .venv/bin/python benchmarks/sliding_kv.py --model gemma3-270m --prompt-tokens 3000
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from arlm.engine import Engine, EngineConfig
from arlm.engine.block_tables import FREED
from arlm.kv_cache import KVCache
from arlm.llm import LLM
from arlm.sampling import SamplingParams

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="the pool's bytes (default 1 GiB)")
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM.load(args.model)
    cfg = llm.model.config
    if not cfg.layer_types:
        raise SystemExit(f"sliding_kv.py: {args.model} has no sliding-window layers")
    config = EngineConfig(kv_cache_memory=args.kv_cache_memory, kv_dtype=llm.kv_dtype)
    engine = Engine(llm.runner, llm.tokenizer.eos_ids, config)
    cache = engine.cache
    unsplit = args.kv_cache_memory // KVCache.bytes_per_block(cfg, config.block_size, llm.kv_dtype)
    bs = config.block_size
    print(f"{args.model}: {cfg.n_layer} layers, {cache.k_local.shape[0] if cache.split else 0} of them in "
          f"the sliding layers' pool (window {cfg.sliding_window}); KV {llm.kv_dtype}")
    print(f"one pool of every layer: {unsplit} blocks = {unsplit * bs:,} tokens of context, "
          f"{KVCache.bytes_per_block(cfg, bs, llm.kv_dtype) // bs:,} bytes/token")
    print(f"split pool:              {cache.n_blocks} blocks = {cache.n_blocks * bs:,} tokens of context, "
          f"{cache.bytes_per_token:,} bytes/token + {cache.n_local_blocks} sliding-layer blocks "
          f"({cache.n_local_blocks * cache.local_bytes_per_block / 2**20:.0f} MiB, a window each for "
          f"{config.max_num_seqs} sequences); {cache.nbytes / 2**20:.0f} MiB in all")
    ids = llm.tokenizer.encode(TEXT.read_text()[:args.prompt_tokens * 8])[:args.prompt_tokens]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    req = engine.add_request(ids, params)
    most = 0
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        if req.local_blocks:
            most = max(most, sum(b != FREED for b in req.local_blocks))
            full = len(req.blocks)
    seconds = time.perf_counter() - t
    print(f"one request of {len(ids)} prompt + {args.new_tokens} tokens ({seconds:.1f} s): {full} full-layer blocks, "
          f"at most {most} sliding-layer blocks between steps (the window's {cfg.sliding_window // bs} and its edge's)")
    ref = llm.engine.generate([ids], params)[0]
    print(f"greedy tokens equal to the contiguous cache's: {req.output_ids == ref}")


if __name__ == "__main__":
    main()
