"""A request's sampling fields in the engine's terms: `SamplingParams` (`sampling_params`), the
structured output it asks for (`structured_output`), and the one rule every protocol follows
between tools that may be called and a structured output (`constraint`). Errors name the field as
the protocol calls it (`names`, `format_field`), written so from the start."""

from __future__ import annotations

import json
from typing import Callable, Mapping

from ..sampling import SamplingParams
from ..structured import GrammarError, StructuredOutput
from .errors import APIError
from .schemas import SamplingRequest

# OpenAI's names of the fields whose errors a protocol may name its own way.
OPENAI = {"max_tokens": "max_tokens", "stop": "stop"}


def sampling_params(req: SamplingRequest, max_tokens: int | None, prompt_len: int, prompt_param: str,
                    context: int, vocab_size: Callable[[], int], default_max_tokens: int | None = None,
                    names: Mapping[str, str] = OPENAI) -> SamplingParams:
    """The request's SamplingParams. Without max_tokens the reply may take the room left in
    the context window, or `default_max_tokens` if that is less: only a max_tokens the client
    sent can be too large. `context`: the model's context window in tokens; `vocab_size`: asked
    where a token id is to be checked. `names`: OpenAI's name of a field -> the protocol's, in the
    errors (a protocol whose fields are not OpenAI's: Responses, Anthropic's Messages)."""
    room = context - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt is {prompt_len} tokens; the context window is "
                            f"{context}", param=prompt_param,
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens > room:
        raise APIError(400, f"the prompt ({prompt_len} tokens) plus {names['max_tokens']} ({max_tokens}) exceeds the "
                            f"context window of {context} tokens",
                       param=names["max_tokens"], code="context_length_exceeded")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 16 or any(not s for s in stop):
        raise APIError(400, f"{names['stop']}: up to 16 non-empty strings", param=names["stop"], code="invalid_value")
    vocab = vocab_size() if req.logit_bias or req.stop_token_ids else 0
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
        name, _, rest = str(e).removeprefix("invalid ").partition("=")
        param = "max_tokens" if name == "max_new_tokens" else name if name in SamplingRequest.model_fields else None
        shown = names.get(name, name) if name == param else name  # (max_new_tokens: the engine's own name)
        raise APIError(400, f"invalid {shown}={rest}", param=names.get(param, param) if param else None,
                       code="invalid_value") from None


def structured_output(req: SamplingRequest, format_field: str = "response_format"
                      ) -> tuple[str, StructuredOutput] | None:
    """The request's structured output (response_format, guided_*, structured_outputs: at most
    one) and the field that asked for it, not compiled yet. `format_field`: the protocol's name of
    OpenAI's `response_format`, in the errors about it."""
    specs: list[tuple[str, StructuredOutput]] = []
    try:
        rf = req.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                specs.append((format_field, StructuredOutput("json")))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema") if isinstance(js, dict) else None
                if not isinstance(schema, dict):
                    raise APIError(400, "response_format.json_schema.schema: a JSON schema (an object) is needed",
                                   param="response_format", code="invalid_value")
                specs.append((format_field, StructuredOutput("json_schema", schema)))
            elif kind != "text":
                raise APIError(400, f"{format_field}.type {kind!r} is not supported (text, json_object, "
                                    "json_schema)", param=format_field, code="unsupported")
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
        raise APIError(400, str(e), param=specs[-1][0] if specs else format_field, code="invalid_value") \
            from None
    if not specs:
        return None
    if len(specs) > 1:
        raise APIError(400, f"one structured output at a time, got {', '.join(n for n, _ in specs)}",
                       param=specs[1][0], code="invalid_value")
    return specs[0]


def constraint(tools: StructuredOutput | None, asked: bool, output: Callable[[], tuple[str, StructuredOutput] | None],
               conflict: APIError) -> tuple[str | None, StructuredOutput | None]:
    """What the reply is held to and the field that asked for it: the tools' constraint where
    tools may be called (serve/tools.py), else the structured output the request asks for
    (`output()`, read only where `asked`), else nothing. Tools and a structured output (`asked`) at once
    is `conflict`, the protocol's 400, raised before anything compiles."""
    if tools is not None and asked:
        raise conflict
    if tools is not None:
        return "tools", tools
    return (output() if asked else None) or (None, None)
