"""A continuous-batching inference engine over a paged KV pool, after vLLM's LLMEngine (Kwon et al.,
2023, "Efficient Memory Management for LLM Serving with PagedAttention").

`Engine` is the thread-safe front: requests in, events out to each request's sink, the background
thread and shutdown. Each of its `step`s runs one step of its `EngineCore` (`core`: schedule →
run → sample → output over typed passes, `passes`): the decoding sequences' pass, then the planned
prefill chunks, each pass one `runner.ModelRunner.forward` (the only part that runs the model);
the logits become tokens in `sampler.sample` (or `sampler.verify` for speculative drafts) and
tokens become `TokenEvent`s in `output.SequenceOutput`. Every sequence samples with its own
`SamplingParams` and `torch.Generator` and is detokenized by its own `IncrementalDecoder` and
`StopMatcher`, so a request's tokens do not depend on what else runs: greedy requests equal
`decoderlm.generate` on their prompt alone, up to floating-point rounding of the batched kernels.

With `draft="prompt-lookup"` or a draft model, each decoding sequence proposes up to K tokens a
step through its `proposers.Proposer` (K adapted per sequence), verified in the decoding pass.

Use it offline with `generate`, or `start()` a background thread that steps while there is work
(or `run()` that loop on the calling thread) and consume `stream(...)` from asyncio (`streams`).
Step on the thread that built the model where you can: PyTorch's OpenMP threads belong to the
first thread that ran a parallel operator, and another thread's operators then ran 2-4× slower
(measured: a 1 × 576 × 1536 float32 product, 32 µs on the loading thread, 120 µs on another, on 2
cores; the engine process steps on its main thread, `engine_process.build_engine_thread` on the
thread that built it). Submitting, cancelling and stats are
thread-safe; cancels take effect at the next step. A forward pass or a sampling step that raises
ends the sequences it was for with finish_reason "error" (logged) and the engine goes on with the
others.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from decoderlm.cpu.paths import SpeedPaths
from decoderlm.engine.core import EngineCore, Request
from decoderlm.engine.inputs import InputProcessor
from decoderlm.engine.proposers import (
    DraftModel,
    PromptLookup,
    Proposer,
    check_draft,
    split_kv_budget,
)
from decoderlm.engine.runner import ModelRunner
from decoderlm.engine.scheduler import Sequence
from decoderlm.engine.state_pool import check_engine_options
from decoderlm.engine.streams import Collector, one_by_one, stream_batches
from decoderlm.engine.types import (
    Completion,
    EngineStats,
    EngineStoppedError,
    QueueFullError,
    RequestParams,
    Sink,
    TokenEvent,
)
from decoderlm.errors import DecoderLMError
from decoderlm.inference.speculative import DEFAULT_NUM_SPECULATIVE_TOKENS, PROMPT_LOOKUP
from decoderlm.model.cache import check_kv_cache_dtype
from decoderlm.model.lm import DecoderLM


class Engine:
    """Serve `model` to many requests at once; see the module docstring."""

    def __init__(
        self,
        model: DecoderLM,
        tokenizer: Any,
        *,
        kv_cache_memory: int | str = "256MiB",
        block_size: int = 16,
        max_queue: int = 64,
        prefill_chunk: int = 128,
        max_batched_tokens: int = 2048,
        prefix_caching: bool = True,
        kv_cache_dtype: str | None = None,
        cpu_kernels: bool | SpeedPaths = True,
        draft: str | DecoderLM | None = None,
        num_speculative_tokens: int | None = None,
        compile: bool = False,
        batch_invariant: bool = False,
    ) -> None:
        """kv_cache_memory, kv_cache_dtype, cpu_kernels (its CPU speed paths): the KV pool and the model's kernels, as
        `ModelRunner` takes them; max_queue: the most sequences waiting; prefill_chunk: the most
        prompt tokens of one sequence one step runs; max_batched_tokens: the most tokens one step
        runs, decodes first, never less than a chunk of prefill (`Scheduler`; a step's chunks run
        in one pass, `ModelRunner`'s segments; 2048 is vLLM's default for its CPU server, and served
        SmolLM2-135M's TTFT p99 and throughput at 16 and 64 streams best of 512, 1024 and 2048:
        benchmarks/README.md); prefix_caching: reuse the KV blocks of a shared
        prefix (off for a model with recurrent layers, and `draft` refused: `state_pool`);
        draft "prompt-lookup" or a draft model (a DecoderLM with `model`'s vocabulary): speculative
        decoding, each decoding sequence proposing `num_speculative_tokens` (default 4) tokens per
        step, all verified in one target pass (`decoderlm.inference.speculative`; the same tokens
        for greedy requests, the same distribution for sampled ones). A draft model's KV pool
        comes out of `kv_cache_memory` too: both pools get the same number of blocks
        (`proposers.split_kv_budget`); compile: the decode and verification passes of the target
        (and of a draft model) compiled ahead of time (`ModelRunner`'s `compile`), made now;
        batch_invariant: a request's tokens the same alone or among any others, bit for bit, in
        bfloat16 too (`ModelRunner`'s `batch_invariant`: float linears in a fixed summation order,
        a GGUF file's block linears in one arithmetic at every number of rows, every pass through
        the in-place attention kernel; with compile, decode passes by a
        library that calls the same kernels)."""
        check_kv_cache_dtype(kv_cache_dtype)
        check_engine_options(model.config, draft)
        for name, value in (
            ("block_size", block_size),
            ("max_queue", max_queue),
            ("prefill_chunk", prefill_chunk),
            ("max_batched_tokens", max_batched_tokens),
        ):
            _positive_int(name, value)
        self.model, self.tokenizer, self.max_queue = model, tokenizer, max_queue
        self.max_sequence = model.config.context_length  # tokens per sequence
        k = _speculative_tokens(draft, num_speculative_tokens)
        pools = dict(
            block_size=block_size,
            kv_cache_dtype=kv_cache_dtype,
            cpu_kernels=cpu_kernels,
            batch_invariant=batch_invariant,
        )
        self.runner, proposer = _runner_and_proposer(
            model, draft, k, kv_cache_memory, pools, compile
        )
        self.core = EngineCore(
            tokenizer,
            self.runner,
            block_size,
            prefill_chunk,
            prefix_caching,
            max_batched_tokens,
            proposer,
            k,
        )
        self.inputs = InputProcessor(  # prompts hold only ids the tokenizer can decode
            tokenizer,
            self.core.decodable,
            self.max_sequence,
            block_size,
            # the blocks one sequence may hold: beside its state's pages, without the scratch block
            self.runner.budget.sequence_blocks - (self.runner.num_blocks - self.runner.pool_blocks),
            max_queue,
        )
        self._lock = threading.Condition()  # guards everything below, and the core
        self._cancels: list[Sequence] = []
        self._calls: list[tuple[Callable[..., Any], tuple, concurrent.futures.Future]] = []
        self._thread: threading.Thread | None = None  # the thread that steps (`start`, `run`)
        self._loop_done = threading.Event()
        self._closed = self._stopping = False
        self.failure: str | None = None  # why the engine stopped by itself, if it did

    # Requests.

    def submit(
        self,
        prompt: str | list[int],
        params: RequestParams,
        *,
        request_id: str | None = None,
        on_event: Sink,
    ) -> str:
        """Queue a request; `on_event` gets its `TokenEvent`s (from the thread that steps).

        Returns the request id. Raises QueueFullError when the waiting queue cannot take its
        `params.n` sequences, and DecoderLMError for a bad prompt or one that cannot fit the pool.
        """
        ids = self.inputs.prompt_ids(prompt)
        max_len = self.inputs.max_len(ids, params)
        grammar = self.inputs.grammar(params)
        request_id = uuid.uuid4().hex if request_id is None else request_id
        with self._lock:
            if self._closed:
                raise EngineStoppedError("the engine is shutting down and takes no new requests")
            if request_id in self.core.requests:
                raise DecoderLMError(f"request_id={request_id!r} is already running")
            if len(self.core.scheduler.waiting) + params.n > self.max_queue:
                raise QueueFullError(
                    f"the engine's waiting queue is full ({self.max_queue} sequences); retry later"
                )
            request = Request(request_id, on_event, n_open=params.n)
            events = self.core.add(request, params, ids, max_len, grammar)
            self._lock.notify_all()
        self._deliver(events)
        return request_id

    def cancel(self, request_id: str) -> None:
        """End a request's sequences at the next step (finish_reason "cancelled"); unknown ids are ignored."""
        with self._lock:
            request = self.core.requests.get(request_id)
            self._cancels.extend(request.seqs if request is not None else ())
            self._lock.notify_all()

    def score(
        self, prompt: str | list[int], top: int = 0
    ) -> concurrent.futures.Future[list[TokenEvent]]:
        """The prompt's own tokens as events, what `echo` with `logprobs` reports: token 0 has no
        logprob (nothing precedes it), token t has log p(token t | tokens < t) and the `top`
        likeliest tokens at t. The engine's thread computes them before one of its steps (`call`), in
        one forward pass over the prompt outside the batch and the KV pool. Thread-safe."""
        ids = self.inputs.prompt_ids(prompt)
        if not (isinstance(top, int) and not isinstance(top, bool) and top >= 0):
            raise DecoderLMError(f"top={top!r} must be an integer ≥ 0")
        return self.call(_prompt_events, ids, top)

    def call(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """fn(self, *args) on the engine's thread before one of its next steps, so that it never
        runs the model at the same time as a step (the playground's attention maps, `score`); its
        result or exception goes to the returned Future. Each step runs at most one call, so that
        many calls (a request's prompts to score) take turns with the running sequences' steps.
        Thread-safe; starts the thread."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise EngineStoppedError("the engine is shutting down; retry on another server")
            self._calls.append((fn, args, future))
            self._lock.notify_all()
        self.start()
        return future

    def generate(self, prompts: list[str | list[int]], params: RequestParams) -> list[Completion]:
        """Run a batch to the end: `params.n` completions per prompt, in prompt order.

        Steps the engine on this thread, or waits for the background thread if it was started.
        """
        done: queue.SimpleQueue[None] = queue.SimpleQueue()
        collectors = [Collector(params, done) for _ in prompts]
        todo, finished = deque(zip(prompts, collectors, strict=True)), 0
        while finished < len(prompts):
            while todo:
                prompt, collector = todo[0]
                collector.prompt_ids = self.inputs.prompt_ids(prompt)
                try:
                    self.submit(collector.prompt_ids, params, on_event=collector.add)
                except QueueFullError:
                    break
                todo.popleft()
            if self._thread is None:
                self.step()
            else:
                done.get()
                finished += 1
            while not done.empty():
                done.get()
                finished += 1
        return [completion for c in collectors for completion in c.completions()]

    def stream(
        self, prompt_ids: list[int], params: RequestParams, *, request_id: str | None = None
    ) -> AsyncIterator[TokenEvent]:
        """Submit now (raising QueueFullError at once) and return the request's events as an async
        iterator; call it on the event loop. Leaving the iteration early cancels the request.
        Starts the background thread if it is not running."""
        return one_by_one(self.stream_batches(prompt_ids, params, request_id=request_id))

    def stream_batches(
        self, prompt_ids: list[int], params: RequestParams, *, request_id: str | None = None
    ) -> AsyncIterator[list[TokenEvent]]:
        """`stream` that yields every event that has arrived at once (`streams.stream_batches`)."""
        batches = stream_batches(self, prompt_ids, params, request_id)
        self.start()
        return batches

    # The background thread.

    def start(self) -> None:
        """Step on a background thread whenever there is work (idempotent)."""
        with self._lock:
            if self._thread is not None or self._stopping:
                return
            self._thread = threading.Thread(target=self._loop, name="decoderlm-engine", daemon=True)
            self._thread.start()

    def run(self, started: Callable[[], None] | None = None) -> None:
        """`start()`'s loop on this thread: step whenever there is work until `shutdown` (from
        another thread). `started()` is called once this thread is the engine's (`start()` is
        then a no-op)."""
        with self._lock:
            if self._thread is not None or self._stopping:
                raise RuntimeError("the engine is already stepping on a thread, or stopped")
            self._thread = threading.current_thread()
        if started is not None:
            started()
        self._loop()

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Refuse new requests and cancel the queued ones that have not started; give the others
        `grace_s` seconds to finish, then cancel them and stop the thread."""
        with self._lock:
            self._closed = True
            waiting = self.core.scheduler.waiting
            self._cancels.extend(s for s in waiting if len(s.tokens) == s.n_prompt)
            self._lock.notify_all()
        deadline = time.monotonic() + grace_s
        with self._lock:
            while self._thread is not None and self._has_work() and time.monotonic() < deadline:
                self._lock.wait(timeout=max(0.0, deadline - time.monotonic()))
        while self._thread is None and self._has_work() and time.monotonic() < deadline:
            self.step()
        with self._lock:
            self._cancels.extend(self.core.live)
            self._stopping = True
            self._lock.notify_all()
            stepping = self._thread is not None
        if stepping:
            self._loop_done.wait()
        self.step()  # applies the cancels

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stopping and not self._has_work():
                        self._lock.wait()
                    if self._stopping:
                        return
                try:
                    self.step()
                except Exception:
                    self._fail()
                    raise
        finally:
            self._loop_done.set()

    def _fail(self) -> None:
        """After a step raised: refuse new requests and end every open one with "error"."""
        events: list[tuple[Request, TokenEvent]] = []
        with self._lock:
            self._closed = self._stopping = True
            self.failure = "an engine step failed; see the server log"
            events += [self.core.end(seq, "error") for seq in list(self.core.live)]
            for _, _, future in self._calls:
                future.set_exception(EngineStoppedError("the engine failed; see the server log"))
            self._calls.clear()
            self._lock.notify_all()
        self._deliver(events)

    def _has_work(self) -> bool:
        scheduler = self.core.scheduler
        return bool(self._cancels or self._calls or scheduler.running or scheduler.waiting)

    # One step: schedule → run → sample → output.

    def step(self) -> bool:
        """Run one engine step; False when there was nothing to run. Not while `start()`'s thread runs."""
        events: list[tuple[Request, TokenEvent]] = []
        with self._lock:
            for seq in self._cancels:
                if seq in self.core.live:  # not finished meanwhile
                    events.append(self.core.end(seq, "cancelled"))
            self._cancels.clear()
            batches = self.core.schedule()
            calls, self._calls = self._calls[:1], self._calls[1:]  # one call per step
        with self.runner.running():
            for fn, args, future in calls:
                try:
                    future.set_result(fn(self, *args))
                except Exception as exc:  # that call fails; the engine goes on
                    future.set_exception(exc)
            logits = self.core.run(batches)
            with self._lock:
                events += self.core.outputs(batches, logits)
                self._lock.notify_all()
        self._deliver(events)
        return bool(batches or calls)

    def _deliver(self, events: list[tuple[Request, TokenEvent]]) -> None:
        for request, event in events:
            try:
                request.sink(event)
            except RuntimeError:  # the consumer is gone (e.g. its event loop closed)
                self.cancel(request.id)

    def stats(self) -> EngineStats:
        with self._lock:
            return self.core.stats()


def _prompt_events(engine: Engine, ids: list[int], top: int) -> list[TokenEvent]:
    """`Engine.score`'s events for prompt `ids`, by `Engine.call`."""
    return engine.core.prompt_events(ids, top)


def _runner_and_proposer(
    model: DecoderLM,
    draft: str | DecoderLM | None,
    k: int | None,
    kv_cache_memory: int | str,
    pools: dict[str, Any],
    compile: bool,
) -> tuple[ModelRunner, Proposer | None]:
    """The target's runner and speculation's proposer (None without a draft): a draft model's
    runner takes its share of `kv_cache_memory` (`split_kv_budget`); with speculation both runners
    keep a scratch block for padded verification passes (`ModelRunner`'s `ragged`)."""
    ragged = k is not None
    proposer: Proposer | None = PromptLookup() if draft == PROMPT_LOOKUP else None
    if isinstance(draft, DecoderLM):
        check_draft(model, draft)
        kv_cache_memory, draft_memory = split_kv_budget(
            model, draft, kv_cache_memory, pools["block_size"], pools["kv_cache_dtype"]
        )
        proposer = DraftModel(
            ModelRunner(draft, kv_cache_memory=draft_memory, compile=compile, ragged=True, **pools)
        )
    runner = ModelRunner(
        model, kv_cache_memory=kv_cache_memory, compile=compile, ragged=ragged, **pools
    )
    if ragged and runner.pool_blocks < 1:
        raise DecoderLMError(
            f"kv_cache_memory={kv_cache_memory!r} holds {runner.num_blocks} KV block; "
            "speculative decoding needs at least 2"
        )
    return runner, proposer


def _speculative_tokens(
    draft: str | DecoderLM | None, num_speculative_tokens: int | None
) -> int | None:
    """The engine's K: None without a draft; DecoderLMError for a draft that is neither prompt
    lookup nor a model."""
    if draft is None:
        if num_speculative_tokens is not None:
            raise DecoderLMError(
                "num_speculative_tokens needs a draft ('prompt-lookup' or a model)"
            )
        return None
    if not (isinstance(draft, DecoderLM) or draft == PROMPT_LOOKUP):
        raise DecoderLMError(
            f"draft={draft!r} must be 'prompt-lookup' or a DecoderLM (a draft model; "
            "`decoderlm.loading.load_draft` loads one from a directory)"
        )
    k = DEFAULT_NUM_SPECULATIVE_TOKENS if num_speculative_tokens is None else num_speculative_tokens
    _positive_int("num_speculative_tokens", k)
    return k


def _positive_int(name: str, value: object) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise DecoderLMError(f"{name}={value!r} must be an integer ≥ 1")
