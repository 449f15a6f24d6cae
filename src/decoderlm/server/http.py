"""What the HTTP routers share (the OpenAI API in `app`, the playground in `playground`): the served
model, the server's state, OpenAI-shaped errors and the checks and encodings of request fields.

Each router reads the server's state through the `State` dependency, the `ServerState` that
`app.create_app` puts in `app.state.server`. Tokenizing and chat templates run off the event loop
(`limits.Offload`), within the server's `Limits`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from decoderlm.chat_template import ChatTemplate, TemplateRenderError
from decoderlm.engine.types import EngineClient, EngineStats
from decoderlm.errors import DecoderLMError
from decoderlm.server import protocol
from decoderlm.server.limits import Limits, Offload
from decoderlm.server.metrics import Metrics
from decoderlm.server.protocol import TokenizeRequest

log = logging.getLogger("decoderlm.serve")


@dataclass
class Served:
    """What the app serves, once loaded: an engine (started by the app) and how to talk to it."""

    engine: EngineClient
    tokenizer: Any
    model_name: str
    context_length: int
    vocab_size: int
    chat_template: ChatTemplate = field(default_factory=ChatTemplate)
    # what a request that leaves a sampling field out gets: the model's generation config's
    # (`decoderlm serve --generation-config auto`), or none (`vllm`)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )
        self.headers = retry_headers(status) | (headers or {})

    def body(self) -> dict[str, Any]:
        """OpenAI's error JSON."""
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": error}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def retry_headers(status: int) -> dict[str, str]:
    """The headers of an APIError of this status: a 429 or 503 tells the client to retry."""
    return {"Retry-After": "1"} if status in (429, 503) else {}


class ServerState:
    """The app's life: loading → serving → draining; and the work in flight, which a drain lets
    finish for its grace period and then cancels: each engine request a response streams, and each
    beam search (serving/beams.py), whose engine requests the search submits step by step."""

    def __init__(
        self,
        load: Callable[[], Served],
        on_load_error: Callable[[BaseException], None] | None,
        limits: Limits,
    ) -> None:
        self.load, self.on_load_error, self.limits = load, on_load_error, limits
        self.served: Served | None = None
        self.error: str | None = None
        self.draining = False
        self.inflight: dict[str, Callable[[], None]] = {}  # request id → how to cancel it
        self.loop: asyncio.AbstractEventLoop | None = None
        self.offload = Offload(limits.work_threads)
        self.metrics = Metrics(lambda: self.served.engine.stats() if self.served else None)

    async def work(self, fn: Callable[..., Any], *args: Any, what: str = "the request") -> Any:
        """fn(*args) off the event loop, within the limits' work_timeout_s."""
        return await self.offload.run(self.limits.work_timeout_s, what, fn, *args)

    async def stats(self) -> EngineStats:
        """The engine's stats, asked off the event loop (a stopped engine cannot block it)."""
        return await self.work(self.ready().engine.stats, what="the engine's stats")

    async def start(self) -> None:
        try:
            served = await asyncio.to_thread(self.load)
            served.engine.start()
        except Exception as exc:
            self.error = f"loading failed: {exc}"
            log.error("decoderlm serve: %s", self.error)
            if self.on_load_error is not None:
                self.on_load_error(exc)
            return
        self.served = served

    def ready(self) -> Served:
        if self.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable")
        if self.served is None:
            raise APIError(503, self.error or "the model is loading", "service_unavailable")
        if self.served.engine.failure is not None:
            message = f"the engine has stopped: {self.served.engine.failure}"
            raise APIError(503, message, "service_unavailable")
        return self.served

    def drain(self, grace_s: float) -> None:
        """Refuse new requests; after grace_s seconds cancel those still running."""
        self.draining = True
        asyncio.get_running_loop().call_later(grace_s, self.cancel_all)

    def cancel_all(self) -> None:
        for cancel in list(self.inflight.values()):
            cancel()


def _server_state(request: Request) -> ServerState:
    return request.app.state.server


State = Annotated[ServerState, Depends(_server_state)]  # a route's parameter: the server's state


def check_model(served: Served, model: str | None) -> None:
    if model is not None and model != served.model_name:
        raise APIError(
            404,
            f"model {model!r} is not served here; this server serves {served.model_name!r}",
            param="model",
            code="model_not_found",
        )


def encode(served: Served, text: str, param: str, completion: bool = False) -> list[int]:
    """The token ids of a text (blocking: tokenizes; run it with `ServerState.work`); a
    completion prompt's with the tokenizer's template (a BOS where the model adds one), a chat
    template's text as it is."""
    try:
        ids = (served.tokenizer.encode_prompt if completion else served.tokenizer.encode)(text)
    except DecoderLMError as exc:
        raise APIError(400, str(exc), param=param) from None
    if not ids:
        raise APIError(400, f"{param} is empty: give at least one token", param=param)
    return ids


async def chat_prompt(
    state: ServerState, served: Served, messages: list[protocol.ChatMessage], generation: bool
) -> str:
    """The chat template's prompt for `messages`, rendered off the loop within the limits."""
    limits = state.limits
    render = functools.partial(
        served.chat_template.render,
        [m.as_dict() for m in messages],
        generation,
        max_chars=limits.max_template_chars,
        timeout_s=limits.template_timeout_s,
    )
    try:
        return await state.work(render, what="rendering the chat template")
    except TemplateRenderError as exc:
        raise APIError(400, str(exc), param="messages") from None


async def request_text(state: ServerState, served: Served, body: TokenizeRequest) -> str:
    """The text of a body with exactly one of prompt and messages (rendered by the chat template)."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        return await chat_prompt(state, served, body.messages, body.add_generation_prompt)
    return body.prompt
