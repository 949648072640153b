"""The OpenAI-compatible HTTP server: FastAPI over one AsyncEngine.

/v1/completions, /v1/chat/completions (both with SSE streaming), /v1/models, /health, /metrics.
Every request from every client goes into the same engine loop and is batched with the rest.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from engine.entrypoints import reasoning
from engine.entrypoints.async_engine import AsyncEngine, EngineDeadError, RequestStream
from engine.entrypoints.llm import chat_prompt_ids
from engine.entrypoints.openai import ecosystem, protocol, responses
from engine.entrypoints.openai.admission import (
    Admission,
    AdmissionLimits,
    Ticket,
    TicketedStream,
)
from engine.entrypoints.openai.browser import BrowserGuard, server_hosts
from engine.entrypoints.openai.login import add_login_routes
from engine.entrypoints.openai.lora_routes import add_lora_routes
from engine.entrypoints.openai.metrics import ServerMetrics
from engine.entrypoints.openai.middleware import APIKeyCheck, BodySizeLimit, error_response
from engine.entrypoints.openai.protocol import APIError
from engine.entrypoints.openai.responses import Echo, ResponseContext
from engine.entrypoints.openai.tokenizer_routes import add_tokenizer_routes
from engine.entrypoints.tools import Tools
from engine.outputs import RequestOutput
from lora.adapter import LoRARequest

_DISCONNECT_POLL_S = 0.2
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # request bodies past it get a 413


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str  # the base model's name in /v1/models and in `model`
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    api_keys: tuple[str, ...] = ()  # any of them opens every route but /health and /login
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    metrics: ServerMetrics | None = None
    lora_dir: Path | None = None  # adapters may be hot-loaded from here (and only from here)
    max_adapters: int = 64  # adapter names served at once (hot loads past it are refused)
    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    bind_host: str | None = None  # the address uvicorn listens on: a name the server answers to
    allowed_hosts: tuple[str, ...] = ()  # more names (key-less servers check Host)
    allowed_origins: tuple[str, ...] = ()  # sites whose pages may call the server (CORS)
    show_cached_tokens: bool = False  # usage.prompt_tokens_details.cached_tokens: a cache oracle
    # Chat answers' thinking as reasoning_content (engine.entrypoints.reasoning): auto (when the
    # chat template writes `<think>`), qwen3 or deepseek_r1 (always), none.
    reasoning_parser: str = "auto"
    created: int = field(default_factory=lambda: int(time.time()))
    admission: Admission = field(init=False)

    def __post_init__(self) -> None:
        self.admission = Admission(self.limits)

    @functools.cached_property
    def splits_reasoning(self) -> bool:
        return reasoning.parser_enabled(
            self.reasoning_parser, getattr(self.tokenizer, "chat_template", None)
        )

    def model_card(self, name: str) -> dict:
        """/v1/models' entry for the base model or an adapter (whose parent is the base)."""
        adapter = self.adapters.get(name) if name != self.model_name else None
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "tandem",
            "root": name,  # (an adapter's path on this machine is not the client's business)
            "parent": None if adapter is None else self.model_name,
            "max_model_len": self.max_model_len,
        }

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """`model` names the base model (or is absent) or a loaded adapter."""
        if model is None or model == self.model_name:
            return None
        if model in self.adapters:
            return self.adapters[model]
        raise APIError(
            f"The model `{model}` does not exist; see /v1/models",
            "model",
            status=404,
            code="model_not_found",
        )


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Tandem", docs_url=None, redoc_url=None)
    app.state.tandem = state
    if state.metrics is None:
        state.metrics = ServerMetrics()
        state.engine.observers.append(state.metrics)
        state.metrics.watch(state.engine)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(HTTPException)  # an unknown route, a wrong method: OpenAI's shape too
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        error = APIError(str(exc.detail), status=exc.status_code, headers=exc.headers)
        return error_response(error)

    # Starlette runs the last added first: browser checks, then the key, then the body limit.
    app.add_middleware(BodySizeLimit, max_bytes=state.max_body_bytes)
    if state.api_keys:
        app.add_middleware(APIKeyCheck, keys=state.api_keys)
        add_login_routes(app, state.api_keys)
    hosts = server_hosts(state.bind_host, state.allowed_hosts)
    guard = {"hosts": hosts, "origins": state.allowed_origins}
    app.add_middleware(BrowserGuard, **guard, check_requests=not state.api_keys)

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.is_running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(state.metrics.exposition)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/snapshot")
    async def snapshot(request: Request) -> dict:
        """What the playground draws: blocks, tables, sharing, speculation, adapters (with API
        keys: the key's own requests, and counts of the rest; engine.entrypoints.tenancy)."""
        tenant = tenant_of(request)
        return await asyncio.to_thread(state.engine.snapshot, tenant)

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [state.model_card(state.model_name)]
        cards += [state.model_card(name) for name in state.adapters]
        return {"object": "list", "data": cards}

    add_tokenizer_routes(app, state)
    add_lora_routes(app, state)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(state, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(state, request, "chat")

    return app


async def _completion_inputs(state: ServerState, body: dict, ticket: Ticket, width: int | None):
    """(prompts' token ids, sampling params, adapter, response context fields) of a
    /v1/completions body, its requests (each prompt's n, or beam width) held on the ticket
    before the prompts are tokenized. echo puts each prompt before its completions (with
    logprobs, the prompt's too); max_tokens 0 then answers the prompt alone (one token is
    generated and dropped, as vLLM does)."""
    if body.get("prompt") is None:
        raise APIError("prompt is required", "prompt")
    lora = state.lora_for(body.get("model"))
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        state.admission.check_num_prompts(len(prompt))  # before a million are looked at
    prompts = protocol.completion_prompts(prompt)
    echo, only = bool(body.get("echo")), body.get("max_tokens") == 0
    if only and not echo:
        raise APIError("max_tokens must be >= 1 (0 only with echo: the prompt alone)", "max_tokens")
    logprobs, prompt_logprobs = body.get("logprobs"), body.get("prompt_logprobs")
    if echo and logprobs is not None:
        prompt_logprobs = max(logprobs, prompt_logprobs or 0)
    params = protocol.sampling_params(
        body,
        None if body.get("n_predict") == -1 else 16,  # llama.cpp's -1: up to the context
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        max_tokens=1 if only else None,
    )
    ticket.admit(len(prompts), width or params.n)
    ids = await asyncio.to_thread(_encode_all, state, prompts)
    if body.get("truncate_prompt_tokens") is not None:  # echo shows what the model read
        prompts = ids = [ecosystem.truncate(i, body) for i in ids]
    ticket.add_tokens(sum(len(i) for i in ids) * (width or params.n))
    fields = {"with_prompt_logprobs": body.get("prompt_logprobs") is not None}
    if echo:
        fields["echoes"] = await asyncio.to_thread(_echoes, state, prompts, ids, only)
    return ids, params, lora, fields


def _echoes(state: ServerState, prompts, ids, only: bool) -> list[Echo]:
    decode = functools.partial(state.engine.engine.decoder, skip_special_tokens=False)
    return [
        Echo(p if isinstance(p, str) else decode(p), decode(i[:1]), only)
        for p, i in zip(prompts, ids, strict=True)
    ]


async def _chat_inputs(state: ServerState, body: dict, ticket: Ticket, width: int | None):
    """(the prompt's token ids, as one list, sampling params, adapter, response context
    fields) of a chat body, its requests (n, or beam width) held on the ticket before the
    messages are tokenized."""
    lora = state.lora_for(body.get("model"))
    messages = protocol.check_messages(body.get("messages") or [])
    if not getattr(state.tokenizer, "chat_template", None):
        raise APIError("this model has no chat template; use /v1/completions", "messages")
    top = body.get("top_logprobs")
    if top is not None and not body.get("logprobs"):
        raise APIError("top_logprobs needs logprobs=true", "top_logprobs")
    logprobs = (top or 0) if body.get("logprobs") else None
    # max_completion_tokens is OpenAI's newer name; it wins over max_tokens when both are given.
    max_tokens = body.get("max_completion_tokens")
    params = protocol.sampling_params(body, None, logprobs=logprobs, max_tokens=max_tokens)
    ticket.admit(1, width or params.n)
    template = ecosystem.chat_template_options(body)
    try:
        tools = Tools.parse(
            body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
        )
        shown = tools.in_prompt if tools else None
        with ecosystem.template_errors(template):
            render = functools.partial(chat_prompt_ids, tools=shown, **template)
            ids = await asyncio.to_thread(render, state.tokenizer, messages)
        params = tools.apply(params) if tools else params
    except ValueError as exc:
        raise protocol.param_error(exc, body, "messages") from None
    ids = ecosystem.truncate(ids, body)
    ticket.add_tokens(len(ids) * (width or params.n))
    fields = {"tools": tools is not None and tools.choice != "none"}
    if state.splits_reasoning:  # does the answer start inside a thinking block?
        leaves_open = functools.partial(reasoning.prompt_leaves_open, state.tokenizer, ids)
        fields["starts_in_reasoning"] = await asyncio.to_thread(leaves_open)
    return [ids], params, lora, fields


def _encode_all(state: ServerState, prompts: list[str | list[int]]) -> list[list[int]]:
    return [state.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]


def _check_max_tokens(state: ServerState, ids: list[list[int]], params, what: str) -> None:
    """OpenAI refuses a max_tokens past the context (the engine would shorten it); an empty or
    too long prompt is the engine's own check (LLMEngine._check_fits)."""
    limit = state.max_model_len
    for prompt in ids:
        fits = len(prompt) < limit  # a prompt that does not is refused by the engine
        if fits and params.max_tokens is not None and len(prompt) + params.max_tokens > limit:
            raise APIError(
                f"max_tokens={params.max_tokens} plus the {len(prompt)} tokens in the {what} "
                f"exceed this model's context limit of {limit}",
                "max_tokens",
            )


async def _generate(state: ServerState, request: Request, kind: str) -> Response:
    """Both generation endpoints: check the body, hold its share of the server's admitted work
    (429 past the limits) until the answer ends, submit every prompt, answer whole or as a
    stream of server-sent events."""
    ticket = Ticket(state.admission)
    try:
        answer = await _answer(state, request, kind, ticket)
    except BaseException:
        ticket.release()
        raise
    if isinstance(answer, StreamingResponse):  # it releases the ticket as the stream ends
        return answer
    ticket.release()
    return answer


async def _answer(state: ServerState, request: Request, kind: str, ticket: Ticket) -> Response:
    is_chat = kind == "chat"
    fields = protocol.CHAT_FIELDS if is_chat else protocol.COMPLETION_FIELDS
    refused = ecosystem.CHAT_REFUSED_FIELDS if is_chat else ecosystem.REFUSED_FIELDS
    body, ignored = ecosystem.check_request(await protocol.read_json(request), fields, refused)
    body = ecosystem.resolve_aliases(body, is_chat)
    headers = ecosystem.ignored_headers(ignored, request.url.path)
    if body.get("use_beam_search"):
        return await _beam_search(state, request, body, kind, ticket, headers)
    if not is_chat:
        protocol.refuse_unsupported(body)
    inputs = _chat_inputs if is_chat else _completion_inputs
    ids, params, lora, fields = await inputs(state, body, ticket, None)
    model = body.get("model") or state.model_name
    ctx = ResponseContext(kind, model, n=params.n, logprobs=params.logprobs, **fields)
    ctx.with_cached_tokens = state.show_cached_tokens
    ctx.with_prediction = body.get("prediction") is not None
    what = "messages" if is_chat else "prompt"
    _check_max_tokens(state, ids, params, what)
    tenant = tenant_of(request)  # whose snapshot shows the request
    salt = cache_salt(request, body)
    streams = await _add_all(state, ctx.id, ids, params, lora, salt, body, what, tenant)
    with_spec_stats = bool(body.get("return_spec_stats"))
    if body.get("stream"):
        events = _sse(ctx, streams, protocol.include_usage(body), with_spec_stats)
        return TicketedStream(events, ticket, media_type="text/event-stream", headers=headers)
    finals = await _collect_unless_disconnected(request, streams)
    if finals is None:
        return Response(status_code=499)  # nobody is listening
    failed = next((f for f in finals if f.error), None)
    if failed:  # its own processing failed; the engine and other requests are fine
        raise request_failed(failed)
    return JSONResponse(responses.final_response(ctx, finals, with_spec_stats), headers=headers)


def tenant_of(request: Request) -> str | None:
    """The salt of the API key the request came with (middleware's `tenant_salt`), or None."""
    return getattr(request.state, "tenant_salt", None)


def cache_salt(request: Request, body: dict) -> str | None:
    """The prefix cache's salt for a request's KV. With API keys a request without a salt takes
    its key's: tenants share no KV unless their requests give the same cache_salt."""
    return body.get("cache_salt") or tenant_of(request)


async def _beam_search(
    state: ServerState, request: Request, body: dict, kind: str, ticket: Ticket, headers: dict
) -> Response:
    """vLLM's use_beam_search (whole responses only): the engine runs the beams, the n best of
    each prompt come back as its choices."""
    is_chat = kind == "chat"
    params = protocol.beam_params(body, None if is_chat else 16)
    inputs = _chat_inputs if is_chat else _completion_inputs
    ids, _, lora, _ = await inputs(state, body, ticket, params.beam_width)
    if lora is not None:
        raise APIError("use_beam_search runs on the base model only", "model")
    n = body.get("n") or 1
    ctx = ResponseContext(kind, body.get("model") or state.model_name, n=n)
    _check_max_tokens(state, ids, params, "messages" if is_chat else "prompt")
    search = asyncio.ensure_future(state.engine.beam_search(ids, params, cache_salt(request, body)))
    try:
        found = await _results_unless_disconnected(request, [search])
    except ValueError as exc:
        raise protocol.param_error(exc, body, "use_beam_search") from None
    finally:
        search.cancel()  # (done already, or its client left: its beams are aborted)
    if found is None:
        return Response(status_code=499)  # nobody is listening
    answer = responses.final_response(ctx, responses.beam_outputs(found[0], n))
    return JSONResponse(answer, headers=headers)


def request_failed(out: RequestOutput) -> APIError:
    """The error for a request that ended with finish_reason "error"."""
    if out.error_status == 400:  # the request's own fault, found while running (its constraint)
        return APIError(out.error, "structured_outputs")
    return APIError(out.error, status=500, type="server_error")


async def _add_all(
    state, request_id, ids, params, lora, salt, body, what, tenant=None
) -> list[RequestStream]:
    """Submit every prompt (as request_id-0, -1, ...), or none: a refused one aborts those
    already added."""
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(ids):
            stream = await state.engine.add_request(
                f"{request_id}-{i}", prompt, params, lora, cache_salt=salt, tenant=tenant
            )
            streams.append(stream)
    except BaseException as exc:
        for s in streams:
            s.close()
        if isinstance(exc, EngineDeadError):
            raise APIError(str(exc), status=503, type="server_error") from None
        if isinstance(exc, ValueError):
            raise protocol.param_error(exc, body, what) from None
        raise
    return streams


async def _collect_unless_disconnected(
    request: Request, streams: list[RequestStream]
) -> list[RequestOutput] | None:
    """Wait for every request to finish; None (all aborted) if the client goes away first."""
    tasks = [asyncio.ensure_future(s.last()) for s in streams]
    try:
        return await _results_unless_disconnected(request, tasks)
    finally:
        await _cancel_and_close(tasks, streams)


async def _results_unless_disconnected(
    request: Request, tasks: list[asyncio.Future]
) -> list | None:
    """Every task's result; None if the client goes away first (the caller stops the tasks).
    The first task to fail raises at once; an engine that died is a 503."""
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=_DISCONNECT_POLL_S)
            if not pending:
                return [t.result() for t in tasks]
            if any(t.exception() for t in done):
                raise next(t.exception() for t in done if t.exception())
            if await request.is_disconnected():
                return None
    except EngineDeadError as exc:
        raise APIError(str(exc), status=503, type="server_error") from None


async def _cancel_and_close(tasks: list[asyncio.Future], streams: list[RequestStream]) -> None:
    """Stop the readers, then abort every request that has not finished (never-read ones too)."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        with suppress(BaseException):
            await t
    for s in streams:
        s.close()


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out, None))
        except Exception as exc:
            await queue.put((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, out, error = await queue.get()
            if error is not None:
                raise error
            if out.finished:
                remaining -= 1
            yield i, out
    finally:
        await _cancel_and_close(tasks, streams)


async def _sse(
    ctx: ResponseContext, streams: list[RequestStream], with_usage: bool, with_spec_stats: bool
) -> AsyncIterator[str]:
    """Server-sent events: a chunk per engine output with what is new, a last chunk with the
    usage and (when asked) the speculation counters, [DONE].
    A disconnect cancels this generator, and closing the merged streams aborts the requests."""
    if ctx.kind == "chat":  # the role comes first, on its own
        role = {"role": "assistant", "content": ""}
        first = [
            {"index": i, "delta": role, "logprobs": None, "finish_reason": None}
            for i in range(len(streams) * ctx.n)
        ]
        yield _event(ctx.envelope(first, chunk=True))
    last: dict[int, RequestOutput] = {}  # prompt index -> its latest output (metrics up to date)
    num_completion_tokens = 0
    try:
        async for i, out in _merge(streams):  # each output holds only what is new
            if out.error:
                raise request_failed(out)
            last[i] = out
            num_completion_tokens += responses.completion_tokens(ctx, [out])
            choices = [
                responses.choice(ctx, i * ctx.n + c.index, c, True, out) for c in out.outputs
            ]
            if choices:
                yield _event(ctx.envelope(choices, chunk=True))
    except (APIError, EngineDeadError, ValueError) as exc:
        if not isinstance(exc, APIError):
            exc = APIError(str(exc), status=500, type="server_error")
        yield _event(exc.body())
        yield "data: [DONE]\n\n"
        return
    if with_usage or with_spec_stats:
        tail = ctx.envelope([], chunk=True)
        if with_usage:
            num_prompt_tokens = sum(len(out.prompt_token_ids) for out in last.values())
            cached = sum(out.num_cached_tokens for out in last.values())
            cached = cached if ctx.with_cached_tokens else None
            predicted = responses.prediction_stats(ctx, list(last.values()))
            tail["usage"] = responses.usage(
                num_prompt_tokens, num_completion_tokens, cached, predicted
            )
        if with_spec_stats:
            tail["speculation"] = responses.spec_stats(list(last.values()))
        yield _event(tail)
    yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
