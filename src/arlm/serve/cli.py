"""`arlm serve`: load a model and serve it over an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from ..cli_common import (UsageError, add_chat_template_arg, add_model_args, add_speculative_args, check_device,
                          parse_size, positive_int)
from ..settings import MAX_BODY_BYTES, MAX_ONGOING_REQUESTS, auto_matmul_path, auto_quantize
from ..structured import GrammarLimits  # (no torch at its top: `arlm serve --help` reads the defaults)

# The smallest --kv-cache-memory taken before the model loads: two blocks of a small model. The
# model's own minimum (two blocks of its K and V) is checked once its shapes are known.
MIN_KV_CACHE_MEMORY = 1 << 20


def model_bytes(spec: str) -> int:
    """About the memory a model's weights take once loaded: its file's size, or its directory's
    (0 if the model cannot be found: loading it will say why)."""
    from ..loading import LoadError, resolve_model_path  # (imports torch and tokenizers: cli_common's doc)

    try:
        path = resolve_model_path(spec)
    except LoadError:
        return 0
    files = [path] if path.is_file() else [f for f in Path(path).rglob("*") if f.is_file()]
    return sum(f.stat().st_size for f in files)


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, for uvicorn to listen on. Bound here, before the model
    loads, so that a bad host or a taken port fails at once in one line (not in uvicorn's thread,
    with a traceback, after a banner that claimed to listen)."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: no wait for TIME_WAIT on restart
        sock.bind(address)
    except OSError as e:  # an unknown host (gaierror), an address not on this machine, a taken port
        if sock is not None:
            sock.close()
        raise UsageError(f"arlm serve: error: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def replica_count(text: str) -> int | str:
    """--replicas: a number >= 0 (0: one process, no Ray) or 'auto'."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 or 'auto', got {text!r}")
    return value


def check_flags(args: argparse.Namespace) -> int:
    """The flags' usage errors, before the model loads (each one line); the KV pool's bytes."""
    from ..kv_cache import check_pool_fits  # (imports torch: cli_common's doc)

    try:
        memory = parse_size(args.kv_cache_memory)
    except ValueError as e:
        raise UsageError(f"arlm serve: error: --kv-cache-memory: {e}") from None
    if args.kv_cache_tokens is None and memory < MIN_KV_CACHE_MEMORY:
        raise UsageError(f"arlm serve: error: --kv-cache-memory {args.kv_cache_memory} is too small: the KV pool "
                         f"needs at least 1MiB ({MIN_KV_CACHE_MEMORY} bytes)")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"arlm serve: error: --port must be in 0..65535 (0: any free port), got {args.port}")
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_body_bytes", "grammar_max_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"arlm serve: error: --{name.replace('_', '-')} must be positive")
    for name in ("grammar_timeout", "health_step_timeout"):
        if not getattr(args, name) > 0:  # (also NaN)
            raise UsageError(f"arlm serve: error: --{name.replace('_', '-')} must be a positive number of seconds")
    if args.replicas == "auto":
        if args.max_replicas is not None and args.max_replicas < args.min_replicas:
            raise UsageError("arlm serve: error: --max-replicas must be >= --min-replicas")
        if args.target_ongoing_requests is not None and not 0 < args.target_ongoing_requests <= MAX_ONGOING_REQUESTS:
            raise UsageError(f"arlm serve: error: --target-ongoing-requests must be a number in (0, "
                             f"{MAX_ONGOING_REQUESTS}] ({MAX_ONGOING_REQUESTS}: the requests a replica takes at once)")
    elif args.max_replicas is not None or args.target_ongoing_requests is not None or args.min_replicas != 1:
        raise UsageError("arlm serve: error: --min-replicas, --max-replicas and --target-ongoing-requests are for "
                         "--replicas auto")
    for name in ("long_prefill_tokens", "max_running_choices"):
        if getattr(args, name) < 0:
            raise UsageError(f"arlm serve: error: --{name.replace('_', '-')} must be >= 0 (0: off)")
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < 1:
        raise UsageError("arlm serve: error: --kv-cache-tokens must be positive")
    check_device(args.device)
    if args.kv_cache_tokens is None:  # (a pool in tokens is checked once the model gives its size)
        try:
            check_pool_fits(memory, args.device, reserved=model_bytes(args.model))
        except ValueError as e:
            raise UsageError(f"arlm serve: error: --kv-cache-memory {args.kv_cache_memory}: {e}") from None
    return memory


def cmd_serve(args: argparse.Namespace) -> int:
    # (these import torch: cli_common's doc)
    from ..engine import EngineConfig
    from ..kv_cache import kv_dtype_name

    memory = check_flags(args)
    if args.quantize == "auto":  # (settings.py: serving's rule beside generate's)
        args.quantize = auto_quantize(args.device, serving=True) or "none"
    if args.matmul_path == "auto" and args.prefill_dtype in (None, "auto") and args.quantize != "none" \
            and args.device == "cpu":
        # Every token through the integer kernels where they are built (settings.auto_matmul_path).
        # An explicit bf16 / float32 path is honoured (faster prompts on CPUs without VNNI, AMX
        # tiles on those with them) and gives up that a request's tokens do not depend on its batch.
        args.matmul_path = auto_matmul_path("cpu", args.activations, serving=True)
    config = EngineConfig(block_size=args.block_size, kv_cache_memory=memory, kv_cache_tokens=args.kv_cache_tokens,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          enable_prefix_caching=not args.no_prefix_caching,
                          long_prefill_tokens=args.long_prefill_tokens or None, group_rows=args.max_running_choices or None)
    if args.replicas:  # replicas of this server on a Ray cluster (serve/cluster.py: imports Ray)
        from .cluster import serve_replicated

        return serve_replicated(args, config)
    # (uvicorn, fastapi: ~0.5 s that the flags' usage errors above do without)
    import uvicorn

    from .api import create_app
    from .build import build_server

    sock = bind(args.host, args.port)
    server = build_server(args, config)
    llm, engine, live, name, api_key = server.llm, server.engine.engine, server.live, server.model_name, server.api_key
    http = uvicorn.Server(uvicorn.Config(create_app(server, engine_thread=False), log_level=args.log_level,
                                         access_log=args.log_level == "debug", timeout_graceful_shutdown=5))
    # The engine loop keeps the main thread, which loaded the model, and owns the signals; HTTP
    # (I/O and text, no OpenMP work) gets a thread of its own.
    http_thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, name="arlm-http", daemon=True)
    http_thread.start()
    while not http.started:
        if not http_thread.is_alive():  # the app's startup failed; uvicorn said why
            raise UsageError(f"arlm serve: error: cannot serve on {args.host}:{args.port}")
        time.sleep(0.05)
    cache = engine.cache
    host, port = sock.getsockname()[:2]  # the port --port 0 was given
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    sliding = (f" + {cache.n_local_blocks} blocks of its {cache.k_local.shape[0]} sliding-window layers "
               f"(a window's each)" if cache.split else "")
    print(f"arlm serve: model {name} ({llm.quantization or 'no quantization'}), KV pool {cache.n_blocks} blocks x "
          f"{cache.block_size} tokens{sliding} = {cache.nbytes / 2**20:.0f} MiB ({kv_dtype_name(cache.dtype)}, "
          f"{cache.bytes_per_token} bytes/token), "
          f"context {engine.max_model_len} tokens, "
          f"paged-attention kernel {'native' if cache.use_kernel else 'PyTorch fallback'}, "
          f"matmul path {llm.matmul_path} ({llm.matmul_isa}), "
          f"speculative decoding {llm.speculative.method if llm.speculative else 'off'}; "
          f"listening on {url}" + (" (API key required)" if api_key else "")
          + (f"; live trace at {url}/trace" if live is not None else ""), file=sys.stderr, flush=True)

    def shutdown(signum, frame) -> None:
        http.should_exit = True
        server.engine.stop()

    signal.signal(signal.SIGINT, shutdown)
    signal.signal(signal.SIGTERM, shutdown)
    server.engine.run()  # until a signal
    http_thread.join(timeout=10)
    return 0


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (continuous batching)")
    add_model_args(p, compile=False)  # for serving, --quantize and --matmul-path auto are decided in cmd_serve
    add_chat_template_arg(p)
    add_speculative_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (or set ARLM_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--kv-cache-memory", default="1GiB", help="KV block pool size, e.g. 2GiB, 512MiB (default: 1GiB)")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="KV block pool size in tokens (overrides memory)")
    p.add_argument("--block-size", type=int, default=16, help="token slots per KV block (default: 16)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="running sequences at most (default: 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="tokens per forward pass: decodes plus prompt chunks (default: 512)")
    p.add_argument("--long-prefill-tokens", type=int, default=128,
                   help="a prompt with more tokens than this left is long: it runs in chunks of at most this many, "
                        "and while other requests decode, long prompts share ~4 tokens a step, so that one "
                        "client's long prompt slows its own first token, not every other stream (default: 128; "
                        "0: prompts take the whole --max-num-batched-tokens)")
    p.add_argument("--max-running-choices", type=int, default=4,
                   help="the choices of one request (n, several prompts) that step together while other requests "
                        "run or wait; the rest wait their turn holding their KV blocks (default: 4; 0: no limit). A "
                        "CPU's decode step costs about a row's share per sequence, so one request's n=16 would "
                        "otherwise make every other stream's steps ~3x longer")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not share KV blocks of common prompt prefixes")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help=f"largest request body accepted (default: {MAX_BODY_BYTES >> 20} MiB)")
    limits = GrammarLimits()
    p.add_argument("--grammar-timeout", type=float, default=limits.timeout,
                   help="seconds a request's grammar (response_format, guided_*, tools) may take to compile, off "
                        "the engine's step; past it the request gets a 400 naming the field (default: "
                        f"{limits.timeout:g})")
    p.add_argument("--grammar-max-size", type=int, default=limits.max_size,
                   help="symbols a request's grammar may have once compiled (llguidance's max_grammar_size); a "
                        f"larger one gets a 400 naming the field (default: {limits.max_size})")
    p.add_argument("--health-step-timeout", type=float, default=30.0,
                   help="seconds the engine may go without completing a step while requests wait before /health "
                        "answers 503 (a wedged engine is not healthy; default: 30)")
    p.add_argument("--trace", action="store_true",
                   help="follow the engine live at /trace (a page; /trace/events: server-sent events): requests, "
                        "their KV blocks, prefix-cache hits, each step's batch, tokens/s (default: off)")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    g = p.add_argument_group("replicas on a Ray cluster (pip install 'arlm[cluster]')")
    g.add_argument("--replicas", type=replica_count, default=0, metavar="N|auto",
                   help="serve from N replicas of this server (each its own engine and KV pool) behind one ingress "
                        "on Ray Serve, routed by prompt prefix; 'auto': as many as the load asks, Ray Serve's "
                        "autoscaler between --min-replicas and --max-replicas (default: 0, one process, no Ray)")
    g.add_argument("--min-replicas", type=positive_int, default=1, help="--replicas auto: the fewest replicas (default: 1)")
    g.add_argument("--max-replicas", type=positive_int, default=None,
                   help="--replicas auto: the most replicas (default: as many as the cluster's CPUs hold at "
                        "--threads-per-replica each, when the server starts)")
    g.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="--replicas auto: the requests a replica should be serving at once; more on average and "
                        "the autoscaler adds replicas, fewer and it removes them (default: half of --max-num-seqs)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster ('auto': the one `ray start` began here; default: start a local one)")
    g.add_argument("--replica-router", choices=("prefix", "power-of-two"), default="prefix",
                   help="how a request's replica is chosen: by its prompt's prefix (default), or Ray Serve's own "
                        "power-of-two-choices (the baseline benchmarks/cluster.py compares with)")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds the running streams may take to finish before they are ended with an "
                        "error event; new requests get 503 meanwhile (default: 30)")
    g.add_argument("--replica-start-timeout", type=float, default=600.0,
                   help="seconds the HTTP proxy and the replicas (each loading the model) may take to start before "
                        "the server gives up; a loaded machine or a large model needs more (default: 600)")
    g.add_argument("--threads-per-replica", type=positive_int, default=1,
                   help="CPU cores each replica is given (Ray's num_cpus) and its threads (default: 1)")
    p.set_defaults(func=cmd_serve)
