"""The server the protocols share (`Server`): the model, the engine and the HTTP counters, and
the steps of a request every protocol takes in the same order: parse (transport.py, schemas.py),
translate its fields (sampling_fields.py), apply the chat template and tools, encode, run its
choices (`run_all`: tokens -> `Delta`s, text cut at stop strings) and answer (`answer`: a
protocol's `Turn` as events or one body). Logprob shapes (`Logprobs`) beside them.

Each protocol module (openai_completions.py, openai_chat.py, responses.py, anthropic.py,
embeddings.py, tokens.py) turns its requests into the engine's through `Server` and its outputs
into its own shapes; api.py builds the app (error shapes, metrics, the routes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, NamedTuple, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine import AsyncEngine, FinishReason, RequestFailed
from ..llm import LLM, PromptError
from ..sampling import SamplingParams
from ..settings import MAX_BODY_BYTES
from ..structured import GrammarError, StructuredOutput
from ..text import TextStreamer
from ..tokenizer import IncrementalDetokenizer
from . import metrics, sampling_fields, transport
from . import tools as tools_mod
from .errors import APIError, grammar_error
from .schemas import UNSUPPORTED, ChatMessage, SamplingRequest, Strict

log = logging.getLogger(__name__)


# -- one choice: tokens from the engine -> text ---------------------------------------------------

@dataclass
class Delta:
    index: int
    text: str
    finish_reason: str | None
    num_tokens: int  # tokens generated so far for this choice (up to a stop string)
    token_id: int = -1
    logprob: float | None = None  # SamplingParams.logprobs: this token's, and the top ones
    top_logprobs: list[tuple[int, float]] | None = None
    prompt_logprobs: list | None = None  # SamplingParams.prompt_logprobs, on a choice's first delta
    stop_sequence: str | None = None  # the stop string that ended the choice (finish_reason "stop")
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (on every delta)


class Job(NamedTuple):
    """One choice of a request as the engine runs it: the choice's index, its prompt, its params."""
    index: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class Reply:
    """One choice's reply as its deltas build it (`add`): every protocol's accumulator."""
    text: str = ""
    finish_reason: str | None = None
    num_tokens: int = 0
    stop_sequence: str | None = None
    cached_tokens: int = 0
    tokens: list[tuple[int, float, list | None]] = field(default_factory=list)  # (id, logprob, top) where asked

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.finish_reason = d.finish_reason or self.finish_reason
        self.num_tokens, self.cached_tokens = d.num_tokens, d.cached_tokens
        self.stop_sequence = d.stop_sequence or self.stop_sequence
        if d.logprob is not None:
            self.tokens.append((d.token_id, d.logprob, d.top_logprobs))


class Turn(Protocol):
    """A protocol's reply to one request's jobs: its events, or its whole body."""

    def events(self, jobs: list[Job]) -> AsyncIterator[str]: ...

    async def collect(self, jobs: list[Job]) -> dict: ...


class Server:
    """The state behind the routes: the loaded model, the engine and the HTTP counters."""

    def __init__(self, llm: LLM, engine: AsyncEngine, model_name: str, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, live=None) -> None:
        self.llm, self.engine, self.model_name = llm, engine, model_name
        self.live = live  # an arlm.trace.live.LiveTrace on the engine (arlm serve --trace), or None
        self.responses = None  # the Responses API's stored responses (responses.ResponseStore, set by its routes)
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.http_requests: dict[tuple[str, int], int] = {}
        self.time_to_first_token = metrics.Histogram()
        engine.engine.stats.on_first_token = self.time_to_first_token.observe
        self.grammar_compile = metrics.Histogram(metrics.COMPILE_BUCKETS)
        if engine.engine.grammars is not None:
            engine.engine.grammars.stats.on_compile = self.grammar_compile.observe

    # -- parsing and validation -------------------------------------------------------------------

    async def read_body(self, request: Request) -> bytes:
        return await transport.read_body(request, self.max_body_bytes)

    def check_auth(self, request: Request) -> None:
        transport.check_auth(request, self.api_key)

    async def parse(self, request: Request, schema: type[Strict]) -> Any:
        """The request's body as `schema`, from a client with the key, for this server's model,
        without the fields this server does not implement (each a 400 naming the field)."""
        self.check_auth(request)
        req = transport.validate(await self.read_body(request), schema)
        if getattr(req, "model", None) is not None and req.model != self.model_name:
            raise APIError(400, f"the model '{req.model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        for name, no_ops in UNSUPPORTED.items():
            value = getattr(req, name, None)
            if value and value not in no_ops:
                raise APIError(400, f"{name} is not supported", param=name, code="unsupported")
        if getattr(req, "best_of", None) not in (None, getattr(req, "n", 1)):
            raise APIError(400, "best_of is not supported (every choice is returned: leave it out or set it to n)",
                           param="best_of", code="unsupported")
        return req

    def model_card(self) -> dict:
        """The served model as OpenAI's model object."""
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "arlm",
                "max_model_len": self.engine.engine.max_model_len,
                "embeddings": {"dimensions": self.llm.model.config.d_model, "pooling": LLM.POOLING}}

    def sampling_params(self, req: SamplingRequest, max_tokens: int | None, prompt_len: int, prompt_param: str,
                        default_max_tokens: int | None = None) -> SamplingParams:
        """The request's SamplingParams for this server's model (`sampling_fields.sampling_params`)."""
        return sampling_fields.sampling_params(req, max_tokens, prompt_len, prompt_param,
                                               self.engine.engine.max_model_len,
                                               lambda: self.llm.model.config.vocab_size, default_max_tokens)

    async def structured(self, req: SamplingRequest) -> tuple[str, StructuredOutput] | None:
        """The request's structured output and the field that asked for it, compiled (`grammar`)."""
        found = sampling_fields.structured_output(req)
        if found is not None:
            await self.grammar(*found)
        return found

    async def constrain(self, tools: StructuredOutput | None, asked: bool,
                        output: Callable[[], tuple[str, StructuredOutput] | None],
                        conflict: APIError) -> tuple[str | None, StructuredOutput | None]:
        """What the reply is held to and the field that asked for it (`sampling_fields.constraint`:
        the one rule for tools vs a structured output), compiled."""
        field, spec = sampling_fields.constraint(tools, asked, output, conflict)
        if spec is not None:
            await self.grammar(field, spec)
        return field, spec

    async def grammar(self, name: str, spec: StructuredOutput) -> None:
        """Compile the spec off the event loop and the engine (`AsyncEngine.compile`): a 400
        naming the field with the compiler's reason if it cannot be enforced within the limits
        (`--grammar-timeout`, `--grammar-max-size`), a 503 while the compiler is full."""
        try:
            await self.engine.compile(spec)
        except GrammarError as e:
            raise grammar_error(name, e) from None

    @property
    def tool_format(self) -> tools_mod.GenericFormat | tools_mod.HermesFormat:
        """How tools are shown and called: the chat template's own format, else the generic one."""
        return tools_mod.tool_format(self.llm.chat_template)

    def chat_messages(self, messages: list[ChatMessage]) -> list[dict]:
        """The request's messages as a conversation (text content; an assistant's earlier tool
        calls as OpenAI's `tool_calls`, written the tool format's way by `template_messages`)."""
        out = []
        for m in messages:
            content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
            msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
            if m.role == "tool" and m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
            if m.role == "assistant" and m.tool_calls:
                msg["tool_calls"] = m.tool_calls
            out.append(msg)
        return out

    def template_messages(self, messages: list[dict]) -> list[dict]:
        """A conversation (role, content; an assistant's `tool_calls` in OpenAI's chat shape, a
        tool message's tool_call_id) as the chat template takes it: earlier calls written the
        tool format's way (serve/tools.py: the generic format's JSON reply, or Hermes's objects)."""
        out = []
        for m in messages:
            if m.get("role") == "assistant" and m.get("tool_calls"):
                m = self.tool_format.history({k: v for k, v in m.items() if k != "tool_calls"}, m["tool_calls"])
            out.append(m)
        return out

    async def chat_prompt(self, messages: list[dict], tools: list | None, tool_choice, parallel: bool,
                          param: str = "messages") -> tuple[list[int], StructuredOutput | None]:
        """A conversation (`template_messages`' input) and its tools (OpenAI's chat shape) as
        prompt token ids, and the constraint the reply follows where tools may be called
        (serve/tools.py; not compiled yet: the caller compiles it with `grammar("tools", ...)`
        once the request's cheaper checks have passed): the one place every protocol's
        conversations meet the chat template."""
        try:
            functions, choice = tools_mod.check_tools(tools, tool_choice)
        except tools_mod.ToolError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
        use_tools = choice not in (None, "none")
        messages, extra = self.template_messages(messages), {}
        if use_tools:
            messages, extra = self.tool_format.prompt(messages, functions, choice, parallel)
        try:
            ids = await self.encode_async(self.llm.apply_chat_template(messages, **extra), param)
        except PromptError as e:
            raise APIError(400, str(e), param=param, code="invalid_value") from None
        return ids, self.tool_format.constraint(functions, choice, parallel) if use_tools else None

    def params_for(self, prompt_len: int, max_tokens: int | None, names: dict[str, str], prompt_param: str,
                   **fields) -> SamplingParams:
        """`sampling_params` for a protocol whose fields are not OpenAI's: `fields` by OpenAI's
        names (temperature, top_p, top_k, stop, ...), an error's field named as `names` says
        (OpenAI's name -> the protocol's)."""
        req = SamplingRequest.model_construct(model=self.model_name, **fields)
        return sampling_fields.sampling_params(req, max_tokens, prompt_len, prompt_param,
                                               self.engine.engine.max_model_len,
                                               lambda: self.llm.model.config.vocab_size,
                                               names={**sampling_fields.OPENAI, **names})

    def format_output(self, response_format: dict, param: str) -> tuple[str, StructuredOutput] | None:
        """A protocol's JSON output format, given as Chat Completions' `response_format`, and the
        protocol's field `param` that asked for it (its errors name that field); not compiled."""
        req = SamplingRequest.model_construct(model=self.model_name, response_format=response_format)
        return sampling_fields.structured_output(req, format_field=param)

    async def answer(self, request: Request, turn: Turn, jobs: list[Job], stream: bool, field: str | None) -> Response:
        """A protocol's reply to a request's jobs: `turn.events(jobs)` as server-sent events, or
        `turn.collect(jobs)` as one JSON body (499 if the client left first; a request its grammar
        stopped is the client's 400, naming `field`)."""
        if stream:
            return StreamingResponse(turn.events(jobs), media_type="text/event-stream")
        try:
            result = await transport.unless_disconnected(request, turn.collect(jobs))
        except RequestFailed as e:
            if e.client_error:
                raise APIError(400, f"{field}: {e}" if field else str(e), param=field,
                               code="grammar_too_complex") from None
            raise
        return JSONResponse(result) if result is not None else Response(status_code=499)

    async def encode_async(self, text: str, param: str) -> list[int]:
        """`encode` on a worker thread (the tokenizer lets go of the GIL): a long prompt takes
        ~1 s per MB to tokenize, which the event loop (/health, every other stream) must not wait for."""
        return await asyncio.to_thread(self.encode, text, param)

    def encode(self, text: str, param: str) -> list[int]:
        ids = self.llm.tokenizer.encode(text)
        if not ids:
            raise APIError(400, "the prompt encodes to no tokens", param=param, code="invalid_value")
        return ids

    # -- running choices --------------------------------------------------------------------------

    async def run_choice(self, index: int, prompt_ids: list[int], params: SamplingParams,
                         arrival: float, group: str | None = None) -> AsyncIterator[Delta]:
        """One sequence: stream its text pieces, cut at a stop string. group: the API call's,
        when it has several choices (they share its turns in the engine's steps)."""
        rid = self.engine.new_request_id("req")
        streamer = TextStreamer(self.llm.tokenizer, params.stop)
        # speculative decoding for every request where the server has it (arlm serve --speculative)
        tokens = self.engine.generate(rid, prompt_ids, params, arrival, drafter=self.llm.drafter(), group=group)
        try:
            async for out in tokens:
                text, hit = streamer.push(out.token_id, final=out.finish_reason is not None)
                extra = dict(token_id=out.token_id, logprob=getattr(out, "logprob", None),
                             top_logprobs=getattr(out, "top_logprobs", None),
                             prompt_logprobs=getattr(out, "prompt_logprobs", None),
                             cached_tokens=getattr(out, "cached_tokens", 0))
                if hit:
                    self.engine.abort(rid, FinishReason.STOP)
                    yield Delta(index, text, "stop", out.num_output_tokens, stop_sequence=streamer.stops.matched,
                                **extra)
                    return
                reason = out.finish_reason.openai if out.finish_reason is not None else None
                yield Delta(index, text, reason, out.num_output_tokens, **extra)
        finally:
            await tokens.aclose()  # an unfinished request is aborted: its blocks free at once

    async def replies(self, jobs: list[Job]) -> list[Reply]:
        """Each job's whole reply."""
        out = [Reply() for _ in jobs]
        async for d in self.run_all(jobs):
            out[d.index - jobs[0].index].add(d)
        return out

    async def run_all(self, jobs: list[Job]) -> AsyncIterator[Delta]:
        """All choices of a request at once (several prompts, or n > 1), merged as they come."""
        arrival = time.monotonic()
        if len(jobs) == 1:
            async for d in self.run_choice(*jobs[0], arrival):
                yield d
            return
        queue: asyncio.Queue = asyncio.Queue()
        group = self.engine.new_request_id("call")

        async def pump(job) -> None:
            try:
                async for d in self.run_choice(*job, arrival, group):
                    await queue.put(d)
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                await queue.put(e)
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(job)) for job in jobs]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def jobs(self, first: int, prompt_ids: list[int], params: SamplingParams, n: int) -> list[Job]:
        """n choices of one prompt, indexed from `first`; choice j of a seeded request uses seed + j."""
        return [Job(first + j, prompt_ids,
                 params if params.seed is None or j == 0 else dataclasses.replace(params, seed=(params.seed + j) % 2**64))
                for j in range(n)]


class Logprobs:
    """OpenAI's logprobs shapes from the engine's (token id, log-probability, top [(id,
    log-probability)]) entries: the completions API's legacy columns, the chat API's `content`."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer

    def offsets(self, ids: list[int], start: int = 0) -> list[int]:
        """Each token's character offset in the text the ids decode to (a token inside a
        multi-byte character starts where that character does)."""
        detok = IncrementalDetokenizer(self.tok, skip_special_tokens=False)
        out, at = [], start
        for i in ids:
            out.append(at)
            at += len(detok.push(i))
        return out

    def legacy(self, entries: list[tuple[int, float | None, list | None]], offsets: list[int]) -> dict:
        text = self.tok.token_text
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": offsets}
        for tid, lp, top in entries:
            t = text(tid)
            out["tokens"].append(t)
            out["token_logprobs"].append(lp)
            if top is None:
                out["top_logprobs"].append(None)
            else:
                d = {text(i): v for i, v in top}
                d.setdefault(t, lp)  # the chosen token is always there, as OpenAI's
                out["top_logprobs"].append(d)
        return out

    def chat(self, entries: list[tuple[int, float, list]]) -> list[dict]:
        def one(i: int, v: float) -> dict:
            return {"token": self.tok.token_text(i), "logprob": v, "bytes": list(self.tok.token_bytes(i))}
        return [{**one(tid, lp), "top_logprobs": [one(i, v) for i, v in top]} for tid, lp, top in entries]


