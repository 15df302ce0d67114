"""The server one `arlm serve` process runs, built from its flags: imported by the command line
(serve/cli.py) and by each replica on a cluster (serve/cluster.py), neither of which the other
needs."""

from __future__ import annotations

import argparse
import os

from ..cli_common import UsageError, load_llm
from ..structured import GrammarLimits


def build_server(args: argparse.Namespace, config):
    """The model, its engine and the HTTP API's state (`common.Server`) as the flags say: what one
    `arlm serve` process serves, and each replica of `--replicas` (serve/cluster.py)."""
    from ..engine import AsyncEngine, Engine
    from ..trace.live import LiveTrace
    from .common import Server

    llm = load_llm(args)
    config.kv_dtype = llm.kv_dtype  # --kv-dtype, resolved as for generate (auto: float16 where the native stack runs)
    try:  # the pool's minimum (two blocks) and whether it fits, now that the model's shapes are known
        engine = Engine(llm.runner, llm.tokenizer.eos_ids, config)
        engine.grammars = llm.grammars  # (structured outputs: response_format, guided_*, tools)
        llm.grammars.limits = GrammarLimits(timeout=args.grammar_timeout, max_size=args.grammar_max_size)
        # llguidance and its view of the tokenizer, made now (~0.2 s quiet): the first grammar
        # request's --grammar-timeout is its own compilation's, not this one-time set-up's (on a
        # busy machine a fresh replica spent the whole 10 s on it and refused a regex it rejects at once)
        llm.grammars.prepare()
    except ValueError as e:
        flag = (f"--kv-cache-tokens {args.kv_cache_tokens}" if args.kv_cache_tokens is not None
                else f"--kv-cache-memory {args.kv_cache_memory}")
        raise UsageError(f"arlm serve: error: {flag}: {e}") from None
    live = engine.hooks.add(LiveTrace(engine)) if args.trace else None
    api_key = args.api_key or os.environ.get("ARLM_API_KEY") or None
    return Server(llm, AsyncEngine(engine, stall_limit=args.health_step_timeout), args.served_model_name or args.model,
                  api_key=api_key, max_body_bytes=args.max_body_bytes, live=live)
