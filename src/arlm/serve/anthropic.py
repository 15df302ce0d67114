"""Anthropic's Messages API: `POST /v1/messages`, `POST /v1/messages/count_tokens`.

What Claude Code and the `anthropic` SDK speak. `system` (a string or text blocks) and `messages`
(content as a string or blocks: `text`, `tool_use`, `tool_result`) become one conversation for
the chat template (`Server.chat_prompt`, as every protocol's); `tools` (`input_schema`) with
`tool_choice` auto / any / tool / none go through the tool formats of serve/tools.py, a call
coming back as a `tool_use` block with `stop_reason: "tool_use"`. `stop_reason` is `end_turn`,
`max_tokens`, `stop_sequence` (with the `stop_sequence` that matched) or `tool_use`.
`output_config.format` (a JSON schema) goes through the structured-output path; `temperature`,
`top_p`, `top_k` are honoured where a client sends them (the SDK's newer versions pass them in
`extra_body`).

Streamed (`stream: true`): message_start, content_block_start, content_block_delta (text_delta,
or input_json_delta for a call), content_block_stop, message_delta (stop_reason, usage),
message_stop; `ping` whenever nothing else went out for PING_SECONDS (a long prompt prefilling, a
tool call held back to be parsed whole). Errors are Anthropic's
shape, `{"type": "error", "error": {"type", "message"}}` (api.py's handlers, by path); the key
may come as `x-api-key` (or `Authorization: Bearer`); `anthropic-version` is accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from .common import Job, Reply, Server
from .errors import APIError, stream_error
from .schemas import MAX_COUNT, Strict, text_parts

PING_SECONDS = 1.0  # a stream's keep-alive while its first token is still coming

# Anthropic's names for the sampling fields' errors
NAMES = {"max_tokens": "max_tokens", "stop": "stop_sequences"}

# Anthropic's error types by status (its error shape)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 499: "invalid_request_error", 500: "api_error", 503: "overloaded_error",
               529: "overloaded_error"}

# Where an error is answered in Anthropic's shape
PATHS = ("/v1/messages",)


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class MessagesRequest(Strict):
    model: str
    max_tokens: int = Field(ge=1, le=MAX_COUNT)
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_COUNT)
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    stream: bool = False
    metadata: dict | None = None
    thinking: dict | None = None  # accepted: "disabled", or refused below (no thinking model here)
    service_tier: str | None = None
    output_config: dict | None = None  # format: {"type": "json_schema", "schema"} (structured output); effort ignored


class CountTokensRequest(Strict):
    model: str
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None


def conversation(req: MessagesRequest | CountTokensRequest) -> list[dict]:
    """The system prompt and messages as the chat template's messages (a tool_use block as an
    assistant's tool call, a tool_result as a tool message answering a call made before it)."""
    out = []
    if req.system:
        out.append({"role": "system", "content": text_parts(req.system, "system")})
    calls: set[str] = set()
    for i, m in enumerate(req.messages):
        param = f"messages.{i}"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise APIError(400, f"{param}.role: user or assistant, got {role!r}", param=f"{param}.role",
                           code="invalid_value")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(400, f"{param}.content: a string or a list of content blocks", param=f"{param}.content",
                           code="invalid_value")
        text, tool_calls, results = [], [], 0
        for j, block in enumerate(content):
            bp = f"{param}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                tid, name, args = block.get("id"), block.get("name"), block.get("input", {})
                if not isinstance(tid, str) or not isinstance(name, str) or not isinstance(args, dict):
                    raise APIError(400, f"{bp}: a tool_use block needs id, name and input (an object)", param=bp,
                                   code="invalid_value")
                tool_calls.append({"id": tid, "type": "function",
                                   "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
                calls.add(tid)
            elif kind == "tool_result" and role == "user":
                tid = block.get("tool_use_id")
                if tid not in calls:
                    raise APIError(400, f"{bp}.tool_use_id: no tool_use {tid!r} earlier in the conversation",
                                   param=f"{bp}.tool_use_id", code="invalid_value")
                result = text_parts(block.get("content", ""), f"{bp}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": tid, "content": result})
                results += 1
            elif kind == "thinking" and role == "assistant":
                continue  # (a client may send back another model's)
            else:
                raise APIError(400, f"{bp}.type: {kind!r} is not a {role} content block this server takes (text"
                                    f"{', tool_use' if role == 'assistant' else ', tool_result'})",
                               param=f"{bp}.type", code="unsupported" if kind else "invalid_value")
        if text or tool_calls or not results:  # (a turn of tool results alone is those tool messages)
            msg = {"role": role, "content": "".join(text)}
            if tool_calls:
                msg["tool_calls"] = tool_calls
            out.append(msg)
    return out


def chat_tools(req: MessagesRequest | CountTokensRequest) -> tuple[list[dict] | None, object, bool]:
    """The tools, tool_choice and whether calls may be parallel, in Chat Completions' shapes."""
    tools = []
    for i, t in enumerate(req.tools or []):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t.get("type") not in (None, "custom"):
            kind = t.get("type") if isinstance(t, dict) else None
            raise APIError(400, f"tools.{i}: a client tool ({{name, description, input_schema}}) is expected, got "
                                f"{kind!r}", param=f"tools.{i}", code="unsupported" if kind else "invalid_value")
        schema = t.get("input_schema", {"type": "object", "properties": {}})
        tools.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                       "parameters": schema}})
    tc = req.tool_choice or {"type": "auto"}
    kind = tc.get("type") if isinstance(tc, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise APIError(400, "tool_choice.type: auto, any, tool or none", param="tool_choice", code="invalid_value")
    choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or {
        "type": "function", "function": {"name": tc.get("name")}}
    if not tools:
        choice = None if kind in ("auto", "none") else choice
    # One call a reply, as arlm's Chat Completions by default (a small model allowed several keeps
    # calling): Anthropic's default of parallel calls is not taken; disable_parallel_tool_use is moot.
    return tools or None, choice, False


def add_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        req: CountTokensRequest = await server.parse(request, CountTokensRequest)
        tools, choice, parallel = chat_tools(req)
        ids, _ = await server.chat_prompt(conversation(req), tools, choice, parallel)
        return JSONResponse({"input_tokens": len(ids)})

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        req: MessagesRequest = await server.parse(request, MessagesRequest)
        if req.thinking is not None and req.thinking.get("type") not in (None, "disabled"):
            raise APIError(400, "thinking: this model does not think (thinking: {\"type\": \"disabled\"} or none)",
                           param="thinking", code="unsupported")
        tools, choice, parallel = chat_tools(req)
        ids, constraint = await server.chat_prompt(conversation(req), tools, choice, parallel)
        params = server.params_for(len(ids), req.max_tokens, NAMES, "messages", temperature=req.temperature,
                                   top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences)
        fmt = (req.output_config or {}).get("format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "json_schema"
                                or not isinstance(fmt.get("schema"), dict)):
            raise APIError(400, "output_config.format: {\"type\": \"json_schema\", \"schema\": {...}}",
                           param="output_config.format", code="invalid_value")
        _, structured = await server.constrain(
            constraint, fmt is not None,
            lambda: server.format_output({"type": "json_schema", "json_schema": {"schema": fmt["schema"]}},
                                         "output_config.format"),
            APIError(400, "output_config.format: not with tools that may be called", code="invalid_value",
                     param="output_config.format"))
        params = dataclasses.replace(params, structured=structured)
        field = "output_config.format" if fmt is not None else "tools"
        return await server.answer(request, Turn(server, ids, constraint is not None, field), [Job(0, ids, params)],
                                   req.stream, field)

class Turn:
    """One reply as a message object and its stream of events."""

    def __init__(self, server: Server, ids: list[int], tools: bool, field: str) -> None:
        self.server, self.ids, self.tools, self.field = server, ids, tools, field
        self.id = f"msg_{uuid.uuid4().hex[:24]}"

    def message(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None,
                output_tokens: int) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.server.model_name,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": len(self.ids), "output_tokens": output_tokens,
                          "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}

    def blocks(self, text: str, reason: str | None, stop: str | None) -> tuple[list[dict], str, str | None]:
        """The reply's content blocks, stop_reason and stop_sequence."""
        content, calls = self.server.tool_format.parse(text) if self.tools else (text, None)
        blocks = [{"type": "text", "text": content}] if content or not calls else []
        for c in calls or []:
            try:
                args = json.loads(c["function"]["arguments"])
            except ValueError:
                args = {}
            blocks.append({"type": "tool_use", "id": f"toolu_{c['id'].removeprefix('call_')}",
                           "name": c["function"]["name"], "input": args})
        if calls:
            return blocks, "tool_use", None
        if reason == "length":
            return blocks, "max_tokens", None
        return blocks, ("stop_sequence" if stop is not None else "end_turn"), stop

    async def collect(self, jobs: list[Job]) -> dict:
        reply, = await self.server.replies(jobs)
        blocks, stop_reason, stop_sequence = self.blocks(reply.text, reply.finish_reason, reply.stop_sequence)
        return self.message(blocks, stop_reason, stop_sequence, reply.num_tokens)

    async def events(self, jobs: list[Job]) -> AsyncIterator[str]:
        def event(kind: str, **fields) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"

        yield event("message_start", message=self.message([], None, None, 0))
        reply, opened = Reply(), False
        deltas = self.server.run_all(jobs).__aiter__()
        pending = asyncio.ensure_future(deltas.__anext__())
        try:
            while True:
                # a ping whenever nothing has gone out for PING_SECONDS: while the prompt prefills,
                # and while a tool call is held back to be parsed whole
                while not pending.done():
                    await asyncio.wait({pending}, timeout=PING_SECONDS)
                    if not pending.done():
                        yield event("ping")
                try:
                    d = pending.result()
                except StopAsyncIteration:
                    break
                reply.add(d)
                if not self.tools and d.text:
                    if not opened:
                        opened = True
                        yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
                    yield event("content_block_delta", index=0, delta={"type": "text_delta", "text": d.text})
                pending = asyncio.ensure_future(deltas.__anext__())
            blocks, stop_reason, stop_sequence = self.blocks(reply.text, reply.finish_reason, reply.stop_sequence)
            if opened:
                yield event("content_block_stop", index=0)
            for k, block in enumerate(blocks):
                if opened and k == 0:
                    continue
                if block["type"] == "text":
                    yield event("content_block_start", index=k, content_block={"type": "text", "text": ""})
                    if block["text"]:
                        yield event("content_block_delta", index=k, delta={"type": "text_delta", "text": block["text"]})
                else:
                    yield event("content_block_start", index=k, content_block={**block, "input": {}})
                    yield event("content_block_delta", index=k, delta={
                        "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)})
                yield event("content_block_stop", index=k)
            yield event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        usage={"output_tokens": reply.num_tokens})
            yield event("message_stop")
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band, in Anthropic's shape
            err = stream_error(e, self.field)["error"]
            status = 400 if err["type"] == "invalid_request_error" else 500
            yield f"event: error\ndata: {json.dumps(error_body(status, err['message']))}\n\n"
        finally:  # (a client gone: the request aborted, its blocks freed)
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
            await deltas.aclose()

