"""OpenAI's Embeddings API: `POST /v1/embeddings`.

`input` as a string, a list of strings, token ids or lists of ids; each becomes one embedding
request on the engine that serves generation (`Engine.add_request(embed=True)`: a prompt-only
request, chunked and batched as any prompt, its blocks given back at its end): the mean of its
tokens' final normed hidden states, L2-normalized (`LLM.POOLING`, named in /v1/models).
`encoding_format` "float" (a list of numbers) or "base64" (the little-endian float32 bytes);
`dimensions` only as the model's width (the vectors are not truncatable).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field

from ..sampling import SamplingParams
from .common import Server
from .errors import APIError
from .schemas import MAX_COUNT, PROMPT_TYPES, Strict
from .transport import unless_disconnected

# Inputs one request may give (OpenAI's limit): each is a request in the engine's queue.
MAX_INPUTS = 2048


class EmbeddingRequest(Strict):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=MAX_COUNT)
    user: str | None = None


def add_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        req: EmbeddingRequest = await server.parse(request, EmbeddingRequest)
        width = server.llm.model.config.d_model
        if req.dimensions is not None and req.dimensions != width:
            raise APIError(400, f"dimensions: this model's embeddings have {width} dimensions (they cannot be "
                                f"shortened), got {req.dimensions}", param="dimensions", code="invalid_value")
        inputs = req.input
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not inputs:
            raise APIError(400, f"input: at least one input is needed ({PROMPT_TYPES})", param="input",
                           code="invalid_value")
        if len(inputs) > MAX_INPUTS:
            raise APIError(400, f"input: {len(inputs)} inputs; a request may give at most {MAX_INPUTS}",
                           param="input", code="invalid_value")
        ids = [x if isinstance(x, list) else await server.encode_async(x, "input") for x in inputs]
        vocab = server.llm.model.config.vocab_size
        room = server.engine.engine.max_model_len
        for i, p in enumerate(ids):
            param = "input" if len(ids) == 1 else f"input.{i}"
            if not p or min(p) < 0 or max(p) >= vocab:
                raise APIError(400, f"{param}: token ids must be in 0..{vocab - 1} and non-empty", param=param,
                               code="invalid_value")
            if len(p) >= room:
                raise APIError(400, f"{param}: {len(p)} tokens; the context window takes {room - 1} at most",
                               param=param, code="context_length_exceeded")
        vectors = await unless_disconnected(request, _embed_all(server, ids))
        if vectors is None:
            return Response(status_code=499)
        tokens = sum(map(len, ids))
        # (2,048 vectors are ~10 MB of JSON: written on a worker thread, not the event loop's)
        body = await asyncio.to_thread(_body, vectors, req.encoding_format, server.model_name, tokens)
        return Response(body, media_type="application/json")


def _body(vectors: list, encoding_format: str, model: str, tokens: int) -> bytes:
    data = []
    for i, v in enumerate(vectors):
        values = v.numpy().astype("<f4")
        embedding = base64.b64encode(values.tobytes()).decode() if encoding_format == "base64" else values.tolist()
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    return json.dumps({"object": "list", "data": data, "model": model,
                       "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, separators=(",", ":")).encode()


async def _embed_all(server: Server, ids: list[list[int]]) -> list:
    """Every input as an embedding request at once; their vectors in order (cancelled: each
    request aborted, its blocks freed)."""
    arrival = time.monotonic()
    params = SamplingParams(max_new_tokens=1)
    # one call's inputs share its turns, as n choices do: 2,048 inputs run a few rows a step while
    # others want the step, and take every row when alone (step_budget.group_turns)
    group = server.engine.new_request_id("call") if len(ids) > 1 else None

    async def one(p: list[int]):
        rid = server.engine.new_request_id("emb")
        stream = server.engine.generate(rid, p, params, arrival, embed=True, group=group)
        try:
            async for out in stream:
                if out.embedding is not None:
                    return out.embedding
        finally:
            await stream.aclose()
        raise RuntimeError("an embedding request ended without its vector")

    tasks = [asyncio.ensure_future(one(p)) for p in ids]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

