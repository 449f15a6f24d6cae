"""Strategies that sample whole solutions and choose among them.

- `self_consistency`: Wang et al. (2022), "Self-Consistency Improves Chain of Thought Reasoning in
  Language Models": sample N solutions, extract their answers, majority vote.
- `best_of_n`: sample N, keep the best by a scorer: the mean log-probability, or a verifier
  (an exact checker, the oracle, as in Cobbe et al., 2021, "Training Verifiers to Solve Math Word
  Problems", or any user verifier).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

from decoderlm.search.base import (
    SOLUTION_END,
    Budget,
    Candidate,
    Extract,
    SearchResult,
    Verifier,
    best_result,
    check_positive,
)
from decoderlm.search.lm import Sample, SearchLM
from decoderlm.tasks import answer_line

Scorer = Callable[[str, Sample], float]  # best-of-N's score of a sample of a prompt


def mean_logprob(prompt: str, sample: Sample) -> float:
    """The sample's mean token log-probability under the model (−∞ for an empty sample)."""
    return sum(sample.logprobs) / len(sample.logprobs) if sample.logprobs else -math.inf


def by_verifier(verifier: Verifier) -> Scorer:
    """Best-of-N's scorer that asks `verifier` about the sample's text."""
    return lambda prompt, sample: verifier(prompt, sample.text)


def sample_solutions(
    lm: SearchLM,
    prompt: str,
    budget: Budget,
    n: int | None,
    max_tokens: int,
    temperature: float,
    stop: tuple[str, ...] = SOLUTION_END,
) -> list[Sample]:
    """Up to n solutions (None: as many as the budget allows), in batches, sampling while a
    whole solution of `max_tokens` still fits; a solution ends at end-of-text or a `stop` string
    (by default an empty line; () for a chat model, whose answer ends at its end-of-turn token)."""
    if n is not None:
        check_positive(n=n)
    wanted = math.inf if n is None else n
    samples: list[Sample] = []
    while (batch := int(min(wanted - len(samples), budget.left // max_tokens))) > 0:
        drawn = budget.sample(lm, [prompt], batch, max_tokens, stop, temperature)
        assert drawn is not None  # batch · max_tokens fits
        samples += drawn[0]
    return samples


def self_consistency(
    lm: SearchLM,
    prompt: str,
    budget: int,
    *,
    n: int | None = None,
    max_tokens: int = 256,
    temperature: float = 1.0,
    extract: Extract = answer_line,
    stop: tuple[str, ...] = SOLUTION_END,
) -> SearchResult:
    """Sample n solutions (default: as many as fit; each ending as `sample_solutions` says), take
    the answer most of them give."""
    check_positive(max_tokens=max_tokens)
    spend = Budget(budget)
    samples = sample_solutions(lm, prompt, spend, n, max_tokens, temperature, stop)
    answers = [extract(s.text) for s in samples]
    votes = Counter(a for a in answers if a is not None)
    winner = votes.most_common(1)[0][0] if votes else None
    candidates = tuple(
        Candidate(s.text, a, float(votes[a]) if a is not None else 0.0, s.tokens)
        for s, a in zip(samples, answers, strict=True)
    )
    text = next((c.text for c in candidates if c.answer == winner), "")
    return SearchResult("self-consistency", winner, text, candidates, spend.spent)


def best_of_n(
    lm: SearchLM,
    prompt: str,
    budget: int,
    *,
    scorer: Scorer = mean_logprob,
    n: int | None = None,
    max_tokens: int = 256,
    temperature: float = 1.0,
    extract: Extract = answer_line,
    stop: tuple[str, ...] = SOLUTION_END,
) -> SearchResult:
    """Sample n solutions (default: as many as fit; each ending as `sample_solutions` says), keep
    the one `scorer` rates highest."""
    check_positive(max_tokens=max_tokens)
    spend = Budget(budget)
    samples = sample_solutions(lm, prompt, spend, n, max_tokens, temperature, stop)
    candidates = tuple(
        Candidate(s.text, extract(s.text), scorer(prompt, s), s.tokens) for s in samples
    )
    return best_result("best-of-n", candidates, spend)
