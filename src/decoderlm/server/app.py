"""The OpenAI-compatible HTTP app: request JSON → `RequestParams` → engine → `TokenEvent`s → JSON or SSE.

It only translates: tokenizing and chat templates here, the response shapes and server-sent events
in server/responses.py, scheduling and sampling in the engine. Each choice of a request (n per
prompt) is one engine stream with request id "<id>-<i>", queued before the response starts, so a
full queue is a 429 and not a broken stream.

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a bad field
or a prompt that leaves no room in the context, 404 for an unknown model, 413 for a body over the
limit, 429 for a full queue, 503 while the model loads, the server drains or the engine has
stopped, 500 for a request the engine failed; 401 without the API key and 421 for a foreign Host
(server/security.py, a middleware that answers before any route). A stream that fails after it
started ends with an event `data: {"error": {...}}`, then `data: [DONE]`. What a request may cost
is bounded by the server's `limits.Limits`, checked before any work; tokenizing, chat templates
and waiting on the engine run off the event loop. A request's sequences are queued (or refused)
before its prompts are scored for `echo` with `logprobs`. `max_tokens` beyond the context is cut to
fit (finish_reason "length"); the i-th of n choices uses seed + i. `best_of` and
`use_beam_search` rank candidates, on both endpoints (server/ranked.py). `create_app` mounts this
module's router and the playground's (server/playground.py: /, /static, /v1/model_card,
/v1/engine_stats, /v1/attention); what both use is in server/http.py. Its OpenAPI document
(/openapi.json, server/openapi.py) declares these answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from decoderlm.engine.types import EngineStoppedError, QueueFullError, TokenEvent
from decoderlm.errors import DecoderLMError
from decoderlm.server import openapi, playground, protocol, ranked
from decoderlm.server.http import (
    APIError,
    Served,
    ServerState,
    State,
    chat_prompt,
    check_model,
    encode,
    request_text,
)
from decoderlm.server.limits import BodySizeLimit, Limits, WorkTimeout, wait
from decoderlm.server.openapi import (
    HEALTH,
    MODELS,
    STR,
    TOKENS,
    completion_responses,
    errors,
    json_object,
    json_response,
)
from decoderlm.server.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from decoderlm.server.responses import (
    ChatFormat,
    CompletionFormat,
    RequestStream,
    respond,
    start_all,
)
from decoderlm.server.security import Guard, Policy

log = logging.getLogger("decoderlm.serve")

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


def drain(app: FastAPI, grace_s: float) -> None:
    """Start a graceful shutdown (safe from a signal handler or another thread)."""
    state: ServerState = app.state.server
    if state.loop is not None:
        state.loop.call_soon_threadsafe(state.drain, grace_s)


def _room(served: Served, ids: list[int], requested: int | None, param: str) -> int:
    """max_tokens for a prompt: the request's (or the rest of the context), cut to fit the context."""
    room = served.context_length - len(ids)
    if room < 1:
        raise APIError(
            400,
            f"{param} has {len(ids)} tokens; the model's context is {served.context_length} "
            f"tokens, so a prompt may have at most {served.context_length - 1}",
            param=param,
            code="context_length_exceeded",
        )
    return room if requested is None else min(requested, room)


def _check_stopping(served: Served, body: protocol.Generation, requested: int | None) -> None:
    """400s naming the field: a stop token id outside the vocabulary, min_tokens past the
    max_tokens asked for."""
    bad = [t for t in body.stop_token_ids or () if not 0 <= t < served.vocab_size]
    if bad:
        raise APIError(
            400,
            f"stop_token_ids holds {bad[0]}, outside the vocabulary [0, {served.vocab_size})",
            param="stop_token_ids",
        )
    if requested is not None and body.min_tokens > requested:
        raise APIError(
            400,
            f"min_tokens={body.min_tokens} must be at most max_tokens={requested}",
            param="min_tokens",
        )


def _check_stream_options(body: protocol.Generation) -> bool:
    if body.stream_options is not None and not body.stream:
        raise APIError(
            400, "stream_options is only allowed with stream=true", param="stream_options"
        )
    return body.stream_options is not None and body.stream_options.include_usage


def _prompts(served: Served, prompt: protocol.Prompt, echo: bool) -> list[tuple[list[int], str]]:
    """Token ids of each prompt of a completion request (text, texts, ids or lists of ids), and
    its text to echo ("" without echo). Blocking (tokenizes): run it with `ServerState.work`."""
    if isinstance(prompt, str):
        prompts = [encode(served, prompt, "prompt", completion=True)]
    elif isinstance(prompt[0], str):
        prompts = [encode(served, p, "prompt", completion=True) for p in prompt]
    else:
        prompts = [prompt] if isinstance(prompt[0], int) else prompt
        bad = [t for ids in prompts for t in ids if t >= served.vocab_size]
        if bad:
            raise APIError(
                400,
                f"prompt token id {bad[0]} is outside the vocabulary [0, {served.vocab_size})",
                param="prompt",
            )
    return [(ids, served.tokenizer.decode(ids) if echo else "") for ids in prompts]


def _check_counts(state: ServerState, n_prompts: int, n_tokens: int, n: int, param: str) -> None:
    """A request within the limits on prompts and on prompt tokens (× n)."""
    limits = state.limits
    if n_prompts > limits.max_prompts_per_request:
        raise APIError(
            400,
            f"{param} has {n_prompts} prompts; this server takes at most "
            f"{limits.max_prompts_per_request} per request",
            param=param,
        )
    if n_tokens * n > limits.max_tokens_per_request:
        raise APIError(
            400,
            f"{param} has {n_tokens} tokens × n={n}; this server takes at most "
            f"{limits.max_tokens_per_request} prompt tokens per request",
            param=param,
        )


async def _scored(
    state: ServerState, ids: list[list[int]], top: int, streams: list[RequestStream]
) -> list[list[TokenEvent]]:
    """Each prompt's own tokens with their logprobs (`Engine.score`), once its streams are
    queued; the engine scores one prompt per step, between the steps of other requests."""
    engine, timeout = state.served.engine, state.limits.work_timeout_s
    try:
        futures = [engine.score(p, top) for p in ids]
        return [await wait(asyncio.wrap_future(f), timeout, "scoring the prompt") for f in futures]
    except BaseException:
        for s in streams:
            s.close()
        raise


async def _completions(state: ServerState, body: CompletionRequest) -> Response:
    created = int(time.time())
    served = state.ready()
    check_model(served, body.model)
    include_usage = _check_stream_options(body)
    ranked.check(body)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    requested = body.max_tokens or DEFAULT_COMPLETION_TOKENS
    _check_stopping(served, body, requested)
    streams, echoes, prompt_events = [], [], None
    several = isinstance(body.prompt, list) and isinstance(body.prompt[0], str | list)
    per_prompt = ranked.candidates(body)  # sequences a prompt: n, or best_of
    _check_counts(
        state, len(body.prompt) if several else 1, 0, per_prompt, "prompt"
    )  # before tokenizing
    prompts = await state.work(_prompts, served, body.prompt, body.echo, what="tokenizing")
    _check_counts(state, len(prompts), sum(len(ids) for ids, _ in prompts), per_prompt, "prompt")
    rooms = [_room(served, ids, requested, "prompt") for ids, _ in prompts]
    if body.use_beam_search:
        return await _beam_completions(state, request_id, created, body, prompts, rooms)
    for p, ((ids, echo), max_tokens) in enumerate(zip(prompts, rooms, strict=True)):
        params = protocol.to_params(body, max_tokens, body.logprobs, (), served.sampling_defaults)
        params = ranked.engine_params(params, body)
        streams.append(RequestStream(state, f"{request_id}-{p}", ids, params, p * per_prompt))
        echoes += [echo] * body.n
    await start_all(state, streams)
    if body.echo and body.logprobs is not None:  # the prompt's tokens get logprobs too
        scored = await _scored(state, [ids for ids, _ in prompts], body.logprobs, streams)
        prompt_events = [events for events in scored for _ in range(body.n)]
    fmt = CompletionFormat(served, echoes, body.logprobs is not None, prompt_events)
    if ranked.selects(body):
        return await ranked.best_of(request_id, created, served, streams, fmt, body.n)
    return await respond(request_id, created, served, streams, fmt, body.stream, include_usage)


async def _beam_completions(
    state: ServerState,
    request_id: str,
    created: int,
    body: CompletionRequest,
    prompts: list[tuple[list[int], str]],
    rooms: list[int],
) -> Response:
    """A completions request's beam search, its prompts scored first for `echo` with `logprobs`."""
    ids = [ids for ids, _ in prompts]
    scored = None
    if body.echo and body.logprobs is not None:
        scored = await _scored(state, ids, body.logprobs, [])

    def fmt(owners: list[int]) -> CompletionFormat:
        prompt_events = None if scored is None else [scored[p] for p in owners]
        echoes = [prompts[p][1] for p in owners]
        return CompletionFormat(state.served, echoes, body.logprobs is not None, prompt_events)

    return await ranked.beam(
        state, request_id, created, body, ids, rooms, body.stops(), body.logprobs, fmt
    )


async def _chat(state: ServerState, body: ChatRequest) -> Response:
    created = int(time.time())
    served = state.ready()
    check_model(served, body.model)
    include_usage = _check_stream_options(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    ranked.check(body)
    _check_stopping(served, body, body.max_completion_tokens or body.max_tokens)
    text = await chat_prompt(state, served, body.messages, body.add_generation_prompt)
    ids = await state.work(encode, served, text, "messages", what="tokenizing")
    _check_counts(state, 1, len(ids), ranked.candidates(body), "messages")
    max_tokens = _room(served, ids, body.max_completion_tokens or body.max_tokens, "messages")
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    params = protocol.to_params(
        body, max_tokens, logprobs, served.chat_template.stop, served.sampling_defaults
    )
    if body.use_beam_search:
        return await ranked.beam(
            state,
            request_id,
            created,
            body,
            [ids],
            [max_tokens],
            params.stop,
            logprobs,
            lambda owners: ChatFormat(served, len(owners), logprobs is not None),
        )
    streams = [RequestStream(state, request_id, ids, ranked.engine_params(params, body), 0)]
    fmt = ChatFormat(served, body.n, logprobs is not None)
    await start_all(state, streams)
    if ranked.selects(body):
        return await ranked.best_of(request_id, created, served, streams, fmt, body.n)
    return await respond(request_id, created, served, streams, fmt, body.stream, include_usage)


def _log_ignored(body: protocol.Generation, path: str) -> None:
    """A warning naming the request's fields this server does not know (and ignores)."""
    if body.model_extra:
        log.warning(
            "%s: ignored unknown request fields %s", path, ", ".join(sorted(body.model_extra))
        )


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {reason}")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None  # the top-level field; the message has the whole path
    got = f" (got {first['input']!r:.80})" if "input" in first and param else ""
    message = f"{'.'.join(loc)}: {first['msg']}{got}" if param else first["msg"]
    return APIError(400, message, param=param)


async def _on_error(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, APIError):
        return exc.response()
    if isinstance(exc, RequestValidationError):
        return _validation_error(exc).response()
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), "rate_limit_error", code="queue_full").response()
    if isinstance(exc, EngineStoppedError | WorkTimeout):
        return APIError(503, str(exc), "service_unavailable").response()
    if isinstance(exc, DecoderLMError):
        return APIError(400, str(exc)).response()
    if isinstance(exc, HTTPException):  # 404, or 405 with its Allow header
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()
    log.exception("decoderlm serve: internal error")
    return APIError(500, f"internal error: {type(exc).__name__}", "server_error").response()


router = APIRouter()


@router.get(
    "/health",
    responses={
        200: json_response("ready", HEALTH),
        503: json_response("not ready, and why", HEALTH),
    },
)
async def health(state: State) -> JSONResponse:
    try:
        state.ready()
    except APIError as exc:
        return JSONResponse({"status": exc.message}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus' text format",
            "content": {CONTENT_TYPE_LATEST: {"schema": STR}},
        }
    },
)
async def metrics(state: State) -> Response:
    content, media_type = await state.work(state.metrics.render, what="the metrics")
    return Response(content, media_type=media_type)


@router.get("/v1/models", responses=errors(503) | {200: json_response("the served model", MODELS)})
async def models(state: State) -> dict[str, Any]:
    served = state.ready()
    model = {
        "id": served.model_name,
        "object": "model",
        "created": served.created,
        "owned_by": "decoderlm",
        "max_model_len": served.context_length,
    }
    return {"object": "list", "data": [model]}


@router.post("/v1/completions", responses=completion_responses("text_completion"))
async def completions(state: State, body: CompletionRequest) -> Response:
    _log_ignored(body, "/v1/completions")
    return await _completions(state, body)


@router.post("/v1/chat/completions", responses=completion_responses("chat.completion"))
async def chat_completions(state: State, body: ChatRequest) -> Response:
    _log_ignored(body, "/v1/chat/completions")
    return await _chat(state, body)


@router.post("/tokenize", responses=errors(404, 503) | {200: json_response("the ids", TOKENS)})
async def tokenize(state: State, body: TokenizeRequest) -> dict[str, Any]:
    served = state.ready()
    check_model(served, body.model)
    text = await request_text(state, served, body)
    try:
        tokens = await state.work(served.tokenizer.encode, text, what="tokenizing")
    except DecoderLMError as exc:
        raise APIError(400, str(exc), param="prompt") from None
    return {"tokens": tokens, "count": len(tokens), "max_model_len": served.context_length}


@router.post(
    "/detokenize",
    responses=errors(404, 503) | {200: json_response("the text", json_object(prompt=STR))},
)
async def detokenize(state: State, body: DetokenizeRequest) -> dict[str, str]:
    served = state.ready()
    check_model(served, body.model)
    bad = [t for t in body.tokens if not 0 <= t < served.vocab_size]
    if bad:
        raise APIError(
            400,
            f"token id {bad[0]} is outside the vocabulary [0, {served.vocab_size})",
            param="tokens",
        )
    return {"prompt": served.tokenizer.decode(body.tokens)}


def create_app(
    load: Callable[[], Served],
    on_load_error: Callable[[BaseException], None] | None = None,
    grace_s: float = 30.0,
    policy: Policy | None = None,
    limits: Limits | None = None,
) -> FastAPI:
    """The app; `load()` runs in a thread at startup (GET /health is 503 until it returns).

    `policy` says which hosts it answers to and its API key (server/security.py); without it,
    loopback names only and no key. `limits`: what one request may cost (`Limits()`'s defaults if
    None). The OpenAPI document is at /openapi.json; there is no /docs or /redoc, whose pages load
    their scripts from a CDN (blank offline).
    """
    limits = Limits() if limits is None else limits
    state = ServerState(load, on_load_error, limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        loading = asyncio.create_task(state.start())
        yield
        loading.cancel()
        if state.served is not None:
            await asyncio.to_thread(state.served.engine.shutdown, grace_s)
        state.offload.shutdown()

    app = FastAPI(title="decoderlm", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    policy = policy or Policy()
    app.add_middleware(Guard, policy=policy)
    app.openapi = lambda: openapi.document(app, policy.document)
    app.state.server = state
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_bytes)
    app.add_exception_handler(Exception, _on_error)
    for exc_class in (APIError, RequestValidationError, DecoderLMError, HTTPException):
        app.add_exception_handler(exc_class, _on_error)
    app.include_router(router)
    app.include_router(playground.router)
    return app
