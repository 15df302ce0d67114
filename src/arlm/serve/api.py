"""The HTTP API over the `AsyncEngine` (FastAPI on uvicorn): the app and what every route shares.

Routes, one module per protocol, each turning its requests into the engine's through the shared
translation layer (common.py: `Server`) and the engine's outputs into its own shapes:

- openai_completions.py: `POST /v1/completions`; openai_chat.py: `POST /v1/chat/completions`
  (both streamed as server-sent events with `stream: true`, ending in `data: [DONE]`;
  choices.py writes their bodies);
- responses.py: `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}` (OpenAI's Responses API);
- anthropic.py: `POST /v1/messages`, `POST /v1/messages/count_tokens` (Anthropic's Messages API);
- embeddings.py: `POST /v1/embeddings`;
- tokens.py: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info` (vLLM's);
- here: `GET /v1/models`, `GET /v1/models/{id}`, `GET /health`, `GET /metrics`, `/trace`.

The edge is text: it validates requests, applies the chat template, encodes prompts,
detokenizes streamed tokens and watches for stop strings; the engine sees token ids only. Every
OpenAI route's error is an OpenAI-style body `{"error": {"message", "type", "param", "code"}}`,
every Anthropic route's Anthropic's `{"type": "error", "error": {"type", "message"}}`; a bad
request gets 4xx naming the field and never a traceback, and the server stays up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import EngineDead
from ..trace.live import live_page
from . import anthropic, embeddings, metrics, openai_chat, openai_completions, responses, tokens
from .common import Server
from .errors import APIError, error_response
from .openai_chat import ChatCompletionRequest
from .openai_completions import CompletionRequest
from .tokens import DetokenizeRequest, TokenizeRequest

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "DetokenizeRequest", "EngineDead", "Server",
           "TokenizeRequest", "create_app"]

log = logging.getLogger(__name__)


def protocol_error(request: Request, status: int, message: str, param: str | None = None, code: str | None = None,
                   type_: str = "invalid_request_error") -> JSONResponse:
    """An error in the shape of the protocol the path speaks: Anthropic's on its routes, else
    OpenAI's (the field it names in the message, as Anthropic's errors name none apart)."""
    if request.url.path.startswith(anthropic.PATHS):
        if param and not message.startswith(param):  # (Anthropic's shape has no field of its own for it)
            message = f"{param}: {message}"
        if code == "model_not_found":  # (Anthropic's status for it)
            status = 404
        return JSONResponse(anthropic.error_body(status, message), status)
    return error_response(status, message, param, code, type_)


def add_error_handlers(app: FastAPI) -> None:
    """Every error as a JSON body in the shape of the protocol its path speaks (`protocol_error`)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return protocol_error(request, e.status, e.message, e.param, e.code, e.type)

    @app.exception_handler(EngineDead)
    async def engine_dead(request: Request, e: EngineDead) -> JSONResponse:
        return protocol_error(request, 503, f"the engine has stopped: {e}", type_="server_error",
                              code="engine_dead")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return protocol_error(request, e.status_code, str(e.detail), code=code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return protocol_error(request, 500, f"internal error: {type(e).__name__}", type_="server_error",
                              code="internal_error")


def create_app(server: Server, engine_thread: bool = True) -> FastAPI:
    """The FastAPI app. With `engine_thread` the app runs the engine loop on a background thread
    of its own; without, the caller runs `server.engine.run()` (as `arlm serve` does)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if server.live is not None:
            server.live.loop = asyncio.get_running_loop()
        if engine_thread:
            server.engine.start(asyncio.get_running_loop())
        else:
            server.engine.attach(asyncio.get_running_loop())
        yield
        server.engine.stop()

    app = FastAPI(title="arlm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    app.add_middleware(CountRequests, server=server)

    add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        engine = server.engine
        if engine.dead:
            return error_response(503, f"engine stopped: {engine.dead}", type_="server_error")
        stalled = engine.stalled
        if stalled > engine.stall_limit:
            return error_response(503, f"the engine has not completed a step in {stalled:.0f} s with "
                                       f"{engine.num_running + engine.num_waiting} request(s) to serve",
                                  type_="server_error", code="engine_stalled")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return PlainTextResponse(metrics.render(server.engine, server.http_requests, server.time_to_first_token,
                                                server.grammar_compile),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    if server.live is not None:  # arlm serve --trace: the engine followed live
        @app.get(TRACE_PATHS[0])
        async def trace_page() -> Response:
            return HTMLResponse(live_page())

        @app.get(TRACE_PATHS[1])
        async def trace_events() -> Response:
            return StreamingResponse(server.live.events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        server.check_auth(request)
        return JSONResponse({"object": "list", "data": [server.model_card()]})

    @app.get("/v1/models/{model_id:path}")  # :path: a model id may hold slashes ("org/name")
    async def model(request: Request, model_id: str) -> Response:
        server.check_auth(request)
        if model_id != server.model_name:
            raise APIError(404, f"the model '{model_id}' does not exist; this server serves '{server.model_name}'",
                           param="model", code="model_not_found")
        return JSONResponse(server.model_card())

    for protocol in (tokens, openai_completions, openai_chat, responses, anthropic, embeddings):
        protocol.add_routes(app, server)
    return app


# The live trace's page and events (`--trace`), counted under their own names with or without it.
TRACE_PATHS = ("/trace", "/trace/events")


class CountRequests:
    """Counts responses by path and status for /metrics. Plain ASGI, not BaseHTTPMiddleware,
    which would pipe every streamed chunk through an extra task and memory stream."""

    def __init__(self, app, server: Server) -> None:
        self.app, self.server = app, server
        self.known: set[str] | None = None  # the app's paths without parameters, read on the first response

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            path = scope["path"]
            if self.known is None:
                self.known = {route.path for route in scope["app"].routes if "{" not in route.path} | set(TRACE_PATHS)
            endpoint = path if path in self.known else "/v1/models/{id}" if path.startswith("/v1/models/") else \
                "/v1/responses/{id}" if path.startswith("/v1/responses/") else "other"
            key = (endpoint, status)
            self.server.http_requests[key] = self.server.http_requests.get(key, 0) + 1
