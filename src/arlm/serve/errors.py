"""The HTTP edge's errors: `APIError` (a status, a message, the field at fault and a code), OpenAI's
error body, and a grammar's refusal or a stream's failure as those. Each protocol shapes them its
own way in api.py's handlers (Anthropic's on its routes)."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from ..engine import RequestFailed
from ..structured import GrammarError

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type_: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status)


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
