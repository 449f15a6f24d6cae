"""A request's engine streams → an OpenAI response: one JSON body, or server-sent events.

Each choice of a request (n per prompt) is one engine stream (`RequestStream`) whose events are
timed for the TTFT and ITL histograms; `merged` interleaves a request's streams as their events
arrive; `CompletionFormat` and `ChatFormat` shape a choice's JSON; `respond` assembles the whole
response, or the SSE chunks `data: {json}\n\n` ending with `data: [DONE]\n\n`, as OpenAI's clients
parse them. A stream that fails after it started ends with `data: {"error": {...}}`, then
`data: [DONE]`; a client that goes away cancels its streams.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from decoderlm.engine.streams import stream_batches
from decoderlm.engine.types import RequestParams, TokenEvent
from decoderlm.server import protocol
from decoderlm.server.http import APIError, Served, ServerState


class RequestStream:
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
        self.state.inflight[self.request_id] = functools.partial(engine.cancel, self.request_id)
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
        self.state.inflight.pop(self.request_id, None)

    def close(self) -> None:
        """Cancel the engine's sequences unless they ended by themselves."""
        if not self.finished and self.request_id in self.state.inflight:
            self.state.served.engine.cancel(self.request_id)
        self.state.inflight.pop(self.request_id, None)


async def start_all(state: ServerState, streams: list[RequestStream]) -> None:
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


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, list[TokenEvent]]]:
    """(choice, events) from all streams as they come; cancels what is left when it is closed."""
    queue: asyncio.Queue[tuple[int, list[TokenEvent]] | BaseException | None] = asyncio.Queue()

    async def pump(s: RequestStream) -> None:
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


class Format:
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


class CompletionFormat(Format):
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
            "stop_reason": events[-1].stop_reason if events else None,
        }


class ChatFormat(Format):
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
            "stop_reason": events[-1].stop_reason if events else None,
        }


def engine_error(served: Served) -> APIError:
    """The error of a request whose sequence ended with finish_reason "error"."""
    if served.engine.failure is not None:
        message = f"the engine has stopped: {served.engine.failure}"
        return APIError(503, message, "service_unavailable")
    message = "the engine failed on this request; see the server log"
    return APIError(500, message, "server_error")


def envelope(
    request_id: str, created: int, served: Served, obj: str, choices: list[dict[str, Any]]
) -> dict[str, Any]:
    """A response's (or a chunk's) JSON around its choices."""
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": served.model_name,
        "choices": choices,
    }


def streams_usage(streams: list[RequestStream]) -> dict[str, int]:
    """Usage: each stream's prompt, and every token its sequences generated."""
    prompt_tokens = sum(len(s.prompt_ids) for s in streams)
    return protocol.usage(prompt_tokens, sum(s.n_tokens for s in streams))


async def collect(served: Served, streams: list[RequestStream]) -> list[list[TokenEvent]]:
    """Every choice's events, once all the streams have ended; the request's error if the engine
    failed on one."""
    events: list[list[TokenEvent]] = [[] for _ in range(sum(s.params.n for s in streams))]
    async for i, batch in merged(streams):
        if any(event.finish_reason == "error" for event in batch):
            raise engine_error(served)
        events[i] += batch
    return events


async def respond(
    request_id: str,
    created: int,
    served: Served,
    streams: list[RequestStream],
    fmt: Format,
    stream: bool,
    include_usage: bool,
) -> Response:
    """The response of a request whose streams have started."""
    n_choices = sum(s.params.n for s in streams)

    if not stream:
        events = await collect(served, streams)
        choices = [fmt.choice(i, e, whole=True) for i, e in enumerate(events)]
        whole = envelope(request_id, created, served, fmt.object, choices)
        return JSONResponse(whole | {"usage": streams_usage(streams)})

    def sse(obj: dict[str, Any]) -> str:
        if include_usage:
            obj.setdefault("usage", None)
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return envelope(request_id, created, served, fmt.chunk_object, choices)

    async def body() -> AsyncIterator[str]:
        try:
            for i in range(n_choices):
                opening = fmt.opening(i)
                if opening is not None:
                    yield sse(chunk([opening]))
            async for i, batch in merged(streams):
                if any(event.finish_reason == "error" for event in batch):
                    yield f"data: {json.dumps(engine_error(served).body())}\n\n"
                    break
                if fmt.logprobs or any(event.text or event.finish_reason for event in batch):
                    yield sse(chunk([fmt.choice(i, batch, whole=False)]))
            else:  # every stream ended well
                if include_usage:
                    yield sse(chunk([]) | {"usage": streams_usage(streams)})
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away and the response was cancelled
            for s in streams:
                s.close()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
