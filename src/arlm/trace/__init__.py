"""What the engine did, step by step: `arlm trace` and `arlm serve --trace`.

tracer.py  Tracer (a step hook) and run_trace: a real run recorded step by step, as one JSON-ready dict
page.py    that trace as a self-contained HTML page (page.html, page.js, page.css)
tui.py     that trace in the terminal (rich)
live.py    LiveTrace: the engine followed live at a server's /trace (live.html)
cli.py     `arlm trace`

The names below load on first use (PEP 562, as arlm's own): `arlm --help` imports cli.py, and
with it this package, without the tracer's torch.
"""

from __future__ import annotations

from .. import lazy_exports

_EXPORTS = {"Tracer": "tracer", "run_trace": "tracer", "machine_ceilings": "tracer", "measure_ceilings": "tracer"}

__all__ = list(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
