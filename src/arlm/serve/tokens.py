"""The tokenizer over HTTP, in vLLM's shapes (lm-eval's remote tokenizer, token counting):
`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..llm import PromptError
from .common import Server
from .errors import APIError
from .schemas import ChatMessage, Strict


class TokenizeRequest(Strict):  # vLLM's POST /tokenize: a prompt, or chat messages
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


def add_routes(app: FastAPI, server: Server) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req: TokenizeRequest = await server.parse(request, TokenizeRequest)
        tok = server.llm.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt", code="invalid_value")
        if req.messages is not None:
            messages = server.template_messages(server.chat_messages(req.messages))
            try:
                text = server.llm.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
            except PromptError as e:
                raise APIError(400, str(e), param="messages", code="invalid_value") from None
            ids = tok.encode(text, add_bos=False)  # (the template writes its own special tokens)
        else:
            ids = tok.encode(req.prompt, add_bos=None if req.add_special_tokens else False)
        out = {"count": len(ids), "max_model_len": server.engine.engine.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [tok.token_text(i) for i in ids]
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req: DetokenizeRequest = await server.parse(request, DetokenizeRequest)
        vocab = server.llm.model.config.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens.{bad}: {req.tokens[bad]} is not a token id (0..{vocab - 1})",
                           param=f"tokens.{bad}", code="invalid_value")
        return JSONResponse({"prompt": server.llm.tokenizer.decode(req.tokens)})

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        server.check_auth(request)
        tok = server.llm.tokenizer
        name = lambda i: tok.decode([i]) if i is not None else None  # noqa: E731
        return JSONResponse({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length":
                             server.engine.engine.max_model_len, "vocab_size": tok.vocab_size,
                             "bos_token": name(tok.bos_id), "bos_token_id": tok.bos_id,
                             "eos_token": name(tok.eos_id), "eos_token_id": tok.eos_id,
                             "add_bos_token": bool(tok.add_bos and tok.bos_id is not None),
                             "chat_template": server.llm.chat_template})
