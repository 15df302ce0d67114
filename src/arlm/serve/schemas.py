"""The request schemas the protocols share, strict as OpenAI's (`Strict`: every protocol's request
derives from it), the sampling fields of OpenAI's completions (`SamplingRequest`), and the limits
every request is held to. A validation error names the field as the client sent it (`param_path`)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError

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


class Strict(BaseModel):
    # strict: "16" is not an int and true is not a number; NaN and Infinity (which Python's JSON
    # parser reads) are not numbers either; unknown fields are ignored, as OpenAI's.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingRequest(Strict):
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


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


def schema_fields(schema: type[BaseModel] = Strict) -> set[str]:
    """The field names of `schema` and every schema derived from it."""
    return set(schema.model_fields).union(*(schema_fields(s) for s in schema.__subclasses__()))


def param_path(loc: tuple) -> str | None:
    """A validation error's location as the path the client sent (`messages.0.content`), without
    the union-member tags pydantic adds (`messages.0.content.str`, `prompt.list[int]`)."""
    fields = schema_fields()
    return ".".join(str(p) for p in loc if isinstance(p, int) or p in fields) or None


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


def deep_json(body: bytes) -> Any:
    """A body nested deeper than pydantic's parser goes, parsed by Python's; 400 past its depth."""
    try:
        return json.loads(body)
    except RecursionError:
        raise APIError(400, "the body nests too deeply to parse (over ~1,000 levels)", code="invalid_json") from None
    except ValueError as e:
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
