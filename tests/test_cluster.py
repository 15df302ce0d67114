"""`arlm serve --replicas 2` on a local Ray head: the same API from two replicas of one
thread each behind Ray Serve's ingress, routed by prompt prefix; compared with the single process."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import pytest

from servers import BAD, KEY, MODEL, ServerProcess
from test_serve_protocols import BAD_EMBEDDINGS, BAD_MESSAGES, BAD_RESPONSES

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {KEY}"}

SYSTEM = "You are the support assistant of a parcel company; answer in one short sentence. " * 12  # ~1,000 chars


@pytest.fixture(scope="module")
def servers():
    """(replicated, single): the same flags, one behind Ray Serve with 2 replicas of 1 thread."""
    single = ServerProcess("--kv-cache-tokens", "4096", "--api-key", KEY)
    replicated = ServerProcess("--kv-cache-tokens", "4096", "--api-key", KEY, "--replicas", "2",
                               "--threads-per-replica", "1", "--drain-timeout", "3")
    try:
        single.wait_ready()
        replicated.wait_ready(timeout=360)
        yield replicated, single
    finally:
        replicated.stop()
        single.stop()


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
    replicated, _ = servers
    times = []
    with httpx.stream("POST", f"{replicated.url}/v1/completions", json={
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stream": True,
            "ignore_eos": True}, headers=AUTH, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
    assert len(times) == 24 and times[-1] - times[0] > 0.05  # (not one buffered burst at the end)


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
    for line in httpx.get(f"{url}/metrics", headers=AUTH, timeout=60).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_name_each_replica(servers):
    # every engine metric of the single process, once per replica, labelled with it; the
    # counters add up to the requests sent; the page parses as Prometheus' text format
    from prometheus_client.parser import text_string_to_metric_families

    replicated, single = servers

    def families(url: str) -> dict:
        text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=60).text
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
    """(Last: it kills a replica.) SIGKILL the replica serving a stream: the stream ends within
    5 s with an OpenAI error event, never cut silently; new requests go to the survivor at once;
    /health says degraded until Ray has restarted the replica, then both serve again (60 s)."""
    import json
    import os
    import signal

    replicated, _ = servers
    url = replicated.url
    lines, killed = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json={
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0, "stream": True,
            "ignore_eos": True}, headers=AUTH, timeout=120) as r:
        pid = int(r.headers["x-arlm-replica"])
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 5 and killed is None:
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
    ended = time.monotonic() - killed
    assert ended < 5, ended
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "replica_lost", lines[-3:]
    assert chat(url, "Hi!").status_code == 200  # (the survivor, at once)
    statuses, deadline = set(), time.monotonic() + 60
    while time.monotonic() < deadline:
        code = httpx.get(f"{url}/health", timeout=30).status_code
        statuses.add(code)
        if code == 200 and 503 in statuses:
            break
        time.sleep(0.5)
    assert statuses == {200, 503}, statuses
    with cf.ThreadPoolExecutor(8) as pool:  # (at once: the router spreads them by their outstanding requests)
        pids = {r.headers["x-arlm-replica"] for r in pool.map(lambda i: chat(url, f"Question {i}?", max_tokens=8),
                                                               range(8))}
    assert len(pids) == 2 and str(pid) not in pids, pids


def test_sigterm_drains(servers):
    """(Last: it stops the server.) SIGTERM: new requests get 503 at once, a short stream running
    finishes, a long one ends with an error event at --drain-timeout (3 s), a long answer not
    streamed gets a 503 then, and the process exits."""
    import signal
    import threading

    replicated, _ = servers
    url = replicated.url
    results = {}

    def stream(name: str, tokens: int) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json={
                "model": MODEL, "prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}, headers=AUTH, timeout=120) as r:
            results[name] = [line for line in r.iter_lines() if line]

    def whole(name: str, tokens: int) -> None:  # (not streamed: its answer would come at its end)
        results[name] = httpx.post(f"{url}/v1/completions", json={
            "model": MODEL, "prompt": "Twice upon a time", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True}, headers=AUTH, timeout=120)

    threads = [threading.Thread(target=stream, args=(name, n)) for name, n in (("short", 24), ("long", 4000))]
    threads.append(threading.Thread(target=whole, args=("whole", 4000)))
    for t in threads:
        t.start()
    time.sleep(1.0)
    replicated.proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, headers=AUTH,
                   timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
    for t in threads:
        t.join(60)
    short, long = results["short"], results["long"]
    assert short[-1] == "data: [DONE]" and all("error" not in line for line in short)
    assert long[-1] == "data: [DONE]" and json.loads(long[-2][6:])["error"]["code"] == "draining"
    whole = results["whole"]
    assert whole.status_code == 503 and whole.json()["error"]["code"] == "draining", whole.text
    assert replicated.proc.wait(60) == 0
