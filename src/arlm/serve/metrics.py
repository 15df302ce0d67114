"""`GET /metrics`: the engine's counters and gauges in Prometheus' text exposition format."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (no torch at import: the replicas' ingress renders its page with this module)
    from ..engine import AsyncEngine

# Prometheus' histogram buckets for the time to first token, in seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# ... and for a grammar's compilation.
COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    """Cumulative-bucket histogram, as Prometheus exposes one."""

    def __init__(self, buckets: tuple[float, ...] = TTFT_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1


def _line(name: str, value: float, labels: dict[str, str] | None = None) -> str:
    label = ",".join(f'{k}="{v}"' for k, v in (labels or {}).items())
    return f"{name}{{{label}}} {value:g}" if label else f"{name} {value:g}"


def _metric(out: list[str], name: str, kind: str, help_: str, samples: list[tuple[float, dict | None]]) -> None:
    out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    out += [_line(name, v, labels) for v, labels in samples]


def _histogram(out: list[str], name: str, help_: str, h: Histogram) -> None:
    out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
    out += [_line(f"{name}_bucket", c, {"le": f"{b:g}"}) for b, c in zip(h.buckets, h.counts)]
    out += [_line(f"{name}_bucket", h.count, {"le": "+Inf"}), _line(f"{name}_sum", h.sum),
            _line(f"{name}_count", h.count)]


def render(engine: AsyncEngine, http_requests: dict[tuple[str, int], int], time_to_first_token: Histogram,
           grammar_compile: Histogram | None = None) -> str:
    """All metrics as one text page, a family of them at a time. Read from the event loop while
    the engine thread runs: each number is read once, so a page may mix two consecutive steps,
    never torn values."""
    out: list[str] = []
    _requests(out, engine, http_requests)
    _kv_cache(out, engine)
    _threads(out, engine)
    _steps(out, engine, time_to_first_token)
    _grammars(out, engine, grammar_compile)
    return "\n".join(out) + "\n"


def _requests(out: list[str], engine: AsyncEngine, http_requests: dict[tuple[str, int], int]) -> None:
    """HTTP requests, the engine's requests and tokens, its queue and running batch."""
    stats = engine.engine.stats
    _metric(out, "arlm_http_requests_total", "counter", "HTTP requests by endpoint and status code.",
            [(n, {"endpoint": ep, "code": str(code)}) for (ep, code), n in sorted(http_requests.items())])
    _metric(out, "arlm_requests_total", "counter", "Generation requests accepted by the engine.",
            [(stats.requests, None)])
    _metric(out, "arlm_requests_finished_total", "counter", "Generation requests finished, by reason.",
            [(n, {"finish_reason": r}) for r, n in sorted(stats.finished.items())])
    _metric(out, "arlm_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.",
            [(stats.prompt_tokens, None)])
    _metric(out, "arlm_generation_tokens_total", "counter", "Tokens generated.", [(stats.generation_tokens, None)])
    _metric(out, "arlm_num_requests_waiting", "gauge", "Requests waiting to be scheduled (queue depth).",
            [(engine.num_waiting, None)])
    _metric(out, "arlm_num_requests_running", "gauge", "Sequences in the running batch.", [(engine.num_running, None)])


def _kv_cache(out: list[str], engine: AsyncEngine) -> None:
    """The KV pool's blocks and bytes, the matrix path, the prefix cache and preemptions."""
    from ..kv_cache import kv_dtype_name

    e = engine.engine
    sched = e.scheduler
    pool = sched.pool
    _metric(out, "arlm_kv_cache_usage_ratio", "gauge", "Fraction of KV blocks held by sequences (0..1).",
            [(pool.utilization, None)])
    _metric(out, "arlm_kv_cache_blocks", "gauge", "KV blocks in the pool, by state.",
            [(pool.num_used, {"state": "used"}), (pool.num_free, {"state": "free"})])
    _metric(out, "arlm_kv_cache_block_size", "gauge", "Token slots per KV block.", [(sched.block_size, None)])
    _metric(out, "arlm_matmul_path", "gauge", "1 for the matrix path prompt tokens take, and its instructions.",
            [(1, {"path": e.runner.matmul_path, "isa": e.runner.matmul_isa})])
    cache = e.cache
    if cache is not None:  # (a contiguous engine has none until its first batch; arlm serve's is paged)
        dtype = {"dtype": kv_dtype_name(cache.dtype)}
        _metric(out, "arlm_kv_cache_bytes_per_token", "gauge",
                "Bytes a token of context adds (K and V of every layer but the sliding-window ones, which hold "
                "a window each: arlm_kv_sliding_blocks; scales included), by element type.",
                [(cache.bytes_per_token, dtype)])
        used = pool.num_used * sched.block_size * cache.bytes_per_token
        if cache.split:
            _metric(out, "arlm_kv_sliding_blocks", "gauge", "Blocks of the sliding-window layers' pool, by state.",
                    [(sched.local.num_used, {"state": "used"}), (sched.local.num_free, {"state": "free"})])
            used += sched.local.num_used * cache.local_bytes_per_block
        _metric(out, "arlm_kv_cache_bytes", "gauge", "Bytes of the KV pool, allocated and held by sequences.",
                [(cache.nbytes, {**dtype, "state": "allocated"}), (used, {**dtype, "state": "used"})])
    _metric(out, "arlm_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
            [(sched.stats.prefix_queries, None)])
    _metric(out, "arlm_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache (not recomputed).",
            [(sched.stats.prefix_hits, None)])
    _metric(out, "arlm_num_preemptions_total", "counter", "Sequences preempted (freed, to be recomputed).",
            [(sched.stats.preemptions, None)])


def _threads(out: list[str], engine: AsyncEngine) -> None:
    """The thread governor's width."""
    gov = engine.engine.runtime.threads
    _metric(out, "arlm_threads", "gauge", "Threads of the engine's steps: in use now, and the most it may use "
            "(fewer while other processes keep cores busy, unless --threads pinned them).",
            [(gov.width, {"state": "in_use"}), (gov.widest, {"state": "max"})])
    _metric(out, "arlm_threads_pinned", "gauge", "1 if --threads fixed the width, else 0.",
            [(int(gov.pinned is not None), None)])
    _metric(out, "arlm_thread_width_changes_total", "counter", "Times the steps' thread width changed.",
            [(gov.changes, None)])


def _steps(out: list[str], engine: AsyncEngine, time_to_first_token: Histogram) -> None:
    """The engine's steps, speculative decoding's rates, the time to first token, and whether the
    engine keeps up."""
    stats = engine.engine.stats
    _metric(out, "arlm_engine_steps_total", "counter", "Forward passes run by the engine.", [(stats.steps, None)])
    _metric(out, "arlm_engine_step_seconds_total", "counter", "Time spent in engine steps.",
            [(round(stats.step_seconds, 6), None)])
    _metric(out, "arlm_spec_decode_num_draft_tokens_total", "counter",
            "Speculative decoding: draft tokens verified by the target.", [(stats.spec_proposed, None)])
    _metric(out, "arlm_spec_decode_num_accepted_tokens_total", "counter",
            "Speculative decoding: draft tokens accepted.", [(stats.spec_accepted, None)])
    _metric(out, "arlm_spec_decode_num_passes_total", "counter",
            "Speculative decoding: rows that verified a draft (one per sequence per target pass).",
            [(stats.spec_passes, None)])
    _metric(out, "arlm_spec_decode_acceptance_rate", "gauge", "Accepted over verified draft tokens, since start.",
            [(round(stats.spec_acceptance_rate, 6), None)])
    _metric(out, "arlm_spec_decode_tokens_per_pass", "gauge",
            "Mean tokens a verifying sequence emitted per target pass (1 is plain decoding's), since start.",
            [(round(stats.spec_tokens_per_pass, 6), None)])
    _histogram(out, "arlm_time_to_first_token_seconds", "Time from arrival to the first generated token.",
               time_to_first_token)
    now = time.monotonic()
    _metric(out, "arlm_engine_last_step_age_seconds", "gauge",
            "Seconds since the engine last completed a step (since it started, before its first).",
            [(round(now - (engine.last_step_end or engine.started), 3), None)])
    _metric(out, "arlm_engine_stalled_seconds", "gauge", "Seconds the engine has had requests to serve without "
            "completing a step (0 while it keeps up; /health answers 503 past --health-step-timeout).",
            [(round(engine.stalled, 3), None)])


def _grammars(out: list[str], engine: AsyncEngine, grammar_compile: Histogram | None) -> None:
    """Structured outputs' grammars: compiling, compiled, refused, and the time they take."""
    grammars = engine.engine.grammars
    if grammars is not None:
        _metric(out, "arlm_grammar_compiling", "gauge", "Grammars being compiled or queued for the compiler.",
                [(grammars.pending, None)])
        _metric(out, "arlm_grammar_compiled_total", "counter", "Grammars compiled (a spec seen recently is reused).",
                [(grammars.stats.compiled, None)])
        _metric(out, "arlm_grammar_rejected_total", "counter",
                "Grammars refused, by reason: invalid, too_large (--grammar-max-size), too_complex (a step's "
                "budget), timeout (--grammar-timeout), busy (the compiler's queue full).",
                [(n, {"reason": r}) for r, n in sorted(grammars.stats.rejected.items())])
    if grammar_compile is not None:
        _histogram(out, "arlm_grammar_compile_seconds", "Time to compile a request's grammar (off the engine's "
                   "step and the event loop).", grammar_compile)


def label_replicas(pages: list[tuple[str, str]]) -> str:
    """Several servers' pages as one, each sample labelled `replica="<name>"` (the tag Ray Serve's
    own metrics use): each metric's HELP and TYPE once, then its samples from every page, as the
    text format wants a metric's samples together. `pages`: (replica name, its /metrics text)."""
    families: dict[str, list[str]] = {}  # metric name -> its header lines, then its samples
    for replica, text in pages:
        name = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split()[2]
                head = families.setdefault(name, [])
                if line not in head:
                    head.append(line)
            elif line and not line.startswith("#") and name is not None:
                space, brace = line.find(" "), line.find("{")
                tag = f'replica="{replica}"'
                if -1 < brace < space:
                    rest = line[brace + 1:]
                    families[name].append(f"{line[:brace + 1]}{tag}{'' if rest.startswith('}') else ','}{rest}")
                else:
                    families[name].append(f"{line[:space]}{{{tag}}}{line[space:]}")
    return "".join(line + "\n" for lines in families.values() for line in lines)


def render_replicas(pages: dict[str, tuple[str, dict[str, str]]], router: dict[str, int], prefix_chars: int) -> str:
    """The page of `arlm serve --replicas`' ingress: every replica's page labelled with it
    (`pages`: replica id -> (its page, where it runs: pid, node, node_id)), which replica runs
    where, and the prefix router's decisions (`router`: router_stats.COUNTS; `prefix_chars`: the
    shortest prefix it routes by, cluster.PREFIX_CHARS)."""
    out: list[str] = []
    _metric(out, "arlm_replica_info", "gauge", "The replicas answering: their process, their node's address and Ray id.",
            [(1, {"replica": r, **where}) for r, (_, where) in sorted(pages.items())])
    _metric(out, "arlm_router_prefix_hits_total", "counter",
            "Requests routed to the replica holding their prompt's prefix.", [(router["prefix_hits"], None)])
    _metric(out, "arlm_router_fallbacks_total", "counter",
            "Requests whose prefix replica was too busy: the least loaded took them.", [(router["fallbacks"], None)])
    _metric(out, "arlm_router_unkeyed_total", "counter",
            f"POSTed requests without a prompt prefix ({prefix_chars} characters) to route by: the least loaded "
            "took them.",
            [(router["no_prefix"], None)])
    return label_replicas([(r, page) for r, (page, _) in sorted(pages.items())]) + "\n".join(out) + "\n"
