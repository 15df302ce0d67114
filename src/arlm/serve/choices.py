"""OpenAI's choice shapes, shared by the Completions and Chat Completions routes: run one
request's choices and answer as a completion or a chat completion, streamed as server-sent events
(ending in `data: [DONE]`) or as one JSON body."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from . import tools as tools_mod
from .common import Delta, Job, Logprobs, Reply, Server
from .errors import stream_error
from .schemas import SamplingRequest
from .transport import sse, usage


class Choices:
    """One request's choices in OpenAI's shapes (a `common.Turn`): a completion or a chat
    completion, streamed as server-sent events (`events`) or as one JSON body (`collect`).

    echo: each choice's prompt text, written before its completion (with its tokens' logprobs
    where asked); zero: max_tokens 0, the one token generated is dropped. tools: the tool format
    whose constrained calls or reply each chat reply is (serve/tools.py), answered once whole.
    field: the request's field whose grammar the choices follow (a request that its grammar
    stops is the client's error, named by it: a 400, or an error event once streaming)."""

    def __init__(self, server: Server, req: SamplingRequest, prompt_tokens: int, chat: bool,
                 echo: list[str] | None = None, zero: bool = False,
                 tools: tools_mod.GenericFormat | tools_mod.HermesFormat | None = None,
                 field: str | None = None) -> None:
        self.server, self.req, self.prompt_tokens, self.chat = server, req, prompt_tokens, chat
        self.echo, self.zero, self.tools, self.field = echo, zero, tools, field
        self.id, self.created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        self.fmt = Logprobs(server.llm.tokenizer)
        self.want_logprobs = bool(req.logprobs) if chat else req.logprobs is not None
        self.include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)

    def body(self, obj: str, choices: list[dict], usage: dict | None) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.server.model_name,
                "choices": choices, "usage": usage}

    @staticmethod
    def prompt_entries(job: Job, d: Delta) -> list[tuple]:
        ids = job.prompt_ids
        pl = d.prompt_logprobs or []
        return [(ids[0], None, None)] + [(ids[t + 1], lp, top) for t, (lp, top) in enumerate(pl)]

    # -- streamed ---------------------------------------------------------------------------------

    def chunk(self, index: int, text: str | None, finish_reason: str | None, role: bool = False,
              logprobs: dict | None = None, delta: dict | None = None) -> str:
        if self.chat:
            if delta is None:
                delta = {"role": "assistant", "content": ""} if role else {"content": text} if text else {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse(self.body("chat.completion.chunk" if self.chat else "text_completion", [choice], None))

    def usage_chunk(self, counts: list[int]) -> str:
        return sse(self.body("chat.completion.chunk" if self.chat else "text_completion", [],
                             usage(self.prompt_tokens, sum(counts))))

    async def events(self, jobs: list[Job]) -> AsyncIterator[str]:
        if self.chat:  # the role comes first, as OpenAI sends it
            for i in range(len(jobs)):
                yield self.chunk(i, None, None, role=True)
        try:
            async for event in (self.tool_events(jobs) if self.tools else self.text_events(jobs)):
                yield event
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            yield sse(stream_error(e, self.field))
        yield "data: [DONE]\n\n"

    async def tool_events(self, jobs: list[Job]) -> AsyncIterator[str]:
        """With tools, each reply is parsed whole: its content or its tool call (one delta with
        the id, the name and the arguments), then the finish."""
        replies = await self.server.replies(jobs)
        for i, reply in enumerate(replies):
            reason = reply.finish_reason
            content, calls = self.tools.parse(reply.text)
            if content:
                yield self.chunk(i, content, None)
            for k, call in enumerate(calls or []):
                yield self.chunk(i, None, None, delta={"tool_calls": [{"index": k, **call}]})
                reason = "tool_calls"
            yield self.chunk(i, None, reason)
        if self.include_usage:
            yield self.usage_chunk([r.num_tokens for r in replies])

    async def text_events(self, jobs: list[Job]) -> AsyncIterator[str]:
        """Each delta as it comes (after a choice's echoed prompt)."""
        counts, offset, started = [0] * len(jobs), [0] * len(jobs), [False] * len(jobs)
        fmt, echo, chat = self.fmt, self.echo, self.chat
        async for d in self.server.run_all(jobs):
            i = d.index
            if echo is not None and not started[i]:  # the prompt first, with its logprobs
                entries = self.prompt_entries(jobs[i], d)
                lp = fmt.legacy(entries, fmt.offsets(jobs[i].prompt_ids)) if self.want_logprobs else None
                yield self.chunk(i, echo[i], None, logprobs=lp)
                offset[i] = len(echo[i])
            started[i] = True
            if self.zero:
                if d.finish_reason:
                    yield self.chunk(i, "", "length")
                continue
            counts[i] = d.num_tokens
            lp = None
            if self.want_logprobs and d.logprob is not None:
                entry = [(d.token_id, d.logprob, d.top_logprobs)]
                lp = {"content": fmt.chat(entry)} if chat else fmt.legacy(entry, [offset[i]])
            offset[i] += len(d.text)
            if chat and d.text and d.finish_reason:  # content, then an empty finishing delta
                yield self.chunk(i, d.text, None, logprobs=lp)
                yield self.chunk(i, None, d.finish_reason)
            elif d.text or d.finish_reason or lp is not None:
                yield self.chunk(i, d.text, d.finish_reason, logprobs=lp)
        if self.include_usage:
            yield self.usage_chunk(counts)

    # -- one body ---------------------------------------------------------------------------------

    async def collect(self, jobs: list[Job]) -> dict:
        prompt_lp: list[list] = [[] for _ in jobs]
        replies = [Reply() for _ in jobs]
        async for d in self.server.run_all(jobs):
            if d.prompt_logprobs is not None or (self.echo is not None and not prompt_lp[d.index]):
                prompt_lp[d.index] = self.prompt_entries(jobs[d.index], d)
            replies[d.index].add(d)
        if self.zero:
            replies = [Reply(finish_reason="length") for _ in jobs]
        choices = [self.message(i, r) if self.chat else self.completion(i, r, jobs[i], prompt_lp[i])
                   for i, r in enumerate(replies)]
        return self.body("chat.completion" if self.chat else "text_completion", choices,
                         usage(self.prompt_tokens, sum(r.num_tokens for r in replies)))

    def message(self, i: int, reply: Reply) -> dict:
        message: dict = {"role": "assistant", "content": reply.text}
        reason = reply.finish_reason
        if self.tools:
            content, calls = self.tools.parse(reply.text)
            message["content"] = content
            if calls:
                message["tool_calls"], reason = calls, "tool_calls"
        return {"index": i, "message": message,
                "logprobs": {"content": self.fmt.chat(reply.tokens)} if self.want_logprobs else None,
                "finish_reason": reason}

    def completion(self, i: int, reply: Reply, job: Job, prompt_lp: list) -> dict:
        fmt, echo = self.fmt, self.echo
        lp = None
        if self.want_logprobs:
            head = echo[i] if echo is not None else ""
            ids = [e[0] for e in reply.tokens]
            offsets = (fmt.offsets(job.prompt_ids) if echo is not None else []) + fmt.offsets(ids, len(head))
            lp = fmt.legacy((prompt_lp if echo is not None else []) + reply.tokens, offsets)
        return {"index": i, "text": (echo[i] if echo is not None else "") + reply.text, "logprobs": lp,
                "finish_reason": reply.finish_reason}
