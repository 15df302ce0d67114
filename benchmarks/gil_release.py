"""Whether the work the server moves off its event loop and engine thread lets other threads run:
HF tokenizers' `encode` against `encode_batch_fast` on a ~2 MB prompt, and llguidance's
`unsafe_compute_mask_ptr` on 20 heavy masks (3,000 optional properties), each beside a
heartbeat thread that sleeps 2 ms at a time: the longest gap between its beats is how long the
GIL was held.

    .venv/bin/python benchmarks/gil_release.py
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from arlm.loading import load_model  # noqa: E402
from arlm.structured import Grammars, StructuredOutput  # noqa: E402


def longest_gap(fn) -> tuple[float, float]:
    """(seconds fn took, the heartbeat's longest gap in seconds)."""
    gaps, stop = [], threading.Event()

    def beat() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = threading.Thread(target=beat)
    t.start()
    time.sleep(0.02)
    t0 = time.perf_counter()
    fn()
    took = time.perf_counter() - t0
    stop.set()
    t.join()
    return took, max(gaps)


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    loaded = load_model("smollm2")
    tok = loaded.tokenizer.backend
    text = "hello world, this is a test of tokenization speed. " * 40000
    for name, fn in (("encode", lambda: tok.encode(text, add_special_tokens=False)),
                     ("encode_batch_fast", lambda: tok.encode_batch_fast([text], add_special_tokens=False))):
        took, gap = longest_gap(fn)
        print(f"tokenizers {name} of {len(text) / 1e6:.1f} MB: {took:.3f} s, heartbeat's longest gap {gap:.3f} s")
    g = Grammars(loaded.tokenizer, loaded.config.vocab_size)
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 40} for i in range(3000)}}
    compiled = g.compile(StructuredOutput("json_schema", wide))
    matchers = [compiled.matcher() for _ in range(20)]
    took, gap = longest_gap(lambda: g.bitmask(matchers))
    print(f"llguidance: 20 masks in {took:.3f} s, heartbeat's longest gap {gap:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
