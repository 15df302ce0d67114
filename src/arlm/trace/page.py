"""`arlm trace --out page.html`: the trace as one self-contained page (no network: the CSS, the
script and the trace's JSON inlined), stepped with next / previous / play, the timeline or the
arrow keys. The page's parts are page.html, page.css and page.js beside this file."""

from __future__ import annotations

import html
import json
from pathlib import Path

HERE = Path(__file__).parent


def render_page(trace: dict) -> str:
    """The HTML page for a `run_trace` dict."""
    data = json.dumps(trace, ensure_ascii=False)
    # Inside <script>, "</script" would end the element early and "<!--" open a comment: every "<"
    # written as JSON's escape \u003c, the data reads back the same.
    data = data.replace("<", "\\u003c")
    page = (HERE / "page.html").read_text(encoding="utf-8")
    title = html.escape(trace["prompts"][0]["text"][:60]) if trace.get("prompts") else "trace"
    for key, value in (("__CSS__", (HERE / "page.css").read_text(encoding="utf-8")),
                       ("__JS__", (HERE / "page.js").read_text(encoding="utf-8")),
                       ("__TITLE__", title)):
        page = page.replace(key, value)
    return page.replace("__DATA__", data)  # last: the data may hold the other markers as text
