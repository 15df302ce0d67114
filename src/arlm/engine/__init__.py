"""One engine under every front end: requests of token ids in, tokens out (see engine.py).

config.py     EngineConfig: the cache and the batch, typed
request.py    a request's state; RequestStatus, FinishReason
block_pool.py which KV blocks are free, shared, or hold a cached prefix
cache_layout.py  how big the KV cache is: a static batch's rows, a paged pool's blocks
scheduler.py  which tokens of which requests run in the next step
runner.py     the forward pass: the step's tensors, native kernels or the modules
sampler.py    a step's sampling: plain rows, grammar masks, draft verification
hooks.py      what watches a step (counters, thread width, step-cost clock, tracers)
speculative/  speculative decoding: drafters, acceptance, cost model, verification
engine.py     Engine: schedule -> forward -> sample -> postprocess
async_engine.py  the engine on its own thread, for asyncio (arlm serve)

The names below load on first use (PEP 562, as arlm's own): `arlm.engine.block_pool` and the
other torch-free modules import without torch, so the `arlm` command's parsers can name their
defaults (`arlm trace --help`) without paying for it.
"""

from __future__ import annotations

from .. import lazy_exports

_EXPORTS = {
    "AsyncEngine": "async_engine", "EngineDead": "async_engine", "RequestFailed": "async_engine",
    "Engine": "engine", "EngineConfig": "config", "RequestOutput": "engine",
    "FinishReason": "request", "Request": "request", "RequestStatus": "request",
    "ModelRunner": "runner", "decode_step": "runner", "prefill": "runner",
}

__all__ = ["AsyncEngine", "Engine", "EngineConfig", "EngineDead", "FinishReason", "ModelRunner", "Request",
           "RequestFailed", "RequestOutput", "RequestStatus", "decode_step", "prefill"]


__getattr__ = lazy_exports(__name__, _EXPORTS)
