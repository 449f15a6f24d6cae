"""The engine in a process of its own, as vLLM v1 runs its EngineCore beside the API server.

In one process the HTTP server's event loop and the engine's thread share one GIL. The engine
releases it inside every tensor operation and must take it back after each one; whenever the loop
holds it (parsing a request, writing a chunk), the engine waits and the cores idle: under HTTP
load the same forward passes took longer while the server's process used well under its cores
(benchmarks/README.md, serve.py). `EngineProcess` runs the `Engine` in a spawned child process
instead, so the two sides only share the cores.

`EngineProcess` offers the part of `Engine`'s interface that the HTTP app and `decoderlm chat`
use, `types.EngineClient`: `submit`, `stream`, `stream_batches`, `cancel`, `score`, `call`,
`stats`, `start`, `shutdown`, `max_sequence` and `failure`. The child loads the checkpoint itself (`EngineSpec`), so the weights never cross
the pipe. Messages are tuples over one `multiprocessing.Pipe`:

    parent → child: ("submit", key, request_id, ids, params) · ("cancel", request_id)
                    ("call", key, method, pickled args)  (`Engine.score`, `.call`, `.stats`)
                    ("shutdown", key, grace_s)
    child → parent: ("ready", facts) or ("failed", error) once, then lists of
                    ("event", request_id, TokenEvent) and ("result", key, ok, value)

The child sends events in batches (what accumulated while it was busy), one pickle per batch. If
the child dies, every open request ends with finish_reason "error", every waiting call raises
EngineStoppedError and `on_death(why)` is called (`decoderlm serve` then exits non-zero, for its
supervisor to restart it). `stats` waits at most STATS_TIMEOUT_S for a child that is busy or
stopped.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from decoderlm.cpu.heap import freeze_startup_objects
from decoderlm.engine.engine import Engine
from decoderlm.engine.streams import one_by_one, stream_batches
from decoderlm.engine.types import EngineStats, EngineStoppedError, RequestParams, Sink, TokenEvent
from decoderlm.errors import DecoderLMError

log = logging.getLogger(__name__)
REPLY_TIMEOUT_S = 60.0  # a submit or call the child has not answered by then fails
STATS_TIMEOUT_S = 2.0  # a stats the child has not answered by then fails


@dataclass(frozen=True)
class EngineSpec:
    """What the child needs to build its engine: a checkpoint, its dtype, `Engine`'s options."""

    checkpoint: str
    dtype: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)  # Engine(**engine) keywords
    matmul_precision: str = "highest"  # torch.set_float32_matmul_precision in the child
    threads: int | None = None  # torch intra-op threads in the child (None: torch's default)


@dataclass(frozen=True)
class EngineFacts:
    """What the child reports once loaded: the tokenizer and the sizes the app needs (vocab_size:
    the ids a prompt may hold, those the tokenizer decodes)."""

    tokenizer: Any
    max_sequence: int
    vocab_size: int


class EngineProcess:
    """An `Engine` in a child process; see the module docstring. `start()` spawns it and waits
    until it has loaded (raising DecoderLMError if loading failed)."""

    def __init__(self, spec: EngineSpec, on_death: Callable[[str], None] | None = None) -> None:
        """on_death(why): called (from the reader thread) if the child dies unasked."""
        self.spec, self.on_death = spec, on_death
        self.facts: EngineFacts | None = None
        self._conn: Any = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._keys = itertools.count()
        self._replies: dict[int, concurrent.futures.Future[Any]] = {}
        self._sinks: dict[str, tuple[Sink, set[int]]] = {}  # request id → sink, open indices
        self._dead: str | None = None  # why the child is gone
        self._final_stats: EngineStats | None = None  # what its engine reported at shutdown
        self._shutting_down = False

    @property
    def max_sequence(self) -> int:
        return self._loaded().max_sequence

    @property
    def failure(self) -> str | None:
        """Why the engine stopped by itself (the child died), as `Engine.failure`; else None."""
        return None if self._shutting_down else self._dead

    # Life.

    def start(self) -> None:
        """Spawn the child and wait until its engine is ready (idempotent)."""
        with self._lock:
            if self._process is not None:
                return
            context = multiprocessing.get_context("spawn")  # no fork of a process with threads
            parent, child = context.Pipe()
            self._process = context.Process(
                target=_child_main, args=(self.spec, child), name="decoderlm-engine", daemon=True
            )
            self._process.start()
            child.close()
            self._conn = parent
        try:
            kind, payload = parent.recv()
        except EOFError:
            kind, payload = "failed", "the engine process exited while loading"
        if kind == "failed":
            self._process.join()
            self._dead = payload
            raise DecoderLMError(payload)
        self.facts = payload
        self._reader = threading.Thread(target=self._read, name="decoderlm-engine-reader")
        self._reader.daemon = True
        self._reader.start()

    def shutdown(self, grace_s: float = 10.0) -> None:
        """`Engine.shutdown(grace_s)` in the child, then wait for it to exit."""
        if self._process is None:
            return
        self._shutting_down = True
        if self._dead is None:
            with contextlib.suppress(EngineStoppedError):
                timeout = grace_s + REPLY_TIMEOUT_S
                self._final_stats = self._request("shutdown", grace_s, timeout=timeout)
        self._process.join(timeout=REPLY_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        if self._reader is not None:
            self._reader.join()

    # Requests: as `Engine`'s.

    def submit(
        self,
        prompt: str | list[int],
        params: RequestParams,
        *,
        request_id: str | None = None,
        on_event: Sink,
    ) -> str:
        """`Engine.submit`: raises its errors (QueueFullError, DecoderLMError) here."""
        request_id = uuid.uuid4().hex if request_id is None else request_id
        with self._lock:
            if request_id in self._sinks:
                raise DecoderLMError(f"request_id={request_id!r} is already running")
            self._sinks[request_id] = (on_event, set(range(params.n)))
        try:
            self._request("submit", request_id, prompt, params)
        except BaseException:
            with self._lock:
                self._sinks.pop(request_id, None)
            raise
        return request_id

    def stream(
        self, prompt_ids: list[int], params: RequestParams, *, request_id: str | None = None
    ) -> AsyncIterator[TokenEvent]:
        """`Engine.stream`: submit now (raising at once) and iterate the events on this loop."""
        return one_by_one(self.stream_batches(prompt_ids, params, request_id=request_id))

    def stream_batches(
        self, prompt_ids: list[int], params: RequestParams, *, request_id: str | None = None
    ) -> AsyncIterator[list[TokenEvent]]:
        """`Engine.stream_batches`: the events that have arrived, a list at a time."""
        return stream_batches(self, prompt_ids, params, request_id)

    def cancel(self, request_id: str) -> None:
        """`Engine.cancel`: the request's sequences end at the child's next step."""
        if self._dead is None:
            self._send(("cancel", request_id))

    def score(
        self, prompt: str | list[int], top: int = 0
    ) -> concurrent.futures.Future[list[TokenEvent]]:
        """`Engine.score`, computed in the child."""
        return self._future("call", "score", (prompt, top))

    def call(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """`Engine.call`: fn(engine, *args) in the child, between its steps; fn must be picklable
        (a module-level function), as must its arguments and result."""
        return self._future("call", "call", (fn, *args))  # PicklingError here if fn cannot be

    def stats(self) -> EngineStats:
        """`Engine.stats` of the child's engine (after `shutdown`, its last); EngineStoppedError
        if the child has not answered within STATS_TIMEOUT_S."""
        if self._final_stats is not None:
            return self._final_stats
        return self._request("call", "stats", (), timeout=STATS_TIMEOUT_S)

    # The pipe.

    def _loaded(self) -> EngineFacts:
        if self.facts is None:
            raise EngineStoppedError("the engine process has not started")
        return self.facts

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as exc:
            raise EngineStoppedError(f"the engine process is gone: {exc}") from None

    def _future(self, kind: str, *payload: Any) -> concurrent.futures.Future[Any]:
        """Send (kind, key, *payload) and return the Future its result will settle. A call's
        arguments travel pickled on their own, so that one the child cannot unpickle (a function
        it cannot import) fails that call, not the child's whole message loop."""
        if self._dead is not None:
            raise EngineStoppedError(self._dead)
        self._loaded()
        if kind == "call":
            method, args = payload
            payload = (method, pickle.dumps(args))
        key, future = next(self._keys), concurrent.futures.Future()
        with self._lock:
            self._replies[key] = future
        self._send((kind, key, *payload))
        return future

    def _request(self, kind: str, *payload: Any, timeout: float = REPLY_TIMEOUT_S) -> Any:
        future = self._future(kind, *payload)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise EngineStoppedError(
                f"the engine process did not answer a {kind} within {timeout:.0f} s"
            ) from None

    def _read(self) -> None:
        """The reader thread: route the child's events to their sinks, results to futures."""
        try:
            while True:
                for message in self._conn.recv():
                    if message[0] == "event":
                        self._deliver(message[1], message[2])
                    else:
                        _, key, ok, value = message
                        with self._lock:
                            future = self._replies.pop(key)
                        future.set_result(value) if ok else future.set_exception(value)
        except (EOFError, OSError):
            self._died()

    def _deliver(self, request_id: str, event: TokenEvent) -> None:
        with self._lock:
            sink, open_ = self._sinks.get(request_id, (None, set()))
            if event.finish_reason is not None:
                open_.discard(event.index)
                if not open_:
                    self._sinks.pop(request_id, None)
        if sink is not None:
            try:
                sink(event)
            except RuntimeError:  # the consumer is gone (e.g. its event loop closed)
                self.cancel(request_id)

    def _died(self) -> None:
        """The child is gone: fail what waits on it, end every open sequence with "error"."""
        self._process.join(timeout=1.0)
        code = self._process.exitcode
        with self._lock:
            self._dead = self._dead or f"the engine process has exited (exit code {code})"
            replies, self._replies = self._replies, {}
            sinks, self._sinks = self._sinks, {}
        for future in replies.values():
            future.set_exception(EngineStoppedError(self._dead))
        for sink, open_ in sinks.values():
            for index in sorted(open_):
                with contextlib.suppress(RuntimeError):
                    sink(TokenEvent(None, "", finish_reason="error", index=index))
        if code not in (0, None):
            log.error("decoderlm serve: %s", self._dead)
        if not self._shutting_down and self.on_death is not None:
            self.on_death(self._dead)


def build_engine(spec: EngineSpec) -> Engine:
    """The (not yet started) `Engine` of `spec`, in this process: what the child runs, and what
    `decoderlm serve --engine thread` serves."""
    from decoderlm.inference.speculative import PROMPT_LOOKUP
    from decoderlm.loading import load, load_draft

    if spec.threads:
        torch.set_num_threads(spec.threads)
    torch.set_float32_matmul_precision(spec.matmul_precision)
    model, tokenizer = load(spec.checkpoint, dtype=spec.dtype)
    if tokenizer is None:
        raise DecoderLMError(f"{spec.checkpoint} has no tokenizer.json, so text cannot be encoded")
    options = dict(spec.engine)
    if options.get("draft") not in (None, PROMPT_LOOKUP):  # a draft model's directory
        options["draft"] = load_draft(options["draft"], model, tokenizer, spec.dtype)
    return Engine(model, tokenizer, **options)


def build_engine_thread(spec: EngineSpec) -> Engine:
    """`build_engine(spec)` on a thread of its own that then steps it (`Engine.run`), so that the
    thread that loaded the model is the one that runs it (see `engine.Engine`); returns the
    running engine, or raises what building it raised. What `decoderlm serve --engine thread`
    serves."""
    built: concurrent.futures.Future[Engine] = concurrent.futures.Future()

    def main() -> None:
        try:
            engine = build_engine(spec)
        except BaseException as exc:
            built.set_exception(exc)
            return
        engine.run(started=lambda: built.set_result(engine))

    threading.Thread(target=main, name="decoderlm-engine", daemon=True).start()
    return built.result()


def _child_main(spec: EngineSpec, conn: Any) -> None:
    """The child: load, report, then serve the parent's messages until shutdown or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when the engine stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = build_engine(spec)
    except Exception as exc:
        conn.send(("failed", str(exc) if isinstance(exc, DecoderLMError) else repr(exc)))
        return
    vocab_size = engine.inputs.vocab_size
    freeze_startup_objects()
    conn.send(("ready", EngineFacts(engine.tokenizer, engine.max_sequence, vocab_size)))
    outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
    sender = threading.Thread(target=_send_batches, args=(conn, outbox), daemon=True)
    sender.start()
    reader = threading.Thread(target=_read_messages, args=(engine, conn, outbox), daemon=True)
    reader.start()
    engine.run()  # steps on this thread, which loaded the model (see `engine.Engine`)
    reader.join()
    outbox.put(None)
    sender.join()


def _read_messages(engine: Engine, conn: Any, outbox: queue.SimpleQueue) -> None:
    """The child's reader thread: the parent's messages until shutdown or EOF, which stop the
    engine (and so the main thread's loop)."""
    try:
        while True:
            message = conn.recv()
            if message[0] == "cancel":
                engine.cancel(message[1])
                continue
            key = message[1]
            if message[0] == "shutdown":
                engine.shutdown(message[2])
                outbox.put(("result", key, True, engine.stats()))
                return
            _answer(engine, message, outbox)
    except EOFError:  # the parent is gone
        engine.shutdown(0)


def _answer(engine: Engine, message: tuple, outbox: queue.SimpleQueue) -> None:
    """Run a submit or a call on the child's engine; its result (or error) goes to the outbox."""
    kind, key = message[0], message[1]
    try:
        if kind == "submit":
            request_id, prompt, params = message[2:]

            def sink(event: TokenEvent, request_id: str = request_id) -> None:
                outbox.put(("event", request_id, event))

            result: Any = engine.submit(prompt, params, request_id=request_id, on_event=sink)
        else:
            method, args = message[2], pickle.loads(message[3])
            result = getattr(engine, method)(*args)
    except Exception as exc:
        outbox.put(("result", key, False, exc))
        return
    if isinstance(result, concurrent.futures.Future):
        result.add_done_callback(lambda done: outbox.put(_settled(key, done)))
    else:
        outbox.put(("result", key, True, result))


def _settled(key: int, done: concurrent.futures.Future) -> tuple:
    exc = done.exception()
    return ("result", key, exc is None, exc if exc is not None else done.result())


def _send_batches(conn: Any, outbox: queue.SimpleQueue) -> None:
    """The child's sender thread: everything in the outbox, one pickle per batch; None stops it."""
    while True:
        batch = [outbox.get()]
        while not outbox.empty():
            batch.append(outbox.get())
        stop = None in batch
        batch = [message for message in batch if message is not None]
        if batch:
            try:
                conn.send(batch)
            except (OSError, ValueError):
                return
            except Exception:  # a result that does not pickle: that call fails, the rest go
                for message in batch:
                    if not _send_one(conn, message):
                        return
        if stop:
            return


def _send_one(conn: Any, message: tuple) -> bool:
    """Send one message, a result that does not pickle as its error; False once the pipe is gone."""
    try:
        conn.send([message])
    except (OSError, ValueError):
        return False
    except Exception as exc:
        error = DecoderLMError(f"the engine's answer cannot be sent back: {exc!r}")
        return message[0] != "result" or _send_one(conn, ("result", message[1], False, error))
    return True
