"""Where the engine's logits become tokens, after vLLM's Sampler (vllm/v1/sample/sampler.py).

`sample` takes one forward pass's logits (B, V) and each row's `SamplingState` and returns each
row's token and log-probabilities. It is the one place where tokens are chosen:

- logits are masked at the top of `sample`, before any token is chosen: the ids past the
  tokenizer's vocabulary (a model's padded embedding rows, which cannot be decoded) are never
  chosen; logit processors go there too: a structured output's grammar masks the tokens it
  forbids next (`decoderlm.inference.structured`), row by row, and a request's stop ids are
  masked until its min_tokens are generated (`SamplingState.hold`);
- a chosen token is accepted in `SamplingState.accept`, where it joins the sequence's sampler
  state and advances its grammar's matcher: speculative decoding's acceptance of draft tokens goes
  there.

Every sequence samples with its own `SamplingParams` and `torch.Generator`, so its tokens do not
depend on what else is in the batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor

from decoderlm.engine.types import RequestParams
from decoderlm.inference import speculative
from decoderlm.inference.prompts import make_generator
from decoderlm.inference.sampling import SamplingParams, greedy_tokens, sample_next
from decoderlm.inference.structured import Matcher, StructuredGrammar, mask_logits

log = logging.getLogger(__name__)


@dataclass(eq=False)
class SamplingState:
    """One sequence's sampler: its parameters, its generator, the tokens it holds."""

    params: SamplingParams
    generator: torch.Generator | None
    seen: Tensor | None  # (1, V) bool: tokens in the sequence, for the repetition penalty
    logprobs: bool  # whether its tokens report log-probabilities
    grammar: Matcher | None = None  # its structured output's place in its grammar
    held: list[int] = field(default_factory=list)  # ids masked until min_tokens are generated
    min_tokens: int = 0
    generated: int = 0  # tokens accepted so far

    @classmethod
    def create(
        cls,
        params: RequestParams,
        index: int,
        prompt_ids: list[int],
        vocab_size: int,
        device: torch.device,
        grammar: StructuredGrammar | None = None,
        stop_ids: frozenset[int] = frozenset(),
    ) -> SamplingState:
        """Sample `index` of a request draws from seed + index: sample 0 equals a solo run with
        `seed`. Each sample has its own matcher of `grammar`. `stop_ids` (the ids that end the
        sequence) are masked until `params.min_tokens` tokens are generated, as vLLM's
        min_tokens logits processor does."""
        seen = None
        if params.sampling.repetition_penalty != 1.0:
            seen = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)
            seen[0, prompt_ids] = True
        generator = make_generator(params.seed, device, index)
        matcher = None if grammar is None else grammar.matcher()
        held = sorted(stop_ids) if params.min_tokens else []
        logprobs = params.logprobs is not None
        return cls(params.sampling, generator, seen, logprobs, matcher, held, params.min_tokens)

    @property
    def greedy(self) -> bool:
        """Its token is the argmax of the raw logits: temperature 0, no repetition penalty."""
        return self.params.temperature == 0 and self.seen is None

    def accept(self, token: int) -> None:
        """`token` joins the sequence: the repetition penalty counts it from now on, and its
        grammar's matcher advances (DecoderLMError if the grammar forbids it)."""
        self.generated += 1
        if self.seen is not None:
            self.seen[0, token] = True
        if self.grammar is not None:
            self.grammar.accept(token)

    def hold(self, logits: Tensor, ahead: int = 0) -> None:
        """Mask, in place, the held stop ids of logits (V,) of the token `ahead` tokens after the
        next, while fewer than min_tokens are generated before it."""
        if self.held and self.generated + ahead < self.min_tokens:
            logits[self.held] = float("-inf")


@dataclass(frozen=True)
class Sampled:
    """One row's choice: its token and, if it reports them, the row's log-probabilities."""

    token: int
    logprobs: Tensor | None  # (V,) raw: before the repetition penalty and the temperature


def mask_undecodable(logits: Tensor, decodable: int | None) -> None:
    """Set to -inf, in place, the logits (..., V) of the ids from `decodable` on: a vocabulary
    padded past its tokenizer's (None: every id decodes)."""
    if decodable is not None and decodable < logits.shape[-1]:
        logits[..., decodable:] = float("-inf")


def sample(
    logits: Tensor, states: list[SamplingState | None], decodable: int | None = None
) -> list[Sampled | None]:
    """Each row's next token from one forward pass's logits (B, V) in float32, among the first
    `decodable` ids (all if None): the others are masked to -inf, in place, as are the tokens a
    row's grammar forbids next.

    states[i] None: row i is not sampled (a prefill chunk short of its prompt's end). One tensor
    operation over all rows gives every greedy row its token (argmax, the one-row operation's);
    a row that reports log-probabilities takes them from its own row alone (`_logprobs`). The
    other rows sample one by one, each from its own generator. A row whose sampling raises gets None (logged), as
    does a row not sampled; the engine ends the first's sequence with "error", the others go on.
    """
    mask_undecodable(logits, decodable)
    mask_logits(logits, [None if state is None else state.grammar for state in states])
    for i, state in enumerate(states):
        if state is not None and state.held:
            state.hold(logits[i])
    greedy = [state is not None and state.greedy for state in states]
    wants_lp = [state is not None and state.logprobs for state in states]
    tokens = greedy_tokens(logits).tolist() if any(greedy) else [None] * len(states)  # (B,)
    lps = [_logprobs(row) if wants else None for row, wants in zip(logits, wants_lp, strict=True)]
    chosen: list[Sampled | None] = []
    for i, state in enumerate(states):
        token = tokens[i] if greedy[i] else None
        if state is not None:
            try:
                if token is None:
                    token = int(
                        sample_next(logits[i][None], state.params, state.seen, state.generator)
                    )
                state.accept(token)
            except Exception:
                log.exception("decoderlm sampler: sampling failed; its sequence ends with 'error'")
                token = None
        if state is None or token is None:
            chosen.append(None)
            continue
        chosen.append(Sampled(token, lps[i]))
    return chosen


def verify(
    logits: Tensor,
    state: SamplingState,
    tokens: list[int],
    drafts: list[int],
    decodable: int | None,
    q: Tensor | None = None,
) -> list[Sampled]:
    """Speculative decoding's choice for one sequence: its accepted `drafts` (proposed after
    `tokens`, drawn from q (k, V) float64 by a draft model, or None: by prompt lookup, q one-hot)
    and the next token, from the logits (k + 1, V) float32 of the pass that ran its last token and
    the drafts, masked as in `sample`; each is accepted in `state`
    (`decoderlm.inference.speculative.verify`: the target's distribution is kept; for a greedy
    sequence, what it comes to without its arithmetic: the drafts up to the first that is not the
    argmax, then the argmax)."""
    mask_undecodable(logits, decodable)
    for ahead, row in enumerate(logits):
        state.hold(row, ahead)
    if state.greedy:  # p one-hot at the argmax: d_i is accepted iff it is the argmax
        best = greedy_tokens(logits).tolist()  # (k + 1,)
        n = next((i for i, d in enumerate(drafts) if d != best[i]), len(drafts))
        token = best[n]
    else:
        n, token = speculative.verify(tokens, drafts, logits, q, state.params, state.generator)
    lps = [_logprobs(row) if state.logprobs else None for row in logits[: n + 1]]
    chosen = []
    for i, t in enumerate([*drafts[:n], token]):
        state.accept(t)
        chosen.append(Sampled(t, lps[i]))
    return chosen


def _logprobs(row: Tensor) -> Tensor:
    """log softmax of one row of logits (V,), alone: a row's log-probabilities then do not depend
    on the rows computed with it (a batched log_softmax's vectorisation over a short vocabulary
    can run across rows)."""
    return torch.log_softmax(row, dim=-1)
