"""The HTTP edge below the protocols: the API key, a body read within its limit and validated
against a request schema (pydantic's errors as a 400 naming the field), server-sent events, and
work cancelled when its client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from .errors import APIError
from .schemas import PROMPT_TYPES, deep_json, param_path


def check_auth(request: Request, api_key: str | None) -> None:
    """401 unless the request carries `api_key` (as a bearer token, or Anthropic's x-api-key)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
        token = request.headers.get("x-api-key", "")
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                       code="invalid_api_key")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, or a 413 once it is over `max_bytes` (by its length, or as a chunked upload grows)."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > max_bytes):
        raise APIError(413, f"request body over {max_bytes} bytes", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():  # a chunked upload has no length to check up front
        body += chunk
        if len(body) > max_bytes:
            raise APIError(413, f"request body over {max_bytes} bytes", code="request_too_large")
    return bytes(body)


def validate(body: bytes, schema: type[BaseModel]) -> Any:
    """The body as `schema`; a 400 naming the field the client sent where it is not."""
    try:
        try:
            return schema.model_validate_json(body)
        except ValidationError as e:
            if "recursion limit" not in str(e):
                raise
            # pydantic's parser stops at a depth of ~200 (a deep JSON schema in response_format):
            # Python's goes on to ~1,000, and the field that holds it is checked by its own rules
            return schema.model_validate(deep_json(body))
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"the body is not valid JSON: {err['msg']}", code="invalid_json") from None
        param = param_path(err["loc"])
        msg = err["msg"]
        if param is not None and param.startswith("prompt") and err["type"] != "missing":
            # pydantic names the union's last member ("a valid string"), wrong for [1.5]
            param, msg = "prompt", f"must be {PROMPT_TYPES}"
        raise APIError(400, f"{param or 'body'}: {msg}", param=param, code="invalid_value") from None


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work) -> Any:
    """Await `work` (a coroutine); if the client goes away first, cancel it (which aborts its
    requests in the engine and frees their blocks) and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()
