"""arlm: autoregressive transformer language models, trained in parallel, decoded with a KV cache."""

# OpenMP's wait policy is left to the user. The native decode step runs ~200 short parallel
# regions a step; with libgomp's default (threads spin briefly before they sleep) SmolLM2 decodes
# at ~150 tokens/s on 2 cores, with OMP_WAIT_POLICY=PASSIVE (sleep at once) at ~67
# (benchmarks/run.py, docs/benchmarks.md). Spinning threads lose whole time slices when another
# process takes their core: the engine watches for that and narrows its threads while others
# keep cores busy, widening again when they go (engine/threads.py; `--threads N` pins them).

from .config import ModelConfig
from .engine import Engine, EngineConfig, FinishReason, decode_step, prefill
from .kv_cache import KVCache
from .model import Transformer
from .sampling import SamplingParams, sample

__version__ = "0.1.0"

__all__ = ["ModelConfig", "Transformer", "KVCache", "SamplingParams", "sample", "Engine", "EngineConfig",
           "FinishReason", "prefill", "decode_step", "__version__"]
