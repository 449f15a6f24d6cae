"""Token-level beam search, length-normalised (Wu et al., 2016, GNMT), by the generated tokens or,
as vLLM's `length_penalty` (what the server uses), by the whole sequence."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from decoderlm.errors import DecoderLMError
from decoderlm.search.base import (
    SOLUTION_END,
    Budget,
    Candidate,
    Extract,
    SearchResult,
    Top,
    best_result,
    check_positive,
    cut_at_stop,
)
from decoderlm.search.lm import SearchLM
from decoderlm.tasks import answer_line


@dataclass(frozen=True)
class _Beam:
    ids: tuple[int, ...]
    logprob: float  # Σ logprobs, summed in order
    logprobs: tuple[float, ...] = ()
    tops: tuple[Top, ...] = ()


def beam_search(
    lm: SearchLM,
    prompt: str | Sequence[int],
    budget: int,
    *,
    width: int = 4,
    max_tokens: int = 256,
    alpha: float = 1.0,
    length: Literal["generated", "sequence"] = "generated",
    stop: tuple[str, ...] = SOLUTION_END,
    top: int = 0,
    extract: Extract = answer_line,
) -> SearchResult:
    """Token-level beam search: each step extends every live beam by its `width` likeliest next
    tokens (one generated token per beam) and keeps the `width` best by length-normalised
    log-probability, logprob / L^alpha, where `length` says what L counts:

    - "generated" (the default, GNMT's length normalisation): the beam's generated tokens,
      end-of-text included;
    - "sequence" (vLLM's `get_beam_search_score`, vllm/beam_search.py, what its `length_penalty`
      means and the server's `use_beam_search` uses): prompt and generated tokens, less one if the
      last is end-of-text.

    A beam ends at end-of-text or a `stop` string (by default the solution's end), or with
    "length" when it fills the model's context; the result is the best ended or live beam. Each candidate carries its tokens' log-probabilities and, with
    `top` > 0, each step's `top` likeliest tokens (the steps then ask for max(width, top) of them
    and extend a beam by the first `width`). `prompt`: text, or its token ids."""
    check_positive(width=width, max_tokens=max_tokens)
    if length not in ("generated", "sequence"):
        raise DecoderLMError(f"length={length!r} must be 'generated' or 'sequence'")
    spend = Budget(budget)
    prompt_ids = lm.encode(prompt) if isinstance(prompt, str) else list(prompt)
    beams, ended, full = [_Beam((), 0.0)], [], []  # full: at the model's context, no next token

    def score(beam: _Beam) -> float:
        counted = len(beam.ids)
        if length == "sequence":  # an empty prompt's lone end-of-text counts one, not zero
            counted = max(len(prompt_ids) + counted - (beam.ids[-1] in lm.stop_ids), 1)
        return beam.logprob / counted**alpha

    for _ in range(max_tokens):
        if not beams or len(beams) > spend.left:
            break
        tops = lm.next_token_logprobs([prompt_ids + list(b.ids) for b in beams], max(width, top))
        spend.charge(sum(1 for step in tops if step))
        full += [b for b, step in zip(beams, tops, strict=True) if not step]
        grown = [
            _Beam((*b.ids, t), b.logprob + lp, (*b.logprobs, lp), (*b.tops, tuple(step[:top])))
            for b, step in zip(beams, tops, strict=True)
            for t, lp in step[:width]
        ]
        grown.sort(key=score, reverse=True)
        beams = []
        for beam in grown[:width]:
            (ended if _ends(lm, beam.ids, stop) else beams).append(beam)
    candidates = []
    for b, finish in [(b, "stop") for b in ended] + [(b, "length") for b in full + beams]:
        text = _solution_text(lm, b.ids, stop)
        candidates.append(
            Candidate(text, extract(text), score(b), len(b.ids), finish, b.ids, b.logprobs, b.tops)
        )
    return best_result("beam", tuple(candidates), spend)


def _ends(lm: SearchLM, ids: tuple[int, ...], stop: tuple[str, ...]) -> bool:
    return ids[-1] in lm.stop_ids or any(end in lm.decode(ids) for end in stop)


def _solution_text(lm: SearchLM, ids: tuple[int, ...], stop: tuple[str, ...]) -> str:
    """The text of generated ids, without end-of-text and cut before the first stop string."""
    return cut_at_stop(lm.decode([t for t in ids if t not in lm.stop_ids]), stop)
