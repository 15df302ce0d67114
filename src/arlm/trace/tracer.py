"""A step-by-step trace of a real run: what each engine step computed, wrote and read (`arlm trace`).

`Tracer` is a step hook (`Engine.hooks`, engine/hooks.py; attached only while a trace runs). Each step it records, per sequence: the phase (a prefill chunk, a decode, a speculative
verification), the token ids fed and their text, the KV slots written and occupied and the pool
blocks held; for the step: the cache's bytes, the bytes of weights and of cached K/V the step
read, its FLOPs, its wall time and the bandwidth that implies beside the machine's (measured
once: `machine_ceilings`), and for every sampled token the model's top-k next-token
probabilities, the sampling transforms' cut and the token drawn.

`run_trace` drives an engine over prompts with the tracer on and returns the trace as one
JSON-ready dict; `arlm.trace.page` renders it as a self-contained HTML page, `arlm.trace.tui`
in the terminal.
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch

from ..engine.hooks import StepHook, StepResult
from ..files import atomic_write_text, cache_home
from ..sampling import SamplingParams

TOP_K = 10  # next-token candidates recorded per sampled token


# -- the machine's ceilings (measured once, cached) ---------------------------------------------------

def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_ceilings(seconds: float = 0.6) -> dict:
    """This machine's memory read bandwidth (bytes/s: the sum of a 256 MiB float32 tensor, best
    of a few) and float32 matmul throughput (FLOP/s: a prefill-shaped 512x576 by 576x1536
    product), on torch's current threads."""
    x = torch.rand(1 << 26)
    x.sum()
    best, t_end = float("inf"), time.perf_counter() + seconds / 2
    while time.perf_counter() < t_end or best == float("inf"):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    bandwidth = x.numel() * 4 / best
    del x
    a, b = torch.rand(512, 576), torch.rand(576, 1536)
    a @ b
    best, t_end = float("inf"), time.perf_counter() + seconds / 2
    while time.perf_counter() < t_end or best == float("inf"):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return {"bandwidth": bandwidth, "flops": 2 * 512 * 576 * 1536 / best}


def machine_ceilings() -> dict:
    """`measure_ceilings` for this CPU and thread count, measured on first use and then read from
    ~/.cache/arlm/machine.json (ARLM_CACHE moves it, as the model cache)."""
    key = f"{_cpu_name()}|{os.cpu_count()}|{torch.get_num_threads()}|{torch.__version__}"
    path = cache_home() / "machine.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if key not in known:
        known[key] = measure_ceilings()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(known))
        except OSError:
            pass  # a read-only cache directory: measured again next time
    return {"cpu": _cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(), **known[key]}


# -- what a step costs ----------------------------------------------------------------------------------

def weight_bytes(runner) -> tuple[int, int]:
    """(bytes of the layers' weights, bytes of the LM head's) as a forward pass streams them: the
    native kernels' own tensors where they run, else the model's parameters and buffers (each
    storage once; the embedding table not counted unless it is the head: a step reads only its
    tokens' rows)."""
    native = getattr(runner, "native", None)
    model = runner.model
    if native is not None:
        layers = sum(w.nbytes for w in native.weights)
        head = sum(w.nbytes for w in native._head[0]) if native._head is not None else \
            sum(p.nbytes for p in model.lm_head.parameters()) + sum(b.nbytes for b in model.lm_head.buffers())
        return layers, head
    seen, layers = set(), 0
    head_ptrs = {t.data_ptr() for t in list(model.lm_head.parameters()) + list(model.lm_head.buffers())}
    emb_ptrs = {t.data_ptr() for t in list(model.tok_emb.parameters()) + list(model.tok_emb.buffers())}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        p = t.data_ptr()
        if p in seen or p in head_ptrs or p in emb_ptrs or "rope" in name:
            continue
        seen.add(p)
        layers += t.nbytes
    head = sum(t.nbytes for t in list(model.lm_head.parameters()) + list(model.lm_head.buffers()))
    return layers, head


def matmul_params(config) -> int:
    """Multiply-adds per token in the layers' matrices (the head apart)."""
    d, hd = config.d_model, config.head_dim
    attn = d * (config.n_head + 2 * config.n_kv_heads) * hd + config.n_head * hd * d
    mlp = d * config.d_ff * (2 if config.mlp == "gelu" else 3)  # a gated MLP (SwiGLU, GeGLU): gate, up, down
    return config.n_layer * (attn + mlp)


def phase(batch, i: int) -> str:
    """Row i's part of a step: "verify" (a draft checked), "decode" or "prefill"."""
    if batch.drafts[i]:
        return "verify"
    return "decode" if batch.decodes(i) else "prefill"


def _distribution(logits: torch.Tensor, params: SamplingParams, k: int) -> dict:
    """The top-k of the model's next-token distribution (log-softmax of the raw logits), and what
    temperature, top-k, top-p and min-p leave of them (`kept`, `p_sampling`: the renormalized
    probability sampling draws from; greedy keeps the argmax alone)."""
    logits = logits.float()
    logp = torch.log_softmax(logits, -1)
    top = torch.topk(logp, k)
    ids = top.indices.tolist()
    out = {"ids": ids, "p": top.values.exp().tolist()}
    if params.temperature == 0:
        out["kept"] = [j == 0 for j in range(k)]
        out["p_sampling"] = [1.0 if j == 0 else 0.0 for j in range(k)]
        return out
    probs = torch.softmax(logits / params.temperature, -1)
    order = torch.argsort(probs, descending=True)
    sp = probs[order]
    keep = torch.ones_like(sp, dtype=torch.bool)
    if params.top_k:
        keep[params.top_k:] = False
    if params.top_p < 1.0:
        before = torch.cumsum(sp, 0) - sp  # mass of the tokens ranked above
        keep &= before < params.top_p
    if params.min_p > 0:
        keep &= sp >= params.min_p * sp[0]
    mass = float(sp[keep].sum())
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order))
    kept = [bool(keep[rank[i]]) for i in ids]
    out["kept"] = kept
    out["p_sampling"] = [float(probs[i]) / mass if kk else 0.0 for i, kk in zip(ids, kept)]
    return out


class Tracer(StepHook):
    """A step hook (`Engine.hooks`): `before` once the step is scheduled, `after` once it is
    sampled; `steps` holds one JSON-ready dict per step."""

    reads_logits = True  # each sampled token's distribution, from the model's own logits

    def __init__(self, engine, decode_token=None, top_k: int = TOP_K, ceilings: dict | None = None) -> None:
        self.engine = engine
        self.decode_token = decode_token or (lambda i: str(i))
        self.top_k = top_k
        self.ceilings = ceilings
        self.steps: list[dict] = []
        self.layer_bytes, self.head_bytes = weight_bytes(engine.runner)
        self.matmul_params = matmul_params(engine.model.config)
        self.seq_order: dict[str, int] = {}  # request id -> its index in the trace
        self._t0: float | None = None

    def text(self, ids: list[int]) -> list[str]:
        return [self.decode_token(i) for i in ids]

    def scheduled(self, engine, batch) -> None:
        self._pre = self.before(engine, batch)

    def stepped(self, engine, result: StepResult) -> None:
        with torch.inference_mode():
            self.after(engine, self._pre, result.batch, result.logits, result.rows, result.sampled, result.seconds)

    def before(self, engine, batch) -> list[dict]:
        if self._t0 is None:
            self._t0 = time.perf_counter()
        self._blocks_used = engine.scheduler.pool.num_used  # (during the step: a finished sequence's go back after)
        pre = []
        for i, seq in enumerate(batch.seqs):
            self.seq_order.setdefault(seq.request_id, len(self.seq_order))
            pre.append({"computed": seq.num_computed, "dropped": seq.num_dropped,
                        "input": batch.input_ids(i), "draft": list(batch.drafts[i]), "phase": phase(batch, i),
                        "blocks": [int(b) for b in seq.blocks], "samples": batch.samples(i)})
        return pre

    def after(self, engine, pre: list[dict], batch, logits: torch.Tensor, rows: list[int],
              sampled: dict[int, list[int]], seconds: float) -> None:
        cfg = engine.model.config
        cache = engine.cache
        per_token = cache.bytes_per_token
        pool_bytes = cache.nbytes
        by_row: dict[int, list[int]] = {}
        for j, i in enumerate(rows):
            by_row.setdefault(i, []).append(j)
        seqs, tokens, kv_read, attn_flops, heads = [], 0, 0, 0, 0
        for i, (seq, p) in enumerate(zip(batch.seqs, pre)):
            n = batch.num_tokens[i]
            start = p["computed"]
            end = start + n
            tokens += n
            # every slot attended over, read once for the sequence (a sliding layer's last `window`)
            kv_read += cache.bytes_per_layer_token * _slots_read(cfg, end)
            # scores and the weighted sum: 2 * 2 * d_head multiply-adds per head, layer, query and slot
            attn_flops += 4 * cfg.n_head * cfg.head_dim * sum(_slots_read(cfg, q) for q in range(start + 1, end + 1))
            new = sampled.get(i, [])
            heads += len(by_row.get(i, []))
            dists = []
            for r, tok in zip(by_row.get(i, []), new):
                d = _distribution(logits[r], seq.params, min(self.top_k, logits.shape[-1]))
                d["text"] = self.text(d["ids"])
                d["sampled"] = tok
                d["sampled_text"] = self.decode_token(tok)
                dists.append(d)
            entry = {"seq": self.seq_order[seq.request_id], "request_id": seq.request_id, "phase": p["phase"],
                     "input_ids": p["input"], "input_text": self.text(p["input"]),
                     "positions": [start + p["dropped"], end + p["dropped"]], "shape": [1, n],
                     "slots_written": [start, end], "slots_occupied": end if not p["draft"] else
                     start + 1 + max(len(new) - 1, 0),
                     "blocks": p["blocks"], "sampled": new, "sampled_text": self.text(new),
                     "distributions": dists,
                     "finish_reason": str(seq.finish_reason) if seq.finish_reason is not None else None}
            if p["draft"]:
                entry["draft"] = p["draft"]
                entry["draft_text"] = self.text(p["draft"])
                entry["accepted"] = max(len(new) - 1, 0)
            seqs.append(entry)
        weights = self.layer_bytes + (self.head_bytes if heads else 0)
        flops = 2 * self.matmul_params * tokens + 2 * cfg.d_model * cfg.vocab_size * heads + attn_flops
        phases = {s["phase"] for s in seqs}
        phase = phases.pop() if len(phases) == 1 else "mixed"
        step = {"step": len(self.steps), "phase": phase, "seconds": seconds,
                "t": time.perf_counter() - self._t0 - seconds,
                "tokens": tokens, "batch_shape": [len(seqs), max(batch.num_tokens)],
                "sequences": seqs,
                "kv": {"bytes_per_token": per_token, "pool_bytes": pool_bytes,
                       "tokens_cached": sum(s["slots_occupied"] for s in seqs),
                       "blocks_total": cache.n_blocks, "block_size": cache.block_size,
                       "blocks_used": self._blocks_used if not engine.config.contiguous else len(seqs)},
                "bytes_weights": weights, "bytes_kv": kv_read, "flops": flops,
                "bandwidth": (weights + kv_read) / seconds if seconds > 0 else 0.0}
        self.steps.append(step)


def _slots_read(cfg, positions: int) -> int:
    """Cached slots a query at `positions` - 1 reads over all layers: every earlier one in a full
    layer, at most `sliding_window` in a sliding one."""
    sliding = sum(cfg.sliding(layer) for layer in range(cfg.n_layer))
    return (cfg.n_layer - sliding) * positions + sliding * min(positions, cfg.sliding_window or positions)


def model_info(llm) -> dict:
    cfg = llm.model.config
    return {"name": llm.loaded.name, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_kv_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, "d_model": cfg.d_model, "d_ff": cfg.d_ff, "vocab_size": cfg.vocab_size,
            "context": cfg.max_seq_len, "quantization": llm.quantization or "none",
            "kv_dtype": str(llm.kv_dtype).removeprefix("torch."),
            # layers that attend over their last `sliding_window` positions only (Gemma 3)
            "sliding_layers": [i for i in range(cfg.n_layer) if cfg.sliding(i)], "sliding_window": cfg.sliding_window}


def run_trace(llm, prompts: list[list[int]], params: SamplingParams, engine=None, drafter=None,
              top_k: int = TOP_K, measure: bool = True) -> dict:
    """Generate from `prompts` (token ids) on `engine` (default: the LLM's own, as `arlm generate`
    runs) with a `Tracer` on; the trace as a JSON-ready dict: the model, the cache layout, the
    machine's ceilings, the prompts, the sampling parameters, and the steps."""
    engine = engine or llm.engine
    tok = llm.tokenizer
    ceilings = machine_ceilings() if measure else {"cpu": _cpu_name(), "bandwidth": 0.0, "flops": 0.0}
    tracer = Tracer(engine, lambda i: tok.decode([i]), top_k, ceilings)
    engine.hooks.add(tracer)
    t0 = time.perf_counter()
    try:
        outputs = engine.generate(prompts, params, drafter=drafter)
    finally:
        engine.hooks.remove(tracer)
    seconds = time.perf_counter() - t0
    finish = {seq["seq"]: seq["finish_reason"] for st in tracer.steps for seq in st["sequences"] if seq["finish_reason"]}
    cache = engine.cache
    return {
        "format": "arlm-trace", "version": 1,
        "model": model_info(llm),
        "cache": {"layout": "contiguous" if engine.config.contiguous else "paged",
                  "block_size": cache.block_size, "blocks": cache.n_blocks, "bytes_per_token": cache.bytes_per_token,
                  "shape": list(cache.k.shape),  # [L, blocks (rows), H_kv, block size, d_head or row bytes]
                  # a paged pool's sliding-window layers in blocks of their own (kv_cache.py: split)
                  "sliding_shape": list(cache.k_local.shape) if cache.split else None,
                  "dtype": str(cache.dtype).removeprefix("torch.")},
        "machine": ceilings,
        "weights_bytes": {"layers": tracer.layer_bytes, "head": tracer.head_bytes},
        "sampling": {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                     "min_p": params.min_p, "max_new_tokens": params.max_new_tokens, "seed": params.seed},
        "speculative": getattr(getattr(drafter, "config", None), "method", type(drafter).__name__)
        if drafter is not None else None,
        "prompts": [{"ids": p, "text": tok.decode(p), "tokens": [tok.decode([i]) for i in p]} for p in prompts],
        "outputs": [{"ids": ids, "text": tok.decode(ids), "finish_reason": finish.get(i)}
                    for i, ids in enumerate(outputs)],
        "seconds": seconds,
        "steps": tracer.steps,
    }
