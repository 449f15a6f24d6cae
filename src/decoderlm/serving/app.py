"""The OpenAI-compatible HTTP app: request JSON → `RequestParams` → engine → `TokenEvent`s → JSON or SSE.

It only translates: tokenizing, chat templates and the response shapes live here, scheduling and
sampling in the engine. Each choice of a request (n per prompt) is one engine stream with request
id "<id>-<i>"; its first event is awaited before the response starts, so a full queue is a 429 and
not a broken stream. Streams are server-sent events, `data: {json}\\n\\n` ending with
`data: [DONE]\\n\\n`, as OpenAI's clients parse them. A client that goes away cancels its streams.

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a bad field
or a prompt that leaves no room in the context, 404 for an unknown model, 413 for a body over the
limit, 429 for a full queue, 503 while the model loads, the server drains or the engine has
stopped, 500 for a request the engine failed; 401 without the API key and 421 for a foreign Host
(serving/security.py, a middleware that answers before any route). A stream that fails after it
started ends with an event `data: {"error": {...}}`, then `data: [DONE]`. What a request may cost
is bounded by the server's `limits.Limits`, checked before any work; tokenizing, chat templates
and waiting on the engine run off the event loop. A request's sequences are queued (or refused)
before its prompts are scored for `echo` with `logprobs`. `max_tokens` beyond the context is cut to
fit (finish_reason "length"); the i-th of n choices uses seed + i. `create_app` mounts this
module's router and the playground's (serving/playground.py: /, /static, /v1/model_card,
/v1/engine_stats, /v1/attention); what both use is in serving/http.py. Its OpenAPI document
(/openapi.json) declares these answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from decoderlm.errors import DecoderLMError
from decoderlm.serving import playground, protocol
from decoderlm.serving.http import (
    ERRORS,
    APIError,
    Served,
    ServerState,
    State,
    chat_prompt,
    check_model,
    encode,
    error_response,
    errors,
    request_text,
)
from decoderlm.serving.limits import BodySizeLimit, Limits, WorkTimeout, wait
from decoderlm.serving.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from decoderlm.serving.security import Guard, Policy
from decoderlm.serving.streams import stream_batches
from decoderlm.serving.types import EngineStoppedError, QueueFullError, RequestParams, TokenEvent

log = logging.getLogger("decoderlm.serve")

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


def drain(app: FastAPI, grace_s: float) -> None:
    """Start a graceful shutdown (safe from a signal handler or another thread)."""
    state: ServerState = app.state.server
    if state.loop is not None:
        state.loop.call_soon_threadsafe(state.drain, grace_s)


class _Stream:
    """One engine request (a prompt and its n sequences); its events timed for TTFT and ITL.

    Sequence j of the request is choice `first_choice + j` of the response.
    """

    def __init__(
        self,
        state: ServerState,
        request_id: str,
        prompt_ids: list[int],
        params: RequestParams,
        first_choice: int,
    ) -> None:
        self.state, self.request_id, self.prompt_ids, self.params = (
            state,
            request_id,
            prompt_ids,
            params,
        )
        self.first_choice = first_choice
        self.arrived = time.perf_counter()
        self.last: dict[int, float] = {}  # choice → when its latest token arrived
        self.n_tokens = 0
        self.finished = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Submit to the engine (QueueFullError at once if its queue is full); the events go to
        `loop`. Blocking (an engine in a process answers the submit): call it off the loop."""
        engine = self.state.served.engine
        self.state.inflight.add(self.request_id)
        self.batches = stream_batches(engine, self.prompt_ids, self.params, self.request_id, loop)

    async def stream(self) -> AsyncIterator[tuple[int, list[TokenEvent]]]:
        """(choice, its events) as they arrive: all of a choice's events that have arrived when
        the response asks for more, so a response that falls behind the engine catches up in one
        chunk of several tokens instead of one chunk per token."""
        metrics = self.state.metrics
        async for batch in self.batches:
            now = time.perf_counter()
            choices: dict[int, list[TokenEvent]] = {}
            for event in batch:
                choice = self.first_choice + event.index
                if event.token_id is not None:
                    histogram = metrics.itl if choice in self.last else metrics.ttft
                    histogram.observe(now - self.last.get(choice, self.arrived))
                    self.last[choice] = now
                    self.n_tokens += 1
                choices.setdefault(choice, []).append(event)
            for item in choices.items():
                yield item
        self.finished = True
        self.state.inflight.discard(self.request_id)

    def close(self) -> None:
        """Cancel the engine's sequences unless they ended by themselves."""
        if not self.finished and self.request_id in self.state.inflight:
            self.state.served.engine.cancel(self.request_id)
        self.state.inflight.discard(self.request_id)


async def _start_all(state: ServerState, streams: list[_Stream]) -> None:
    """Queue every stream of a request, off the event loop, or none (the error is raised)."""
    loop = asyncio.get_running_loop()

    def start() -> None:
        for s in streams:
            s.start(loop)

    try:
        await state.work(start, what="queueing the request")
    except BaseException:
        for s in streams:
            s.close()
        raise


async def _merged(streams: list[_Stream]) -> AsyncIterator[tuple[int, list[TokenEvent]]]:
    """(choice, events) from all streams as they come; cancels what is left when it is closed."""
    queue: asyncio.Queue[tuple[int, list[TokenEvent]] | BaseException | None] = asyncio.Queue()

    async def pump(s: _Stream) -> None:
        try:
            async for item in s.stream():
                queue.put_nowait(item)
            queue.put_nowait(None)
        except Exception as exc:
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(streams)
        while remaining:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                remaining -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for s in streams:
            s.close()


class _Format:
    """The JSON of one endpoint's choices; `whole` is a non-streamed choice, else a chunk's."""

    object: str
    chunk_object: str

    def __init__(self, served: Served, n_choices: int, logprobs: bool) -> None:
        self.served, self.logprobs = served, logprobs
        self.offsets = [0] * n_choices  # characters of text each choice has released

    def opening(self, i: int) -> dict[str, Any] | None:
        return None

    def choice(self, i: int, events: list[TokenEvent], whole: bool) -> dict[str, Any]:
        raise NotImplementedError

    def _text(self, i: int, events: list[TokenEvent]) -> tuple[str, int]:
        """The events' text, and the offset it starts at in choice i."""
        text, start = "".join(e.text for e in events), self.offsets[i]
        self.offsets[i] += len(text)
        return text, start


class _CompletionFormat(_Format):
    object = chunk_object = "text_completion"

    def __init__(
        self,
        served: Served,
        echoes: list[str],
        logprobs: bool,
        prompt_events: list[list[TokenEvent]] | None = None,
    ) -> None:
        """echoes: each choice's prompt text ("" without echo); prompt_events: with echo and
        logprobs, each choice's prompt tokens (`Engine.score`), reported before its own tokens."""
        super().__init__(served, len(echoes), logprobs)
        self.echoes, self.prompt_events = echoes, prompt_events
        self.offsets = [len(e) for e in echoes]

    def opening(self, i: int) -> dict[str, Any] | None:
        if not self.echoes[i]:
            return None
        logprobs = None
        if self.prompt_events is not None:
            logprobs = protocol.completion_logprobs(
                self.prompt_events[i], self.served.token_text, 0
            )
        return {"index": i, "text": self.echoes[i], "logprobs": logprobs, "finish_reason": None}

    def choice(self, i: int, events: list[TokenEvent], whole: bool) -> dict[str, Any]:
        text, start = self._text(i, events)
        logprobs = None
        if self.logprobs:
            if whole and self.prompt_events is not None:  # the prompt's tokens, then the choice's
                events, start = self.prompt_events[i] + events, 0
            logprobs = protocol.completion_logprobs(events, self.served.token_text, start)
        return {
            "index": i,
            "text": self.echoes[i] + text if whole else text,
            "logprobs": logprobs,
            "finish_reason": events[-1].finish_reason if events else None,
        }


class _ChatFormat(_Format):
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def opening(self, i: int) -> dict[str, Any] | None:
        delta = {"role": "assistant", "content": ""}
        return {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}

    def choice(self, i: int, events: list[TokenEvent], whole: bool) -> dict[str, Any]:
        text, _ = self._text(i, events)
        logprobs = protocol.chat_logprobs(events, self.served.token_text) if self.logprobs else None
        message = {"role": "assistant", "content": text} if whole else {"content": text}
        return {
            "index": i,
            ("message" if whole else "delta"): message if whole or text else {},
            "logprobs": logprobs,
            "finish_reason": events[-1].finish_reason if events else None,
        }


def _engine_error(served: Served) -> APIError:
    """The error of a request whose sequence ended with finish_reason "error"."""
    if served.engine.failure is not None:
        message = f"the engine has stopped: {served.engine.failure}"
        return APIError(503, message, "service_unavailable")
    message = "the engine failed on this request; see the server log"
    return APIError(500, message, "server_error")


async def _respond(
    request_id: str,
    created: int,
    served: Served,
    streams: list[_Stream],
    fmt: _Format,
    stream: bool,
    include_usage: bool,
) -> Response:
    """The response of a request whose streams have started."""
    n_choices = sum(s.params.n for s in streams)

    def envelope(obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": request_id,
            "object": obj,
            "created": created,
            "model": served.model_name,
            "choices": choices,
        }

    def total_usage() -> dict[str, int]:
        prompt_tokens = sum(len(s.prompt_ids) for s in streams)
        return protocol.usage(prompt_tokens, sum(s.n_tokens for s in streams))

    if not stream:
        events: list[list[TokenEvent]] = [[] for _ in range(n_choices)]
        async for i, batch in _merged(streams):
            if any(event.finish_reason == "error" for event in batch):
                raise _engine_error(served)
            events[i] += batch
        choices = [fmt.choice(i, e, whole=True) for i, e in enumerate(events)]
        return JSONResponse(envelope(fmt.object, choices) | {"usage": total_usage()})

    def sse(obj: dict[str, Any]) -> str:
        if include_usage:
            obj.setdefault("usage", None)
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def body() -> AsyncIterator[str]:
        try:
            for i in range(n_choices):
                opening = fmt.opening(i)
                if opening is not None:
                    yield sse(envelope(fmt.chunk_object, [opening]))
            async for i, batch in _merged(streams):
                if any(event.finish_reason == "error" for event in batch):
                    yield f"data: {json.dumps(_engine_error(served).body())}\n\n"
                    break
                if fmt.logprobs or any(event.text or event.finish_reason for event in batch):
                    yield sse(envelope(fmt.chunk_object, [fmt.choice(i, batch, whole=False)]))
            else:  # every stream ended well
                if include_usage:
                    yield sse(envelope(fmt.chunk_object, []) | {"usage": total_usage()})
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away and the response was cancelled
            for s in streams:
                s.close()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)


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
        prompts = [encode(served, prompt, "prompt")]
    elif isinstance(prompt[0], str):
        prompts = [encode(served, p, "prompt") for p in prompt]
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
    state: ServerState, ids: list[list[int]], top: int, streams: list[_Stream]
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
    request_id = f"cmpl-{uuid.uuid4().hex}"
    requested = body.max_tokens or DEFAULT_COMPLETION_TOKENS
    streams, echoes, prompt_events = [], [], None
    several = isinstance(body.prompt, list) and isinstance(body.prompt[0], str | list)
    _check_counts(
        state, len(body.prompt) if several else 1, 0, body.n, "prompt"
    )  # before tokenizing
    prompts = await state.work(_prompts, served, body.prompt, body.echo, what="tokenizing")
    _check_counts(state, len(prompts), sum(len(ids) for ids, _ in prompts), body.n, "prompt")
    for p, (ids, echo) in enumerate(prompts):
        max_tokens = _room(served, ids, requested, "prompt")
        params = protocol.to_params(body, max_tokens, body.logprobs)
        streams.append(_Stream(state, f"{request_id}-{p}", ids, params, p * body.n))
        echoes += [echo] * body.n
    await _start_all(state, streams)
    if body.echo and body.logprobs is not None:  # the prompt's tokens get logprobs too
        scored = await _scored(state, [ids for ids, _ in prompts], body.logprobs, streams)
        prompt_events = [events for events in scored for _ in range(body.n)]
    fmt = _CompletionFormat(served, echoes, body.logprobs is not None, prompt_events)
    return await _respond(request_id, created, served, streams, fmt, body.stream, include_usage)


async def _chat(state: ServerState, body: ChatRequest) -> Response:
    created = int(time.time())
    served = state.ready()
    check_model(served, body.model)
    include_usage = _check_stream_options(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    text = await chat_prompt(state, served, body.messages, body.add_generation_prompt)
    ids = await state.work(encode, served, text, "messages", what="tokenizing")
    _check_counts(state, 1, len(ids), body.n, "messages")
    max_tokens = _room(served, ids, body.max_completion_tokens or body.max_tokens, "messages")
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    params = protocol.to_params(body, max_tokens, logprobs, served.chat_template.stop)
    streams = [_Stream(state, request_id, ids, params, 0)]
    fmt = _ChatFormat(served, body.n, logprobs is not None)
    await _start_all(state, streams)
    return await _respond(request_id, created, served, streams, fmt, body.stream, include_usage)


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


# The routes' `responses=`: what they answer, in the OpenAPI document (`_openapi` adds the 400
# of a bad body, which FastAPI would call 422)
def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _object(**properties: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of an object that has (at least) these properties."""
    return {"type": "object", "required": list(properties), "properties": properties}


_INT, _STR = {"type": "integer"}, {"type": "string"}
_HEALTH = _object(status=_STR)
_MODELS = _object(
    object={"const": "list"},
    data={"type": "array", "items": _object(id=_STR, created=_INT, max_model_len=_INT)},
)
_TOKENS = _object(tokens={"type": "array", "items": _INT}, count=_INT, max_model_len=_INT)


def _completion(obj: str) -> dict[str, Any]:
    """A route's `responses=` for a completion (`object` obj) or, with stream=true, its chunks."""
    usage = _object(prompt_tokens=_INT, completion_tokens=_INT, total_tokens=_INT)
    schema = _object(
        id=_STR,
        object={"const": obj},
        created=_INT,
        model=_STR,
        choices={"type": "array", "items": _object(index=_INT, finish_reason={})},
        usage=usage,
    )
    stream = {"text/event-stream": {"schema": _STR}}
    whole = _json("the completion, or with stream=true its chunks as server-sent events", schema)
    return errors(404, 413, 429, 500, 503) | {200: whole | {"content": whole["content"] | stream}}


router = APIRouter()


@router.get(
    "/health",
    responses={200: _json("ready", _HEALTH), 503: _json("not ready, and why", _HEALTH)},
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
            "content": {CONTENT_TYPE_LATEST: {"schema": _STR}},
        }
    },
)
async def metrics(state: State) -> Response:
    content, media_type = await state.work(state.metrics.render, what="the metrics")
    return Response(content, media_type=media_type)


@router.get("/v1/models", responses=errors(503) | {200: _json("the served model", _MODELS)})
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


@router.post("/v1/completions", responses=_completion("text_completion"))
async def completions(state: State, body: CompletionRequest) -> Response:
    _log_ignored(body, "/v1/completions")
    return await _completions(state, body)


@router.post("/v1/chat/completions", responses=_completion("chat.completion"))
async def chat_completions(state: State, body: ChatRequest) -> Response:
    _log_ignored(body, "/v1/chat/completions")
    return await _chat(state, body)


@router.post("/tokenize", responses=errors(404, 503) | {200: _json("the ids", _TOKENS)})
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
    "/detokenize", responses=errors(404, 503) | {200: _json("the text", _object(prompt=_STR))}
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


def _openapi(app: FastAPI, policy: Policy) -> dict[str, Any]:
    """FastAPI's OpenAPI document, saying what the server answers: a bad body is a 400 (FastAPI
    says 422) and the policy adds its 401 and 421."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema["paths"].values():
            for operation in operations.values():
                if operation["responses"].pop("422", None) is not None:
                    operation["responses"]["400"] = error_response(ERRORS[400])
        components = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        policy.document(schema)
        app.openapi_schema = schema
    return app.openapi_schema


def create_app(
    load: Callable[[], Served],
    on_load_error: Callable[[BaseException], None] | None = None,
    grace_s: float = 30.0,
    policy: Policy | None = None,
    limits: Limits | None = None,
) -> FastAPI:
    """The app; `load()` runs in a thread at startup (GET /health is 503 until it returns).

    `policy` says which hosts it answers to and its API key (serving/security.py); without it,
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
    app.openapi = lambda: _openapi(app, policy)
    app.state.server = state
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_bytes)
    app.add_exception_handler(Exception, _on_error)
    for exc_class in (APIError, RequestValidationError, DecoderLMError, HTTPException):
        app.add_exception_handler(exc_class, _on_error)
    app.include_router(router)
    app.include_router(playground.router)
    return app
