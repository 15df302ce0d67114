"""arlm: autoregressive transformer language models, trained in parallel, decoded with a KV cache."""

# OpenMP's wait policy is left to the user. The native decode step runs ~200 short parallel
# regions a step; with libgomp's default (threads spin briefly before they sleep) SmolLM2 decodes
# at ~150 tokens/s on 2 cores, with OMP_WAIT_POLICY=PASSIVE (sleep at once) at ~67
# (benchmarks/run.py, docs/benchmarks.md). Spinning threads lose whole time slices when another
# process takes their core: the engine watches for that and narrows its threads while others
# keep cores busy, widening again when they go (engine/threads.py; `--threads N` pins them).

# Transparent huge pages for torch's large CPU buffers (weights, the KV cache): a decode step
# streams both, and with 4 KB pages an int8 cache crosses a page every ~60 rows (on a kernel
# whose THP setting is "madvise", the usual default; c10 aligns buffers of 2 MB or more and
# madvises them). SmolLM2 at 8,000 tokens of context: 0-6% faster decode (this machine's noise is
# as large), the same resident memory (docs/benchmarks.md, "KV-cache compression"). c10 reads the
# variable once, at its first allocation, so it is set before torch is imported;
# THP_MEM_ALLOC_ENABLE=0 turns it off.
import os as _os

_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from .config import ModelConfig  # noqa: E402
from .engine import Engine, EngineConfig, FinishReason, decode_step, prefill  # noqa: E402
from .kv_cache import KVCache  # noqa: E402
from .model import Transformer  # noqa: E402
from .sampling import SamplingParams, sample  # noqa: E402

__version__ = "0.1.0"

__all__ = ["ModelConfig", "Transformer", "KVCache", "SamplingParams", "sample", "Engine", "EngineConfig",
           "FinishReason", "prefill", "decode_step", "__version__"]
