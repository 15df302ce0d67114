"""argparse types the benchmark scripts share: a bad number is argparse's one-line error (exit 2)
at parse time, before a model is loaded or a minute of work is spent on it.

The scripts import this module by name: run as `python benchmarks/<script>.py`, their own folder
is the first entry of sys.path.
"""

from __future__ import annotations

import argparse
from typing import Callable

# SmolLM2-135M's context window (its GGUF's llama.context_length). A constant, not read from the
# file: reading the GGUF's metadata costs seconds, and the limit must be checked before any load.
SMOLLM2_MAX_SEQ_LEN = 8192


def int_range(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse `type=` for an integer in lo..hi (hi None: no upper limit)."""
    want = f"an integer >= {lo}" if hi is None else f"an integer in {lo}..{hi}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"expected {want}, got {value}")
        return value

    return parse


positive_int = int_range(1)


def positive_int_list(text: str) -> list[int]:
    """An argparse `type=` for a comma-separated list of positive integers ("1,8,32")."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values
