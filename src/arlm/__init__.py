"""arlm: autoregressive transformer language models, trained in parallel, decoded with a KV cache.

The names below load on first use (PEP 562): `import arlm` itself imports no torch and sets
nothing, so a program (the `arlm` command first of all) can set torch's allocator variables
before torch loads (`prefer_huge_pages`).
"""

from __future__ import annotations

import os
import sys

__version__ = "0.1.0"


def prefer_huge_pages() -> None:
    """Ask torch for transparent huge pages for its large CPU buffers (THP_MEM_ALLOC_ENABLE=1,
    unless the variable is set already); call it before torch is imported, as the `arlm`
    command does first thing.

    A decode step streams every weight and the whole KV cache; with 4 KB pages an int8 cache
    crosses a page every ~60 rows (on a kernel whose THP setting is "madvise", the usual
    default, c10 aligns buffers of 2 MB or more and madvises them when this is set). SmolLM2 at
    8,000 tokens of context: 0-6% faster decode, the same resident memory (docs/benchmarks.md,
    "KV-cache compression"). c10 reads the variable once, at its first allocation, so setting
    it later does nothing: then this warns instead. THP_MEM_ALLOC_ENABLE=0 turns it off."""
    if "torch" in sys.modules and "THP_MEM_ALLOC_ENABLE" not in os.environ:
        print("arlm: prefer_huge_pages() after torch was imported has no effect", file=sys.stderr)
        return
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

_EXPORTS = {
    "ModelConfig": "config", "Transformer": "model", "KVCache": "kv_cache", "SamplingParams": "sampling",
    "sample": "sampling", "Engine": "engine", "EngineConfig": "engine", "FinishReason": "engine",
    "prefill": "engine", "decode_step": "engine",
}

__all__ = [*_EXPORTS, "__version__", "prefer_huge_pages"]


def lazy_exports(package: str, exports: dict[str, str]):
    """A package's PEP 562 `__getattr__`: each name of `exports` (name -> submodule) imported from
    its submodule on first use, then kept in the package (looked up once). arlm, arlm.engine and
    arlm.trace export so: what imports the package (`arlm --help`) pays for no torch."""
    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        # (__import__, not importlib.import_module: `python -X importtime` logs only the import statement's loads)
        value = getattr(__import__(f"{package}.{module}", fromlist=[name]), name)
        setattr(sys.modules[package], name, value)
        return value
    return __getattr__


__getattr__ = lazy_exports(__name__, _EXPORTS)
