"""arlm: autoregressive transformer language models, trained in parallel, decoded with a KV cache."""

import os

# OpenMP threads that spin while they wait turn a decode step of hundreds of small ops into a
# crawl as soon as another process wants a core (measured on 2 cores: 77 ms a step spinning
# against 31 ms passive, while the machine was busy; ~10% slower passive when it was idle). Only
# takes effect if set before torch starts OpenMP, and never overrides the user's own setting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .config import ModelConfig
from .generate import Generation, decode_step, generate, prefill
from .kv_cache import KVCache
from .model import Transformer
from .sampling import SamplingParams, sample

__version__ = "0.1.0"

__all__ = ["ModelConfig", "Transformer", "KVCache", "SamplingParams", "sample", "Generation",
           "generate", "prefill", "decode_step", "__version__"]
