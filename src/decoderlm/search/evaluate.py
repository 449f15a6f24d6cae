"""A strategy on a task's problems: each problem searched with the same budget of generated tokens,
its chosen completion checked exactly; accuracy and the tokens spent (`decoderlm search`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from decoderlm.errors import DecoderLMError
from decoderlm.search import STRATEGY_NAMES
from decoderlm.search.lm import SearchLM
from decoderlm.search.strategies import (
    SearchResult,
    Verifier,
    beam_search,
    best_of_n,
    by_verifier,
    mcts,
    mean_logprob,
    oracle,
    process_oracle,
    self_consistency,
    step_beam_search,
)
from decoderlm.tasks import Problem, Task


@dataclass(frozen=True)
class SearchOptions:
    """How a strategy searches: `n` samples (self-consistency, best-of-n; None: as many as the
    budget allows) or beams (beam, step-beam), `expand` steps sampled per expansion (step-beam,
    mcts), at most `max_tokens` a solution (or a step, for the step-level strategies), and
    best-of-n ranked by the exact checker (`oracle`), a `verifier` or mean log-probability. The
    step-level strategies are guided by `verifier`, else the task's process oracle
    (`process_oracle`); MCTS widens its nodes progressively with exponent `widening` (0: expands
    each node once)."""

    n: int | None = None
    expand: int = 4
    max_tokens: int = 128
    temperature: float = 1.0
    oracle: bool = False
    verifier: Verifier | None = None
    widening: float = 0.0


@dataclass(frozen=True)
class Score:
    """A strategy's results on problems: how many were solved, and the generated tokens spent."""

    problems: int
    correct: int
    tokens: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.problems


def search(
    lm: SearchLM,
    task: Task,
    problem: Problem,
    strategy: str,
    budget: int,
    options: SearchOptions,
) -> SearchResult:
    """`strategy` on one problem within `budget` generated tokens."""
    o, prompt, extract = options, problem.prompt, task.extract_answer
    if strategy == "self-consistency":
        return self_consistency(
            lm,
            prompt,
            budget,
            n=o.n,
            max_tokens=o.max_tokens,
            temperature=o.temperature,
            extract=extract,
        )
    if strategy == "best-of-n":
        scorer = mean_logprob
        if o.oracle or o.verifier is not None:
            scorer = by_verifier(oracle(task, problem) if o.oracle else o.verifier)
        return best_of_n(
            lm,
            prompt,
            budget,
            scorer=scorer,
            n=o.n,
            max_tokens=o.max_tokens,
            temperature=o.temperature,
            extract=extract,
        )
    if strategy == "beam":
        return beam_search(
            lm, prompt, budget, width=o.n or 4, max_tokens=o.max_tokens, extract=extract
        )
    guide = o.verifier if o.verifier is not None else process_oracle(task, problem)
    if strategy == "step-beam":
        return step_beam_search(
            lm,
            prompt,
            budget,
            guide,
            width=o.n or 4,
            expand=o.expand,
            step_tokens=o.max_tokens,
            temperature=o.temperature,
            extract=extract,
        )
    if strategy == "mcts":
        return mcts(
            lm,
            prompt,
            budget,
            guide,
            expand=o.expand,
            step_tokens=o.max_tokens,
            widening=o.widening,
            temperature=o.temperature,
            extract=extract,
        )
    raise DecoderLMError(
        f"unknown strategy {strategy!r}; the strategies are {', '.join(STRATEGY_NAMES)}"
    )


def evaluate(
    lm: SearchLM,
    task: Task,
    problems: Sequence[Problem],
    strategy: str,
    budget: int,
    options: SearchOptions,
    progress: bool = True,
) -> Score:
    """`strategy` on every problem, `budget` tokens each; the chosen completions checked exactly."""
    correct = tokens = 0
    with tqdm(problems, desc=strategy, unit="problem", disable=not progress) as bar:
        for done, problem in enumerate(bar, 1):
            result = search(lm, task, problem, strategy, budget, options)
            correct += task.check(problem, result.text)
            tokens += result.tokens
            bar.set_postfix(accuracy=f"{correct / done:.0%}", tokens=tokens)
    return Score(len(problems), correct, tokens)
