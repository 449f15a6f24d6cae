"""Speculative decoding: a cheap proposer guesses K tokens, the target model checks them in one pass.

Speculative sampling (Leviathan et al., 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al., 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"): a proposer drafts d_1 … d_k, drawn from its distributions q_1 … q_k; one forward pass
of the target over [t, d_1 … d_k] (t: the last token chosen) gives its distributions p_1 … p_{k+1};
d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)), in order, and at the first rejection
the next token is drawn from norm(max(0, p_i − q_i)); when all k are accepted, a bonus token is
drawn from p_{k+1}. Every token so chosen is distributed exactly as the target's sampling
(`decoderlm.inference.sampling.token_probs`: temperature, top-k, top-p, repetition penalty), and
with temperature 0 (p, q one-hot) the output is plain greedy's, token for token. The rejected
tokens' keys and values are rolled back (`LayerCache.rollback`).

Recurrent layers (`ModelConfig.layer_types`): a state S_t = f(S_{t−1}, x_t) cannot forget its last
tokens, so the cache keeps a copy of it before the tokens that may be rejected (`checkpoint()`:
the target's before each verification pass, a draft model's before its drafts); a rejection
restores that copy, rolls the attention layers back as far (`LayerCaches.rollback` returns the
tokens forgotten), and the kept tokens are written again: by the target at once, one more pass
over [t, d_1 … d_n] (only after a rejection; a proposal accepted whole keeps its state), by a
draft model with its next proposal. Same tokens at the same positions: the same keys, values and
states, so greedy output stays plain greedy's.

Proposers: `DraftModel` (any `DecoderLM` with the target's vocabulary, e.g. a smaller one, sampled
with the same parameters) and `PromptLookup` (Saxena, 2023, "Prompt Lookup Decoding"; Hugging
Face's `prompt_lookup_num_tokens`): the tokens that followed the latest earlier occurrence of the
row's last n-gram. Prompt lookup is deterministic (q one-hot), so its token d is accepted with
probability p(d), and on rejection the next token is drawn from p with d removed.

`AdaptiveK` chooses how many tokens to propose at each step: Hugging Face's heuristic schedule
and a back-off when nothing is accepted, so that a proposer that is always wrong costs little.

Sliding windows: a full ring (`RingKVCache`) forgets at most 1 token, so once a row is past a
window the proposals shrink to what its caches can roll back (`rollback_room`).

Batches: each row is decoded alone (B = 1, its own caches), one row after the other, since the
static cache's rollback is whole-batch and rows accept different counts; speculation pays where
decoding is latency-bound, at batch 1.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from decoderlm.errors import DecoderLMError
from decoderlm.inference.options import DecodeOptions
from decoderlm.inference.prompts import check_lengths
from decoderlm.inference.sampling import SamplingParams, draw, sample_next, token_probs
from decoderlm.model.cache import CacheStep, HybridCache, RingKVCache, StaticKVCache
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM

logger = logging.getLogger(__name__)

PROMPT_LOOKUP = "prompt-lookup"
# Tokens proposed per step when num_speculative_tokens is not given.
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
# `AdaptiveK`: plain steps after a fruitless proposal grow as 2^f − 1, f failures in a row, to this.
MAX_BACKOFF_STEPS = 63

Draft = DecoderLM | str


@dataclass
class SpeculativeStats:
    """Counts over a speculative generation (summed over its rows).

    proposed / accepted: proposed tokens, and those the target accepted; verifications: target
    passes that checked ≥ 1 proposed token; steps: target passes after the prefills (those writing
    accepted tokens again into recurrent layers included); tokens: the
    tokens generated (the prefills' first tokens included)."""

    proposed: int = 0
    accepted: int = 0
    verifications: int = 0
    steps: int = 0
    tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed (0 when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted tokens per verification (the bonus or corrected token not counted)."""
        return self.accepted / self.verifications if self.verifications else 0.0

    def __str__(self) -> str:
        return (
            f"speculative decoding: acceptance rate {self.acceptance_rate:.3f} "
            f"({self.accepted}/{self.proposed} proposed tokens), mean accepted length "
            f"{self.mean_accepted_length:.2f} over {self.verifications} verifications, "
            f"{self.tokens} tokens in {self.steps} target steps"
        )


class Proposer(Protocol):
    """Guesses the next tokens of one row that `generate` decodes alone (B = 1, over its own
    cache). The engine's proposers (`decoderlm.engine.proposers`) guess for every speculating
    sequence of a batch at once, over the paged pool; their prompt lookup runs this one's."""

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], Tensor | None]:
        """Up to k tokens to follow `tokens` (the row so far), and the distributions (k', V)
        float64 they were drawn from; None: chosen deterministically (q one-hot)."""
        ...

    def accepted(self, n: int) -> None:
        """The target accepted the first n tokens of the last proposal."""
        ...


class PromptLookup:
    """Proposes the tokens that followed the latest earlier occurrence of the row's last n-gram,
    trying n = max_ngram first, down to 1 (Saxena, 2023). Stateless; q is one-hot."""

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], Tensor | None]:
        for n in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # the latest occurrence first
                if tokens[start] == tail[0] and tokens[start : start + n] == tail:
                    return tokens[start + n : start + n + k], None
        return [], None

    def accepted(self, n: int) -> None:
        pass


class DraftModel:
    """Proposes by sampling a draft model k times, over a static cache of its own (B = 1).

    The cache holds the row's tokens it has seen; a proposal feeds what it has not (the prompt at
    first, then the tokens chosen since), then, after a `checkpoint`, its own drafts
    d_1 … d_{k−1}; `accepted` rolls back those the target rejected (with recurrent layers, every
    draft: the next proposal feeds the accepted ones again)."""

    def __init__(
        self,
        model: DecoderLM,
        params: SamplingParams,
        max_len: int,
        generator: torch.Generator | None,
        options: DecodeOptions,
    ) -> None:
        self.model, self.params, self.generator, self.options = model, params, generator, options
        self.cache = options.cache(model, 1, max_len)
        self.held = 0  # tokens in the cache
        self.k = 0  # tokens of the last proposal

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], Tensor | None]:
        # It holds len(tokens) + k − 1 tokens after, and may have to forget k − 1 of them.
        while k > 2 and rollback_room(self.model.config, len(tokens) + k - 1) < k - 1:
            k -= 1
        drafts: list[int] = []
        q: list[Tensor] = []
        feed = tokens[self.held :]
        for i in range(k):
            logits = forward(self.model, self.cache, feed, self.held, self.options, True)[:, -1]
            self.held += len(feed)
            if i == 0:  # the row's tokens are held; the drafts after them may be rolled back
                self.cache.checkpoint()
            probs = token_probs(logits, self.params, seen(tokens + drafts, self.params, logits))
            drafts.append(int(draw(probs, self.generator)))
            q.append(probs[0])  # (V,)
            feed = drafts[-1:]
        self.k = k
        return drafts, torch.stack(q)  # (k, V)

    def accepted(self, n: int) -> None:
        drop = (self.k - 1) - min(n, self.k - 1)  # the cache holds d_1 … d_{k−1}
        self.held -= self.cache.rollback(drop)


class AdaptiveK:
    """How many tokens to propose next, within [1, K]: Hugging Face's heuristic schedule (k + 2
    after a proposal accepted whole, else k − 1), and after f fruitless proposals in a row,
    2^f − 1 plain steps (at most `MAX_BACKOFF_STEPS`) before the next."""

    def __init__(self, k_max: int) -> None:
        self.k_max = self.k = k_max
        self.failures = 0  # proposals in a row with nothing accepted
        self.wait = 0  # plain steps left before the next proposal

    def next(self) -> int:
        """The tokens to propose at this step; 0: a plain step."""
        if self.wait:
            self.wait -= 1
            return 0
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        self.k = min(self.k_max, self.k + 2) if accepted == proposed else max(1, self.k - 1)
        self.failures = 0 if accepted else self.failures + 1
        self.wait = min(2**self.failures - 1, MAX_BACKOFF_STEPS)


def accept(
    drafts: Tensor, p: Tensor, q: Tensor | None, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """Rejection sampling of proposed tokens, row by row of a batch.

    drafts (B, k) proposed ids; p (B, k + 1, V) the target's distributions at each draft's
    position and the one after; q (B, k, V) the proposer's (None: one-hot at the drafts).
    Returns (accepted (B,), token (B,)): the leading drafts accepted, each with probability
    min(1, p(d) / q(d)), and the next token: from norm(max(0, p − q)) at the first rejection,
    from p_{k+1} when all k were accepted.
    """
    b, k, v = drafts.shape[0], drafts.shape[1], p.shape[-1]
    if q is None:
        q = torch.nn.functional.one_hot(drafts, v).to(p.dtype)  # (B, k, V)
    p_d = p[:, :k].gather(2, drafts[:, :, None]).squeeze(2)  # (B, k) p_i(d_i)
    q_d = q.gather(2, drafts[:, :, None]).squeeze(2)  # (B, k) q_i(d_i) > 0: d_i ~ q_i
    u = torch.rand(b, k, dtype=p.dtype, generator=generator, device=p.device)  # (B, k)
    ok = u * q_d < p_d  # u < p/q: accepted with probability min(1, p/q)
    n = ok.long().cumprod(dim=1).sum(dim=1)  # (B,) the leading run of acceptances
    rows = torch.arange(b, device=p.device)
    q_next = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1)  # (B, k + 1, V): q_{k+1} = 0
    residual = (p[rows, n] - q_next[rows, n]).clamp(min=0)  # (B, V) max(0, p − q); = p_{k+1}
    return n, draw(residual, generator)  # draw normalises


def verify(
    tokens: list[int],
    drafts: list[int],
    logits: Tensor,
    q: Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """(accepted, next token) of one row's k drafts after `tokens`, from the target's logits
    (k + 1, V) at [t, d_1 … d_k] and the proposer's q (k, V) (None: one-hot): `accept`, with the
    repetition penalty of position i counting the drafts before it."""
    penalty = [seen(tokens + drafts[:i], params, logits) for i in range(len(drafts) + 1)]
    p = token_probs(logits, params, None if penalty[0] is None else torch.cat(penalty))  # (k+1, V)
    d = torch.tensor([drafts], device=logits.device)  # (1, k)
    n, token = accept(d, p[None], None if q is None else q[None], generator)
    return int(n[0]), int(token[0])


def seen(tokens: list[int], params: SamplingParams, like: Tensor) -> Tensor | None:
    """(1, V) bool: the tokens of the row, for the repetition penalty; None without one."""
    if params.repetition_penalty == 1.0:
        return None
    mask = torch.zeros(1, like.shape[-1], dtype=torch.bool, device=like.device)
    mask[0, tokens] = True
    return mask


def rollback_room(config: ModelConfig, end: int) -> int:
    """The most tokens a cache of `config` holding `end` may roll back: all of them in static
    buffers and in rings not yet full, 1 once a ring of W slots has held more than W
    (`RingKVCache.rollback`: the forgotten tokens overwrote keys still needed)."""
    w = config.sliding_window
    return end if w is None or end <= w else 1


def forward(
    model: DecoderLM,
    cache: StaticKVCache | RingKVCache | HybridCache,
    tokens: list[int],
    start: int,
    options: DecodeOptions,
    last_only: bool = False,
) -> Tensor:
    """Logits (1, T, V), float32, of T tokens written at cache positions start … start + T − 1
    ((1, 1, V): the last token's only, with last_only)."""
    device = model.tok_emb.weight.device
    cache.seek(CacheStep.span(start, len(tokens), device))
    idx = torch.tensor([tokens], device=device)  # (1, T)
    positions = torch.arange(start, start + len(tokens), device=device)[None]  # (1, T)
    # The linear kernels on the prefill (start 0) only: on a few tokens their Python hook on every
    # op costs more than it saves (3× on a 5-token verification).
    with options.paths.linear(start == 0 and len(tokens) > 1):
        return model(idx, positions, None, cache, last_only=last_only).float()


def check(
    model: DecoderLM,
    draft: Draft,
    num_speculative_tokens: int,
    rows: list[list[int]],
    max_new_tokens: int,
    options: DecodeOptions,
) -> None:
    """DecoderLMError unless `model` can decode `rows` speculatively with `draft`."""
    k = num_speculative_tokens
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise DecoderLMError(f"num_speculative_tokens={k!r} must be an integer ≥ 1")
    if not (isinstance(draft, DecoderLM) or draft == PROMPT_LOOKUP):
        raise DecoderLMError(f"draft={draft!r} must be a DecoderLM or {PROMPT_LOOKUP!r}")
    if options.compile or options.refill_past_context:
        raise DecoderLMError(
            "speculative decoding does not support compile or refill_past_context; drop them"
        )
    for m in [model, draft] if isinstance(draft, DecoderLM) else [model]:
        check_lengths(rows, max_new_tokens, m.config.context_length, m.config.decodes_past_context)
    if isinstance(draft, DecoderLM):
        if draft.config.vocab_size != model.config.vocab_size:
            raise DecoderLMError(
                f"the draft model's vocab_size={draft.config.vocab_size} differs from the "
                f"target's {model.config.vocab_size}: they must share a vocabulary"
            )
        if draft.tok_emb.weight.device != model.tok_emb.weight.device:
            raise DecoderLMError("the draft model must be on the target model's device")


def speculative_rows(
    model: DecoderLM,
    rows: list[list[int]],
    max_new_tokens: int,
    params: SamplingParams,
    draft: Draft,
    num_speculative_tokens: int,
    generator: torch.Generator | None = None,
    options: DecodeOptions | None = None,
    stops: tuple[int, ...] = (),
    stats: SpeculativeStats | None = None,
) -> list[list[int]]:
    """Each row followed by its up to `max_new_tokens` new ids (ending at the first of `stops`),
    decoded speculatively row by row; `stats` (when given) counts proposals and acceptances.

    Call it under `torch.inference_mode()` with the models in eval mode and `options.paths`
    applied (`decoderlm.inference.generate.generate` does all three); `check` first.
    """
    options = DecodeOptions() if options is None else options
    stats = SpeculativeStats() if stats is None else stats
    out = []
    for row in rows:
        proposer: Proposer = (
            PromptLookup()
            if draft == PROMPT_LOOKUP
            else DraftModel(draft, params, len(row) + max_new_tokens, generator, options)
        )
        new: list[int] = []
        for token in speculative_tokens(
            model,
            row,
            max_new_tokens,
            params,
            proposer,
            num_speculative_tokens,
            generator,
            options,
            stats,
        ):
            new.append(token)
            if token in stops:
                break
        out.append(row + new)
    logger.info("%s", stats)
    return out


def speculative_tokens(
    model: DecoderLM,
    row: list[int],
    max_new_tokens: int,
    params: SamplingParams,
    proposer: Proposer,
    num_speculative_tokens: int,
    generator: torch.Generator | None,
    options: DecodeOptions,
    stats: SpeculativeStats,
) -> Iterator[int]:
    """Yield the `max_new_tokens` new ids of one row, decoded speculatively.

    The target's cache holds the row but its last token t; a step writes [t, d_1 … d_k] at
    positions n … n + k, keeps t and the accepted drafts, and rolls back the rest (with recurrent
    layers, all of them after a rejection, then writes t, d_1 … d_n again)."""
    if max_new_tokens == 0:
        return
    cache = options.cache(model, 1, len(row) + max_new_tokens)
    logits = forward(model, cache, row, 0, options, last_only=True)[:, -1]  # (1, V)
    tokens = [*row, int(draw(token_probs(logits, params, seen(row, params, logits)), generator))]
    stats.tokens += 1
    yield tokens[-1]
    schedule = AdaptiveK(num_speculative_tokens)
    while len(tokens) - len(row) < max_new_tokens:
        room = max_new_tokens - (len(tokens) - len(row)) - 1  # the step adds one token of its own
        k = min(schedule.next(), room)
        while k > 1 and rollback_room(model.config, len(tokens) + k) < k:  # end: n + k + 1
            k -= 1
        drafts, q = proposer.propose(tokens, k) if k else ([], None)
        k = len(drafts)
        if k:
            cache.checkpoint()
        logits = forward(model, cache, tokens[-1:] + drafts, len(tokens) - 1, options)[0]
        if k:
            n, token = verify(tokens, drafts, logits, q, params, generator)
            kept = k + 1 - cache.rollback(k - n)  # of t, d_1 … d_n; 0 after a recurrent restore
            if kept < n + 1:  # write the rest again: the same keys, values and states
                again = (tokens[-1:] + drafts)[kept : n + 1]
                forward(model, cache, again, len(tokens) - 1 + kept, options, last_only=True)
                stats.steps += 1
            proposer.accepted(n)
            schedule.update(k, n)
            stats.proposed += k
            stats.accepted += n
            stats.verifications += 1
        else:  # a plain step
            n, token = 0, int(sample_next(logits, params, seen(tokens, params, logits), generator))
        stats.steps += 1
        stats.tokens += n + 1
        tokens += [*drafts[:n], token]
        yield from tokens[-(n + 1) :]
