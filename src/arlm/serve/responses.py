"""OpenAI's Responses API: `POST /v1/responses`, `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`.

What the OpenAI Agents SDK and Codex-style clients speak. A request's `input` (a string, or a list
of items: messages with `input_text` parts, earlier `function_call` items and their
`function_call_output`s) and `instructions` become one conversation for the chat template
(`Server.chat_prompt`, the one place every protocol's conversations meet it); function `tools`
(with `tool_choice` and `parallel_tool_calls`) and `text.format` (json_schema, json_object) go
through the same structured-output path as Chat Completions'. The reply is a response object
whose `output` holds a `message` item (its `output_text`) or `function_call` items; streamed, the
documented events with `sequence_number`s: response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta...,
response.output_text.done, response.content_part.done, response.output_item.done (or
response.function_call_arguments.delta/done for a call), then response.completed (or
response.incomplete at max_output_tokens, response.failed on an engine error).

`store` (default true, as OpenAI's) keeps each response and its conversation in a bounded
in-memory store (`ResponseStore`: by count and bytes, oldest first out); `previous_response_id`
continues that conversation (its earlier turns, rendered the same way, come back from the prefix
cache). An evicted or unknown id is a 404 naming it. `reasoning` is accepted and ignored.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from .common import Job, Reply, Server
from .errors import APIError, stream_error
from .schemas import MAX_COUNT, Strict, text_parts

# OpenAI's names for the sampling fields' errors
NAMES = {"max_tokens": "max_output_tokens", "stop": "text"}


class ResponsesRequest(Strict):
    model: str
    input: str | list[dict] = Field(...)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    reasoning: dict | None = None  # accepted, ignored: no reasoning model here
    truncation: Literal["disabled", "auto"] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # (not OpenAI's: vLLM's extra)
    top_k: int = Field(0, ge=-1, le=MAX_COUNT)  # (vLLM's)


class ResponseStore:
    """Stored responses: id -> (the response object, its conversation's messages), the oldest
    out first past `max_items` responses or `max_bytes` of their JSON."""

    def __init__(self, max_items: int = 1000, max_bytes: int = 64 << 20) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self.items: OrderedDict[str, tuple[dict, list[dict], set[str], int]] = OrderedDict()
        self.bytes = 0

    def put(self, response: dict, messages: list[dict], call_ids: set[str]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(messages))
        if size > self.max_bytes:
            return  # (too large to keep: a later previous_response_id gets a 404 naming it)
        self.items[response["id"]] = (response, messages, call_ids, size)
        self.bytes += size
        while len(self.items) > self.max_items or self.bytes > self.max_bytes:
            _, (*_, s) = self.items.popitem(last=False)
            self.bytes -= s

    def get(self, rid: str, param: str = "response_id") -> tuple[dict, list[dict], set[str]]:
        if rid not in self.items:
            raise APIError(404, f"no response with id '{rid}' is stored (never stored, deleted, or evicted from "
                                f"the server's bounded store)", param=param, code="not_found")
        response, messages, call_ids, _ = self.items[rid]
        return response, messages, call_ids

    def delete(self, rid: str) -> None:
        self.get(rid)
        *_, size = self.items.pop(rid)
        self.bytes -= size


def conversation(req: ResponsesRequest, history: list[dict], known_calls: set[str]) -> tuple[list[dict], set[str]]:
    """The request's input items after `history` (a previous response's conversation), as a
    conversation (`Server.template_messages`' input; `instructions` are not part of it: they
    apply to this request alone, as OpenAI's); and every call id it holds. A
    function_call_output must answer a call made earlier in it. `history`'s messages are never
    changed (they are the store's)."""
    messages = list(history)
    calls = set(known_calls)
    items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    if not items:
        raise APIError(400, "input: at least one item is needed", param="input", code="invalid_value")
    for i, item in enumerate(items):
        param = f"input.{i}"
        if not isinstance(item, dict):
            raise APIError(400, f"{param}: an item (an object)", param=param, code="invalid_value")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{param}.role: user, system, developer or assistant, got {role!r}",
                               param=f"{param}.role", code="invalid_value")
            kinds = ("output_text", "input_text", "refusal") if role == "assistant" else ("input_text", "text")
            text = text_parts(item.get("content"), f"{param}.content", kinds)
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, str):
                raise APIError(400, f"{param}: a function_call needs call_id, name and arguments (strings)",
                               param=param, code="invalid_value")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # (its text and calls, parallel calls: one turn)
                messages[-1] = {**last, "tool_calls": [*last.get("tool_calls", []), call]}
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            calls.add(call_id)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or call_id not in calls:
                raise APIError(400, f"{param}.call_id: no function call {call_id!r} in this conversation",
                               param=f"{param}.call_id", code="invalid_value")
            if not isinstance(output, str):
                output = text_parts(output, f"{param}.output", ("input_text", "output_text", "text"))
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # (no reasoning here: a client may still send back what another model made)
        else:
            raise APIError(400, f"{param}.type: {kind!r} is not an input item this server takes (message, "
                                f"function_call, function_call_output)", param=f"{param}.type",
                           code="unsupported" if kind else "invalid_value")
    return messages, calls


def chat_tools(req: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    """The request's function tools and tool_choice in Chat Completions' shapes."""
    tools = []
    for i, t in enumerate(req.tools or []):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise APIError(400, f"tools.{i}: only function tools are supported, got {kind!r}", param=f"tools.{i}",
                           code="unsupported")
        tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                       if k in t}})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise APIError(400, "tool_choice: none, auto, required or {\"type\": \"function\", \"name\": ...}",
                           param="tool_choice", code="invalid_value")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return tools or None, choice


def text_format(req: ResponsesRequest) -> dict | None:
    """`text.format` as Chat Completions' response_format (json_schema's schema flattened there)."""
    fmt = (req.text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "text.format: {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}",
                       param="text.format", code="invalid_value")
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    return {"type": fmt["type"]}


def add_routes(app: FastAPI, server: Server) -> None:
    store = server.responses = ResponseStore()

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        server.check_auth(request)
        return JSONResponse(store.get(response_id)[0])

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        server.check_auth(request)
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        req: ResponsesRequest = await server.parse(request, ResponsesRequest)
        history, known = [], set()
        if req.previous_response_id is not None:
            _, history, known = store.get(req.previous_response_id, "previous_response_id")
        messages, calls = conversation(req, history, known)
        tools, choice = chat_tools(req)
        parallel = bool(req.parallel_tool_calls) if req.parallel_tool_calls is not None else False
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        ids, constraint = await server.chat_prompt(system + messages, tools, choice, parallel, param="input")
        params = server.params_for(len(ids), req.max_output_tokens, NAMES, "input", temperature=req.temperature,
                                   top_p=req.top_p, seed=req.seed, top_k=req.top_k)
        fmt = text_format(req)
        _, structured = await server.constrain(
            constraint, fmt is not None and fmt["type"] != "text", lambda: server.format_output(fmt, "text.format"),
            APIError(400, "tools and a JSON text.format at once", param="text.format", code="invalid_value"))
        field = "tools" if constraint is not None else "text.format"
        params = dataclasses.replace(params, structured=structured)
        turn = Turn(server, req, messages, calls, ids, constraint is not None, field)
        return await server.answer(request, turn, [Job(0, ids, params)], req.stream, field)

class Turn:
    """One response: the request's fields echoed, the output items built from the reply."""

    def __init__(self, server: Server, req: ResponsesRequest, messages: list[dict], calls: set[str],
                 ids: list[int], tools: bool, field: str) -> None:
        self.server, self.req, self.messages, self.calls, self.ids, self.tools = server, req, messages, calls, ids, tools
        self.field = field  # the request's field a grammar that stops the reply is charged to
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.msg_id = f"msg_{uuid.uuid4().hex}"

    def response(self, status: str, output: list[dict], usage: dict | None, incomplete: str | None = None,
                 error: dict | None = None) -> dict:
        req = self.req
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.server.model_name, "output": output, "usage": usage,
                "incomplete_details": {"reason": incomplete} if incomplete else None, "error": error,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "metadata": req.metadata or {}, "parallel_tool_calls": bool(req.parallel_tool_calls),
                "previous_response_id": req.previous_response_id, "temperature": req.temperature,
                "top_p": req.top_p, "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
                "tools": req.tools or [], "text": {"format": fmt}, "store": req.store, "user": req.user,
                "reasoning": {"effort": None, "summary": None}, "truncation": req.truncation or "disabled"}

    def usage(self, output_tokens: int, cached: int) -> dict:
        n = len(self.ids)
        return {"input_tokens": n, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": n + output_tokens}

    def items(self, text: str, reason: str | None = None) -> tuple[list[dict], list[dict]]:
        """The reply as output items (a message, or function calls), and the assistant's turn for
        the stored conversation; a message cut by max_output_tokens is `incomplete`."""
        content, calls = (self.server.tool_format.parse(text) if self.tools else (text, None))
        if calls:
            out = [{"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": c["id"],
                    "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}
                   for c in calls]
            self.calls.update(c["id"] for c in calls)
            return out, [{"role": "assistant", "content": content or "", "tool_calls": calls}]
        status = "incomplete" if reason == "length" else "completed"
        return [self.message(content or "", status)], [{"role": "assistant", "content": content or ""}]

    def message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status
                != "in_progress" else []}

    def finish(self, output: list[dict], turn: list[dict], reply: Reply) -> dict:
        incomplete = "max_output_tokens" if reply.finish_reason == "length" else None
        response = self.response("incomplete" if incomplete else "completed", output,
                                 self.usage(reply.num_tokens, reply.cached_tokens), incomplete)
        if self.req.store:
            self.server.responses.put(response, self.messages + turn, self.calls)
        return response

    async def collect(self, jobs: list[Job]) -> dict:
        reply, = await self.server.replies(jobs)
        output, turn = self.items(reply.text, reply.finish_reason)
        return self.finish(output, turn, reply)

    async def events(self, jobs: list[Job]) -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **fields) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

        yield event("response.created", response=self.response("in_progress", [], None))
        yield event("response.in_progress", response=self.response("in_progress", [], None))
        reply, started = Reply(), False
        try:
            async for d in self.server.run_all(jobs):
                reply.add(d)
                if self.tools:  # a tool call is parsed whole: its events come at the end
                    continue
                if not started:
                    started = True
                    yield event("response.output_item.added", output_index=0, item=self.message("", "in_progress"))
                    yield event("response.content_part.added", item_id=self.msg_id, output_index=0, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                if d.text:
                    yield event("response.output_text.delta", item_id=self.msg_id, output_index=0, content_index=0,
                                delta=d.text, logprobs=[])
            output, turn = self.items(reply.text, reply.finish_reason)
            for k, item in enumerate(output):
                if item["type"] == "message":
                    if not started:
                        yield event("response.output_item.added", output_index=k, item=self.message("", "in_progress"))
                        yield event("response.content_part.added", item_id=self.msg_id, output_index=k,
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                           "logprobs": []})
                        if item["content"][0]["text"]:
                            yield event("response.output_text.delta", item_id=self.msg_id, output_index=k,
                                        content_index=0, delta=item["content"][0]["text"], logprobs=[])
                    part = item["content"][0]
                    yield event("response.output_text.done", item_id=self.msg_id, output_index=k, content_index=0,
                                text=part["text"], logprobs=[])
                    yield event("response.content_part.done", item_id=self.msg_id, output_index=k, content_index=0,
                                part=part)
                else:
                    yield event("response.output_item.added", output_index=k, item={**item, "arguments": "",
                                                                                     "status": "in_progress"})
                    yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                                delta=item["arguments"])
                    yield event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                                name=item["name"], arguments=item["arguments"])
                yield event("response.output_item.done", output_index=k, item=item)
            response = self.finish(output, turn, reply)
            kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
            yield event(kind, response=response)
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            err = stream_error(e, self.field)["error"]
            yield event("response.failed", response=self.response(
                "failed", [], None, error={"code": err["code"], "message": err["message"]}))

