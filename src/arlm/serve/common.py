"""What the HTTP edge's protocols share: errors, request parsing and validation, the translation
of a request's sampling fields into the engine's `SamplingParams` and structured outputs, running
choices (tokens from the engine -> text, cut at stop strings), logprob shapes and SSE framing.

Each protocol module (openai_completions.py, openai_chat.py, responses.py, anthropic.py,
embeddings.py, tokens.py) turns its requests into the engine's through `Server` and its outputs
into its own shapes; api.py builds the app (auth, limits, error shapes, metrics, the routes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine import AsyncEngine, FinishReason, RequestFailed
from ..llm import LLM, PromptError
from ..sampling import SamplingParams
from ..settings import MAX_BODY_BYTES
from ..structured import GrammarError, StructuredOutput
from ..text import TextStreamer
from ..tokenizer import IncrementalDetokenizer
from . import metrics
from . import tools as tools_mod

log = logging.getLogger(__name__)


# Sequences one request may start (prompts x n): each takes a slot in the engine's queue, and
# 2000 prompts x n=16 would keep the server busy for minutes on one small body.
MAX_SEQUENCES_PER_REQUEST = 256

# The largest count a request may give (max_tokens, top_k, best_of): the engine's sampling packs
# them into int64 tensors and C ints, where a larger value would fail inside the engine's step.
# top_k above the vocabulary means no filter, as 0 does.
MAX_COUNT = 2**31 - 1

PROMPT_TYPES = "a string, a list of strings, a list of token ids (integers) or a list of such lists"

# OpenAI (and vLLM) fields this server does not implement, with the values that change nothing
# besides null, 0, false and empty. Any other value gets 400 naming the field: ignoring it would
# answer a different request than the one sent (no tool call, no JSON schema, no logit bias).
UNSUPPORTED = {"functions": (), "function_call": ("none",)}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type_: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status)


# -- request schemas ------------------------------------------------------------------------------

class _Strict(BaseModel):
    # strict: "16" is not an int and true is not a number; NaN and Infinity (which Python's JSON
    # parser reads) are not numbers either; unknown fields are ignored, as OpenAI's.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM's extra sampling fields (the openai client sends them through `extra_body`)
    top_k: int = Field(0, ge=-1, le=MAX_COUNT)  # 0 or -1: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_COUNT)
    stop_token_ids: list[int] | None = None
    # Structured outputs: OpenAI's response_format, and vLLM's guided_* / structured_outputs
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) -> bias
    # Fields this schema does not name are kept (unvalidated, unused), so that `Server.parse` can
    # refuse the UNSUPPORTED ones by name whatever their type.
    model_config = ConfigDict(extra="allow")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


def _schema_fields(schema: type[BaseModel] = _Strict) -> set[str]:
    """The field names of `schema` and every schema derived from it."""
    return set(schema.model_fields).union(*(_schema_fields(s) for s in schema.__subclasses__()))


def _param(loc: tuple) -> str | None:
    """A validation error's location as the path the client sent (`messages.0.content`), without
    the union-member tags pydantic adds (`messages.0.content.str`, `prompt.list[int]`)."""
    fields = _schema_fields()
    return ".".join(str(p) for p in loc if isinstance(p, int) or p in fields) or None


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
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            raise APIError(413, f"request body over {self.max_body_bytes} bytes", code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():  # a chunked upload has no length to check up front
            body += chunk
            if len(body) > self.max_body_bytes:
                raise APIError(413, f"request body over {self.max_body_bytes} bytes", code="request_too_large")
        return bytes(body)

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
            token = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                           code="invalid_api_key")

    async def parse(self, request: Request, schema: type[_Strict]) -> Any:
        self.check_auth(request)
        body = await self.read_body(request)
        try:
            try:
                req = schema.model_validate_json(body)
            except ValidationError as e:
                if "recursion limit" not in str(e):
                    raise
                # pydantic's parser stops at a depth of ~200 (a deep JSON schema in response_format):
                # Python's goes on to ~1,000, and the field that holds it is checked by its own rules
                req = schema.model_validate(_deep_json(body))
        except ValidationError as e:
            err = e.errors()[0]
            if err["type"] == "json_invalid":
                raise APIError(400, f"the body is not valid JSON: {err['msg']}", code="invalid_json") from None
            param = _param(err["loc"])
            msg = err["msg"]
            if param is not None and param.startswith("prompt") and err["type"] != "missing":
                # pydantic names the union's last member ("a valid string"), wrong for [1.5]
                param, msg = "prompt", f"must be {PROMPT_TYPES}"
            raise APIError(400, f"{param or 'body'}: {msg}", param=param, code="invalid_value") from None
        if getattr(req, "model", None) is not None and req.model != self.model_name:
            raise APIError(400, f"the model '{req.model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        for name, no_ops in UNSUPPORTED.items():
            value = getattr(req, name, None)
            if value and value not in no_ops:
                raise APIError(400, f"{name} is not supported", param=name,
                               code="unsupported")
        if getattr(req, "best_of", None) not in (None, getattr(req, "n", 1)):
            raise APIError(400, "best_of is not supported (every choice is returned: leave it out or set it to n)",
                           param="best_of", code="unsupported")
        return req

    def model_card(self) -> dict:
        """The served model as OpenAI's model object."""
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "arlm",
                "max_model_len": self.engine.engine.max_model_len,
                "embeddings": {"dimensions": self.llm.model.config.d_model, "pooling": LLM.POOLING}}

    def sampling_params(self, req: _SamplingRequest, max_tokens: int | None, prompt_len: int,
                        prompt_param: str, default_max_tokens: int | None = None) -> SamplingParams:
        """The request's SamplingParams. Without max_tokens the reply may take the room left in
        the context window, or `default_max_tokens` if that is less: only a max_tokens the client
        sent can be too large."""
        room = self.engine.engine.max_model_len - prompt_len
        if room < 1:
            raise APIError(400, f"the prompt is {prompt_len} tokens; the context window is "
                                f"{self.engine.engine.max_model_len}", param=prompt_param,
                           code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        elif max_tokens > room:
            raise APIError(400, f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                f"context window of {self.engine.engine.max_model_len} tokens",
                           param="max_tokens", code="context_length_exceeded")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 16 or any(not s for s in stop):
            raise APIError(400, "stop: up to 16 non-empty strings", param="stop", code="invalid_value")
        vocab = self.llm.model.config.vocab_size if req.logit_bias or req.stop_token_ids else 0
        bias = {}
        for key, value in (req.logit_bias or {}).items():
            if not key.strip().isdigit() or int(key) >= vocab:
                raise APIError(400, f"logit_bias: {key!r} is not a token id (0..{vocab - 1})", param="logit_bias",
                               code="invalid_value")
            bias[int(key)] = value
        bad = next((t for t in req.stop_token_ids or [] if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"stop_token_ids: {bad} is not a token id (0..{vocab - 1})", param="stop_token_ids",
                           code="invalid_value")
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature,
                                  top_k=max(req.top_k, 0), top_p=req.top_p, min_p=req.min_p,
                                  repetition_penalty=req.repetition_penalty, seed=req.seed, stop=stop,
                                  ignore_eos=req.ignore_eos, presence_penalty=req.presence_penalty,
                                  frequency_penalty=req.frequency_penalty, logit_bias=bias or None,
                                  min_tokens=req.min_tokens, stop_token_ids=list(req.stop_token_ids or []))
        except ValueError as e:  # SamplingParams.validate: "invalid top_k=...: why"
            name = str(e).removeprefix("invalid ").partition("=")[0]
            param = "max_tokens" if name == "max_new_tokens" else name if name in _SamplingRequest.model_fields else None
            raise APIError(400, str(e), param=param, code="invalid_value") from None

    async def structured(self, req: _SamplingRequest) -> tuple[str, StructuredOutput] | None:
        """The request's structured output (response_format, guided_*, structured_outputs: at
        most one) and the field that asked for it, compiled (`grammar`)."""
        specs: list[tuple[str, StructuredOutput]] = []
        try:
            rf = req.response_format
            if rf is not None:
                kind = rf.get("type")
                if kind == "json_object":
                    specs.append(("response_format", StructuredOutput("json")))
                elif kind == "json_schema":
                    js = rf.get("json_schema")
                    schema = js.get("schema") if isinstance(js, dict) else None
                    if not isinstance(schema, dict):
                        raise APIError(400, "response_format.json_schema.schema: a JSON schema (an object) is needed",
                                       param="response_format", code="invalid_value")
                    specs.append(("response_format", StructuredOutput("json_schema", schema)))
                elif kind != "text":
                    raise APIError(400, f"response_format.type {kind!r} is not supported (text, json_object, "
                                        "json_schema)", param="response_format", code="unsupported")
            guided = {"guided_json": req.guided_json, "guided_regex": req.guided_regex,
                      "guided_choice": req.guided_choice, "guided_grammar": req.guided_grammar}
            so = req.structured_outputs or {}
            if not isinstance(so, dict):
                raise APIError(400, "structured_outputs: an object", param="structured_outputs", code="invalid_value")
            for key in ("json", "regex", "choice", "grammar"):
                if so.get(key) is not None:
                    guided[f"structured_outputs.{key}"] = so[key]
            for name, value in guided.items():
                if value is None:
                    continue
                kind = name.rpartition("_")[2].rpartition(".")[2]
                if kind == "json":
                    if isinstance(value, str):
                        try:
                            value = json.loads(value)
                        except ValueError:
                            raise APIError(400, f"{name}: not JSON", param=name, code="invalid_value") from None
                    specs.append((name, StructuredOutput("json_schema", value) if value else StructuredOutput("json")))
                else:
                    specs.append((name, StructuredOutput(kind, value)))
        except GrammarError as e:
            raise APIError(400, str(e), param=specs[-1][0] if specs else "response_format", code="invalid_value") \
                from None
        if not specs:
            return None
        if len(specs) > 1:
            raise APIError(400, f"one structured output at a time, got {', '.join(n for n, _ in specs)}",
                           param=specs[1][0], code="invalid_value")
        name, spec = specs[0]
        await self.grammar(name, spec)
        return name, spec

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
        names (temperature, top_p, top_k, stop, ...), an error's field named back by `names`
        (OpenAI's name -> the protocol's)."""
        req = _SamplingRequest.model_construct(model=self.model_name, **fields)
        try:
            return self.sampling_params(req, max_tokens, prompt_len, prompt_param)
        except APIError as e:
            if e.param in names:
                e.message = e.message.replace(e.param, names[e.param], 1)
                e.param = names[e.param]
            raise

    async def format_grammar(self, response_format: dict, param: str) -> StructuredOutput | None:
        """A protocol's JSON output format, given as Chat Completions' `response_format`, compiled
        (`structured`); its errors name the protocol's field `param`."""
        try:
            found = await self.structured(_SamplingRequest.model_construct(model=self.model_name,
                                                                           response_format=response_format))
        except APIError as e:
            if e.param == "response_format":
                e.param, e.message = param, e.message.replace("response_format", param)
            raise
        return found[1] if found else None

    async def answer(self, request: Request, turn, job: tuple, stream: bool, field: str | None) -> Response:
        """A protocol's reply to one job: `turn.events(job)` as server-sent events, or
        `turn.collect(job)` as one JSON body (499 if the client left first; a request its grammar
        stopped is the client's 400, naming `field`)."""
        if stream:
            return StreamingResponse(turn.events(job), media_type="text/event-stream")
        try:
            result = await _unless_disconnected(request, turn.collect(job))
        except RequestFailed as e:
            if e.client_error:
                raise APIError(400, f"{field}: {e}", param=field, code="grammar_too_complex") from None
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

    async def run_all(self, jobs: list[tuple[int, list[int], SamplingParams]]) -> AsyncIterator[Delta]:
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

    def jobs(self, first: int, prompt_ids: list[int], params: SamplingParams,
             n: int) -> list[tuple[int, list[int], SamplingParams]]:
        """n choices of one prompt, indexed from `first`; choice j of a seeded request uses seed + j."""
        return [(first + j, prompt_ids,
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


def text_parts(content, param: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """A message's content, a string or a list of parts (OpenAI's) or blocks (Anthropic's), as its
    text: each part of one of `kinds` with its text; any other refused naming it (400)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{param}: a string or a list of content parts", param=param, code="invalid_value")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise APIError(400, f"{param}.{j}: a part of type {' or '.join(kinds)} with its text is supported here, "
                                f"got {kind!r}", param=f"{param}.{j}", code="unsupported" if kind else "invalid_value")
        out.append(part["text"])
    return "".join(out)


def _deep_json(body: bytes) -> Any:
    """A body nested deeper than pydantic's parser goes, parsed by Python's; 400 past its depth."""
    try:
        return json.loads(body)
    except RecursionError:
        raise APIError(400, "the body nests too deeply to parse (over ~1,000 levels)", code="invalid_json") from None
    except ValueError as e:
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None


# A grammar's refusal (structured.REASONS) as the error's code.
GRAMMAR_CODES = {"invalid": "invalid_value", "too_large": "grammar_too_large", "too_complex": "grammar_too_complex",
                 "timeout": "grammar_timeout", "busy": "server_busy"}


def grammar_error(name: str, e: GrammarError) -> APIError:
    """The API's error for a grammar refused (or stopped) by its limits: 400 naming the field
    that asked for it; 503 when the compiler is busy (the server's state, not the request's)."""
    if e.reason == "busy":
        return APIError(503, str(e), code="server_busy", type_="server_error")
    return APIError(400, f"{name}: {e}", param=name, code=GRAMMAR_CODES.get(e.reason, "invalid_value"))


def stream_error(e: Exception, field: str | None) -> dict:
    """A started stream's error event, as OpenAI's error body: the client's (its grammar stopped
    by its limits, naming the field) or the server's."""
    if isinstance(e, RequestFailed) and e.client_error:
        log.info("stream stopped: %s", e)
        return {"error": {"message": f"{field}: {e}" if field else str(e), "type": "invalid_request_error",
                          "param": field, "code": "grammar_too_complex"}}
    log.warning("stream failed: %s", e)
    return {"error": {"message": str(e), "type": "server_error", "param": None, "code": "internal_error"}}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work) -> Any:
    """Await `work` (a coroutine); if the client goes away first, cancel it (which aborts its
    requests in the engine and frees their blocks) and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
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
