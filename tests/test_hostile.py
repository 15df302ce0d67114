"""A hostile-request battery against `arlm serve`: one costly or malformed request at a time,
sent beside ordinary traffic.

For each hostile case, while 8 ordinary greedy streams run beside it, the 8 take at most 2x the
engine's CPU time they take alone (from the first one's arrival to the last one's last token) and
each at most 2x the engine steps it takes alone (from its arrival to its last token), /health answers (200) while the HTTP event loop spends under a
second on other work (and at most MAX_HEALTH_STEPS engine steps pass), the server's RSS stays
bounded and the ordinary outputs equal their solo runs; the hostile request itself gets either a
4xx naming the field at fault (OpenAI's error body) or completes normally (200), never a 500 and
never a hang. A greedy request after the storm equals its run before.

The clocks are the server's threads' CPU time and the engine's step counter, not seconds
(tests/step_log.py: the server's engine logs each request's arrival, each step's rows and the
engine thread's CPU time in it; the event loop's thread is read from /proc): a loaded machine
stretches every step's wall time, not the work a step does nor the scheduler's decisions, so the
outcome does not follow the machine's load. A hostile request that makes every step costlier (a
logit bias over the vocabulary, a grammar's masks) costs the streams engine CPU; one that holds
them back costs them steps; one that holds the event loop costs it CPU time while /health waits
(or, where the loop waits on something, engine steps pass meanwhile). Drafting is fixed
(`--speculative-fixed`): adaptive drafting drafts by the steps' wall time. What the steps cost in
seconds beside each kind of hostile request is benchmarks/fairness.py's.

One server for the module (`--speculative ngram`, so that grammars, logprobs and drafting meet in
one step). The reference for the ordinary streams' cost is their run as a set of 8 with nothing
else ("alone": the median of BASELINE_RUNS runs); for their texts, each prompt run by
itself. A case that leaves the server dead or busy gets a fresh server, so the cases after it
still measure something.

Every case's numbers (status, the streams' CPU and steps against alone, /health's worst loop CPU
and steps, RSS) are printed, and the whole table with the last test: run with `pytest -rA` to
read them for passing cases too.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from servers import HTTP_TIMEOUT, MODEL, ServerProcess, free_port
from step_log import StepLog, thread_cpu

pytestmark = pytest.mark.slow

MAX_BODY_BYTES = 4 << 20
# The server's engine threads. Two cores on the reference machine, and the test's own client
# threads (8 streams, the /health poller) need some of them: one engine thread leaves them one.
SERVER_THREADS = 1

PROMPTS = ["The cat sat on the", "Once upon a time", "def fibonacci(n):", "The capital of France is",
           "1, 2, 3, 4,", "Hello, my name is", "In 1492, Columbus", "The best way to learn Python is"]
STREAM_TOKENS = 32
BASELINE_RUNS = 3
# The ordinary streams' engine CPU seconds (and each one's engine steps) beside a hostile request
# over theirs alone
MAX_RATIO = 2.0


def cpu_bound(body) -> float:
    """MAX_RATIO, or the rows a hostile request adds to the 8 streams' steps where it asks for
    more than one sequence (n): a step's CPU grows with its rows, so 16 sampled choices batched
    beside 8 streams may cost each step up to (8 + 16) / 8 = 3x its work alone (2.16x measured;
    the streams' steps themselves stay x1.00, which `step_ratio` checks against MAX_RATIO)."""
    n = body.get("n", 1) if isinstance(body, dict) and isinstance(body.get("n", 1), int) else 1
    return max(MAX_RATIO, (len(PROMPTS) + n) / len(PROMPTS))
# The HTTP event loop's CPU seconds while one /health call is answered: ~0 while the loop is free;
# one request's work on it (a 10 MB body parsed, a grammar compiled on it) is what it waits behind.
MAX_HEALTH_LOOP_CPU_S = 1.0
# Engine steps while one /health call is answered (on the HTTP loop, beside the engine's thread):
# ~0-2 while the loop is free; a loop held waiting (not computing) lets dozens pass.
MAX_HEALTH_STEPS = 16
HEALTH_EVERY_S = 0.2  # (how often /health is asked: a sampling rate, not a bound)
HEALTH_TIMEOUT_S = 60.0  # a /health call that takes longer fails: a hang guard
HOSTILE_TIMEOUT_S = 300.0  # the hostile request's own time-out: reaching it is a hang (a guard, not a bound)
RSS_MARGIN = 1.5 * 2**30  # bytes over the RSS measured before the battery
# What a hostile request that legitimately generates asks for: enough to overlap the ordinary
# streams (32 tokens each) several times over.
HOSTILE_TOKENS = 256


# -- the server -----------------------------------------------------------------------------------

class HostileServer(ServerProcess):
    """`ServerProcess` whose engine logs its arrivals and steps (`steps`: tests/step_log.py), the
    thread width pinned (`--threads`)."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        step_log = tempfile.NamedTemporaryFile("w", suffix=".steps.jsonl", delete=False)
        step_log.close()
        self.steps = StepLog(step_log.name)
        env = {**os.environ, "OMP_NUM_THREADS": str(SERVER_THREADS), "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("step_log.py")), step_log.name,
                                      "serve", "--model", MODEL, "--port", str(self.port),
                                      "--threads", str(SERVER_THREADS), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def stop(self) -> None:
        super().stop()
        os.unlink(self.steps.path)

    def rss(self) -> int:
        """The process's resident set in bytes (0 once it has exited)."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            return 0

    def healthy(self) -> bool:
        """Alive, /health 200 (HEALTH_TIMEOUT_S: a hang guard) and nothing running or waiting
        within 60 s."""
        if self.proc.poll() is not None:
            return False
        try:
            if httpx.get(f"{self.url}/health", timeout=HEALTH_TIMEOUT_S).status_code != 200:
                return False
            m = self.wait_idle(timeout=60)
        except (httpx.HTTPError, KeyError):
            return False
        return m["arlm_num_requests_running"] == 0 and m["arlm_num_requests_waiting"] == 0


SERVER_ARGS = ("--speculative", "ngram", "--speculative-fixed", "--max-body-bytes", str(MAX_BODY_BYTES))


@dataclass
class Battery:
    """The module's server (replaced when a case leaves it dead or busy) and what the cases are
    measured against."""

    server: HostileServer
    solo: list[str] = field(default_factory=list)  # each prompt's text, run by itself
    prompts: dict[str, int] = field(default_factory=dict)  # the engine's prompt digest -> its index in PROMPTS
    alone: list[float] = field(default_factory=list)  # each prompt's engine steps in the 8 streams alone
    alone_cpu: float = 0.0  # the engine's CPU seconds over the 8 streams alone (the runs' median)
    alone_runs: list[float] = field(default_factory=list)  # those of each run
    rss0: int = 0  # bytes, before the battery (after the baseline's runs)
    before: str = ""  # the greedy request's text before the battery
    restarts: list[str] = field(default_factory=list)  # the cases after which the server was replaced
    results: dict[str, dict] = field(default_factory=dict)

    def restart(self, after: str) -> None:
        self.server.stop()
        self.server = HostileServer(*SERVER_ARGS)
        self.server.wait_ready()
        self.restarts.append(after)


# -- ordinary traffic -----------------------------------------------------------------------------

def stream_chat(url: str, prompt: str) -> str:
    """One greedy streamed chat reply's text (STREAM_TOKENS tokens at most); an error event
    in the stream raises."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": STREAM_TOKENS,
            "temperature": 0, "stream": True}
    text = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT) as r:
        if r.status_code != 200:
            raise AssertionError(f"ordinary stream got {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise AssertionError(f"ordinary stream failed in-band: {chunk['error']}")
            if chunk.get("choices"):
                text += chunk["choices"][0]["delta"].get("content") or ""
    return text


def run_streams(server: HostileServer, prompts: dict[str, int]) -> tuple[list[str | Exception], list[int | None],
                                                                        float | None]:
    """The 8 ordinary streams at once: each reply's text (or error), each one's engine steps from
    its arrival to its last token (None: it never reached the engine), and the engine thread's CPU
    seconds from the first one's arrival to the last one's last token (None: one never reached
    it). `prompts`: the engine's digest of each stream's prompt -> its index (`Battery.prompts`)."""
    out: list[str | Exception] = [""] * len(PROMPTS)

    def one(i: int) -> None:
        try:
            out[i] = stream_chat(server.url, PROMPTS[i])
        except Exception as e:  # noqa: BLE001 - reported by the case
            out[i] = e

    steps = server.steps
    steps.read()
    arrived = len(steps.added)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    steps.read()  # (a step is logged before its tokens go out: the streams' last steps are in)
    spans: list[int | None] = [None] * len(PROMPTS)
    rids = []
    for rid, prompt in steps.arrivals(arrived).items():
        if prompt in prompts and rid in steps.last:  # (one that failed before its first step: None)
            spans[prompts[prompt]] = steps.span(rid)
            rids.append(rid)
    return out, spans, steps.span_cpu(rids) if None not in spans else None


class Watch:
    """/health every HEALTH_EVERY_S seconds and the server's RSS, from a thread, until stopped:
    the most CPU seconds the HTTP event loop's thread spent and the most engine steps that passed
    while one /health call was answered, the statuses other than 200 and the largest RSS seen."""

    def __init__(self, server: HostileServer) -> None:
        self.server = server
        self.max_loop_cpu = 0.0
        self.max_steps = 0
        self.calls = 0
        self.bad: list[str] = []
        self.max_rss = server.rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        steps, pid = self.server.steps, self.server.proc.pid

        def loop_cpu() -> float | None:
            """The event loop thread's CPU seconds (None: not known yet, a fresh server before its
            first request; or the server exited: its /health fails too)."""
            try:
                return None if steps.http_tid is None else thread_cpu(pid, steps.http_tid)
            except OSError:
                return None

        with httpx.Client(timeout=HEALTH_TIMEOUT_S) as c:
            while not self._stop.is_set():
                before, cpu = steps.read(), loop_cpu()
                try:
                    status = c.get(f"{self.server.url}/health").status_code
                    if status != 200:
                        self.bad.append(str(status))
                except httpx.HTTPError as e:
                    self.bad.append(type(e).__name__)
                if cpu is not None and (after := loop_cpu()) is not None:
                    self.max_loop_cpu = max(self.max_loop_cpu, after - cpu)
                self.max_steps = max(self.max_steps, steps.read() - before)
                self.calls += 1
                self.max_rss = max(self.max_rss, self.server.rss())
                self._stop.wait(HEALTH_EVERY_S)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def greedy_probe(url: str) -> str:
    """The greedy reply compared before and after the storm (not streamed)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a short poem about the sea."}],
            "max_tokens": 64, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text[:500]
    c = r.json()["choices"][0]
    return f"{c['message']['content']!r} ({c['finish_reason']}, {r.json()['usage']['completion_tokens']} tokens)"


@pytest.fixture(scope="module")
def battery():
    server = HostileServer(*SERVER_ARGS)
    b = Battery(server)
    try:
        server.wait_ready()
        for i, prompt in enumerate(PROMPTS):  # (one at a time: the i-th arrival is PROMPTS[i])
            server.steps.read()
            arrived = len(server.steps.added)
            b.solo.append(stream_chat(server.url, prompt))
            server.steps.read()
            (digest,) = server.steps.arrivals(arrived).values()
            b.prompts[digest] = i
        assert len(b.prompts) == len(PROMPTS) and server.steps.http_tid is not None
        run_streams(server, b.prompts)  # (a warm-up: the first batch's steps do more)
        runs = []
        for _ in range(BASELINE_RUNS):
            texts, spans, cpu = run_streams(server, b.prompts)
            assert texts == b.solo, f"the 8 streams at once differ from their solo runs: {texts} vs {b.solo}"
            runs.append((spans, cpu))
        b.alone = [statistics.median(run[0][i] for run in runs) for i in range(len(PROMPTS))]
        b.alone_runs = [round(run[1], 3) for run in runs]
        b.alone_cpu = statistics.median(b.alone_runs)
        b.before = greedy_probe(server.url)
        server.wait_idle()
        b.rss0 = server.rss()
        print(f"\nalone: {alone(b)}, RSS {b.rss0 / 2**20:.0f} MiB")
        yield b
    finally:
        b.server.stop()


# -- the hostile requests -------------------------------------------------------------------------

def chat(content: str = "Describe yourself.", **fields: Any) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


def schema_props(n: int, required: bool) -> dict:
    props = {f"field_{i:05d}": {"type": "string", "maxLength": 40} for i in range(n)}
    schema = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        schema["required"] = list(props)
    return schema


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "hostile", "schema": schema}}


def deep_schema(depth: int) -> dict:
    """`depth` levels of nesting, objects and arrays in turn, a string at the bottom."""
    s: dict = {"type": "string", "maxLength": 8}
    for level in range(depth):
        if level % 2:
            s = {"type": "array", "items": s, "minItems": 1, "maxItems": 2}
        else:
            s = {"type": "object", "properties": {"x": s}, "required": ["x"], "additionalProperties": False}
    return s


def words(n: int, prefix: str) -> list[str]:
    return [f"{prefix}{i:05d}" for i in range(n)]


def tools(n: int, props: int) -> list[dict]:
    """n functions, each with `props` described parameters of assorted types."""
    types = [{"type": "string", "maxLength": 64}, {"type": "integer", "minimum": 0, "maximum": 10**6},
             {"type": "number"}, {"type": "boolean"}, {"type": "string", "enum": ["red", "green", "blue"]},
             {"type": "array", "items": {"type": "string"}, "maxItems": 4}]
    out = []
    for i in range(n):
        params = {f"param_{j}": {**types[j % len(types)], "description": f"parameter {j} of tool {i}"}
                  for j in range(props)}
        out.append({"type": "function", "function": {
            "name": f"tool_{i:04d}", "description": f"Tool number {i}: does thing {i} to its parameters.",
            "parameters": {"type": "object", "properties": params, "required": list(params)[:props // 2]}}})
    return out


LONG_PROMPT_IDS = 4000  # tokens (the context is 8192): its logprobs take the LM head over every position


def long_prompt(url: str) -> list[int]:
    """LONG_PROMPT_IDS token ids of ordinary English text (a sentence's ids, repeated)."""
    sentence = "The quick brown fox jumps over the lazy dog, and the dog does not mind at all. "
    r = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": sentence, "add_special_tokens": False},
                   timeout=HTTP_TIMEOUT)
    ids = r.json()["tokens"]
    return (ids * (LONG_PROMPT_IDS // len(ids) + 1))[:LONG_PROMPT_IDS]


@dataclass(frozen=True)
class Case:
    """One hostile request. body: the JSON body or raw bytes, built from the server's URL when
    the case runs.
    params: the `param` values a 4xx may name (a prefix match: "tools" covers "tools.3");
    statuses: the statuses it may get."""

    id: str
    body: Callable[[str], dict | bytes]
    params: tuple[str, ...]
    path: str = "/v1/chat/completions"
    statuses: tuple[int, ...] = (200, 400)
    note: str = ""


CASES = [
    Case("schema_3000_required",
         lambda url: chat(response_format=json_schema(schema_props(3000, True)), max_tokens=HOSTILE_TOKENS,
                          temperature=0),
         ("response_format",), note="3000 string properties (maxLength 40), all required"),
    Case("schema_3000_optional",
         lambda url: chat(response_format=json_schema(schema_props(3000, False)), max_tokens=HOSTILE_TOKENS,
                          temperature=0),
         ("response_format",), note="3000 string properties (maxLength 40), none required"),
    Case("schema_depth_60",
         lambda url: chat(response_format=json_schema(deep_schema(60)), max_tokens=HOSTILE_TOKENS, temperature=0),
         ("response_format",), note="60 levels of objects and arrays"),
    Case("schema_depth_200",
         lambda url: chat(response_format=json_schema(deep_schema(200)), max_tokens=HOSTILE_TOKENS, temperature=0),
         ("response_format",), note="200 levels of objects and arrays: ~400 levels of JSON nesting in the body"),
    Case("schema_self_ref_required",
         lambda url: chat(response_format=json_schema(
             {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
              "$ref": "#/$defs/n"}), max_tokens=HOSTILE_TOKENS, temperature=0),
         ("response_format",), statuses=(400,),
         note="a required self-reference: no finite instance, only 400 is right"),
    Case("regex_alt_star", lambda url: chat(guided_regex="(a|aa)*b", max_tokens=HOSTILE_TOKENS, temperature=0),
         ("guided_regex",)),
    Case("regex_nested_plus", lambda url: chat(guided_regex="(x+x+)+y", max_tokens=HOSTILE_TOKENS, temperature=0),
         ("guided_regex",)),
    Case("regex_count_100000",
         lambda url: chat(guided_regex="a{1,100000}", max_tokens=HOSTILE_TOKENS, temperature=0), ("guided_regex",)),
    Case("regex_nested_count",
         lambda url: chat(guided_regex="((a{1,1000}){1,1000}){1,1000}", max_tokens=HOSTILE_TOKENS, temperature=0),
         ("guided_regex",)),
    Case("enum_20000",
         lambda url: chat(response_format=json_schema({"enum": words(20000, "value_")}), max_tokens=HOSTILE_TOKENS,
                          temperature=0),
         ("response_format",), note="a JSON schema enum of 20000 strings"),
    Case("choice_5000",
         lambda url: chat(guided_choice=words(5000, "choice number "), max_tokens=HOSTILE_TOKENS, temperature=0),
         ("guided_choice",), note="guided_choice among 5000 strings"),
    Case("json_speculative_logprobs",
         lambda url: chat(response_format={"type": "json_object"}, logprobs=True, top_logprobs=5,
                          max_tokens=HOSTILE_TOKENS, temperature=0),
         ("response_format", "logprobs", "top_logprobs"), note="a grammar, ngram drafts and logprobs in one request"),
    Case("logit_bias_40000",
         lambda url: chat(logit_bias={str(t): (t % 7 - 3) / 10 for t in range(40000)}, max_tokens=HOSTILE_TOKENS,
                          temperature=0),
         ("logit_bias",), note="40000 of the 49152 tokens biased by -0.3..0.3"),
    Case("n_16_sampled", lambda url: chat(n=16, max_tokens=HOSTILE_TOKENS, temperature=1.0, seed=7), ("n",),
         note="n at its limit (16), sampled"),
    Case("stop_16_long",
         lambda url: chat(stop=[f"{i}" * 4000 for i in range(16)], max_tokens=HOSTILE_TOKENS, temperature=0),
         ("stop",), note="16 stop strings (the limit) of 4000 characters"),
    Case("stop_5000", lambda url: chat(stop=words(5000, "stop here "), max_tokens=HOSTILE_TOKENS, temperature=0),
         ("stop",), note="5000 stop strings"),
    Case("top_logprobs_20_long",
         lambda url: chat(logprobs=True, top_logprobs=20, max_tokens=1024, ignore_eos=True, temperature=0),
         ("top_logprobs", "logprobs", "max_tokens"), note="1024 tokens (EOS ignored), the top 20 of each"),
    Case("echo_logprobs_long_prompt",
         lambda url: {"model": MODEL, "prompt": long_prompt(url), "echo": True, "logprobs": 5, "max_tokens": 0},
         ("prompt", "max_tokens", "logprobs"), path="/v1/completions",
         note=f"echo: a {LONG_PROMPT_IDS}-token prompt's logprobs (top 5), max_tokens 0"),
    Case("body_over_limit",
         lambda url: json.dumps(chat("x" * (MAX_BODY_BYTES + (1 << 20)), max_tokens=4)).encode(),
         (), statuses=(413,), note="5 MiB against a 4 MiB limit"),
    Case("tools_300_big", lambda url: chat(tools=tools(300, 24), max_tokens=HOSTILE_TOKENS, temperature=0),
         ("tools", "messages"), note="300 functions x 24 parameters: over the context once shown"),
    # the other protocols' routes: the same costs asked in their own fields
    Case("responses_schema_3000",
         lambda url: {"model": MODEL, "input": "Describe yourself.", "max_output_tokens": HOSTILE_TOKENS,
                      "temperature": 0, "text": {"format": {"type": "json_schema", "name": "x",
                                                            "schema": schema_props(3000, True)}}},
         ("text.format",), path="/v1/responses", note="Responses: text.format with 3000 required properties"),
    Case("messages_tools_300",
         lambda url: {"model": MODEL, "max_tokens": HOSTILE_TOKENS, "temperature": 0,
                      "messages": [{"role": "user", "content": "Describe yourself."}],
                      "tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                                 "input_schema": t["function"]["parameters"]} for t in tools(300, 24)]},
         ("tools", "messages"), path="/v1/messages", note="Messages: 300 tools x 24 parameters"),
    # (base64, as the openai SDK asks by default: 2,048 vectors as float lists are 10 MB of JSON, whose
    # parsing in this process held the GIL ~1 s and delayed the /health watch's own requests)
    Case("embeddings_2048",
         lambda url: {"model": MODEL, "input": [f"sentence number {i} about the weather" for i in range(2048)],
                      "encoding_format": "base64"},
         ("input",), path="/v1/embeddings", note="2048 inputs in one embeddings request"),
    Case("tools_10_fit",
         lambda url: chat(tools=tools(10, 12), tool_choice="required", max_tokens=HOSTILE_TOKENS, temperature=0),
         ("tools", "messages"),
         note="10 functions x 12 parameters: shown within the context (~5000 tokens), one grammar over them all"),
]


def send(url: str, case: Case, body: dict | bytes) -> dict:
    """The hostile request, not streamed: {status, message, param, seconds}; status "timeout"
    or the exception's name where no response came."""
    t0 = time.monotonic()
    try:
        if isinstance(body, bytes):
            r = httpx.post(f"{url}{case.path}", content=body, headers={"content-type": "application/json"},
                           timeout=HOSTILE_TIMEOUT_S)
        else:
            r = httpx.post(f"{url}{case.path}", json=body, timeout=HOSTILE_TIMEOUT_S)
    except httpx.TimeoutException:
        return {"status": "timeout", "message": f"no response in {HOSTILE_TIMEOUT_S:.0f} s", "param": None,
                "seconds": time.monotonic() - t0}
    except httpx.HTTPError as e:
        return {"status": type(e).__name__, "message": str(e)[:200], "param": None, "seconds": time.monotonic() - t0}
    out = {"status": r.status_code, "seconds": time.monotonic() - t0, "param": None, "message": "", "shape_ok": True}
    try:
        payload = r.json()
    except ValueError:
        out["message"], out["shape_ok"] = f"not JSON: {r.text[:200]!r}", False
        return out
    if case.path.startswith("/v1/messages"):  # Anthropic's shapes: the field named first in the message
        if r.status_code == 200:
            out["message"] = f"stop_reason {payload.get('stop_reason')}, {payload.get('usage')}"
            out["shape_ok"] = payload.get("type") == "message" and payload.get("stop_reason") is not None
        else:
            err = payload.get("error") if isinstance(payload, dict) else None
            out["shape_ok"] = payload.get("type") == "error" and isinstance(err, dict) and set(err) == {"type",
                                                                                                       "message"}
            out["message"] = str((err or {}).get("message"))[:300]
            out["param"] = out["message"].partition(":")[0]
        return out
    if r.status_code == 200 and case.path in ("/v1/responses", "/v1/embeddings"):
        if case.path == "/v1/responses":
            out["message"] = f"status {payload.get('status')}, {payload.get('usage')}"
            out["shape_ok"] = payload.get("object") == "response" and payload.get("status") in ("completed",
                                                                                                "incomplete")
        else:
            out["message"] = f"{len(payload.get('data', []))} vectors, {payload.get('usage')}"
            out["shape_ok"] = payload.get("object") == "list" and bool(payload.get("data"))
        return out
    if r.status_code == 200:
        choices = payload.get("choices") or []
        reasons = sorted({c.get("finish_reason") for c in choices}, key=str)
        tokens = (payload.get("usage") or {}).get("completion_tokens")
        out["message"] = f"{len(choices)} choice(s), finish {reasons}, {tokens} tokens"
        out["shape_ok"] = bool(choices) and all(c.get("finish_reason") for c in choices)
    else:
        err = payload.get("error") if isinstance(payload, dict) else None
        out["shape_ok"] = isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
        if isinstance(err, dict):
            out["message"], out["param"], out["code"] = str(err.get("message"))[:300], err.get("param"), err.get("code")
        else:
            out["message"] = r.text[:300]
    return out


def alone(b: Battery) -> str:
    return f"the 8 streams' engine CPU {b.alone_cpu:.3f} s (runs {b.alone_runs}), engine steps {b.alone}"


def row(case_id: str, r: dict) -> str:
    """One case's line of the table."""
    status = f"{r['status']}" + (f" ({r['param']})" if r.get("param") else "")
    bad = f" non-200: {','.join(sorted(set(r['health_bad'])))}" if r["health_bad"] else ""
    return (f"{case_id:26} {status:22} {r['seconds']:6.1f}s  CPU x{r['cpu_ratio']:4.2f} steps x{r['ratio']:4.2f}  "
            f"health max loop {r['health_loop_cpu']:4.2f} s, {r['health_steps']:3d} steps ({r['health_calls']} calls){bad}  "
            f"RSS max {r['rss_max'] / 2**20:5.0f} MiB  "
            f"outputs {'equal' if r['outputs_equal'] else 'DIFFER'}{'  RESTARTED' if r.get('restarted') else ''}"
            f"  | {r['message'][:160]}")


def server_reason(server: HostileServer) -> str:
    """The last error line of the server's log (a 500's cause: the body only names the
    exception's type)."""
    lines = [ln for ln in server.output().splitlines() if "Error" in ln or "failed" in ln]
    return lines[-1][:300] if lines else ""


def step_ratio(spans: list[int | None], alone: list[float]) -> float:
    """The largest of each stream's engine steps over its steps alone (inf: one never ran)."""
    return max(float("inf") if s is None else s / a for s, a in zip(spans, alone))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile(battery: Battery, case: Case):
    server = battery.server
    body = case.body(server.url)  # (built before it is sent: the client's work is not the server's)
    box: dict = {}
    hostile = threading.Thread(target=lambda: box.update(send(server.url, case, body)), daemon=True)
    with Watch(server) as watch:
        hostile.start()
        time.sleep(0.05)  # (the hostile request first, the ordinary ones after it: an order, no bound)
        texts, spans, cpu = run_streams(server, battery.prompts)
        hostile.join(HOSTILE_TIMEOUT_S + 10)
    r = dict(box) or {"status": "timeout", "message": "the client thread did not return", "param": None,
                      "seconds": HOSTILE_TIMEOUT_S}
    r.update(spans=spans, ratio=step_ratio(spans, battery.alone), cpu=cpu if cpu is None else round(cpu, 3),
             cpu_ratio=float("inf") if cpu is None else cpu / battery.alone_cpu, health_loop_cpu=watch.max_loop_cpu, health_steps=watch.max_steps,
             health_calls=watch.calls, health_bad=watch.bad, rss_max=max(watch.max_rss, server.rss()),
             outputs_equal=texts == battery.solo,
             errors=[f"{PROMPTS[i]!r}: {t}" for i, t in enumerate(texts) if isinstance(t, Exception)])
    if r["status"] == 500:
        r["message"] += f" (server log: {server_reason(server)})"
    if not server.healthy():
        battery.restart(case.id)
        r["restarted"] = True
    battery.results[case.id] = r
    print("\n" + row(case.id, r))

    what = (f"[{case.id}: {case.note or 'as named'}] hostile: {r['status']} param={r.get('param')!r}: "
            f"{r['message']}; the streams' engine CPU {r['cpu']} s against {battery.alone_cpu:.3f} s "
            f"alone (x{r['cpu_ratio']:.2f}), their engine steps {spans} against {battery.alone} (x{r['ratio']:.2f}); "
            f"/health: at most {r['health_loop_cpu']:.2f} s of the event loop's CPU and {r['health_steps']} engine "
            f"steps while one was answered; "
            f"RSS max {r['rss_max'] / 2**20:.0f} MiB (before {battery.rss0 / 2**20:.0f} MiB)")
    failures = []
    if r["status"] not in case.statuses:
        failures.append(f"status {r['status']} not in {case.statuses}")
    if not r.get("shape_ok", False):
        failures.append("the body is not a completed response or an OpenAI error body")
    if r["status"] in range(400, 500) and case.params and not (
            isinstance(r["param"], str) and r["param"].startswith(case.params)):
        failures.append(f"the 4xx names {r['param']!r}, not one of {case.params}")
    if r["cpu_ratio"] > cpu_bound(body):
        failures.append(f"the ordinary streams took {r['cpu_ratio']:.2f}x their engine CPU time alone "
                        f"(> {cpu_bound(body):.2f})")
    if r["ratio"] > MAX_RATIO:
        failures.append(f"an ordinary stream took {r['ratio']:.2f}x its engine steps alone (> {MAX_RATIO})")
    if r["health_loop_cpu"] >= MAX_HEALTH_LOOP_CPU_S or r["health_steps"] > MAX_HEALTH_STEPS or r["health_bad"]:
        failures.append(f"/health: the event loop spent {r['health_loop_cpu']:.2f} s on other work (>= "
                        f"{MAX_HEALTH_LOOP_CPU_S}) and {r['health_steps']} engine steps passed (> {MAX_HEALTH_STEPS}) "
                        f"while one was answered, non-200: {r['health_bad']}")
    if r["rss_max"] > battery.rss0 + RSS_MARGIN:
        failures.append(f"RSS {r['rss_max'] / 2**20:.0f} MiB over {(battery.rss0 + RSS_MARGIN) / 2**20:.0f} MiB")
    if not r["outputs_equal"]:
        failures.append(f"ordinary outputs differ from their solo runs: {r['errors'] or texts}")
    if r.get("restarted"):
        failures.append("the server was left dead or busy (restarted)")
    assert not failures, what + "\n  " + "\n  ".join(failures)


def test_greedy_after_storm(battery: Battery):
    """The greedy request after every case equals its run before them (on the same server,
    unless a case left it dead: then the restart is named)."""
    after = greedy_probe(battery.server.url)
    print(f"\nalone: {alone(battery)}, "
          f"RSS before {battery.rss0 / 2**20:.0f} MiB, now {battery.server.rss() / 2**20:.0f} MiB")
    for case_id, r in battery.results.items():
        print(row(case_id, r))
    print(f"greedy before: {battery.before}\ngreedy after:  {after}")
    assert after == battery.before, (f"after the storm (server restarted after: {battery.restarts or 'none'}): "
                                     f"{after} != before: {battery.before}")
