"""The asyncio side of an engine's events: a request's `TokenEvent`s, posted from the engine's
thread (or `EngineProcess`'s reader thread), as async iterators on an event loop, after vLLM's
AsyncLLM output collector; and `Collector`, which gathers them into `Completion`s for
`Engine.generate`.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import weakref
from collections.abc import AsyncIterator

from decoderlm.engine.types import Completion, EngineClient, RequestParams, TokenEvent


class _Mailbox:
    """Events bound for one event loop's queues, posted from other threads: one
    `call_soon_threadsafe` wakes the loop for all the events posted before it runs (a step's
    tokens for every stream), not one wake-up per event."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[tuple[asyncio.Queue[TokenEvent], TokenEvent]] = []

    def post(self, events: asyncio.Queue[TokenEvent], event: TokenEvent) -> None:
        with self.lock:
            self.pending.append((events, event))
            wake = len(self.pending) == 1  # else a wake-up is already on its way
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._hand_over)
            except RuntimeError:  # the loop is closed: the sink's caller cancels the request
                with self.lock:
                    self.pending.clear()
                raise

    def _hand_over(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, []
        for events, event in pending:
            events.put_nowait(event)


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = (
    weakref.WeakKeyDictionary()
)


def stream_batches(
    engine: EngineClient,
    prompt_ids: list[int],
    params: RequestParams,
    request_id: str | None,
    loop: asyncio.AbstractEventLoop | None = None,
) -> AsyncIterator[list[TokenEvent]]:
    """One request's events as lists, for an engine here or in another process
    (`engine_process.EngineProcess`): submit through `engine.submit` with a sink onto this event
    loop, then yield, each time the consumer asks, every event that has arrived (at least one), so
    a consumer slower than the engine takes several steps' tokens at once, as vLLM's output
    collector merges them. Leaving early calls `engine.cancel`. The events go to `loop` (by
    default the running one: give it to submit from another thread)."""
    loop = asyncio.get_running_loop() if loop is None else loop
    mailbox = _mailboxes.get(loop) or _mailboxes.setdefault(loop, _Mailbox(loop))
    events: asyncio.Queue[TokenEvent] = asyncio.Queue()
    sink = functools.partial(mailbox.post, events)
    request_id = engine.submit(prompt_ids, params, request_id=request_id, on_event=sink)

    async def iterate(open_: int) -> AsyncIterator[list[TokenEvent]]:
        try:
            while open_:
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                open_ -= sum(event.finish_reason is not None for event in batch)
                yield batch
        finally:
            if open_:
                engine.cancel(request_id)

    return iterate(params.n)


async def one_by_one(batches: AsyncIterator[list[TokenEvent]]) -> AsyncIterator[TokenEvent]:
    """The events of `stream_batches`, one at a time (`stream`); leaving early cancels too."""
    try:
        async for batch in batches:
            for event in batch:
                yield event
    finally:
        await batches.aclose()


class Collector:
    """Gathers one prompt's events into `Completion`s for `Engine.generate`."""

    def __init__(self, params: RequestParams, done: queue.SimpleQueue[None]) -> None:
        self.prompt_ids: list[int] = []
        self.events: list[list[TokenEvent]] = [[] for _ in range(params.n)]
        self.open, self.done, self.logprobs = params.n, done, params.logprobs is not None

    def add(self, event: TokenEvent) -> None:
        self.events[event.index].append(event)
        if event.finish_reason is not None:
            self.open -= 1
            if self.open == 0:
                self.done.put(None)

    def completions(self) -> list[Completion]:
        result = []
        for events in self.events:
            tokens = [e for e in events if e.token_id is not None]
            result.append(
                Completion(
                    self.prompt_ids,
                    [e.token_id for e in tokens],
                    "".join(e.text for e in events),
                    events[-1].finish_reason,
                    [e.logprob for e in tokens] if self.logprobs else None,
                    [e.top_logprobs for e in tokens] if self.logprobs else None,
                )
            )
        return result
