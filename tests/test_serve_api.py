"""`arlm serve` as a user meets it: a real server process on loopback, the official `openai` client.

Two servers for the module: the main one (with an API key) and one whose KV pool is too small for
its load, so that it must preempt. The reference for every batched output is the same request
run alone on the main server (greedy: tokens, hence texts and counts, identical). The tests that
use the servers are marked slow (two processes load the model); the in-process ones are not.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from conftest import run_arlm
from servers import AUTH, BAD, HTTP_TIMEOUT, KEY, MODEL, ServerProcess

PROMPTS = [
    "The cat sat on the", "Once upon a time", "def fibonacci(n):", "The capital of France is",
    "1, 2, 3, 4,", "Hello, my name is", "In 1492, Columbus", "The best way to learn Python is",
    "Water boils at", "Q: What is 2 + 2?\nA:", "import numpy as np\n", "The quick brown fox",
    "My favourite colour is", "Dear Sir or Madam,", "The mitochondria is", "To be or not to be,",
    "Photosynthesis converts", "SELECT * FROM", "The weather today is", "A haiku about the sea:",
    "Rust and Python differ in", "<html>\n<head>", "The first law of thermodynamics", "Once there was a dragon who",
    "Ingredients: flour, eggs,", "The stock market", "Translate to French: cheese =", "Knock knock.",
    "The answer to life is", "git commit -m", "Roses are red,", "Chapter 1\n\nIt was a dark",
]
MAX_TOKENS = [4 + i % 9 for i in range(len(PROMPTS))]  # 4..12: sequences finish at different steps
# Greedy, every prompt runs to its max_tokens but this one, which ends with EOS after " blue."
# (3 tokens): a batch holds both ways of finishing.
EOS_PROMPT, EOS_TOKENS = "My favourite colour is", 3


@pytest.fixture(scope="module")
def servers():
    main = ServerProcess("--api-key", KEY, "--kv-cache-tokens", "8192")
    # 12 blocks of 4 tokens: 12 concurrent requests of 9..20 tokens need ~45.
    # (and the live trace on: its outputs are checked against the main server's like the rest)
    tiny = ServerProcess("--kv-cache-tokens", "48", "--block-size", "4", "--trace")
    try:
        main.wait_ready()
        tiny.wait_ready()
        yield main, tiny
    finally:
        main.stop()
        tiny.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


def client(server: ServerProcess, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)


def complete(c: openai.OpenAI, prompt: str, max_tokens: int, stream: bool = False, **extra):
    """(text, finish_reason, completion_tokens) of one greedy completion, streamed or not."""
    kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=extra.pop("temperature", 0.0))
    if stream:
        text, reason, usage = "", None, None
        for chunk in c.completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                          extra_body=extra or None):
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                usage = chunk.usage
        return text, reason, usage.completion_tokens
    r = c.completions.create(**kw, extra_body=extra or None)
    return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens


@pytest.fixture(scope="module")
def alone(server):
    """Every PROMPTS request run alone, one after another, on the main server."""
    c = client(server)
    return [complete(c, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]


# -- basics ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_models_health_and_api_key(server):
    assert httpx.get(f"{server.url}/health", timeout=HTTP_TIMEOUT).status_code == 200
    assert [m.id for m in client(server).models.list().data] == [MODEL]
    with pytest.raises(openai.AuthenticationError) as e:
        client(server, "wrong-key").completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key" and e.value.param is None
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hi"},
                   timeout=HTTP_TIMEOUT)  # no key at all
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    # no field of the body is at fault (the body is not even read)
    assert r.json()["error"]["param"] is None and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.slow
def test_retrieve_model(server):
    c = client(server)
    m = c.models.retrieve(MODEL)
    assert (m.id, m.object, m.owned_by) == (MODEL, "model", "arlm") and m.created > 0
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-4")
    assert e.value.code == "model_not_found" and "gpt-4" in e.value.message and e.value.param == "model"
    with pytest.raises(openai.AuthenticationError) as e:
        client(server, "wrong-key").models.retrieve(MODEL)
    assert e.value.code == "invalid_api_key" and e.value.param is None


@pytest.mark.slow
def test_unknown_routes_and_methods_are_errors_about_no_field(server):
    h = {"Authorization": f"Bearer {KEY}"}
    for method, path, status, code in (("GET", "/v1/nothing-here", 404, "not_found"),
                                       ("POST", "/v1/audio/speech", 404, "not_found"),
                                       ("GET", "/v1/completions", 405, "method_not_allowed"),
                                       ("DELETE", "/v1/models", 405, "method_not_allowed")):
        r = httpx.request(method, f"{server.url}{path}", headers=h, timeout=HTTP_TIMEOUT)
        err = r.json()["error"]
        assert r.status_code == status and set(err) == {"message", "type", "param", "code"}, (method, path, r.text)
        assert err["code"] == code and err["param"] is None and err["message"], (method, path, r.text)


@pytest.mark.slow
def test_completion_streamed_and_not_agree_with_usage(server, smollm2):
    c = client(server)
    prompt = "The capital of France is"
    text, reason, n = complete(c, prompt, 12)
    assert (text, reason, n) == complete(c, prompt, 12, stream=True)
    assert reason == "length" and n == 12 and text
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert r.usage.prompt_tokens == len(smollm2.tokenizer.encode(prompt))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12 and r.object == "text_completion"
    # The same request as token ids, as vLLM takes them: the same continuation.
    ids = smollm2.tokenizer.encode(prompt)
    assert c.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0).choices[0].text == text


@pytest.mark.slow
def test_chat_streamed_and_not_agree(server, smollm2):
    c = client(server)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    choice = r.choices[0]
    # Greedy, the reply (one short sentence) ends with EOS well before max_tokens.
    assert choice.message.role == "assistant" and choice.finish_reason == "stop" and choice.message.content
    prompt_ids = smollm2.tokenizer.encode(smollm2.apply_chat_template(messages))
    assert r.usage.prompt_tokens == len(prompt_ids) and 1 <= r.usage.completion_tokens < 10
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert text == choice.message.content and reasons == [choice.finish_reason]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


@pytest.mark.slow
def test_eos_ends_a_chat_reply_with_stop(server):
    r = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say OK."}],
                                               max_tokens=200, temperature=0)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 200


@pytest.mark.slow
def test_stop_string_cuts_the_text(server):
    c = client(server)
    full, _, _ = complete(c, "Once upon a time", 16)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip() and stop in full
    for stream in (False, True):
        text, reason, n = complete(c, "Once upon a time", 16, stream=stream, stop=[stop, "zzzz"])
        assert text == full[:full.index(stop)] and reason == "stop" and n < 16


@pytest.mark.slow
def test_sse_wire_format(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=HTTP_TIMEOUT) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert {ch["object"] for ch in chunks} == {"text_completion"} and len({ch["id"] for ch in chunks}) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_several_prompts_and_n(server):
    c = client(server)
    r = c.completions.create(model=MODEL, prompt=["Hello", "The sky is"], n=2, max_tokens=5, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text
    assert r.usage.completion_tokens == 20


# -- many users at once ----------------------------------------------------------------------------

@pytest.mark.slow
def test_32_concurrent_streams_equal_each_request_alone(server, alone):
    c = client(server)
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        batched = list(pool.map(lambda a: complete(c, a[0], a[1], stream=True), zip(PROMPTS, MAX_TOKENS)))
    assert batched == alone
    assert [(r, n) for _, r, n in alone] == [("stop", EOS_TOKENS) if p == EOS_PROMPT else ("length", mt)
                                             for p, mt in zip(PROMPTS, MAX_TOKENS)]
    m = server.wait_idle()
    assert m["arlm_kv_cache_usage_ratio"] == 0 and m["arlm_num_requests_running"] == 0


@pytest.mark.slow
def test_seeded_sampling_is_the_same_alone_or_batched(server):
    c = client(server)
    kw = dict(temperature=0.9, seed=1234, top_k=50, min_p=0.02, repetition_penalty=1.1)
    solo = complete(c, "The weather today is", 12, **kw)
    with cf.ThreadPoolExecutor(8) as pool:
        noise = [pool.submit(complete, c, p, 12, temperature=1.0) for p in PROMPTS[:7]]
        batched = complete(c, "The weather today is", 12, stream=True, **kw)
        [f.result() for f in noise]
    assert batched == solo


@pytest.mark.slow
def test_client_disconnect_frees_blocks(server):
    before = server.metrics().get('arlm_requests_finished_total{finish_reason="abort"}', 0)
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=HTTP_TIMEOUT) as r:
        lines = r.iter_lines()  # (leaving a `for` over it early would close the response)
        for _ in range(6):
            next(lines)
        assert server.metrics()["arlm_kv_cache_usage_ratio"] > 0  # still generating
    # leaving the block closes the connection mid-stream
    m = server.wait_idle()
    assert m["arlm_kv_cache_usage_ratio"] == 0 and m["arlm_num_requests_running"] == 0
    # A non-streaming request whose client gives up is aborted too: the client leaves once the
    # request runs in the engine (whatever the machine's speed: not at a time-out that a loaded
    # machine could pass before the server has read the request), before any answer came.
    payload = json.dumps({**body, "stream": False}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(payload)
                     + payload)
        deadline = time.monotonic() + HTTP_TIMEOUT  # (a hang guard)
        while server.metrics()["arlm_num_requests_running"] < 1:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.05)
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):  # no answer yet: 2,000 tokens are still being made
            sock.recv(1)
    m = server.wait_idle()
    assert m["arlm_kv_cache_usage_ratio"] == 0 and m["arlm_num_requests_running"] == 0
    assert m['arlm_requests_finished_total{finish_reason="abort"}'] == before + 2


@pytest.mark.slow
def test_small_pool_preempts_and_still_matches(servers, alone):
    _, tiny = servers
    c = client(tiny)
    n = 12
    with cf.ThreadPoolExecutor(n) as pool:
        batched = list(pool.map(lambda a: complete(c, a[0], a[1], stream=True), zip(PROMPTS[:n], MAX_TOKENS[:n])))
    assert batched == alone[:n]
    m = tiny.wait_idle()
    assert m["arlm_num_preemptions_total"] > 0 and m["arlm_kv_cache_usage_ratio"] == 0


@pytest.mark.slow
def test_metrics_page(server):
    text = httpx.get(f"{server.url}/metrics", timeout=HTTP_TIMEOUT).text
    for name in ("arlm_requests_total", "arlm_prompt_tokens_total", "arlm_generation_tokens_total",
                 "arlm_num_requests_waiting", "arlm_num_requests_running", "arlm_kv_cache_usage_ratio",
                 "arlm_time_to_first_token_seconds_bucket", "arlm_prefix_cache_hits_total"):
        assert f"\n{name}" in text
    m = server.metrics()
    assert m["arlm_generation_tokens_total"] > 0 and m["arlm_time_to_first_token_seconds_count"] > 0
    # the pool's element type, its bytes per token and in total
    # one thread a server (OMP_NUM_THREADS=1: nothing to narrow), not pinned by --threads
    assert m['arlm_threads{state="in_use"}'] == m['arlm_threads{state="max"}'] == 1 and m["arlm_threads_pinned"] == 0
    assert "arlm_thread_width_changes_total" in m
    per_token = {k: v for k, v in m.items() if k.startswith("arlm_kv_cache_bytes_per_token{dtype=")}
    assert len(per_token) == 1 and list(per_token.values())[0] > 0
    # every token through the integer kernels (the server's auto: vnni with the packed kernels,
    # AVX-512 VNNI or AVX2; else avx2)
    from cpu_flags import packed_expected

    path = [k for k in m if k.startswith("arlm_matmul_path{")]
    assert len(path) == 1 and f'path="{"vnni" if packed_expected() else "avx2"}"' in path[0], path
    allocated = [v for k, v in m.items() if k.startswith("arlm_kv_cache_bytes{") and 'state="allocated"' in k]
    assert len(allocated) == 1 and allocated[0] > 0


# -- bad input -------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("body,param,code", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_style_400(server, body, param, code):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}/v1/completions", content=content,
                   headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"}, timeout=HTTP_TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["code"] == code and err["param"] == param, r.text  # None: the body as a whole is at fault
    assert "Traceback" not in r.text


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", content=json.dumps(body),
                      headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"},
                      timeout=HTTP_TIMEOUT)


@pytest.mark.slow
def test_huge_top_k_gets_400_while_another_stream_goes_on(server):
    # Such a request once reached the engine, whose step then failed for every running request.
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    expect = post(server, "completions", body).json()["choices"][0]["text"]
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=HTTP_TIMEOUT) as r:
        lines = r.iter_lines()
        events = [next(lines)]  # generating now
        for top_k in (2**63, 2**31):
            bad = post(server, "completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "temperature": 1.0,
                                               "top_k": top_k})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k", bad.text
        events = [e for e in events + list(lines) if e]
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == expect
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and events[-1] == "data: [DONE]"
    # top_k above the vocabulary is no filter, as 0 is
    ok = post(server, "completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "top_k": 2**31 - 1})
    assert ok.status_code == 200, ok.text


def test_sampling_params_errors_are_400_naming_the_field():
    from arlm.serve.api import APIError, CompletionRequest, Server

    server = Server(None, SimpleNamespace(engine=SimpleNamespace(max_model_len=100, stats=SimpleNamespace(),
                                                                      grammars=None)), MODEL)
    req = CompletionRequest.model_construct(model=MODEL, prompt="Hi", min_p=2.0)  # past the schema
    with pytest.raises(APIError) as e:
        server.sampling_params(req, None, 10, "prompt")
    assert (e.value.status, e.value.param, e.value.code) == (400, "min_p", "invalid_value")
    # Without max_tokens: the default, capped to the room left; a max_tokens sent must fit.
    req = CompletionRequest.model_construct(model=MODEL, prompt="Hi")
    assert server.sampling_params(req, None, 90, "prompt", default_max_tokens=16).max_new_tokens == 10
    assert server.sampling_params(req, None, 99, "prompt", default_max_tokens=16).max_new_tokens == 1
    assert server.sampling_params(req, None, 10, "prompt", default_max_tokens=16).max_new_tokens == 16
    with pytest.raises(APIError) as e:
        server.sampling_params(req, 16, 90, "prompt", default_max_tokens=16)
    assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"


class FailingEngine:
    """An AsyncEngine stand-in whose requests fail the ways the real one's do: a request's step
    raises after its first token (AsyncEngine hands a row's error to its request as a
    RuntimeError), or the engine loop has stopped (`dead`: EngineDead for every request)."""

    def __init__(self, token_id: int) -> None:
        self.engine = SimpleNamespace(max_model_len=2048, stats=SimpleNamespace(), grammars=None)  # the Engine it drives
        self.token_id = token_id
        self.dead: str | None = None

    def start(self, loop) -> None:
        pass

    attach = start

    def stop(self) -> None:
        pass

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-1"

    def abort(self, request_id: str, reason: str = "abort") -> None:
        pass

    async def generate(self, request_id, prompt_ids, params, arrival_time=None, drafter=None, group=None):
        from arlm.serve import api

        if self.dead:
            raise api.EngineDead(self.dead)
        yield SimpleNamespace(request_id=request_id, token_id=self.token_id, finish_reason=None, num_output_tokens=1)
        raise RuntimeError("sampling failed")


def test_engine_errors_are_server_errors_about_no_field(smollm2):
    # What the client sent is fine, so no field is named: param is null, as OpenAI's 5xx bodies.
    from fastapi.testclient import TestClient

    from arlm.serve import api

    (hello,) = smollm2.tokenizer.encode("Hello")
    engine = FailingEngine(hello)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
    with TestClient(api.create_app(api.Server(smollm2, engine, MODEL)), raise_server_exceptions=False) as http:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 500 and r.json()["error"] == {
            "message": "internal error: RuntimeError", "type": "server_error", "param": None, "code": "internal_error"}
        # Streamed, the 200 has gone out with the first token: the error comes in-band, then [DONE].
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line]
        assert r.status_code == 200 and events[-1] == "data: [DONE]", events
        assert json.loads(events[0][6:])["choices"][0]["text"] == "Hello"
        assert json.loads(events[-2][6:]) == {"error": {"message": "sampling failed", "type": "server_error",
                                                        "param": None, "code": "internal_error"}}
        engine.dead = "RuntimeError: the step failed"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        for r in (http.post("/v1/completions", json=body), http.post("/v1/chat/completions", json=chat)):
            err = r.json()["error"]
            assert r.status_code == 503 and (err["type"], err["param"], err["code"]) == ("server_error", None,
                                                                                         "engine_dead")
            assert engine.dead in err["message"]
        r = http.get("/health")
        err = r.json()["error"]
        assert r.status_code == 503 and err["param"] is None and engine.dead in err["message"]


def _in_process_server(llm, **async_engine_args):
    """The app over a real engine of its own on `llm`'s runner (and a grammar compiler of its
    own: its cache and counts start empty), for a TestClient."""
    from arlm.engine import AsyncEngine, Engine, EngineConfig
    from arlm.serve import api
    from arlm.structured import Grammars

    engine = Engine(llm.runner, llm.tokenizer.eos_ids, EngineConfig(kv_cache_tokens=2048))
    engine.grammars = Grammars(llm.tokenizer, llm.model.config.vocab_size)
    return api.create_app(api.Server(llm, AsyncEngine(engine, **async_engine_args), MODEL)), engine


def test_health_is_503_while_the_engine_is_wedged(smollm2_default):
    """A step that does not end while a request waits: /health says so within the limit and
    /metrics shows the stall; once the step ends, the request completes and /health is 200."""
    import threading

    from fastapi.testclient import TestClient

    app, engine = _in_process_server(smollm2_default, stall_limit=0.5)
    release, entered = threading.Event(), threading.Event()
    step = engine.step

    def wedged_step():
        entered.set()
        release.wait(60)
        return step()

    engine.step = wedged_step
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        done = {}
        t = threading.Thread(target=lambda: done.update(r=http.post("/v1/completions", json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": 0})))
        t.start()
        assert entered.wait(30)
        deadline = time.monotonic() + 60  # (a hang guard: the stall is real, held by `release`)
        while (r := http.get("/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stalled", r.text
        m = {k: float(v) for k, v in re.findall(r"^(arlm_engine_\w+_seconds) (\S+)$", http.get("/metrics").text, re.M)}
        assert m["arlm_engine_stalled_seconds"] >= 0.5 and m["arlm_engine_last_step_age_seconds"] >= 0.5, m
        release.set()
        t.join(60)
        assert done["r"].status_code == 200 and http.get("/health").status_code == 200


def test_a_grammar_its_limits_stop_is_the_clients_error_naming_the_field(smollm2_default):
    """A schema that compiles but whose grammar hits llguidance's limits at its first tokens (3,000
    optional properties: one Earley row holds them all): a 400 naming response_format, or
    streamed, an error event naming it; a self-recursive schema is refused before it runs. The
    compile time and the refusals are in /metrics."""
    from fastapi.testclient import TestClient

    from test_structured import SELF_RECURSIVE, WIDE

    app, _ = _in_process_server(smollm2_default)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "JSON please."}], "max_tokens": 20,
            "temperature": 0}

    def schema(s):
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}

    with TestClient(app) as http:
        r = http.post("/v1/chat/completions", json={**chat, "response_format": schema(WIDE)})
        err = r.json()["error"]
        assert r.status_code == 400 and (err["param"], err["code"]) == ("response_format", "grammar_too_complex"), r.text
        with http.stream("POST", "/v1/chat/completions", json={**chat, "response_format": schema(WIDE),
                                                               "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"]
        assert events[-1]["error"]["param"] == "response_format" and events[-1]["error"]["code"] == "grammar_too_complex"
        r = http.post("/v1/chat/completions", json={**chat, "response_format": schema(SELF_RECURSIVE)})
        err = r.json()["error"]
        assert r.status_code == 400 and (err["param"], err["code"]) == ("response_format", "grammar_too_complex"), r.text
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 5,
                                               "guided_grammar": "start: undefined_rule"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_grammar", r.text
        metrics = http.get("/metrics").text
        assert re.search(r'^arlm_grammar_rejected_total\{reason="too_complex"\} 1$', metrics, re.M), metrics
        assert re.search(r'^arlm_grammar_rejected_total\{reason="invalid"\} 1$', metrics, re.M)
        assert re.search(r"^arlm_grammar_compile_seconds_count 1$", metrics, re.M)  # WIDE, once


@pytest.mark.slow
def test_completion_without_max_tokens_near_the_end_of_the_context(servers):
    _, tiny = servers
    window = httpx.get(f"{tiny.url}/v1/models/{MODEL}", timeout=HTTP_TIMEOUT).json()["max_model_len"]
    prompt = [28] * (window - 3)
    r = post(tiny, "completions", {"model": MODEL, "prompt": prompt, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text  # not "plus max_tokens (16) exceeds": the client sent none
    assert r.json()["usage"]["completion_tokens"] == 3 and r.json()["choices"][0]["finish_reason"] == "length"
    r = post(tiny, "completions", {"model": MODEL, "prompt": prompt, "max_tokens": 16})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["code"], err["param"]) == ("context_length_exceeded", "max_tokens"), r.text


@pytest.mark.slow
def test_prompt_of_the_wrong_type_says_what_a_prompt_is(server):
    for prompt in ([1.5], [[1, 2], [1.5]], 5, [True]):
        r = post(server, "completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt", r.text
        assert "token ids (integers)" in err["message"] and "valid string" not in err["message"]


@pytest.mark.slow
def test_non_finite_numbers_are_refused(server):
    # Python's JSON parser reads NaN and Infinity; they must not reach a range check ("must be <= 100").
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        for value in (float("nan"), float("inf"), float("-inf")):
            r = post(server, "completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1, name: value})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == name and "finite" in err["message"], (name, value, r.text)


@pytest.mark.slow
def test_too_many_sequences_in_one_request(server):
    for n_prompts, n in ((129, 2), (2000, 16)):  # 258 and 32,000 sequences
        r = post(server, "completions", {"model": MODEL, "prompt": ["Hi"] * n_prompts, "n": n, "max_tokens": 1})
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["param"] == "n" and f"{n_prompts * n} sequences" in err["message"] and "256" in err["message"]
    r = post(server, "completions", {"model": MODEL, "prompt": ["Hi"] * 128, "n": 2, "max_tokens": 1})  # the limit
    assert r.status_code == 200 and len(r.json()["choices"]) == 256


@pytest.mark.slow
def test_chat_user_or_system_message_needs_content(server):
    # Without content (and without max_tokens) the reply would run to the end of the context window.
    user = {"role": "user", "content": "Hi"}
    for messages, param in (([{"role": "user"}], "messages.0.content"),
                            ([{"role": "system", "content": None}, user], "messages.0.content"),
                            ([{"role": "developer"}, user], "messages.0.content"),
                            ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": None}],
                             "messages.1.content")):
        r = post(server, "chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant"}, {"role": "user", "content": "Hi again"}]
    assert post(server, "chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1}).status_code == 200


@pytest.mark.slow
def test_fields_that_change_the_output_are_refused_by_name(server):
    c = client(server)
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}
    for name, value in (("functions", [tool["function"]]), ("function_call", "auto")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**chat, **{name: value})
        assert (e.value.param, e.value.code) == (name, "unsupported") and name in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="Hi", max_tokens=1, best_of=2)
    assert (e.value.param, e.value.code) == ("best_of", "unsupported")
    # The values that change nothing are accepted.
    r = c.chat.completions.create(**chat, tools=[], tool_choice="none", response_format={"type": "text"})
    assert r.choices[0].finish_reason == "length"
    assert c.completions.create(model=MODEL, prompt="Hi", max_tokens=1, n=2, best_of=2).usage.completion_tokens == 2


@pytest.mark.slow
def test_completion_logprobs_and_echo(server):
    """logprobs: the legacy columns (tokens, token_logprobs, top_logprobs with the chosen token,
    text_offset); echo with max_tokens 0: the prompt's own (the first null); the same model's
    numbers either way: a generated token's logprob = that token's echoed logprob."""
    c = client(server)
    prompt = "The capital of France is"
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    ch = r.choices[0]
    lp = ch.logprobs
    assert "".join(lp.tokens) == ch.text and len(lp.tokens) == r.usage.completion_tokens == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and top[tok] == v and len(top) in (3, 4)
        assert v == max(top.values())  # greedy: the chosen token is the most likely
    e = c.completions.create(model=MODEL, prompt=prompt + ch.text, max_tokens=0, echo=True, logprobs=1)
    ee = e.choices[0]
    assert ee.text == prompt + ch.text and e.usage.completion_tokens == 0 and ee.finish_reason == "length"
    assert ee.logprobs.token_logprobs[0] is None and ee.logprobs.top_logprobs[0] is None
    assert "".join(ee.logprobs.tokens) == ee.text
    assert ee.logprobs.token_logprobs[-6:] == pytest.approx(lp.token_logprobs, abs=2e-3)
    # echo and generation in one, token ids as the prompt, streamed: the prompt's chunk first
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}, headers=AUTH,
                     timeout=HTTP_TIMEOUT).json()["tokens"]
    chunks = list(c.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, logprobs=0,
                                       echo=True, stream=True))
    first = chunks[0].choices[0]
    assert first.text == prompt and first.logprobs.token_logprobs[0] is None and len(first.logprobs.tokens) == len(ids)
    gen = [ch.choices[0] for ch in chunks[1:] if ch.choices and ch.choices[0].logprobs]
    assert "".join(g.logprobs.tokens[0] for g in gen) == ch.text[:len("".join(g.text for g in gen))]
    assert [g.logprobs.token_logprobs[0] for g in gen] == pytest.approx(lp.token_logprobs[:4], abs=1e-4)


@pytest.mark.slow
def test_chat_logprobs_and_the_caps(server):
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=5,
                                  temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(x.token for x in content) == r.choices[0].message.content
    for x in content:
        assert bytes(x.bytes).decode() == x.token and len(x.top_logprobs) == 2
        assert x.top_logprobs[0].logprob == x.logprob  # greedy
    for kw, param in ((dict(logprobs=True, top_logprobs=21), "top_logprobs"), (dict(top_logprobs=2), "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1, **kw)
        assert e.value.param == param
    for kw, param in ((dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"), (dict(max_tokens=0), "max_tokens")):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt="x", **{"max_tokens": 1, **kw})
        assert e.value.param == param


@pytest.mark.slow
def test_openai_sampling_fields(server):
    """logit_bias (ids as strings, clamped), stop_token_ids and min_tokens (vLLM's extras),
    presence/frequency penalties: honoured, and a bad id is a 400 naming the field."""
    c = client(server)
    (banana,) = httpx.post(f"{server.url}/tokenize", json={"prompt": " banana"}, headers=AUTH,
                           timeout=HTTP_TIMEOUT).json()["tokens"]
    text, reason, n = complete(c, "The cat sat on the", 3, logit_bias={str(banana): 500})
    assert text == " banana" * 3 and n == 3
    text, reason, n = complete(c, "The cat sat on the", 8, logit_bias={str(banana): 100}, stop_token_ids=[banana])
    assert (text, reason, n) == (" banana", "stop", 1)
    plain = complete(c, "A B A B A B A B A B A", 12)
    penalized = complete(c, "A B A B A B A B A B A", 12, frequency_penalty=2.0, presence_penalty=2.0)
    assert plain[0] != penalized[0]
    for body, param in (({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"99999999": 1}}, "logit_bias"),
                        ({"stop_token_ids": [10**9]}, "stop_token_ids"), ({"presence_penalty": 3}, "presence_penalty"),
                        ({"min_tokens": -1}, "min_tokens")):
        r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=HTTP_TIMEOUT,
                       json={"model": MODEL, "prompt": "x", "max_tokens": 1, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


@pytest.mark.slow
def test_structured_outputs_with_the_openai_sdk_and_langchain(server):
    """chat.completions.parse() with a pydantic model (a strict json_schema response_format),
    json_object, vLLM's guided_choice / guided_regex; LangChain's with_structured_output with
    its default method (json_schema, through the SDK's parse)."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=40)
        country: str = Field(max_length=40)
        population_millions: int = Field(ge=0, le=100)
        continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]

    c = client(server)
    messages = [{"role": "user", "content": "Describe Paris as JSON."}]
    r = c.chat.completions.parse(model=MODEL, messages=messages, response_format=City, max_tokens=200, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.continent in ("Europe", "Asia", "Africa", "America", "Oceania")
    r = c.chat.completions.create(model=MODEL, messages=messages, response_format={"type": "json_object"},
                                  max_tokens=120, temperature=0.7, seed=3)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    text, reason, _ = complete(c, "Is the sky blue? Answer:", 5, guided_choice=["yes", "no"])
    assert text in ("yes", "no") and reason == "stop"
    text, reason, _ = complete(c, "A date:", 20, stream=True, guided_regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", text) and reason == "stop"

    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=KEY, temperature=0, max_tokens=200,
                     max_retries=0)
    out = llm.with_structured_output(City).invoke("Describe Rome as JSON.")
    assert isinstance(out, City) and out.name


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                                        "b": {"type": "integer", "minimum": -999, "maximum": 999}},
                       "required": ["a", "b"]}}}]


@pytest.mark.slow
def test_tool_calls_with_the_openai_sdk_and_langchain(server):
    """tools with tool_choice required / a named function / none / auto: OpenAI's tool_calls
    shape, arguments valid against the function's parameters, finish_reason tool_calls; streamed
    as deltas; a follow-up turn with the tool's result; LangChain's function_calling method."""
    import jsonschema

    c = client(server)
    msgs = [{"role": "user", "content": "What's the weather in Paris, in Celsius?"}]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice, names in (("required", set(params)), ({"type": "function", "function": {"name": "add"}}, {"add"}),
                          ("auto", None)):
        r = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=80,
                                      temperature=0)
        ch = r.choices[0]
        if names is None and not ch.message.tool_calls:  # auto: a reply is allowed too
            assert ch.message.content and ch.finish_reason == "stop"
            continue
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        (call,) = ch.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in (names or params)
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, {**params[call.function.name], "additionalProperties": False})
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    stream = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=80,
                                       temperature=0, stream=True)
    deltas = [ch.choices[0] for ch in stream if ch.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert len(calls) == 1 and calls[0].function.name in params and deltas[-1].finish_reason == "tool_calls"
    json.loads(calls[0].function.arguments)
    follow = msgs + [{"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = c.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=60, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "tool_calls", "length")
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=120,
                                  parallel_tool_calls=True, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) >= 1 and len({x.id for x in calls}) == len(calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    for kw, param in ((dict(tools=[{"type": "function"}]), "tools.0"),
                      (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
                      (dict(tool_choice="required"), "tool_choice"),
                      (dict(tools=TOOLS, response_format={"type": "json_object"}), "response_format")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, **kw)
        assert e.value.param == param, (kw, e.value.message)

    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=30)
        unit: str = Field(pattern="^[CF]$")

    llm = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=KEY, temperature=0, max_tokens=80,
                     max_retries=0)
    out = llm.with_structured_output(Weather, method="function_calling").invoke("Weather in Rome, Celsius?")
    assert isinstance(out, Weather) and out.unit in ("C", "F")
    bound = llm.bind_tools([TOOLS[1]], tool_choice="add").invoke("What is 2 + 3?")
    assert bound.tool_calls and bound.tool_calls[0]["name"] == "add" and set(bound.tool_calls[0]["args"]) == {"a", "b"}


@pytest.mark.slow
def test_litellm_with_the_openai_prefix(server, monkeypatch):
    """litellm (the `openai/` provider prefix, any OpenAI-compatible base URL): chat, streaming,
    chat logprobs, tools, a pydantic response_format, text completion with echo and logprobs,
    and a 400 that reaches the caller as litellm's BadRequestError naming the field."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # (no fetch of its price list: no network)
    import litellm
    from pydantic import BaseModel

    kw = dict(model=f"openai/{MODEL}", api_base=f"{server.url}/v1", api_key=KEY, temperature=0)
    c = client(server)
    msgs = [{"role": "user", "content": "Say hi"}]
    r = litellm.completion(messages=msgs, max_tokens=10, **kw)
    ref = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == ref.choices[0].message.content and r.usage.completion_tokens == 10
    stream = litellm.completion(messages=msgs, max_tokens=10, stream=True, **kw)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == ref.choices[0].message.content
    r = litellm.completion(messages=msgs, max_tokens=4, logprobs=True, top_logprobs=2, **kw)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob == x.logprob
                                     for x in content)  # greedy: the chosen token is the most likely
    r = litellm.completion(messages=[{"role": "user", "content": "What is 2 + 3?"}], tools=[TOOLS[1]],
                           tool_choice="required", max_tokens=40, **kw)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
    assert set(json.loads(call.function.arguments)) == {"a", "b"}

    class Book(BaseModel):
        title: str
        year: int

    r = litellm.completion(messages=[{"role": "user", "content": "A book as JSON"}], response_format=Book,
                           max_tokens=60, **kw)
    assert r.choices[0].finish_reason == "stop"
    Book.model_validate_json(r.choices[0].message.content)
    r = litellm.text_completion(prompt="The cat sat on the", max_tokens=3, logprobs=1, echo=True, **kw)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("The cat sat on the") and lp.token_logprobs[0] is None
    assert len(lp.tokens) == 5 + 3 and "".join(lp.tokens) == r.choices[0].text
    with pytest.raises(litellm.BadRequestError, match="top_logprobs"):
        litellm.completion(messages=msgs, max_tokens=2, logprobs=True, top_logprobs=50, **kw)


@pytest.mark.slow
def test_a_templates_own_tool_format():
    """`--chat-template` with a tools section in Hermes's format (tests/data): the template renders
    the tools, calls come as <tool_call> blocks under the grammar, parallel_tool_calls gives
    several (two cities asked: two calls, streamed as two deltas), earlier calls and results
    render in the template's own way, and a follow-up turn runs."""
    import jsonschema

    hermes = os.path.join(os.path.dirname(__file__), "data", "hermes_chat_template.jinja")
    srv = ServerProcess("--chat-template", hermes)
    try:
        srv.wait_ready()
        c = client(srv)
        msgs = [{"role": "user", "content": "What's the weather in Paris and in Rome, in Celsius?"}]
        params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        r = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=True, max_tokens=120, temperature=0)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert [x.function.name for x in calls] == ["get_weather", "get_weather"]
        assert {json.loads(x.function.arguments)["city"] for x in calls} == {"Paris", "Rome"}
        for x in calls:
            jsonschema.validate(json.loads(x.function.arguments), {**params[x.function.name],
                                                                  "additionalProperties": False})
        stream = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=True, max_tokens=120, temperature=0, stream=True)
        deltas = [ch.choices[0] for ch in stream if ch.choices]
        streamed = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
        assert [(x.index, x.function.name, x.function.arguments) for x in streamed] == \
            [(i, x.function.name, x.function.arguments) for i, x in enumerate(calls)]
        assert deltas[-1].finish_reason == "tool_calls"
        r = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required",
                                      max_tokens=120, temperature=0)
        assert len(r.choices[0].message.tool_calls) == 1  # parallel_tool_calls off (the default): one call
        r = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=120, temperature=0,
                                      tool_choice={"type": "function", "function": {"name": "add"}})
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
        follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "C"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
        r = c.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=40, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "tool_calls", "length")
        with pytest.raises(openai.BadRequestError) as e:  # a parameter schema the grammar engine cannot take
            c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, tool_choice="required", tools=[
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
                    "x": {"type": "frobnicate"}}}}}])
        assert e.value.param == "tools"
    finally:
        srv.stop()


@pytest.mark.slow
def test_tokenizer_endpoints(server):
    post = lambda path, body: httpx.post(f"{server.url}{path}", json=body, headers=AUTH,  # noqa: E731
                                         timeout=HTTP_TIMEOUT)
    r = post("/tokenize", {"model": MODEL, "prompt": "Hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == 2 and r["token_strs"] == ["Hello", " world"] and r["max_model_len"] > 0
    assert post("/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    chat = post("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    text = post("/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n") and "Hi" in text
    bad = post("/detokenize", {"tokens": [1, 10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens.1"
    assert post("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}).status_code == 400
    assert post("/tokenize", {"model": "other", "prompt": "x"}).json()["error"]["param"] == "model"
    info = httpx.get(f"{server.url}/tokenizer_info", headers=AUTH, timeout=HTTP_TIMEOUT).json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    # the API key
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}, timeout=HTTP_TIMEOUT).status_code == 401


@pytest.mark.slow
def test_bad_chat_requests_and_oversize_body(server):
    h = {"Authorization": f"Bearer {KEY}"}
    for messages, param in (([], "messages"), ([{"role": "wizard", "content": "x"}], "messages.0.role"),
                            ("hello", "messages")):
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": messages}, headers=h,
                       timeout=HTTP_TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=h,
                   json={"model": MODEL, "messages": [{"role": "user", "content": 5}]}, timeout=HTTP_TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"  # not ...content.str
    r = httpx.post(f"{server.url}/v1/completions", headers=h,
                   json={"model": MODEL, "prompt": "x" * (3 << 20)}, timeout=HTTP_TIMEOUT)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert r.json()["error"]["param"] is None  # the size, not a field, is at fault
    with pytest.raises(openai.BadRequestError) as e:
        client(server).completions.create(model=MODEL, prompt="Hi", max_tokens=10**6)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    assert httpx.get(f"{server.url}/health", timeout=HTTP_TIMEOUT).status_code == 200  # still up


@pytest.mark.slow
def test_live_trace_only_with_the_flag_and_it_follows_the_engine(servers):
    """`arlm serve --trace`: /trace is a page that follows the engine by server-sent events; in a
    real browser (Debian's chromium) it updates while requests stream: requests running, their
    blocks, each step's batch; back to an idle, empty pool after. Without --trace: 404."""
    from playwright.sync_api import sync_playwright

    from test_trace import chromium

    main, tiny = servers
    assert httpx.get(f"{main.url}/trace", timeout=HTTP_TIMEOUT).status_code == 404
    assert httpx.get(f"{main.url}/trace/events", timeout=HTTP_TIMEOUT).status_code == 404
    r = httpx.get(f"{tiny.url}/trace", timeout=HTTP_TIMEOUT)
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    tiny.wait_idle()
    c = client(tiny)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{tiny.url}/trace")
            # (the waits' time-outs are hang guards: a loaded machine only makes them take longer)
            page.wait_for_function("window.arlmLive.updates >= 1", timeout=120_000)
            before = page.evaluate("window.arlmLive.last.steps_total")
            with cf.ThreadPoolExecutor(4) as pool:
                # 4 requests of ~5 + 8 tokens: 4 blocks of 4 each, so the 12-block pool runs 3 at once
                jobs = [pool.submit(complete, c, p, 8, True) for p in PROMPTS[:4]]
                assert all(j.result()[1] == "length" for j in jobs)
            # the burst lasts ~0.1 s: what the page saw comes from every snapshot it received (the
            # first step after idle is always sent, and the idle one after the last)
            page.wait_for_function("window.arlmLive.last.running.length === 0 && window.arlmLive.last.pool.used === 0"
                                   " && window.arlmLive.last.requests_finished >= 4", timeout=120_000)
            last = page.evaluate("window.arlmLive.last")
            widest = max(len(st["batch"]) for st in last["steps"])
            assert page.evaluate("window.arlmLive.maxRunning") >= 1 and page.evaluate("window.arlmLive.maxUsed") >= 1
            assert widest >= 2  # batches of several requests
            assert last["steps_total"] >= before + 8 and last["requests_finished"] >= 4
            assert any(x["phase"] == "decode" for st in last["steps"] for x in st["batch"])
            assert page.locator("#chart rect").count() > 0 and "idle" in page.inner_text("#reqs")
            assert errors == []
        finally:
            browser.close()


def test_serve_cli_rejects_bad_flags(capfd):
    # All before the model loads: a pool larger than the machine's memory once got the server
    # OOM-killed without a word (or an allocator's internal error), 0 failed after the load.
    # The first case through the process end to end, the rest through the same main() in this
    # one (each process costs its interpreter's imports). --port 0 (any free port): the template
    # is read after the port is bound, and the default port may be another server's.
    cases = [(["--kv-cache-memory", size], "--kv-cache-memory", says)
             for size, says in (("lots", "not a memory size"), ("1000GiB", "does not fit"),
                                ("100TiB", "does not fit"), ("0", "at least 1MiB"), ("1", "at least 1MiB"))]
    with tempfile.NamedTemporaryFile("w", suffix=".jinja") as bad:
        bad.write("{% for m in messages %}{{ m.content }")
        bad.flush()
        cases += [(["--chat-template", value, "--port", "0"], "--chat-template", says)
                  for value, says in (("/no/such/template.jinja", "no such file"), (bad.name, "line 1"))]
        for i, (args, flag, says) in enumerate(cases):
            if i == 0:
                r = subprocess.run([sys.executable, "-m", "arlm", "serve", *args], capture_output=True, text=True,
                                   timeout=300)
            else:
                r = run_arlm(capfd, "serve", *args)
            assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
            assert flag in r.stderr and says in r.stderr, r.stderr


@pytest.mark.slow
def test_serve_cli_fails_in_one_line_before_claiming_to_listen():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for args, says in ((["--port", "70000"], "70000"), (["--port", port], "already in use"),
                           (["--host", "192.0.2.1", "--port", port], "192.0.2.1")):  # an address not on this machine
            r = subprocess.run([sys.executable, "-m", "arlm", "serve", "--model", MODEL, *args],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and says in r.stderr, r.stderr
            assert "Traceback" not in r.stdout + r.stderr and "listening on" not in r.stdout + r.stderr


@pytest.mark.slow
def test_an_openai_agents_sdk_agent_calls_a_python_tool_through_the_responses_api(server, monkeypatch):
    """The OpenAI Agents SDK end to end against the real server: an agent whose model is arlm's
    Responses API calls a Python function tool (the SDK runs it and, told to stop on the first
    tool, returns its result); then a plain agent answers in text."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # (no trace export: no network here)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}, 24 C"

    model = OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300))
    settings = ModelSettings(temperature=0, tool_choice="required", max_tokens=64)
    agent = Agent(name="weather", instructions="Use the tool to answer.", tools=[get_weather], model=model,
                  model_settings=settings, tool_use_behavior="stop_on_first_tool")
    plain = Agent(name="plain", instructions="You are a helpful assistant.", model=model,
                  model_settings=ModelSettings(temperature=0, max_tokens=96))

    async def run():  # (one event loop: the client's connections belong to it)
        return (await Runner.run(agent, "What is the weather in Paris?"),
                await Runner.run(plain, "Hi!"))  # (a greedy reply that ends well within 96 tokens)

    result, answer = asyncio.run(run())
    assert len(calls) == 1 and calls[0]
    assert result.final_output == f"Sunny in {calls[0]}, 24 C"
    assert isinstance(answer.final_output, str) and answer.final_output
