"""Where sampled tokens become `TokenEvent`s, after vLLM's OutputProcessor
(vllm/v1/engine/output_processor.py): text by an `IncrementalDecoder` (UTF-8 safe), stop strings
by a `StopMatcher`, log-probabilities and the top tokens, and why a sequence ended.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from decoderlm.engine.types import RequestParams, TokenEvent, TopLogprob
from decoderlm.inference.stream import IncrementalDecoder, StopMatcher


@dataclass(eq=False)
class SequenceOutput:
    """One sequence's detokenizer: sequence `index` of its request, from its prompt on."""

    tokenizer: Any
    index: int
    logprobs: int | None  # None: none; k ≥ 0: the chosen token's logprob and the top k
    decoder: IncrementalDecoder
    matcher: StopMatcher
    stop_ids: frozenset[int]  # the ids that end it: the model's (`eos_ids`) and the request's
    eos_ids: frozenset[int]  # the model's own among them (reported with stop_reason None)
    min_tokens: int  # no stop id or string ends it before this many tokens
    generated: int = 0

    @classmethod
    def create(
        cls, tokenizer: Any, params: RequestParams, index: int, prompt_ids: list[int]
    ) -> SequenceOutput:
        model_stops = getattr(tokenizer, "stop_ids", ())
        # ignore_eos goes on past the model's stop ids; a grammar ends at them (its stop tokens)
        eos = frozenset(() if params.ignore_eos and params.structured is None else model_stops)
        decoder = IncrementalDecoder(tokenizer, prompt_ids, params.skip_special_tokens)
        matcher = StopMatcher(params.stop, params.include_stop_str_in_output)
        stops = eos | frozenset(params.stop_token_ids)
        return cls(
            tokenizer, index, params.logprobs, decoder, matcher, stops, eos, params.min_tokens
        )

    def event(self, token: int, lp: Tensor | None, full: bool) -> TokenEvent:
        """The event of a new `token`: the text it releases, its logprob and top tokens from the
        row's log-probabilities lp (V,), and finish_reason "stop" (a stop id or string, with
        `stop_reason` the request's stop id or string; None for the model's own) or, when the
        sequence is `full` (max_tokens or the context), "length"."""
        self.generated += 1
        logprob, top = None, ()
        if self.logprobs is not None:
            logprob, top = float(lp[token]), top_logprobs(self.tokenizer, lp, self.logprobs)
        finish, reason, armed = None, None, self.generated >= self.min_tokens
        if token in self.stop_ids and armed:  # (the sampler masks them before min_tokens)
            text, finish = "", "stop"
            reason = None if token in self.eos_ids else token
        else:
            text = self.matcher.feed(self.decoder.add(token), armed)
            if self.matcher.stopped:
                finish, reason = "stop", self.matcher.stopped_at
            elif full:
                finish = "length"
        if finish is not None and not self.matcher.stopped:
            text += self.matcher.feed(self.decoder.flush(), armed)
            text += "" if self.matcher.stopped else self.matcher.flush()
        return TokenEvent(token, text, logprob, top, finish, self.index, reason)

    def ended(self, reason: str) -> TokenEvent:
        """The last event of a sequence that ends without a token ("length", "cancelled", "error")."""
        return TokenEvent(None, "", finish_reason=reason, index=self.index)


def top_logprobs(tokenizer: Any, lp: Tensor, k: int) -> tuple[TopLogprob, ...]:
    """The k likeliest tokens of one row of log-probabilities lp (V,), likeliest first."""
    if k == 0:
        return ()
    best = torch.topk(lp, min(k, lp.numel()))
    return tuple(
        TopLogprob(i, tokenizer.decode([i]), v)
        for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)
    )


def prompt_events(tokenizer: Any, ids: list[int], lp: Tensor, top: int) -> list[TokenEvent]:
    """A prompt's own tokens as events (`Engine.score`), from lp (T − 1, V), whose row t is
    log p(· | tokens ≤ t): token 0 has no logprob, token t has log p(token t | tokens < t) and the
    `top` likeliest tokens at t."""
    following = torch.tensor(ids[1:], device=lp.device)[:, None]  # (T − 1, 1)
    chosen = lp.gather(1, following)[:, 0].tolist()  # log p(token t + 1 | tokens ≤ t)
    decoder, events = IncrementalDecoder(tokenizer), []
    for t, token in enumerate(ids):
        text = decoder.add(token) + (decoder.flush() if t == len(ids) - 1 else "")
        if t == 0:
            events.append(TokenEvent(token, text))
        else:
            top_t = top_logprobs(tokenizer, lp[t - 1], top)
            events.append(TokenEvent(token, text, chosen[t - 1], top_t))
    return events
