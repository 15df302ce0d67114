"""`arlm trace` (arlm/trace): the recorded steps against what the engine really did, and the page in
a real browser (Debian's chromium, driven by Playwright with `executable_path`: no download).

The numbers: one prefill step then one decode step per further token for a single prompt; the
slots each step reports = the tokens in the cache; the bytes = the cache's own accounting; the
tokens fed = what the model's embedding saw; the recorded next-token probabilities = a separate
forward pass's; tracing changes no token.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

from arlm.engine import Engine, EngineConfig
from arlm.engine.speculative import SpeculativeConfig
from arlm.sampling import SamplingParams
from arlm.trace import run_trace
from arlm.trace.page import render_page

from conftest import run_arlm

PROMPT = "The cat sat on the"


def _trace(llm, prompts, params, **kw):
    return run_trace(llm, [llm.tokenizer.encode(p) for p in prompts], params, measure=False, **kw)


def test_steps_slots_bytes_and_shapes_are_the_engines(smollm2, monkeypatch):
    llm = smollm2
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    plain = llm.generate([PROMPT], params)[0].token_ids
    seen = []  # the token count of each embedding lookup: what the model saw each step
    embed = llm.runner.native.embed
    monkeypatch.setattr(llm.runner.native, "embed", lambda tokens, out=None: seen.append(tokens.numel())
                        or embed(tokens, out))
    trace = run_trace(llm, [ids], params, measure=False)
    steps = trace["steps"]
    assert trace["outputs"][0]["ids"] == plain  # tracing changes nothing
    # the prefill samples the first token; each further token is one decode step
    assert [s["phase"] for s in steps] == ["prefill"] + ["decode"] * (params.max_new_tokens - 1)
    cache = llm.engine.cache
    per_token = 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads of 64, float32
    assert trace["cache"]["bytes_per_token"] == cache.bytes_per_token == per_token
    assert trace["cache"]["shape"] == list(cache.k.shape)
    for i, s in enumerate(steps):
        (seq,) = s["sequences"]
        cached = len(ids) + i
        assert seq["slots_occupied"] == s["kv"]["tokens_cached"] == cached
        assert seq["slots_written"] == ([0, len(ids)] if i == 0 else [cached - 1, cached])
        assert s["bytes_kv"] == cached * cache.bytes_per_token
        assert s["kv"]["pool_bytes"] == cache.k.nbytes + cache.v.nbytes
        assert seen[i] == s["tokens"] == seq["shape"][1] == (len(ids) if i == 0 else 1)
        assert s["batch_shape"] == [1, seq["shape"][1]]
        assert seq["input_ids"] == (ids if i == 0 else [plain[i - 1]])
        assert seq["sampled"] == [plain[i]]
        assert s["bytes_weights"] == trace["weights_bytes"]["layers"] + trace["weights_bytes"]["head"] > 0
    assert len(seen) == len(steps)
    # the recorded distribution is the model's: a separate forward pass over the same tokens
    with torch.inference_mode():
        logits = llm.model(torch.tensor([ids + plain[:2]]))[0, -1].double()
    d = steps[2]["sequences"][0]["distributions"][0]
    p = torch.softmax(logits, -1)
    assert d["ids"][0] == plain[2] == int(p.argmax()) and d["sampled"] == plain[2]
    assert d["p"] == pytest.approx(p[d["ids"]].tolist(), abs=1e-5)
    assert d["kept"] == [True] + [False] * (len(d["ids"]) - 1)  # greedy keeps the argmax alone


def test_paged_batch_blocks_and_the_sampling_cut(smollm2):
    llm = smollm2
    prompts = [PROMPT, "Once upon a time, in a land far away,"]
    params = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.5, seed=7)
    bs = 4
    engine = Engine(llm.runner, llm.tokenizer.eos_ids, EngineConfig(block_size=bs, kv_cache_tokens=128))
    trace = _trace(llm, prompts, params, engine=engine)
    assert trace["cache"]["layout"] == "paged" and trace["cache"]["blocks"] == 32
    for s in trace["steps"]:
        owners = {}
        for seq in s["sequences"]:
            assert len(seq["blocks"]) == math.ceil(seq["slots_occupied"] / bs)
            for b in seq["blocks"]:
                assert owners.setdefault(b, seq["seq"]) == seq["seq"]  # no block in two sequences
        assert s["kv"]["blocks_used"] >= len(owners)
        for seq in s["sequences"]:
            for d in seq["distributions"]:
                kept = [p for p, k in zip(d["p_sampling"], d["kept"]) if k]
                assert sum(kept) <= 1 + 1e-6 and all(p == 0 for p, k in zip(d["p_sampling"], d["kept"]) if not k)
                # top-p 0.5: a token is kept only while the mass ranked above it is below 0.5
                assert d["kept"][0]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert [o["ids"] for o in trace["outputs"]] == alone  # seeded rows: the same tokens as alone


def test_speculative_steps_are_verifications(smollm2):
    llm = smollm2
    prompt = "one two three four one two three four one two three four one two"
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    plain = llm.generate([prompt], params)[0].token_ids
    # (fixed drafts: the adaptive rule follows the engine's measured step times, and under load it
    # may draft nothing, leaving no verification step)
    trace = _trace(llm, [prompt], params, drafter=llm.drafter(SpeculativeConfig("ngram", adaptive=False)))
    assert trace["speculative"] == "ngram"
    assert trace["outputs"][0]["ids"] == plain
    verify = [seq for s in trace["steps"] for seq in s["sequences"] if seq["phase"] == "verify"]
    assert verify and all(seq["accepted"] == len(seq["sampled"]) - 1 for seq in verify)
    assert sum(len(seq["sampled"]) for s in trace["steps"] for seq in s["sequences"]) == len(plain)


def test_cli_bad_input_is_one_line(tmp_path, capfd):
    cases = ((["trace", ""], "empty"), (["trace", "hi", "--out", str(tmp_path / "no" / "x.html")], "no directory"),
             (["trace", "hi", "--batch-prompts", str(tmp_path / "missing.txt")], "cannot read"))
    for i, (args, word) in enumerate(cases):
        if i == 0:  # the process end to end; the others through the same main() in this one
            r = subprocess.run([sys.executable, "-m", "arlm", *args], capture_output=True, text=True, timeout=300)
        else:
            r = run_arlm(capfd, *args)
        assert r.returncode == 2 and word in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and not r.stdout


# -- the page in a real browser ------------------------------------------------------------------------

def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "Debian's chromium is missing: `make install-test` installs it (apt-get install chromium)"
    return path


@pytest.fixture(scope="module")
def page_file(smollm2, tmp_path_factory):
    trace = _trace(smollm2, [PROMPT, "The capital of France is"], SamplingParams(max_new_tokens=8, temperature=0.7,
                                                                                top_p=0.9, seed=1))
    trace["prompts"][0]["text"] += "</script><!-- <b>"  # text that must not break the page
    path = tmp_path_factory.mktemp("trace") / "trace.html"
    path.write_text(render_page(trace), encoding="utf-8")
    return path, trace


@pytest.mark.slow  # a real browser
def test_page_steps_clicks_and_fits_a_phone(page_file, tmp_path):
    from playwright.sync_api import sync_playwright

    path, trace = page_file
    n = len(trace["steps"])
    first_decode = next(i for i, s in enumerate(trace["steps"]) if s["phase"] == "decode")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            for width, height in ((1280, 900), (390, 844)):
                page = browser.new_page(viewport={"width": width, "height": height})
                errors, remote = [], []
                page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.on("request", lambda r: remote.append(r.url) if not r.url.startswith(("file:", "data:")) else None)
                page.goto(path.as_uri())
                step = lambda: int(page.evaluate("document.body.dataset.step"))  # noqa: E731
                assert step() == 0
                assert "".join(page.locator("#stream .tok").all_inner_texts()[:5]) == PROMPT
                page.keyboard.press("ArrowRight")
                page.keyboard.press("ArrowRight")
                assert step() == 2
                page.keyboard.press("ArrowLeft")
                assert step() == 1
                page.click("#next")
                assert step() == 2
                page.click("#prev")
                page.click("#prev")
                assert step() == 0 and "prefill" in page.inner_text("#stepinfo")
                page.click('#code .ln[data-kind="decode"]')  # a code line jumps to a step that runs it
                assert step() == first_decode
                assert page.locator("#code .ln.run").first.get_attribute("data-kind") == "decode"
                page.click(f'#timeline [data-step="{n - 1}"]')
                assert step() == n - 1
                page.keyboard.press("Home")
                assert step() == 0
                assert page.locator("#kv .slot").count() > 0 and page.locator("#dist .row").count() == 10
                assert page.locator("#chart rect.bar").count() == 3 * n  # time; weights + K/V bytes
                # no horizontal scrolling: the page fits the screen
                assert page.evaluate("document.documentElement.scrollWidth") <= width
                page.screenshot(path=str(tmp_path / f"trace-{width}.png"), full_page=True)
                assert (tmp_path / f"trace-{width}.png").stat().st_size > 10_000
                assert errors == [] and remote == []
                page.close()
        finally:
            browser.close()


def test_trace_json_round_trips(page_file):
    _, trace = page_file
    assert json.loads(json.dumps(trace)) == trace


def test_terminal_view_shows_every_step(page_file):
    from rich.console import Console

    from arlm.trace.tui import print_trace

    _, trace = page_file
    console = Console(record=True, width=110, force_terminal=False)
    print_trace(trace, console)
    text = console.export_text()
    for s in trace["steps"]:
        assert f"step {s['step']} · {s['phase']}" in text
    assert "KV slots" in text and trace["outputs"][0]["text"].strip()[:10] in text


def test_machine_ceilings_are_measured_once(tmp_path, monkeypatch):
    import arlm.trace.tracer as tr

    monkeypatch.setenv("ARLM_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(tr, "measure_ceilings", lambda: calls.append(1) or {"bandwidth": 2e10, "flops": 1e11})
    first, again = tr.machine_ceilings(), tr.machine_ceilings()
    assert calls == [1] and first == again and first["bandwidth"] == 2e10
    assert json.loads((tmp_path / "machine.json").read_text())


def test_the_probe_measures_something_plausible(monkeypatch):
    from types import SimpleNamespace

    import arlm.trace.tracer as tr

    # Units and arithmetic on a clock that advances 10 ms a reading, so that every timed pass
    # takes 10 ms: 256 MiB read in 10 ms, a 512x576 by 576x1536 product in 10 ms. (Bounds on what
    # the real clock gives would follow the machine's load.)
    ticks = iter(range(10**6))
    monkeypatch.setattr(tr, "time", SimpleNamespace(perf_counter=lambda: 0.01 * next(ticks)))
    c = tr.measure_ceilings(seconds=0.2)
    assert c["bandwidth"] == pytest.approx((1 << 26) * 4 / 0.01)
    assert c["flops"] == pytest.approx(2 * 512 * 576 * 1536 / 0.01)
    monkeypatch.undo()
    c = tr.measure_ceilings(seconds=0.2)  # the real clock: positive, finite numbers at any load
    assert c["bandwidth"] > 0 and c["flops"] > 0 and math.isfinite(c["bandwidth"]) and math.isfinite(c["flops"])
