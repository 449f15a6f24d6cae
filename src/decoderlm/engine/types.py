"""What the engine and the HTTP layer exchange: a request's parameters, its streamed events, stats,
and `EngineClient`, the engine's interface as the HTTP app and `decoderlm chat` use it (vLLM's
EngineClient protocol, which its AsyncLLM implements).

The engine (`decoderlm.engine.engine`) takes token ids and `RequestParams` and yields `TokenEvent`s;
the OpenAI-compatible app (`decoderlm.server.app`) only translates JSON to these and back.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from decoderlm.errors import DecoderLMError
from decoderlm.inference.sampling import SamplingParams
from decoderlm.inference.structured import StructuredOutput


@dataclass(frozen=True)
class RequestParams:
    """One request's generation options (OpenAI's names where they exist)."""

    max_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # text stop strings: the output ends before the first one
    seed: int | None = None  # its own torch.Generator: the same text alone or in a crowd
    logprobs: int | None = None  # None: none; k ≥ 0: the chosen token's logprob and the top-k
    n: int = 1  # completions of the prompt, separate sequences; sample j draws from seed + j
    structured: StructuredOutput | None = None  # the grammar its text follows, to its end
    # Stopping, as vLLM's SamplingParams: the model's own stop ids (`Tokenizer.stop_ids`, from its
    # files) end the output unless ignore_eos; stop_token_ids end it too; neither these ids nor
    # the stop strings end it before min_tokens tokens (the ids are masked until then).
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False  # the stop string ends the text (else cut before)
    skip_special_tokens: bool = True  # special tokens' text is left out of the reply text

    def __post_init__(self) -> None:
        checks = (
            ("max_tokens", self.max_tokens, "an integer ≥ 0", _is_int(self.max_tokens, 0)),
            ("n", self.n, "an integer ≥ 1", _is_int(self.n, 1)),
            ("seed", self.seed, "an integer or None", self.seed is None or _is_int(self.seed)),
            (
                "logprobs",
                self.logprobs,
                "an integer ≥ 0 or None",
                self.logprobs is None or _is_int(self.logprobs, 0),
            ),
            (
                "stop",
                self.stop,
                "a tuple of strings",
                isinstance(self.stop, tuple) and all(isinstance(s, str) for s in self.stop),
            ),
            (
                "stop_token_ids",
                self.stop_token_ids,
                "a tuple of token ids ≥ 0",
                isinstance(self.stop_token_ids, tuple)
                and all(_is_int(t, 0) for t in self.stop_token_ids),
            ),
            ("min_tokens", self.min_tokens, "an integer ≥ 0", _is_int(self.min_tokens, 0)),
            (
                "sampling",
                self.sampling,
                "a SamplingParams",
                isinstance(self.sampling, SamplingParams),
            ),
            (
                "structured",
                self.structured,
                "a StructuredOutput or None",
                self.structured is None or isinstance(self.structured, StructuredOutput),
            ),
        )
        for name, value, allowed, ok in checks:
            if not ok:
                raise DecoderLMError(f"{name}={value!r} must be {allowed}")


def _is_int(value: object, least: int | None = None) -> bool:
    return (
        isinstance(value, int) and not isinstance(value, bool) and (least is None or value >= least)
    )


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenEvent:
    """One step of one sequence: the new token, the text it releases (possibly ""), and, last, why it ended.

    `text` is UTF-8 safe and never holds a partial stop string; `finish_reason` is None until the
    last event of the sequence, then "stop" (a stop id or a stop string), "length"
    (max_tokens or the context), "cancelled", or "error" (the engine failed; it takes no more
    requests). `index` is the sequence's number among the request's `n`.
    """

    token_id: int | None  # None on a final event that carries no token
    text: str
    logprob: float | None = None
    top_logprobs: tuple[TopLogprob, ...] = ()
    finish_reason: str | None = None
    index: int = 0
    # with finish_reason "stop": the request's stop token id or stop string that ended it; None
    # for the model's own stop ids (vLLM's stop_reason)
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class Completion:
    """A finished sequence, as `Engine.generate` returns it."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[TopLogprob, ...]] | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine, for /metrics and the playground's panel."""

    running: int  # sequences decoding now
    waiting: int  # queued, not yet admitted (no KV blocks for them yet)
    kv_blocks_used: int
    kv_blocks_total: int
    kv_block_size: int  # tokens per block
    kv_bytes_per_token: int  # 2 · n_layers · n_kv_heads · head_dim · dtype size (+ the draft's)
    prompt_tokens: int  # totals since start
    generated_tokens: int
    prefix_cache_hit_tokens: int  # prompt tokens whose KV blocks were reused
    max_running_seen: int  # the most sequences that ran at once since start
    tokens_per_s: float  # generated tokens per second over the last few seconds
    preemptions: int = 0  # running sequences sent back to the queue (KV pool full) since start
    speculative_proposed: int = 0  # draft tokens proposed since start (either proposer)
    speculative_accepted: int = 0  # of them, accepted
    speculative_verifications: int = 0  # sequences × steps that verified proposed tokens
    state_bytes_per_sequence: int = 0  # recurrent layers' state of one sequence (0: none)
    # The pages one sequence's state takes (`state_pool`): KV blocks, counted in kv_blocks_used
    # (a hybrid), or slots of their own (a pure recurrent model); those held now; the pool's.
    state_pages_per_sequence: int = 0
    state_pages_used: int = 0
    state_pages_total: int = 0

    @property
    def speculative_acceptance_rate(self) -> float:
        """Accepted / proposed tokens (0 before any proposal)."""
        return (
            self.speculative_accepted / self.speculative_proposed
            if self.speculative_proposed
            else 0.0
        )

    @property
    def speculative_mean_accepted_length(self) -> float:
        """Accepted tokens per verification (0 before any)."""
        v = self.speculative_verifications
        return self.speculative_accepted / v if v else 0.0


class QueueFullError(DecoderLMError):
    """The engine's waiting queue is full: the request is refused (HTTP 429)."""


class EngineStoppedError(DecoderLMError):
    """The engine is shutting down (or failed): the request is refused (HTTP 503)."""


Sink = Callable[[TokenEvent], None]  # where a request's events go, called from the engine's thread


class EngineClient(Protocol):
    """An engine as the HTTP app, the playground and `decoderlm chat` use it: `Engine` in this
    process or `EngineProcess` in a process of its own (tests/serving/test_engine_process.py
    checks that both have every member, with the same signature)."""

    @property
    def max_sequence(self) -> int:
        """Tokens per sequence: the model's context_length."""
        ...

    @property
    def failure(self) -> str | None:
        """Why the engine stopped by itself, if it did; else None."""
        ...

    def start(self) -> None:
        """Start stepping in the background (idempotent)."""
        ...

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Refuse new requests; give the running ones `grace_s` seconds, then cancel them."""
        ...

    def submit(
        self,
        prompt: str | list[int],
        params: RequestParams,
        *,
        request_id: str | None = None,
        on_event: Sink,
    ) -> str:
        """Queue a request whose events go to `on_event`; its id."""
        ...

    def stream(
        self, prompt_ids: list[int], params: RequestParams, *, request_id: str | None = None
    ) -> AsyncIterator[TokenEvent]:
        """Submit now and iterate the request's events on this event loop."""
        ...

    def stream_batches(
        self, prompt_ids: list[int], params: RequestParams, *, request_id: str | None = None
    ) -> AsyncIterator[list[TokenEvent]]:
        """`stream`, every event that has arrived at once."""
        ...

    def cancel(self, request_id: str) -> None:
        """End a request's sequences at the next step; unknown ids are ignored."""
        ...

    def score(
        self, prompt: str | list[int], top: int = 0
    ) -> concurrent.futures.Future[list[TokenEvent]]:
        """The prompt's own tokens as events, with their log-probabilities."""
        ...

    def call(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """fn(engine, *args) on the engine's thread, between its steps."""
        ...

    def stats(self) -> EngineStats:
        """A snapshot of the engine."""
        ...
