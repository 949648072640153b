"""vLLM's tokenizer routes: POST /tokenize, POST /detokenize and GET /tokenizer_info (what
lm-evaluation-harness's tokenizer_backend=remote reads). Behind the API key like every route
but /health and /login (middleware.APIKeyCheck)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request, Response

from engine.entrypoints.openai import ecosystem, protocol

if TYPE_CHECKING:
    from engine.entrypoints.openai.server import ServerState


def add_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request, response: Response) -> dict:
        body = await _checked_body(request, response, protocol.TOKENIZE_FIELDS)
        state.lora_for(body.get("model"))  # an unknown model is a 404, as everywhere
        template = ecosystem.chat_template_options(body) if "messages" in body else {}
        with ecosystem.template_errors(template):
            return await asyncio.to_thread(
                protocol.tokenize, body, state.tokenizer, state.max_model_len, template
            )

    @app.post("/detokenize")
    async def detokenize(request: Request, response: Response) -> dict:
        body = await _checked_body(request, response, protocol.DETOKENIZE_FIELDS)
        state.lora_for(body.get("model"))
        ids = protocol.detokenize_ids(body, state.engine.engine.vocab_size)
        decoder = state.engine.engine.decoder  # as the engine's outputs: no space clean-up
        text = await asyncio.to_thread(decoder, ids, skip_special_tokens=False)
        return {"prompt": text}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        """vLLM's, for lm-evaluation-harness's tokenizer_backend=remote."""
        return ecosystem.tokenizer_info(state.tokenizer, state.max_model_len)


async def _checked_body(request: Request, response: Response, fields: dict) -> dict:
    """A body's known fields under ecosystem's rule; the ignored ones named in a header."""
    raw = await protocol.read_json(request)
    body, ignored = ecosystem.check_request(raw, fields, ecosystem.NO_REFUSED_FIELDS)
    response.headers.update(ecosystem.ignored_headers(ignored, request.url.path))
    return body
