"""OpenAI's Completions API: `POST /v1/completions` (a prompt or several, as text or token ids;
echo, logprobs, n choices), answered by `choices.Choices`."""

from __future__ import annotations

import dataclasses

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field

from ..sampling import MAX_LOGPROBS
from .choices import Choices
from .common import Server
from .errors import APIError
from .schemas import MAX_COUNT, MAX_SEQUENCES_PER_REQUEST, SamplingRequest


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0, le=MAX_COUNT)  # 0: with echo, the prompt's log-probabilities alone
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_COUNT)


def add_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await server.parse(request, CompletionRequest)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported")
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens: 0 asks for nothing without echo (then: the prompt's logprobs alone)",
                           param="max_tokens", code="invalid_value")
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt: at least one prompt is needed", param="prompt", code="invalid_value")
        if len(prompt) * req.n > MAX_SEQUENCES_PER_REQUEST:  # (chat has one prompt and n <= 16)
            raise APIError(400, f"{len(prompt)} prompts x n={req.n} is {len(prompt) * req.n} sequences; a request "
                                f"may ask for at most {MAX_SEQUENCES_PER_REQUEST}",
                           param="n" if req.n > 1 else "prompt", code="invalid_value")
        prompts = [p if isinstance(p, list) else await server.encode_async(p, "prompt") for p in prompt]
        vocab = server.llm.model.config.vocab_size
        if any(not p or min(p) < 0 or max(p) >= vocab for p in prompts):
            raise APIError(400, f"prompt: token ids must be in 0..{vocab - 1} and non-empty", param="prompt",
                           code="invalid_value")
        structured = await server.structured(req)
        field, structured = structured or (None, None)
        jobs, echo = [], []
        for p, ids in zip(prompt, prompts):
            # max_tokens 0 (with echo): one token is generated, and dropped
            params = server.sampling_params(req, req.max_tokens or (1 if req.max_tokens == 0 else None), len(ids),
                                            "prompt", default_max_tokens=16)
            params = dataclasses.replace(params, logprobs=req.logprobs, structured=structured,
                                         prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None)
            new = server.jobs(len(jobs), ids, params, req.n)
            jobs += new
            echo += [p if isinstance(p, str) else server.llm.tokenizer.decode(ids)] * len(new)
        choices = Choices(server, req, sum(map(len, prompts)), chat=False, echo=echo if req.echo else None,
                          zero=req.max_tokens == 0, field=field)
        return await server.answer(request, choices, jobs, req.stream, field)
