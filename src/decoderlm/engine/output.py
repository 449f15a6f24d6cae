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
    eot: int | None  # the end-of-text token that ends it, if it stops there

    @classmethod
    def create(
        cls, tokenizer: Any, params: RequestParams, index: int, prompt_ids: list[int]
    ) -> SequenceOutput:
        stops = params.stop_at_eot or params.structured is not None  # a grammar ends at eot
        eot = getattr(tokenizer, "eot_id", None) if stops else None
        decoder = IncrementalDecoder(tokenizer, prompt_ids)
        return cls(tokenizer, index, params.logprobs, decoder, StopMatcher(params.stop), eot)

    def event(self, token: int, lp: Tensor | None, full: bool) -> TokenEvent:
        """The event of a new `token`: the text it releases, its logprob and top tokens from the
        row's log-probabilities lp (V,), and finish_reason "stop" (end-of-text or a stop string)
        or, when the sequence is `full` (max_tokens or the context), "length"."""
        logprob, top = None, ()
        if self.logprobs is not None:
            logprob, top = float(lp[token]), top_logprobs(self.tokenizer, lp, self.logprobs)
        finish = None
        if token == self.eot:
            text, finish = "", "stop"
        else:
            text = self.matcher.feed(self.decoder.add(token))
            if self.matcher.stopped:
                finish = "stop"
            elif full:
                finish = "length"
        if finish is not None and not self.matcher.stopped:
            text += self.matcher.feed(self.decoder.flush())
            text += "" if self.matcher.stopped else self.matcher.flush()
        return TokenEvent(token, text, logprob, top, finish, self.index)

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
