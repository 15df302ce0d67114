"""One engine under every front end: requests of token ids in, tokens out (see engine.py).

request.py    a request's state; RequestStatus, FinishReason
block_pool.py which KV blocks are free, shared, or hold a cached prefix
scheduler.py  which tokens of which requests run in the next step
runner.py     the forward pass: the step's tensors, native kernels or the modules
sampler.py    a step's sampling: plain rows, grammar masks, draft verification
hooks.py      what watches a step (counters, thread width, step-cost clock, tracers)
speculative/  speculative decoding: drafters, acceptance, cost model, verification
engine.py     Engine: schedule -> forward -> sample -> postprocess
async_engine.py  the engine on its own thread, for asyncio (arlm serve)
"""

from .async_engine import AsyncEngine, EngineDead, RequestFailed
from .engine import Engine, EngineConfig, RequestOutput
from .request import FinishReason, Request, RequestStatus
from .runner import ModelRunner, decode_step, prefill

__all__ = ["AsyncEngine", "Engine", "EngineConfig", "EngineDead", "FinishReason", "ModelRunner", "Request",
           "RequestFailed", "RequestOutput", "RequestStatus", "decode_step", "prefill"]
