"""What one request may cost the server, bounded before any work is done for it.

`Limits` holds the bounds (`decoderlm serve` flags): body bytes, prompts per request, prompt
tokens per request (summed over prompts, times n) and a chat template's rendered size and time.
`BodySizeLimit` is the ASGI middleware that refuses a body over `max_request_bytes` with 413 in
OpenAI's error shape, by its Content-Length before reading it, and by counting the bytes of a
chunked one as they arrive. `Offload` runs the blocking parts of a request (tokenizing, rendering
a template, waiting on the engine) on a small pool of threads with a timeout, off the event loop,
so that no request can stall the others or /health.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from decoderlm.errors import DecoderLMError

T = TypeVar("T")
MiB = 2**20


@dataclass(frozen=True)
class Limits:
    """The most one request may ask for; see the module docstring."""

    max_request_bytes: int = 8 * MiB
    max_prompts_per_request: int = 256
    max_tokens_per_request: int = 2**18  # prompt tokens, summed over prompts, times n
    max_template_chars: int = 4 * MiB  # a rendered chat template's characters
    template_timeout_s: float = 2.0  # a chat template's rendering
    work_timeout_s: float = 60.0  # tokenizing one request's prompts, waiting on an engine call
    work_threads: int = 4  # threads that tokenize and render, off the event loop

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_prompts_per_request", "max_tokens_per_request",
                     "max_template_chars", "work_threads"):  # fmt: skip
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise DecoderLMError(f"{name}={value!r} must be an integer ≥ 1")
        for name in ("template_timeout_s", "work_timeout_s"):
            if not getattr(self, name) > 0:
                raise DecoderLMError(f"{name}={getattr(self, name)!r} must be > 0")


class RequestTooLarge(HTTPException):
    """A body over the limit: 413 (an HTTPException, so that FastAPI's body reading passes it on)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body is larger than the server's limit of "
                         f"{max_bytes} bytes (decoderlm serve --max-request-bytes)")  # fmt: skip


def error_body(status: int, message: str) -> bytes:
    """OpenAI's error JSON."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    error = {"message": message, "type": kind, "param": None, "code": None}
    return json.dumps({"error": error}).encode()


class BodySizeLimit:
    """ASGI middleware: 413 for a request body over `max_bytes`, before it is read whole."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(send)
            return
        received, started = 0, False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise RequestTooLarge(self.max_bytes)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except RequestTooLarge:
            if started:
                raise
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = error_body(413, RequestTooLarge(self.max_bytes).detail)
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]  # fmt: skip
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class Offload:
    """Blocking work off the event loop, on `threads` threads, each piece bounded in time: a piece
    that overruns raises `WorkTimeout` (its thread finishes it, unwatched)."""

    def __init__(self, threads: int) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, "decoderlm-work")

    async def run(self, timeout_s: float, what: str, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.pool, functools.partial(fn, *args))
        return await wait(future, timeout_s, what)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class WorkTimeout(Exception):
    """A request's work overran its time (HTTP 503)."""


async def wait(awaitable: Any, timeout_s: float, what: str) -> Any:
    """`awaitable`'s result, or WorkTimeout naming `what` after timeout_s seconds."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        raise WorkTimeout(f"{what} took longer than {timeout_s:g} s") from None
