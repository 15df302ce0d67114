"""Screenshots of an `arlm trace --out` page in Debian's chromium, driven by Playwright (no browser
download: `executable_path`). Used by `make trace-screenshot` for the README's picture.

    .venv/bin/python tools/trace_screenshot.py build/trace.html docs/trace.png [--step N] [--width 1280]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def chromium_path() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise SystemExit("no chromium on PATH: apt-get install chromium (make install-test does)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("page")
    p.add_argument("png")
    p.add_argument("--step", type=int, default=None, help="the step shown (default: the first decode step)")
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=900)
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": args.width, "height": args.height})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(Path(args.page).resolve().as_uri())
        step = args.step if args.step is not None else page.evaluate(
            "() => { const s = JSON.parse(document.getElementById('trace-data').textContent).steps;"
            " const i = s.findIndex(x => x.phase === 'decode'); return i < 0 ? 0 : i + 2 < s.length ? i + 2 : i; }")
        page.evaluate(f"() => window.arlmTrace.go({int(step)})")
        page.screenshot(path=args.png, full_page=False)
        browser.close()
    if errors:
        print("console errors:\n" + "\n".join(errors), file=sys.stderr)
        return 1
    print(f"wrote {args.png} (step {step})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
