"""arlm: autoregressive transformer language models, trained in parallel, decoded with a KV cache."""

from .config import ModelConfig
from .generate import Generation, decode_step, generate, prefill
from .kv_cache import KVCache
from .model import Transformer
from .sampling import SamplingParams, sample

__version__ = "0.1.0"

__all__ = ["ModelConfig", "Transformer", "KVCache", "SamplingParams", "sample", "Generation",
           "generate", "prefill", "decode_step", "__version__"]
