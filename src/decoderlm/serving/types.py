"""What the engine and the HTTP layer exchange: a request's parameters, its streamed events, stats.

The engine (`decoderlm.serving.engine`) takes token ids and `RequestParams` and yields `TokenEvent`s;
the OpenAI-compatible app (`decoderlm.serving.app`) only translates JSON to these and back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decoderlm.errors import DecoderLMError
from decoderlm.inference.sampling import SamplingParams


@dataclass(frozen=True)
class RequestParams:
    """One request's generation options (OpenAI's names where they exist)."""

    max_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # text stop strings: the output ends before the first one
    seed: int | None = None  # its own torch.Generator: the same text alone or in a crowd
    logprobs: int | None = None  # None: none; k ≥ 0: the chosen token's logprob and the top-k
    stop_at_eot: bool = True  # end at the tokenizer's end-of-text token


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenEvent:
    """One step of one sequence: the new token, the text it releases (possibly ""), and, last, why it ended.

    `text` is UTF-8 safe and never holds a partial stop string; `finish_reason` is None until the
    last event of the sequence, then "stop" (end-of-text or a stop string), "length"
    (max_tokens or the context) or "cancelled".
    """

    token_id: int | None  # None on a final event that carries no token
    text: str
    logprob: float | None = None
    top_logprobs: tuple[TopLogprob, ...] = ()
    finish_reason: str | None = None


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
    kv_bytes_per_token: int  # 2 · n_layers · n_kv_heads · head_dim · dtype size
    prompt_tokens: int  # totals since start
    generated_tokens: int
    prefix_cache_hit_tokens: int  # prompt tokens whose KV blocks were reused
    max_running_seen: int  # the most sequences that ran at once since start
    tokens_per_s: float  # generated tokens per second over the last few seconds


class QueueFullError(DecoderLMError):
    """The engine's waiting queue is full: the request is refused (HTTP 429)."""
