"""A continuous-batching inference engine over a paged KV pool, after vLLM's LLMEngine (Kwon et al.,
2023, "Efficient Memory Management for LLM Serving with PagedAttention").

Each `step` runs the `Scheduler`'s plan: one forward pass decoding a token for every running
sequence (rows of different lengths attend their own blocks: read in place by
`decoderlm.cpu.paged_attention` on the CPU, else gathered and padded under a key mask; a layer
with a sliding window gathers only the keys inside it), then the planned prefill chunks,
one forward pass each. Every sequence samples with its
own `SamplingParams` and `torch.Generator` and is detokenized by its own `IncrementalDecoder` and
`StopMatcher`, so a request's tokens do not depend on what else runs: greedy requests equal
`decoderlm.generate` on their prompt alone, up to floating-point rounding of the batched kernels.

Use it offline with `generate`, or `start()` a background thread that steps while there is work
and consume `stream(...)` from asyncio. Submitting, cancelling and stats are thread-safe; cancels
take effect at the next step. A forward pass or a sampling step that raises ends the sequences it
was for with finish_reason "error" (logged) and the engine goes on with the others.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from decoderlm.cpu import heap, paged_attention
from decoderlm.cpu.packed_linear import pack_linears, packed
from decoderlm.errors import DecoderLMError
from decoderlm.inference.generate import evaluating, make_generator, prompt_rows
from decoderlm.inference.sampling import greedy_tokens, sample_next
from decoderlm.inference.stream import IncrementalDecoder, StopMatcher
from decoderlm.model.int8_cache import check_kv_cache_dtype
from decoderlm.model.kv_cache import kv_cache_bytes_per_token
from decoderlm.model.lm import DecoderLM
from decoderlm.serving.kv_pool import BlockPool, PagedKVCache, blocks_for, parse_bytes
from decoderlm.serving.scheduler import Scheduler, Sequence
from decoderlm.serving.types import (
    Completion,
    EngineStats,
    EngineStoppedError,
    QueueFullError,
    RequestParams,
    TokenEvent,
    TopLogprob,
)

log = logging.getLogger(__name__)
Sink = Callable[[TokenEvent], None]
RATE_WINDOW_S = 5.0  # EngineStats.tokens_per_s averages over this many seconds


@dataclass(eq=False)
class _Output:
    """What turns one sequence's logits into events: its sampler state and its detokenizer."""

    request: _Request
    index: int
    params: RequestParams
    generator: torch.Generator | None
    seen: Tensor | None  # (1, V) tokens in the sequence, for the repetition penalty
    decoder: IncrementalDecoder
    matcher: StopMatcher
    eot: int | None


@dataclass(eq=False)
class _Request:
    id: str
    sink: Sink
    seqs: list[Sequence] = field(default_factory=list)
    n_open: int = 0


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
        prefix_caching: bool = True,
        kv_cache_dtype: str | None = None,
        cpu_kernels: bool = True,
    ) -> None:
        """kv_cache_memory: the byte budget of the KV pool, which holds
        ⌊budget / (block_size · bytes per token)⌋ blocks; kv_cache_dtype: None (K/V in the model's
        dtype) or "int8" (`decoderlm.model.int8_cache`, whose scales the bytes per token count);
        cpu_kernels: on the CPU, run the steps with the linear weights packed for oneDNN, or
        for AMX tiles in bfloat16 where the CPU has them (`decoderlm.cpu.packed_linear`: faster
        for a batch of rows, at twice the linear weights' memory; packed now, so a model changed
        later needs a new engine) and keep freed memory
        in the process (`decoderlm.cpu.heap`), so that each step's gathered K/V reuse the last
        step's pages instead of faulting in new ones; and, for float32 and bfloat16 pools, attend
        the decode rows of layers without a window in place, without gathering their blocks
        (`decoderlm.cpu.paged_attention`, where a C compiler builds it). (The attention,
        embedding and linear paths that `generate` applies made the batched steps slower:
        benchmarks/README.md.)"""
        check_kv_cache_dtype(kv_cache_dtype)
        for name, value in (
            ("block_size", block_size),
            ("max_queue", max_queue),
            ("prefill_chunk", prefill_chunk),
        ):
            _positive_int(name, value)
        self.model, self.tokenizer, self.max_queue = model, tokenizer, max_queue
        self.max_sequence = model.config.context_length  # tokens per sequence
        weight = model.tok_emb.weight
        self.device = weight.device
        on_cpu = cpu_kernels and self.device.type == "cpu"
        if on_cpu:
            heap.keep_freed_memory()
        self._packed = pack_linears(model) if on_cpu else []
        self.bytes_per_token = kv_cache_bytes_per_token(
            model.config, kv_cache_dtype or weight.dtype
        )
        num_blocks = parse_bytes(kv_cache_memory) // (block_size * self.bytes_per_token)
        if num_blocks == 0:
            raise DecoderLMError(
                f"kv_cache_memory={kv_cache_memory!r} holds no KV block: one block of "
                f"{block_size} tokens takes {block_size * self.bytes_per_token} bytes"
            )
        self.pool = BlockPool(num_blocks, block_size, prefix_caching)
        in_place = on_cpu and paged_attention.available(weight.dtype, self.device)
        self.cache = PagedKVCache(
            model.config,
            num_blocks,
            block_size,
            weight.dtype,
            self.device,
            kv_cache_dtype,
            in_place,
        )
        self.scheduler = Scheduler(self.pool, prefill_chunk)
        self._lock = threading.Condition()  # guards everything below, and the scheduler
        self._requests: dict[str, _Request] = {}
        self._outputs: dict[Sequence, _Output] = {}
        self._cancels: list[Sequence] = []
        self._calls: list[tuple[Callable[..., Any], tuple, concurrent.futures.Future]] = []
        self._thread: threading.Thread | None = None
        self._closed = self._stopping = False
        self.failure: str | None = None  # why the engine stopped by itself, if it did
        self._prompt_tokens = self._generated = self._max_running = 0
        self._rate: deque[tuple[float, int]] = deque()  # (time, generated tokens so far)

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
        ids = self._prompt_ids(prompt)
        max_len = min(len(ids) + params.max_tokens, self.max_sequence)
        needed = blocks_for(max_len, self.pool.block_size)
        if needed > self.pool.num_blocks:
            raise DecoderLMError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs {needed} KV "
                f"blocks but kv_cache_memory holds {self.pool.num_blocks}; lower max_tokens or "
                "raise kv_cache_memory"
            )
        if params.n > self.max_queue:
            raise DecoderLMError(f"n={params.n} exceeds the engine's max_queue={self.max_queue}")
        request_id = uuid.uuid4().hex if request_id is None else request_id
        events: list[tuple[_Request, TokenEvent]] = []
        with self._lock:
            if self._closed:
                raise EngineStoppedError("the engine is shutting down and takes no new requests")
            if request_id in self._requests:
                raise DecoderLMError(f"request_id={request_id!r} is already running")
            if len(self.scheduler.waiting) + params.n > self.max_queue:
                raise QueueFullError(
                    f"the engine's waiting queue is full ({self.max_queue} sequences); retry later"
                )
            request = _Request(request_id, on_event, n_open=params.n)
            self._requests[request_id] = request
            self._prompt_tokens += len(ids)
            for index in range(params.n):
                seq = Sequence(list(ids), len(ids), max_len)
                self._outputs[seq] = self._output(request, index, params, ids)
                request.seqs.append(seq)
                if max_len == len(ids):  # nothing to generate: max_tokens 0 or a full context
                    event = TokenEvent(None, "", finish_reason="length", index=index)
                    events.append(self._finish(seq, event))
                else:
                    self.scheduler.add(seq)
            self._lock.notify_all()
        self._deliver(events)
        return request_id

    def cancel(self, request_id: str) -> None:
        """End a request's sequences at the next step (finish_reason "cancelled"); unknown ids are ignored."""
        with self._lock:
            request = self._requests.get(request_id)
            self._cancels.extend(request.seqs if request is not None else ())
            self._lock.notify_all()

    def score(
        self, prompt: str | list[int], top: int = 0
    ) -> concurrent.futures.Future[list[TokenEvent]]:
        """The prompt's own tokens as events, what `echo` with `logprobs` reports: token 0 has no
        logprob (nothing precedes it), token t has log p(token t | tokens < t) and the `top`
        likeliest tokens at t. The engine's thread computes them before its next step (`call`), in
        one forward pass over the prompt outside the batch and the KV pool. Thread-safe."""
        ids = self._prompt_ids(prompt)
        if not (isinstance(top, int) and not isinstance(top, bool) and top >= 0):
            raise DecoderLMError(f"top={top!r} must be an integer ≥ 0")
        return self.call(Engine._prompt_events, ids, top)

    def call(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """fn(self, *args) on the engine's thread before its next step, so that it never runs
        the model at the same time as a step (the playground's attention maps, `score`); its
        result or exception goes to the returned Future. Thread-safe; starts the thread."""
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
        collectors = [_Collector(params, done) for _ in prompts]
        todo, finished = deque(zip(prompts, collectors, strict=True)), 0
        while finished < len(prompts):
            while todo:
                prompt, collector = todo[0]
                collector.prompt_ids = self._prompt_ids(prompt)
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
        """`stream` that yields every event that has arrived at once (module `stream_batches`)."""
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

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Refuse new requests and cancel the queued ones that have not started; give the others
        `grace_s` seconds to finish, then cancel them and stop the thread."""
        with self._lock:
            self._closed = True
            self._cancels.extend(s for s in self.scheduler.waiting if len(s.tokens) == s.n_prompt)
            self._lock.notify_all()
        deadline = time.monotonic() + grace_s
        with self._lock:
            while self._thread is not None and self._has_work() and time.monotonic() < deadline:
                self._lock.wait(timeout=max(0.0, deadline - time.monotonic()))
        while self._thread is None and self._has_work() and time.monotonic() < deadline:
            self.step()
        with self._lock:
            self._cancels.extend(self._outputs)
            self._stopping = True
            self._lock.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        self.step()  # applies the cancels

    def _loop(self) -> None:
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

    def _fail(self) -> None:
        """After a step raised: refuse new requests and end every open one with "error"."""
        events: list[tuple[_Request, TokenEvent]] = []
        with self._lock:
            self._closed = self._stopping = True
            self.failure = "an engine step failed; see the server log"
            events += [self._error(seq) for seq in list(self._outputs)]
            for _, _, future in self._calls:
                future.set_exception(EngineStoppedError("the engine failed; see the server log"))
            self._calls.clear()
            self._lock.notify_all()
        self._deliver(events)

    def _has_work(self) -> bool:
        return bool(
            self._cancels or self._calls or self.scheduler.running or self.scheduler.waiting
        )

    # One step.

    def step(self) -> bool:
        """Run one engine step; False when there was nothing to run. Not while `start()`'s thread runs."""
        events: list[tuple[_Request, TokenEvent]] = []
        with self._lock:
            self._apply_cancels(events)
            plan = self.scheduler.schedule()
            self._max_running = max(self._max_running, len(self.scheduler.running))
            calls, self._calls = self._calls, []
        batches = [(plan.decode, 1)] if plan.decode else []
        batches += [([seq], n) for seq, n in plan.prefill]
        with evaluating(self.model), packed(self._packed):
            for fn, args, future in calls:
                try:
                    future.set_result(fn(self, *args))
                except Exception as exc:  # that call fails; the engine goes on
                    future.set_exception(exc)
            logits = [self._isolated(self._forward, seqs, n) for seqs, n in batches]  # (B, V)
            with self._lock:
                for (seqs, n), rows in zip(batches, logits, strict=True):
                    if rows is None:  # the pass failed: its sequences end, the others go on
                        events += [self._error(seq) for seq in seqs if seq in self._outputs]
                        continue
                    choices = self._batch_choices(seqs, rows)
                    for seq, row, (token, lp) in zip(seqs, rows, choices, strict=True):
                        self.scheduler.computed(seq, n)
                        if seq.n_pending == 0 and seq in self._outputs:
                            sampled = self._isolated(self._sample, seq, row, token, lp)
                            events.append(self._error(seq) if sampled is None else sampled)
                self._rate.append((self._prune_rate(), self._generated))
                self._lock.notify_all()
        self._deliver(events)
        return bool(batches or calls)

    @staticmethod
    def _isolated(fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), or None (logged) if it raised: one request's failure ends that request only."""
        try:
            return fn(*args)
        except Exception:
            log.exception(
                "decoderlm engine: %s failed; its sequences end with 'error'", fn.__name__
            )
            return None

    def _error(self, seq: Sequence) -> tuple[_Request, TokenEvent]:
        event = TokenEvent(None, "", finish_reason="error", index=self._outputs[seq].index)
        return self._finish(seq, event)

    def _forward(self, seqs: list[Sequence], n: int) -> Tensor:
        """Run tokens [n_computed, n_computed + n) of each sequence; logits (B, V) of the last."""
        dev = self.device
        start = torch.tensor([s.n_computed for s in seqs], device=dev)  # (B,)
        width = max(len(s.blocks) for s in seqs)
        table = torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in seqs], device=dev)
        idx = torch.tensor([s.tokens[s.n_computed : s.n_computed + n] for s in seqs], device=dev)
        self.cache.seek(table, start, n)  # each layer cache supplies its own key mask
        positions = start[:, None] + torch.arange(n, device=dev)  # (B, n)
        logits = self.model(idx, positions, None, self.cache, last_only=True)
        return logits[:, -1].float()  # (B, V)

    def _batch_choices(
        self, seqs: list[Sequence], rows: Tensor
    ) -> list[tuple[int | None, Tensor | None]]:
        """What one tensor operation over all rows (B, V) gives each sequence: its greedy token
        (argmax: temperature 0, no repetition penalty; else None) and its log-probabilities (V,)
        if it reports them (else None). Per row they equal the one-row operations."""
        outs = [self._outputs.get(seq) for seq in seqs]
        greedy = [
            o is not None and o.params.sampling.temperature == 0 and o.seen is None for o in outs
        ]
        wants_lp = [o is not None and o.params.logprobs is not None for o in outs]
        tokens = greedy_tokens(rows).tolist() if any(greedy) else [None] * len(seqs)  # (B,)
        lps = torch.log_softmax(rows, dim=-1) if any(wants_lp) else None  # (B, V)
        return [
            (tokens[i] if greedy[i] else None, lps[i] if wants_lp[i] else None)
            for i in range(len(seqs))
        ]

    def _sample(
        self, seq: Sequence, logits: Tensor, token: int | None, lp: Tensor | None
    ) -> tuple[_Request, TokenEvent]:
        """Choose `seq`'s next token from its logits (V,), unless `_batch_choices` chose it
        (`token`); lp: its log-probabilities when it reports them. The event that reports it."""
        out = self._outputs[seq]
        if token is None:
            token = int(sample_next(logits[None], out.params.sampling, out.seen, out.generator)[0])
        seq.tokens.append(token)
        self._generated += 1
        if out.seen is not None:
            out.seen[0, token] = True
        logprob, top = None, ()
        if out.params.logprobs is not None:  # lp: raw, before penalty and temperature
            logprob, top = float(lp[token]), self._top_logprobs(lp, out.params.logprobs)
        finish = None
        if token == out.eot:
            text, finish = "", "stop"
        else:
            text = out.matcher.feed(out.decoder.add(token))
            if out.matcher.stopped:
                finish = "stop"
            elif len(seq.tokens) >= seq.max_len:
                finish = "length"
        if finish is not None and not out.matcher.stopped:
            text += out.matcher.feed(out.decoder.flush())
            text += "" if out.matcher.stopped else out.matcher.flush()
        event = TokenEvent(token, text, logprob, top, finish, out.index)
        return self._finish(seq, event) if finish else (out.request, event)

    def _top_logprobs(self, lp: Tensor, k: int) -> tuple[TopLogprob, ...]:
        """The k likeliest tokens of one row of log-probabilities lp (V,), likeliest first."""
        if k == 0:
            return ()
        best = torch.topk(lp, min(k, lp.numel()))
        return tuple(
            TopLogprob(i, self.tokenizer.decode([i]), v)
            for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)
        )

    def _prompt_events(self, ids: list[int], top: int) -> list[TokenEvent]:
        """`score`'s events for prompt `ids`."""
        logits = self.model(torch.tensor([ids], device=self.device))[0, :-1]  # (T − 1, V)
        lp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
        # row t: log p(· | tokens ≤ t), in at least float32
        following = torch.tensor(ids[1:], device=self.device)[:, None]  # (T − 1, 1)
        chosen = lp.gather(1, following)[:, 0].tolist()  # log p(token t + 1 | tokens ≤ t)
        decoder, events = IncrementalDecoder(self.tokenizer), []
        for t, token in enumerate(ids):
            text = decoder.add(token) + (decoder.flush() if t == len(ids) - 1 else "")
            if t == 0:
                events.append(TokenEvent(token, text))
            else:
                events.append(
                    TokenEvent(token, text, chosen[t - 1], self._top_logprobs(lp[t - 1], top))
                )
        return events

    def _apply_cancels(self, events: list[tuple[_Request, TokenEvent]]) -> None:
        for seq in self._cancels:
            if seq in self._outputs:  # not finished meanwhile
                index = self._outputs[seq].index
                event = TokenEvent(None, "", finish_reason="cancelled", index=index)
                events.append(self._finish(seq, event))
        self._cancels.clear()

    def _finish(self, seq: Sequence, event: TokenEvent) -> tuple[_Request, TokenEvent]:
        """Take `seq` out (its blocks are freed); `event` is its last."""
        self.scheduler.remove(seq)
        request = self._outputs.pop(seq).request
        request.n_open -= 1
        if request.n_open == 0:
            del self._requests[request.id]
        return request, event

    def _deliver(self, events: list[tuple[_Request, TokenEvent]]) -> None:
        for request, event in events:
            try:
                request.sink(event)
            except RuntimeError:  # the consumer is gone (e.g. its event loop closed)
                self.cancel(request.id)

    # Helpers.

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise DecoderLMError("empty prompt: give some text to continue")
            prompt = self.tokenizer.encode(prompt)
        ids = prompt_rows([list(prompt)], self.model.config.vocab_size)[0]
        if len(ids) > self.max_sequence:
            raise DecoderLMError(
                f"prompt has {len(ids)} tokens, more than the model's context_length "
                f"({self.max_sequence})"
            )
        return ids

    def _output(
        self, request: _Request, index: int, params: RequestParams, ids: list[int]
    ) -> _Output:
        """Sample j of a request draws from seed + j: sample 0 equals a solo run with `seed`."""
        seed = None if params.seed is None else (params.seed + index) % 2**64
        seen = None
        if params.sampling.repetition_penalty != 1.0:
            seen = torch.zeros(
                1, self.model.config.vocab_size, dtype=torch.bool, device=self.device
            )
            seen[0, ids] = True
        return _Output(
            request,
            index,
            params,
            make_generator(seed, self.device),
            seen,
            IncrementalDecoder(self.tokenizer, ids),
            StopMatcher(params.stop),
            getattr(self.tokenizer, "eot_id", None) if params.stop_at_eot else None,
        )

    def _prune_rate(self) -> float:
        """Forget the rate samples older than the window; returns the time now."""
        now = time.monotonic()
        while self._rate and now - self._rate[0][0] > RATE_WINDOW_S:
            self._rate.popleft()
        return now

    def stats(self) -> EngineStats:
        with self._lock:
            now = self._prune_rate()
            t0, g0 = self._rate[0] if self._rate else (now, self._generated)
            return EngineStats(
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting),
                kv_blocks_used=self.pool.num_used,
                kv_blocks_total=self.pool.num_blocks,
                kv_block_size=self.pool.block_size,
                kv_bytes_per_token=self.bytes_per_token,
                prompt_tokens=self._prompt_tokens,
                generated_tokens=self._generated,
                prefix_cache_hit_tokens=self.scheduler.prefix_hit_tokens,
                max_running_seen=self._max_running,
                tokens_per_s=(self._generated - g0) / (now - t0) if now > t0 else 0.0,
                preemptions=self.scheduler.preemptions,
            )


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
    engine: Any, prompt_ids: list[int], params: RequestParams, request_id: str | None
) -> AsyncIterator[list[TokenEvent]]:
    """One request's events as lists, for an engine here or in another process
    (`engine_process.EngineProcess`): submit through `engine.submit` with a sink onto this event
    loop, then yield, each time the consumer asks, every event that has arrived (at least one), so
    a consumer slower than the engine takes several steps' tokens at once, as vLLM's output
    collector merges them. Leaving early calls `engine.cancel`."""
    loop = asyncio.get_running_loop()
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


class _Collector:
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


def _positive_int(name: str, value: object) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise DecoderLMError(f"{name}={value!r} must be an integer ≥ 1")
