"""A continuous-batching inference engine over a paged KV pool, after vLLM's LLMEngine (Kwon et al.,
2023, "Efficient Memory Management for LLM Serving with PagedAttention").

`Engine` is the thread-safe front: requests in, events out to each request's sink, the background
thread and shutdown. Each of its `step`s runs one step of its `EngineCore` (vLLM's EngineCore): the
`Scheduler`'s plan, one forward pass decoding a token for every running sequence, then the planned
prefill chunks, one forward pass each (`runner.ModelRunner`, the only part that runs the model);
the logits become tokens in `sampler.sample` and tokens become `TokenEvent`s in
`output.SequenceOutput`. Every sequence samples with its own `SamplingParams` and
`torch.Generator` and is detokenized by its own `IncrementalDecoder` and `StopMatcher`, so a
request's tokens do not depend on what else runs: greedy requests equal `decoderlm.generate` on
their prompt alone, up to floating-point rounding of the batched kernels.

With `draft="prompt-lookup"` or a draft model each decoding sequence proposes up to K tokens, by
prompt lookup (`decoderlm.inference.speculative`) or with the draft in a KV pool of its own
(`draft.DraftProposer`, every speculating sequence's draft passes batched), K adapted per
sequence; the scheduler appends them to its tokens, and one target pass runs every speculating
sequence's last token and drafts (`ragged.forward_rows`: rows of different lengths);
`sampler.verify` accepts a prefix and chooses the next token, and the rejected ones are taken off
again (their K/V is not counted in n_computed, so the next pass writes over it).

Use it offline with `generate`, or `start()` a background thread that steps while there is work
and consume `stream(...)` from asyncio (`streams`). Submitting, cancelling and stats are
thread-safe; cancels take effect at the next step. A forward pass or a sampling step that raises
ends the sequences it was for with finish_reason "error" (logged) and the engine goes on with the
others.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from decoderlm.cpu.paths import SpeedPaths
from decoderlm.engine.draft import DraftProposer, check_draft, split_kv_budget
from decoderlm.engine.inputs import InputProcessor
from decoderlm.engine.kv_pool import BlockPool
from decoderlm.engine.output import SequenceOutput, prompt_events
from decoderlm.engine.ragged import SCRATCH_BLOCKS, Row, forward_rows
from decoderlm.engine.runner import ModelRunner
from decoderlm.engine.sampler import Sampled, SamplingState, sample, verify
from decoderlm.engine.scheduler import Scheduler, Sequence
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
from decoderlm.inference.speculative import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    PROMPT_LOOKUP,
    AdaptiveK,
    PromptLookup,
)
from decoderlm.inference.structured import StructuredGrammar
from decoderlm.model.cache import check_kv_cache_dtype
from decoderlm.model.lm import DecoderLM

log = logging.getLogger(__name__)
RATE_WINDOW_S = 5.0  # EngineStats.tokens_per_s averages over this many seconds


@dataclass(eq=False)
class _Request:
    id: str
    sink: Sink
    seqs: list[Sequence] = field(default_factory=list)
    n_open: int = 0


@dataclass(eq=False)
class _Live:
    """A sequence that has not finished: its request, its sampler and its detokenizer."""

    request: _Request
    sampling: SamplingState
    output: SequenceOutput
    speculation: AdaptiveK | None  # how many tokens to propose next; None: no speculation


class _Counters:
    """What `Engine.stats` counts since the start (under the engine's lock), and the generated
    tokens of the last RATE_WINDOW_S seconds."""

    def __init__(self) -> None:
        self.prompt_tokens = self.generated = self.max_running = 0
        self.proposed = self.accepted = self.verifications = 0  # speculative decoding's
        self._rate: deque[tuple[float, int]] = deque()  # (time, generated tokens so far)

    def mark(self) -> None:
        """A step ended: a sample of the rate."""
        self._rate.append((self._prune(), self.generated))

    def tokens_per_s(self) -> float:
        now = self._prune()
        t0, g0 = self._rate[0] if self._rate else (now, self.generated)
        return (self.generated - g0) / (now - t0) if now > t0 else 0.0

    def _prune(self) -> float:
        """Forget the rate samples older than the window; returns the time now."""
        now = time.monotonic()
        while self._rate and now - self._rate[0][0] > RATE_WINDOW_S:
            self._rate.popleft()
        return now


class EngineCore:
    """The requests in flight and one step over them: schedule → run → sample → output, after
    vLLM's EngineCore. Not thread-safe: `Engine` calls it under its lock, except `run` (the
    forward passes, inside `runner.running()`)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        runner: ModelRunner,
        block_size: int,
        prefill_chunk: int,
        prefix_caching: bool,
        num_speculative_tokens: int | None = None,
        draft: DraftProposer | None = None,
        max_batched_tokens: int | None = None,
    ) -> None:
        """num_speculative_tokens: K, each decoding sequence's proposals per step, by `draft`, or
        by prompt lookup without one (`decoderlm.inference.speculative`); None: no speculation.
        Speculation keeps the runner's last block out of the pool (`ragged.SCRATCH_BLOCKS`)."""
        self.tokenizer, self.vocab_size, self.runner = tokenizer, vocab_size, runner
        self.num_speculative_tokens = num_speculative_tokens
        self.lookup, self.draft = PromptLookup(), draft
        self.drafted: dict[Sequence, int] = {}  # this step's verifications: drafts per sequence
        self.q: dict[Sequence, Tensor | None] = {}  # the draft model's q (k, V) of them
        self.decodable = decodable_ids(tokenizer, vocab_size)
        reserved = 0 if num_speculative_tokens is None else SCRATCH_BLOCKS
        states = runner.states  # recurrent layers' (`state_pool`): no prefix sharing over them
        self.pool = BlockPool(
            runner.num_blocks - reserved, block_size, prefix_caching and states is None
        )
        pages = None if states is None else states.pages(self.pool)
        self.scheduler = Scheduler(self.pool, prefill_chunk, pages, max_batched_tokens)
        self.requests: dict[str, _Request] = {}
        self.live: dict[Sequence, _Live] = {}  # the sequences that have not finished
        self.counters = _Counters()

    def add(
        self,
        request: _Request,
        params: RequestParams,
        ids: list[int],
        max_len: int,
        grammar: StructuredGrammar | None = None,
    ) -> list[tuple[_Request, TokenEvent]]:
        """Queue the request's `params.n` sequences of prompt `ids`, to end at `max_len` tokens,
        each with its own matcher of `grammar`; the last events of those with nothing to generate
        (max_tokens 0 or a full context)."""
        self.requests[request.id] = request
        self.counters.prompt_tokens += len(ids)
        events = []
        for index in range(params.n):
            seq = Sequence(list(ids), len(ids), max_len)
            sampling = SamplingState.create(
                params, index, ids, self.vocab_size, self.runner.device, grammar
            )
            output = SequenceOutput.create(self.tokenizer, params, index, ids)
            k = self.num_speculative_tokens  # a constrained sequence does not speculate: `verify`
            speculation = None if k is None or grammar is not None else AdaptiveK(k)  # has no mask
            self.live[seq] = _Live(request, sampling, output, speculation)
            request.seqs.append(seq)
            if max_len == len(ids):
                events.append(self.end(seq, "length"))
            else:
                self.scheduler.add(seq)
        return events

    def schedule(self) -> list[tuple[list[Sequence], int]]:
        """This step's forward passes, (sequences, tokens each): the decode rows, then each
        prefill chunk."""
        plan = self.scheduler.schedule()
        counters = self.counters
        counters.max_running = max(counters.max_running, len(self.scheduler.running))
        self.drafted = {seq: k for seq in plan.decode if (k := self._speculate(seq))}
        decode = [seq for seq in plan.decode if seq not in self.drafted]
        if self.drafted:  # one pass: the plain rows, then the verifications (`ragged`)
            batches = [(decode + list(self.drafted), max(self.drafted.values()) + 1)]
        else:
            batches = [(decode, 1)] if decode else []
        chunks: dict[tuple[int, int], list[Sequence]] = {}  # one pass per (start, n): same shapes
        for seq, n in plan.prefill:
            chunks.setdefault((seq.n_computed, n), []).append(seq)
        return batches + [(seqs, n) for (_, n), seqs in chunks.items()]

    def _speculate(self, seq: Sequence) -> int:
        """How many drafts decoding `seq` verifies this step: prompt lookup's, appended to its
        tokens now, or the draft model's, for which room is made now (`run` proposes them)."""
        schedule = self.live[seq].speculation
        k = 0 if schedule is None else schedule.next()
        if not k:
            return 0
        if self.draft is not None:
            return self.scheduler.room(seq, self.draft.limit(seq, k))
        drafts = self.lookup.propose(seq.tokens, k)[0]
        if not drafts:  # nothing to propose counts as a proposal rejected: the lookup backs off
            schedule.update(k, 0)
            return 0
        return self.scheduler.speculate(seq, drafts)

    def run(self, batches: list[tuple[list[Sequence], int]]) -> list[Tensor | list[Tensor] | None]:
        """Each pass's logits, (B, V), or for the pass with verifications each row's (n_b, V);
        None for a pass that raised (logged)."""
        return [
            self._verification(seqs)
            if seqs[-1] in self.drafted
            else _isolated(self.runner.forward, seqs, n)
            for seqs, n in batches
        ]

    def _verification(self, seqs: list[Sequence]) -> list[Tensor] | None:
        """The draft model's proposals, if it proposes, then the pass over each sequence's tokens
        not computed: a plain row's last token, a speculating one's last token and drafts."""
        drafting = [seq for seq in seqs if seq in self.drafted]
        if self.draft is not None:
            ks = [self.drafted[seq] for seq in drafting]
            states = [self.live[seq].sampling for seq in drafting]
            qs = _isolated(self.draft.propose, drafting, ks, states, self.decodable)
            if qs is None:
                return None
            self.q = dict(zip(drafting, qs, strict=True))
        rows = [Row(seq.blocks, seq.n_computed, seq.tokens[seq.n_computed :]) for seq in seqs]
        return _isolated(forward_rows, self.runner, rows)

    def outputs(
        self,
        batches: list[tuple[list[Sequence], int]],
        logits: list[Tensor | list[Tensor] | None],
    ) -> list[tuple[_Request, TokenEvent]]:
        """The events of the passes `run` ran."""
        events = []
        for (seqs, n), rows in zip(batches, logits, strict=True):
            events += self._pass_events(seqs, n, rows)
        self.counters.mark()
        return events

    def _pass_events(
        self, seqs: list[Sequence], n: int, logits: Tensor | list[Tensor] | None
    ) -> list[tuple[_Request, TokenEvent]]:
        """The events of a forward pass that ran n tokens of `seqs`, whose logits (B, V) (for
        the pass with verifications: each row's (n_b, V)) are None if it failed: then its
        sequences end, and the other passes go on."""
        if logits is None:
            return [self.end(seq, "error") for seq in seqs if seq in self.live]
        if seqs[-1] in self.drafted:  # logits: a list, each row's (n_b, V)
            plain = len(seqs) - len(self.drafted)  # the plain rows come first
            events = []
            if plain:  # their last (only) token's logits: (B', V)
                events += self._pass_events(seqs[:plain], 1, torch.stack(logits[:plain])[:, -1])
            for seq, rows in zip(seqs[plain:], logits[plain:], strict=True):
                events += self._verified(seq, self.drafted[seq], rows)
            return events
        ready = [seq in self.live and seq.n_pending == n for seq in seqs]  # at its last token
        states = [self.live[s].sampling if r else None for s, r in zip(seqs, ready, strict=True)]
        events = []
        chosen = sample(logits, states, self.decodable)
        for seq, is_ready, sampled in zip(seqs, ready, chosen, strict=True):
            self.scheduler.computed(seq, n)
            if is_ready:
                event = None if sampled is None else _isolated(self._emit, seq, sampled)
                events.append(self.end(seq, "error") if event is None else event)
        return events

    def _verified(self, seq: Sequence, k: int, logits: Tensor) -> list[tuple[_Request, TokenEvent]]:
        """The events of the pass that ran `seq`'s last token and its k drafts, logits (k + 1, V):
        the accepted drafts and the next token, one event each, until one finishes it."""
        live = self.live[seq]
        drafts = seq.tokens[-k:]
        self.scheduler.reject(seq, k)  # they come back as they are accepted
        q = self.q.pop(seq, None)
        chosen = _isolated(verify, logits, live.sampling, seq.tokens, drafts, self.decodable, q)
        if chosen is None:
            return [self.end(seq, "error")]
        n = len(chosen) - 1
        if live.speculation is not None:
            live.speculation.update(k, n)
        if self.draft is not None:
            self.draft.accepted(seq, n)
        self.counters.proposed += k
        self.counters.accepted += n
        self.counters.verifications += 1
        events = []
        for sampled in chosen:
            event = _isolated(self._emit, seq, sampled)
            events.append(self.end(seq, "error") if event is None else event)
            if seq not in self.live:
                return events
        self.scheduler.computed(seq, n + 1)  # the last token and the accepted drafts
        return events

    def _emit(self, seq: Sequence, sampled: Sampled) -> tuple[_Request, TokenEvent]:
        """`seq` takes its sampled token; the event that reports it."""
        seq.tokens.append(sampled.token)
        self.counters.generated += 1
        live = self.live[seq]
        event = live.output.event(sampled.token, sampled.logprobs, len(seq.tokens) >= seq.max_len)
        return self._finish(seq, event) if event.finish_reason else (live.request, event)

    def end(self, seq: Sequence, reason: str) -> tuple[_Request, TokenEvent]:
        """Take `seq` out with a last event that carries no token, finish_reason `reason`."""
        return self._finish(seq, self.live[seq].output.ended(reason))

    def _finish(self, seq: Sequence, event: TokenEvent) -> tuple[_Request, TokenEvent]:
        """Take `seq` out (its blocks are freed); `event` is its last."""
        self.scheduler.remove(seq)
        if self.draft is not None:
            self.draft.forget(seq)
        request = self.live.pop(seq).request
        request.n_open -= 1
        if request.n_open == 0:
            del self.requests[request.id]
        return request, event

    def prompt_events(self, ids: list[int], top: int) -> list[TokenEvent]:
        """`Engine.score`'s events for prompt `ids`."""
        lp = self.runner.prompt_logprobs(ids)[:, : self.decodable].log_softmax(-1)  # as `sample`
        return prompt_events(self.tokenizer, ids, lp, top)

    def stats(self) -> EngineStats:
        """`Engine.stats`."""
        counters = self.counters
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.pool.num_used,
            kv_blocks_total=self.pool.num_blocks,
            kv_block_size=self.pool.block_size,
            kv_bytes_per_token=self.runner.bytes_per_token  # the draft's pool's too, if any
            + (0 if self.draft is None else self.draft.runner.bytes_per_token),
            prompt_tokens=counters.prompt_tokens,
            generated_tokens=counters.generated,
            prefix_cache_hit_tokens=self.scheduler.prefix_hit_tokens,
            max_running_seen=counters.max_running,
            tokens_per_s=counters.tokens_per_s(),
            preemptions=self.scheduler.preemptions,
            speculative_proposed=counters.proposed,
            speculative_accepted=counters.accepted,
            speculative_verifications=counters.verifications,
            **_state_stats(self.runner, self.scheduler),
        )


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
        max_batched_tokens: int = 512,
        prefix_caching: bool = True,
        kv_cache_dtype: str | None = None,
        cpu_kernels: bool | SpeedPaths = True,
        draft: str | DecoderLM | None = None,
        num_speculative_tokens: int | None = None,
        compile: bool = False,
    ) -> None:
        """kv_cache_memory, kv_cache_dtype, cpu_kernels (its CPU speed paths): the KV pool and the model's kernels, as
        `ModelRunner` takes them; max_queue: the most sequences waiting; prefill_chunk: the most
        prompt tokens of one sequence one step runs; max_batched_tokens: the most tokens one step
        runs, decodes first, never less than a chunk of prefill (`Scheduler`; chunks of the same
        start and length run in one pass; 512 was vLLM's first chunked-prefill default, its best
        ITL/TTFT balance, vllm-project/vllm#4580); prefix_caching: reuse the KV blocks of a shared
        prefix (off for a model with recurrent layers, and `draft` refused: `state_pool`);
        draft "prompt-lookup" or a draft model (a DecoderLM with `model`'s vocabulary): speculative
        decoding, each decoding sequence proposing `num_speculative_tokens` (default 4) tokens per
        step, all verified in one target pass (`decoderlm.inference.speculative`; the same tokens
        for greedy requests, the same distribution for sampled ones). A draft model's KV pool
        comes out of `kv_cache_memory` too: both pools get the same number of blocks
        (`draft.split_kv_budget`); compile: the target's decode passes compiled ahead of time
        (`ModelRunner`'s `compile`), made now (the draft's run eagerly)."""
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
        pools = dict(block_size=block_size, kv_cache_dtype=kv_cache_dtype, cpu_kernels=cpu_kernels)
        proposer = None
        if isinstance(draft, DecoderLM):
            check_draft(model, draft)
            kv_cache_memory, draft_memory = split_kv_budget(
                model, draft, kv_cache_memory, block_size, kv_cache_dtype
            )
            proposer = DraftProposer(ModelRunner(draft, kv_cache_memory=draft_memory, **pools))
        self.runner = ModelRunner(model, kv_cache_memory=kv_cache_memory, compile=compile, **pools)
        if k is not None and self.runner.num_blocks <= SCRATCH_BLOCKS:
            raise DecoderLMError(
                f"kv_cache_memory={kv_cache_memory!r} holds {self.runner.num_blocks} KV block; "
                "speculative decoding needs at least 2"
            )
        vocab_size = model.config.vocab_size
        self.core = EngineCore(
            tokenizer,
            vocab_size,
            self.runner,
            block_size,
            prefill_chunk,
            prefix_caching,
            k,
            proposer,
            max_batched_tokens,
        )
        self.inputs = InputProcessor(  # prompts hold only ids the tokenizer can decode
            tokenizer,
            decodable_ids(tokenizer, vocab_size),
            self.max_sequence,
            block_size,
            # the blocks one sequence may hold: beside its state's pages, without the scratch block
            self.runner.budget.sequence_blocks
            - (self.runner.num_blocks - self.core.pool.num_blocks),
            max_queue,
        )
        self._lock = threading.Condition()  # guards everything below, and the core
        self._cancels: list[Sequence] = []
        self._calls: list[tuple[Callable[..., Any], tuple, concurrent.futures.Future]] = []
        self._thread: threading.Thread | None = None
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
            request = _Request(request_id, on_event, n_open=params.n)
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
        events: list[tuple[_Request, TokenEvent]] = []
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

    def _deliver(self, events: list[tuple[_Request, TokenEvent]]) -> None:
        for request, event in events:
            try:
                request.sink(event)
            except RuntimeError:  # the consumer is gone (e.g. its event loop closed)
                self.cancel(request.id)

    def stats(self) -> EngineStats:
        with self._lock:
            return self.core.stats()


def decodable_ids(tokenizer: Any, vocab_size: int) -> int:
    """How many of a model's `vocab_size` ids the tokenizer decodes: all of them, or the
    tokenizer's size when the model's vocabulary is padded beyond it (GPT-2's 50257 → 50304).
    DecoderLMError if the tokenizer is larger than the model's vocabulary: it could encode ids
    the model has no embedding for."""
    size = getattr(tokenizer, "vocab_size", None) or vocab_size
    if size > vocab_size:
        raise DecoderLMError(
            f"the tokenizer has {size} tokens but the model's vocabulary only {vocab_size}: "
            "it is not this model's tokenizer"
        )
    return size


def _prompt_events(engine: Engine, ids: list[int], top: int) -> list[TokenEvent]:
    """`Engine.score`'s events for prompt `ids`, by `Engine.call`."""
    return engine.core.prompt_events(ids, top)


def _isolated(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), or None (logged) if it raised: one request's failure ends that request only."""
    try:
        return fn(*args)
    except Exception:
        log.exception("decoderlm engine: %s failed; its sequences end with 'error'", fn.__name__)
        return None


def _state_stats(runner: ModelRunner, scheduler: Scheduler) -> dict[str, int]:
    """`EngineStats`' recurrent state fields (`state_pool`)."""
    pages = scheduler.states
    if pages is None:
        return {}
    return {
        "state_bytes_per_sequence": runner.budget.state_bytes,
        "state_pages_per_sequence": pages.per_sequence,
        "state_pages_used": pages.per_sequence * len(scheduler.running),
        "state_pages_total": pages.pool.num_blocks,
    }


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
