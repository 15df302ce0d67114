"""The test modules' server helpers: `arlm serve` in a process of its own on a free loopback port
(`ServerProcess`), the key and model it serves, and the bad requests every server must refuse
with a 400 naming the field (`BAD`: test_serve_api.py, test_cluster.py)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

KEY = "test-key-123"
MODEL = "smollm2"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Every HTTP call's time-out: a hang guard, generous (httpx's own default, 5 s, is not: a
# request on a loaded machine can take that long).
HTTP_TIMEOUT = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m arlm serve ...` on a free loopback port, its output in a temp file."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        # One thread per server: two servers and pytest share the CI machine's two cores.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "arlm", "serve", "--model", MODEL, "--port", str(self.port),
                                      *args], stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        pytest.fail(f"server not ready after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-4000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.unlink(self.log.name)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=HTTP_TIMEOUT).text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}

    def wait_idle(self, timeout: float = 120.0) -> dict[str, float]:
        """Metrics once nothing runs or waits and no KV block is held; after `timeout` seconds,
        the metrics as they are (and the caller's assertions fail). A hang guard only: an idle
        server returns at once, a loaded machine only delays it."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["arlm_kv_cache_usage_ratio"] == 0 and m["arlm_num_requests_running"] == 0
                    and m["arlm_num_requests_waiting"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)


# (name, body, the field the 400 names, its code): POSTed to /v1/completions
BAD = [
    ("not json", "{bad json", None, "invalid_json"),
    ("unknown model", {"model": "gpt-4", "prompt": "Hi"}, "model", "model_not_found"),
    ("missing prompt", {"model": MODEL}, "prompt", "invalid_value"),
    ("string max_tokens", {"model": MODEL, "prompt": "Hi", "max_tokens": "8"}, "max_tokens", "invalid_value"),
    ("bool temperature", {"model": MODEL, "prompt": "Hi", "temperature": True}, "temperature", "invalid_value"),
    ("negative temperature", {"model": MODEL, "prompt": "Hi", "temperature": -1}, "temperature", "invalid_value"),
    ("top_p zero", {"model": MODEL, "prompt": "Hi", "top_p": 0}, "top_p", "invalid_value"),
    ("max_tokens zero", {"model": MODEL, "prompt": "Hi", "max_tokens": 0}, "max_tokens", "invalid_value"),
    ("min_p above 1", {"model": MODEL, "prompt": "Hi", "min_p": 2.0}, "min_p", "invalid_value"),
    ("too long", {"model": MODEL, "prompt": "Hi", "max_tokens": 10**6}, "max_tokens", "context_length_exceeded"),
    ("bad token id", {"model": MODEL, "prompt": [1, 10**9]}, "prompt", "invalid_value"),
    ("empty stop", {"model": MODEL, "prompt": "Hi", "stop": [""]}, "stop", "invalid_value"),
    ("body is a list", [1, 2], None, "invalid_value"),
    # the param names the field sent, not the member of its type union (`prompt.str`)
    ("number prompt", {"model": MODEL, "prompt": 5}, "prompt", "invalid_value"),
    ("number stop", {"model": MODEL, "prompt": "Hi", "stop": 5}, "stop", "invalid_value"),
    ("best_of", {"model": MODEL, "prompt": "Hi", "best_of": 2}, "best_of", "unsupported"),
    ("logit_bias id", {"model": MODEL, "prompt": "Hi", "logit_bias": {"-1": -100}}, "logit_bias", "invalid_value"),
    ("logit_bias type", {"model": MODEL, "prompt": "Hi", "logit_bias": {"1": "x"}}, "logit_bias", "invalid_value"),
    ("bad regex", {"model": MODEL, "prompt": "Hi", "guided_regex": "(("}, "guided_regex", "invalid_value"),
    ("bad schema", {"model": MODEL, "prompt": "Hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frobnicate"}}}}, "response_format", "invalid_value"),
    ("two grammars", {"model": MODEL, "prompt": "Hi", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice",
     "invalid_value"),
    # counts the engine's int64 tensors cannot hold are refused here, by name, not in its step
    ("huge top_k", {"model": MODEL, "prompt": "Hi", "top_k": 2**63}, "top_k", "invalid_value"),
    ("top_k 2**31", {"model": MODEL, "prompt": "Hi", "top_k": 2**31}, "top_k", "invalid_value"),
    ("huge max_tokens", {"model": MODEL, "prompt": "Hi", "max_tokens": 2**63}, "max_tokens", "invalid_value"),
    ("huge best_of", {"model": MODEL, "prompt": "Hi", "best_of": 2**64}, "best_of", "invalid_value"),
]
