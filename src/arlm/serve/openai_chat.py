"""OpenAI's Chat Completions API: `POST /v1/chat/completions` (messages through the chat
template, tools, structured outputs, logprobs, n choices), answered by `choices.Choices`."""

from __future__ import annotations

import dataclasses

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field

from ..sampling import MAX_LOGPROBS
from .choices import Choices
from .common import Server
from .errors import APIError
from .sampling_fields import structured_output
from .schemas import MAX_COUNT, ChatMessage, SamplingRequest


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


def add_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = await server.parse(request, ChatCompletionRequest)
        for i, m in enumerate(req.messages):
            if m.content is None and not (m.role == "assistant"):  # (an assistant turn may be only a tool call)
                raise APIError(400, f"messages.{i}.content: a {m.role} message needs content",
                               param=f"messages.{i}.content", code="invalid_value")
        ids, constraint = await server.chat_prompt(server.chat_messages(req.messages), req.tools, req.tool_choice,
                                                   bool(req.parallel_tool_calls))
        params = server.sampling_params(req, req.max_completion_tokens or req.max_tokens, len(ids), "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        if req.logprobs:
            params = dataclasses.replace(params, logprobs=req.top_logprobs or 0)
        output = structured_output(req)
        field, structured = await server.constrain(
            constraint, output is not None, lambda: output,
            APIError(400, "tools and a structured output (response_format, guided_*) at once",
                     param="response_format", code="invalid_value"))
        params = dataclasses.replace(params, structured=structured)
        choices = Choices(server, req, len(ids), chat=True,
                          tools=server.tool_format if constraint is not None else None, field=field)
        return await server.answer(request, choices, server.jobs(0, ids, params, req.n), req.stream, field)
