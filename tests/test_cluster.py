"""`arlm serve --replicas 2` on a local Ray head: the same API from two replicas of one
thread each behind Ray Serve's ingress, routed by prompt prefix; compared with the single process."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from servers import BAD, HTTP_TIMEOUT, KEY, MODEL, ServerProcess
from test_serve_protocols import BAD_EMBEDDINGS, BAD_MESSAGES, BAD_RESPONSES

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {KEY}"}

SYSTEM = "You are the support assistant of a parcel company; answer in one short sentence. " * 12  # ~1,000 chars


# Sized to the work, not to a machine's speed: a replica's start (a Ray worker process, then the
# model) took 84 s beside two busy processes here, and the drain must outlast the rest of a 24-token
# stream (3 s of it at 8 tokens/s there) by far.
START_TIMEOUT = 600  # --replica-start-timeout: then the server gives up and says so
DRAIN_TIMEOUT = 30  # --drain-timeout: the product's default
# How long the ingress's router waits for a replica's answer to its queue-length probe. Ray's
# 0.1 s is missed on a loaded machine, and then Ray sends the request to the next replica the
# router ranked instead of the one it chose (a prefix not where its blocks are, two streams on
# one replica): here the answer is awaited, as it comes at any load (a hang guard's size).
QUEUE_PROBE_DEADLINE_S = 30
# tests/replica_gate: on the replicated server's PYTHONPATH, it gives each replica's engine a gate
# (its `hold` file) that test_sigterm_drains holds the streams at
GATE_PATH = str(Path(__file__).with_name("replica_gate"))


def port_below_ephemeral() -> int:
    """A free loopback port below the kernel's ephemeral range. Ray Serve's proxy binds the port
    when it runs, a minute on a loaded machine after the server starts, and meanwhile a port of that
    range may be handed to one of Ray's own processes binding port 0 (here a worker's gRPC server
    took the proxy's 34077: "Failed to bind to address"). Ray's fixed ports are below 20000."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except OSError:
        low = 32768
    for port in random.sample(range(20000, low), 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in 20000..{low}")


@pytest.fixture(scope="module")
def gate(tmp_path_factory) -> Path:
    """The replicas' engine gate's directory (tests/replica_gate/sitecustomize.py)."""
    return tmp_path_factory.mktemp("gate")


@pytest.fixture(scope="module")
def servers(gate):
    """(replicated, single): the same flags, one behind Ray Serve with 2 replicas of 1 thread."""
    single = ServerProcess("--kv-cache-tokens", "4096", "--api-key", KEY)
    port = port_below_ephemeral()  # (the last --port given is the one taken)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (GATE_PATH, os.environ.get("PYTHONPATH")) if p),
           "ARLM_TEST_ENGINE_GATE": str(gate), "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": str(QUEUE_PROBE_DEADLINE_S)}
    replicated = ServerProcess("--kv-cache-tokens", "4096", "--api-key", KEY, "--replicas", "2",
                               "--threads-per-replica", "1", "--drain-timeout", str(DRAIN_TIMEOUT),
                               "--replica-start-timeout", str(START_TIMEOUT), "--port", str(port), env=env)
    replicated.port, replicated.url = port, f"http://127.0.0.1:{port}"
    try:
        single.wait_ready()
        replicated.wait_ready(timeout=START_TIMEOUT + 120)  # (a hang guard: the server gives up first)
        yield replicated, single
    finally:
        # a drain, then Ray's own stop: ServerProcess.stop's 15 s would kill it midway, Ray's processes left
        replicated.proc.terminate()
        try:
            replicated.proc.wait(DRAIN_TIMEOUT + 90)
        except subprocess.TimeoutExpired:
            pass
        replicated.stop()
        single.stop()


class Stream(threading.Thread):
    """A streamed completion read on its own thread: its non-empty lines as they come, the replica
    serving it (`pid`), `started` set at its first token (or its end); `leave()` closes it."""

    def __init__(self, url: str, max_tokens: int, prompt: str = "Once upon a time") -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.prompt = url, max_tokens, prompt
        self.lines: list[str] = []
        self.pid: str | None = None
        self.started, self.left = threading.Event(), threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json={
                    "model": MODEL, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                    "stream": True, "ignore_eos": True}, headers=AUTH, timeout=300) as r:
                self.pid = r.headers.get("x-arlm-replica")
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                    if line.startswith("data: {"):
                        self.started.set()
                    if self.left.is_set():
                        break
        finally:
            self.started.set()

    def tokens(self) -> int:
        return sum(line.startswith("data: {") and '"error"' not in line for line in self.lines)

    def leave(self) -> None:
        self.left.set()
        self.join(300)


def samples(url: str, name: str) -> list:
    """The samples of one family of the ingress's /metrics (every replica's, labelled with it)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=HTTP_TIMEOUT).text
    return [s for f in text_string_to_metric_families(text) if f.name == name for s in f.samples]


def until(condition, what: str, timeout: float = 300):
    """Poll `condition` until it holds (a hang guard, not a speed bound: `timeout` is minutes)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s"
        time.sleep(0.25)
    return value


def chat(url: str, content: str, max_tokens: int = 12, system: str | None = None, **extra) -> httpx.Response:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                                                          "temperature": 0, **extra}, headers=AUTH, timeout=300)


QUESTIONS = [f"Where is parcel number {i}?" for i in range(32)]


def test_concurrent_greedy_requests_equal_the_single_process(servers):
    replicated, single = servers
    solo = [chat(single.url, q).json()["choices"][0]["message"]["content"] for q in QUESTIONS]
    with cf.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        got = list(pool.map(lambda q: chat(replicated.url, q), QUESTIONS))
    assert [r.status_code for r in got] == [200] * len(QUESTIONS)
    assert [r.json()["choices"][0]["message"]["content"] for r in got] == solo


def test_streams_pass_token_by_token(servers):
    # the first token reaches the client while its request still runs in a replica's engine (2,000
    # tokens: seconds on any CPU): not one buffered burst at its end; then each token its own event
    replicated, _ = servers
    stream = Stream(replicated.url, 2000)
    try:
        assert stream.started.wait(300) and stream.tokens() >= 1, stream.lines
        running = sum(s.value for s in samples(replicated.url, "arlm_num_requests_running"))
        until(lambda: stream.tokens() >= 24 or not stream.is_alive(), "24 tokens")
    finally:
        stream.leave()
    assert running >= 1 and stream.tokens() >= 24, (running, stream.lines[-3:])


def test_conversations_land_where_their_prefix_is(servers):
    # 4 conversations, each its own ~1,000-character system prompt, 3 turns each, interleaved: every
    # turn after a conversation's first finds that prompt's blocks in its replica's prefix cache.
    replicated, _ = servers
    url = replicated.url
    before = metric(url, "arlm_router_prefix_hits_total")
    cached = []
    for turn in range(3):
        for c in range(4):
            r = httpx.post(f"{url}/v1/responses", json={
                "model": MODEL, "instructions": f"[desk {c}] " + SYSTEM, "input": f"Turn {turn}: where is parcel {c}?",
                "max_output_tokens": 4, "temperature": 0, "store": False}, headers=AUTH, timeout=300)
            assert r.status_code == 200, r.text
            cached.append((turn, r.json()["usage"]["input_tokens_details"]["cached_tokens"]))
    assert all(n > 0 for turn, n in cached if turn > 0), cached
    assert metric(url, "arlm_router_prefix_hits_total") - before >= 8


def test_bad_input_gets_the_single_process_answer(servers):
    # the bad-input batteries of every protocol, and the key: the same status and body from both
    replicated, single = servers
    cases = [("completions", body, AUTH) for _, body, _, _ in BAD]
    cases += [("embeddings", {"model": MODEL, **body}, AUTH) for body, _ in BAD_EMBEDDINGS]
    cases += [("responses", {"model": MODEL, **body}, AUTH) for body, _, _ in BAD_RESPONSES]
    cases += [("messages", body, {"x-api-key": KEY}) for body, _ in BAD_MESSAGES]
    cases += [("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, {}),
              ("messages", BAD_MESSAGES[0][0], {"x-api-key": "wrong"}),
              ("chat/completions", {"model": MODEL, "messages": []}, AUTH)]
    differ = []
    for path, body, headers in cases:
        content = body if isinstance(body, str) else json.dumps(body)
        got = [httpx.post(f"{s.url}/v1/{path}", content=content, timeout=120,
                          headers={**headers, "content-type": "application/json"}) for s in (replicated, single)]
        a, b = ((r.status_code, r.json()) for r in got)
        if a != b or a[0] < 400:
            differ.append((path, content[:80], a, b))
    assert not differ, differ
    assert len(cases) > 40


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", headers=AUTH, timeout=HTTP_TIMEOUT).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_name_each_replica(servers):
    # every engine metric of the single process, once per replica, labelled with it; the
    # counters add up to the requests sent; the page parses as Prometheus' text format
    from prometheus_client.parser import text_string_to_metric_families

    replicated, single = servers

    def families(url: str) -> dict:
        text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=HTTP_TIMEOUT).text
        return {f.name: f for f in text_string_to_metric_families(text)}

    def requests(fams: dict) -> dict[str, float]:
        return {s.labels["replica"]: s.value for s in fams["arlm_requests"].samples}

    first = families(replicated.url)
    before = requests(first)
    with cf.ThreadPoolExecutor(8) as pool:
        pids = {r.headers["x-arlm-replica"] for r in pool.map(lambda i: chat(replicated.url, f"Count {i}", max_tokens=2),
                                                               range(8))}
    fams = families(replicated.url)
    after = requests(fams)
    assert len(after) == 2 and sum(after.values()) - sum(before.values()) == 8, (before, after)
    info = {s.labels["replica"]: s.labels["pid"] for s in fams["arlm_replica_info"].samples}
    assert set(info) == set(after) and pids <= set(info.values())
    by_traffic = {"arlm_http_requests", "arlm_requests_finished"}  # (series per endpoint, per finish reason)
    for name, family in families(single.url).items():
        labelled = {s.labels.get("replica") for s in fams[name].samples}
        assert labelled == set(info) or name in by_traffic and labelled <= set(info), (name, labelled)
        for replica in info if name not in by_traffic else ():  # the same series from each
            assert {s.name for s in fams[name].samples if s.labels["replica"] == replica} == \
                {s.name for s in family.samples}, (name, replica)
    assert {"arlm_router_prefix_hits", "arlm_router_fallbacks"} <= set(fams)
    # the 8 short chats had no prefix to route by; the scrapes and health checks are not counted
    unkeyed = [f["arlm_router_unkeyed"].samples[0].value for f in (first, fams)]
    assert unkeyed[1] - unkeyed[0] == 8, unkeyed


def test_a_replica_lost_mid_stream(servers):
    """(Last: it kills a replica.) SIGKILL the replica serving a stream: the stream ends with an
    OpenAI error event, never cut silently (nor left hanging); /health says degraded until Ray has
    restarted the replica, and meanwhile new requests go to the survivor; then both serve again:
    two streams running at once are on the two replicas (the router sends a request to the replica
    with fewer outstanding, and one holds a running stream)."""
    import os
    import signal

    replicated, _ = servers
    url = replicated.url
    lines, killed = [], False
    with httpx.stream("POST", f"{url}/v1/completions", json={
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0, "stream": True,
            "ignore_eos": True}, headers=AUTH, timeout=120) as r:  # (a silent hang: the read time-out fails it)
        pid = int(r.headers["x-arlm-replica"])
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 5 and not killed:
                os.kill(pid, signal.SIGKILL)
                killed = True
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "replica_lost", lines[-3:]
    # the replacement loads a model before Ray reports it running: seconds at least, while each
    # /health takes a round trip; so a 503 is seen in between (if Ray had not yet noticed, a 200 first)
    statuses = []

    def restarted() -> bool:
        statuses.append(httpx.get(f"{url}/health", timeout=HTTP_TIMEOUT).status_code)
        if statuses[-1] == 503 and len(statuses) == statuses.index(503) + 1:  # (degraded: the survivor serves)
            r = chat(url, "Hi!")
            assert r.status_code == 200 and r.headers["x-arlm-replica"] != str(pid), r.text
        return statuses[-1] == 200 and 503 in statuses

    until(restarted, "the replica restarted")
    assert set(statuses) == {200, 503}, statuses
    # the ingress's router knows both (it asks each replica it knows for /metrics), the killed one gone
    def both() -> set[str] | None:
        found = {s.labels["pid"] for s in samples(url, "arlm_replica_info")}
        return found if len(found) == 2 and str(pid) not in found else None

    pids = until(both, "both replicas known to the router")
    first = Stream(url, 2000)
    try:
        assert first.started.wait(300) and first.tokens() >= 1, first.lines
        second = Stream(url, 2000)
        try:
            assert second.started.wait(300) and second.tokens() >= 1, second.lines
        finally:
            second.leave()
    finally:
        first.leave()
    assert {first.pid, second.pid} == pids, (first.pid, second.pid, pids)


def in_engines(url: str) -> dict[str, float]:
    """Each replica's requests running or waiting, by its process id (the x-arlm-replica header)."""
    pids = {s.labels["replica"]: s.labels["pid"] for s in samples(url, "arlm_replica_info")}
    held: dict[str, float] = {}
    for name in ("arlm_num_requests_running", "arlm_num_requests_waiting"):
        for s in samples(url, name):
            held[pids[s.labels["replica"]]] = held.get(pids[s.labels["replica"]], 0) + s.value
    return held


def test_sigterm_drains(servers, gate):
    """(Last: it stops the server.) SIGTERM: new requests get 503; the streams running go on: a
    short one finishes, a long one ends with an error event at --drain-timeout; a long answer not
    streamed gets a 503 then; the process exits. Each is running when SIGTERM comes, held there
    by the replicas' engine gate (tests/replica_gate): the long ones, on one replica (their prompt's
    prefix), until the drain's time is up; the short one, alone on the other, until the drain has
    begun, then it has 23 tokens to make in the 30 s (the one bound left: ~100x a loaded machine's
    pace). No outcome follows the machine's speed: a fast one does not finish the long ones first,
    a loaded one has them all running when the signal comes."""
    import signal

    replicated, _ = servers
    url = replicated.url
    results = {}
    prefix = SYSTEM[:300]  # (one hashed chunk of the router's: the long ones' replica; 4,000 tokens still fit)

    def whole() -> None:  # (not streamed: its answer would come at its end)
        results["whole"] = httpx.post(f"{url}/v1/completions", json={
            "model": MODEL, "prompt": prefix + "Twice upon a time", "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True}, headers=AUTH, timeout=300)

    # (both replicas running, as Ray reports them: the ingress's /health is 503 while fewer are)
    until(lambda: httpx.get(f"{url}/health", timeout=HTTP_TIMEOUT).status_code == 200, "both replicas running")
    (gate / "hold").touch()  # (each engine stops once every request it holds has its first token)
    try:
        long = Stream(url, 4000, prompt=prefix + "Once upon a time")
        assert long.started.wait(300) and long.tokens() >= 1, long.lines
        waiter = threading.Thread(target=whole)
        waiter.start()
        until(lambda: in_engines(url).get(long.pid, 0) >= 2, "the long answer in the long stream's engine")
        short = Stream(url, 24)  # (no prefix to route by: to the replica with nothing outstanding)
        assert short.started.wait(300) and short.tokens() >= 1, short.lines
        assert short.pid != long.pid, (short.pid, long.pid, in_engines(url))
        replicated.proc.send_signal(signal.SIGTERM)

        def draining() -> bool:  # (until the drain begins, the replicas answer; no engine's step)
            r = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=HTTP_TIMEOUT)
            assert r.status_code in (200, 503), r.text
            return r.status_code == 503 and r.json()["error"]["code"] == "draining"

        until(draining, "the drain begun")
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                       headers=AUTH, timeout=HTTP_TIMEOUT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining", r.text  # new requests refused
        assert short.is_alive() and short.tokens() < 24, short.lines  # (still held: running at the signal)
        (gate / f"release-{short.pid}").touch()
        for t in (short, long, waiter):
            t.join(DRAIN_TIMEOUT + 120)
    finally:
        (gate / "hold").unlink(missing_ok=True)  # (the long ones' engine: its aborts, then its exit)
    assert short.lines[-1] == "data: [DONE]" and short.tokens() == 24, short.lines
    assert all("error" not in line for line in short.lines)
    assert long.lines[-1] == "data: [DONE]" and json.loads(long.lines[-2][6:])["error"]["code"] == "draining"
    assert 1 <= long.tokens() < 4000
    answer = results["whole"]
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "draining", answer.text
    assert replicated.proc.wait(120) == 0
