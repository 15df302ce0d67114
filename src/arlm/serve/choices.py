"""OpenAI's choice shapes, shared by the Completions and Chat Completions routes: run one
request's choices and answer as a completion or a chat completion, streamed as server-sent events
(ending in `data: [DONE]`) or as one JSON body."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine import RequestFailed
from . import tools as tools_mod
from .common import (APIError, Delta, Logprobs, Server, _SamplingRequest, _sse, _unless_disconnected, _usage,
                     stream_error)


async def respond(server: Server, request: Request, req: _SamplingRequest, jobs: list, prompt_tokens: int,
                  chat: bool, echo: list[str] | None = None, zero: bool = False,
                  tools: tools_mod.GenericFormat | tools_mod.HermesFormat | None = None,
                  field: str | None = None) -> Response:
    """Run the jobs (one per choice) and answer in OpenAI's format: a completion or a chat
    completion, streamed as server-sent events or as one JSON body. echo: each choice's
    prompt text, written before its completion (with its tokens' logprobs where asked);
    zero: max_tokens 0, the one token generated is dropped. tools: the tool format whose
    constrained calls or reply each chat reply is (serve/tools.py), answered once whole.
    field: the request's field whose grammar the choices follow (a request that its grammar
    stops is the client's error, named by it: a 400, or an error event once streaming)."""
    rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
    fmt = Logprobs(server.llm.tokenizer)
    want_logprobs = bool(req.logprobs) if chat else req.logprobs is not None

    def body(obj: str, choices: list[dict], usage: dict | None) -> dict:
        return {"id": rid, "object": obj, "created": created, "model": server.model_name,
                "choices": choices, "usage": usage}

    def prompt_entries(i: int, d: Delta) -> list[tuple]:
        ids = jobs[i][1]
        pl = d.prompt_logprobs or []
        return [(ids[0], None, None)] + [(ids[t + 1], lp, top) for t, (lp, top) in enumerate(pl)]

    if req.stream:
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(index: int, text: str | None, finish_reason: str | None, role: bool = False,
                  logprobs: dict | None = None) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else {"content": text} if text else {}
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            else:
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            return _sse(body(obj, [choice], None))

        async def tool_events() -> AsyncIterator[str]:
            """With tools, each reply is parsed whole: role, then its content or its tool
            call (one delta with the id, the name and the arguments), then the finish."""
            for i in range(len(jobs)):
                yield chunk(i, None, None, role=True)
            try:
                texts, reasons, counts = [""] * len(jobs), [None] * len(jobs), [0] * len(jobs)
                async for d in server.run_all(jobs):
                    texts[d.index] += d.text
                    counts[d.index] = d.num_tokens
                    reasons[d.index] = d.finish_reason or reasons[d.index]
                for i, (text, reason) in enumerate(zip(texts, reasons)):
                    content, calls = tools.parse(text)
                    if content:
                        yield chunk(i, content, None)
                    for k, call in enumerate(calls or []):
                        delta = {"tool_calls": [{"index": k, **call}]}
                        yield _sse(body(obj, [{"index": i, "delta": delta, "logprobs": None,
                                               "finish_reason": None}], None))
                        reason = "tool_calls"
                    yield chunk(i, None, reason)
                if include_usage:
                    yield _sse(body(obj, [], _usage(prompt_tokens, sum(counts))))
            except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
                yield _sse(stream_error(e, field))
            yield "data: [DONE]\n\n"

        async def events() -> AsyncIterator[str]:
            counts = [0] * len(jobs)
            offset = [0] * len(jobs)
            started = [False] * len(jobs)
            if chat:  # the role comes first, as OpenAI sends it
                for i in range(len(jobs)):
                    yield chunk(i, None, None, role=True)
            try:
                async for d in server.run_all(jobs):
                    i = d.index
                    if echo is not None and not started[i]:  # the prompt first, with its logprobs
                        entries = prompt_entries(i, d)
                        lp = fmt.legacy(entries, fmt.offsets(jobs[i][1])) if want_logprobs else None
                        yield chunk(i, echo[i], None, logprobs=lp)
                        offset[i] = len(echo[i])
                    started[i] = True
                    if zero:
                        if d.finish_reason:
                            yield chunk(i, "", "length")
                        continue
                    counts[i] = d.num_tokens
                    lp = None
                    if want_logprobs and d.logprob is not None:
                        entry = [(d.token_id, d.logprob, d.top_logprobs)]
                        lp = {"content": fmt.chat(entry)} if chat else fmt.legacy(entry, [offset[i]])
                    offset[i] += len(d.text)
                    if chat and d.text and d.finish_reason:  # content, then an empty finishing delta
                        yield chunk(i, d.text, None, logprobs=lp)
                        yield chunk(i, None, d.finish_reason)
                    elif d.text or d.finish_reason or lp is not None:
                        yield chunk(i, d.text, d.finish_reason, logprobs=lp)
                if include_usage:
                    yield _sse(body(obj, [], _usage(prompt_tokens, sum(counts))))
            except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
                yield _sse(stream_error(e, field))
            yield "data: [DONE]\n\n"

        return StreamingResponse(tool_events() if tools else events(), media_type="text/event-stream")

    async def collect() -> dict:
        texts, reasons, counts = [""] * len(jobs), [None] * len(jobs), [0] * len(jobs)
        prompt_lp: list[list] = [[] for _ in jobs]
        tokens: list[list] = [[] for _ in jobs]
        async for d in server.run_all(jobs):
            if d.prompt_logprobs is not None or (echo is not None and not prompt_lp[d.index]):
                prompt_lp[d.index] = prompt_entries(d.index, d)
            texts[d.index] += d.text
            counts[d.index] = d.num_tokens
            reasons[d.index] = d.finish_reason or reasons[d.index]
            if d.logprob is not None:
                tokens[d.index].append((d.token_id, d.logprob, d.top_logprobs))
        if zero:
            texts, counts, tokens = [""] * len(jobs), [0] * len(jobs), [[] for _ in jobs]
            reasons = ["length"] * len(jobs)
        if chat:
            choices = []
            for i, (t, r) in enumerate(zip(texts, reasons)):
                message: dict = {"role": "assistant", "content": t}
                if tools:
                    content, calls = tools.parse(t)
                    message["content"] = content
                    if calls:
                        message["tool_calls"], r = calls, "tool_calls"
                choices.append({"index": i, "message": message,
                                "logprobs": {"content": fmt.chat(tokens[i])} if want_logprobs else None,
                                "finish_reason": r})
        else:
            choices = []
            for i, (t, r) in enumerate(zip(texts, reasons)):
                lp = None
                if want_logprobs:
                    head = echo[i] if echo is not None else ""
                    ids = [e[0] for e in tokens[i]]
                    offsets = (fmt.offsets(jobs[i][1]) if echo is not None else []) + fmt.offsets(ids, len(head))
                    lp = fmt.legacy((prompt_lp[i] if echo is not None else []) + tokens[i], offsets)
                choices.append({"index": i, "text": (echo[i] if echo is not None else "") + t, "logprobs": lp,
                                "finish_reason": r})
        return body("chat.completion" if chat else "text_completion", choices, _usage(prompt_tokens, sum(counts)))

    try:
        result = await _unless_disconnected(request, collect())
    except RequestFailed as e:
        if e.client_error:
            raise APIError(400, f"{field}: {e}" if field else str(e), param=field,
                           code="grammar_too_complex") from None
        raise
    return JSONResponse(result) if result is not None else Response(status_code=499)
