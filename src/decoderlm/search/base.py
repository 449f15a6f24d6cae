"""What every search strategy shares: the solution format, the verifiers, the candidates and the
result a strategy returns, and the budget of generated tokens it may spend.

A solution is lines of text ending at an empty line (`SOLUTION_END`), the format of
`decoderlm.tasks`; a step is one line (`STEP_END`). A verifier scores a partial or full solution;
the exact ones (`oracle`, `process_oracle`) ask the task's checker, as the exact outcome verifier
of Cobbe et al. (2021), "Training Verifiers to Solve Math Word Problems". A strategy makes a call
to the model only if its most expensive outcome still fits the `Budget`, and its
`SearchResult.tokens` is what it spent, exactly, so strategies compare at equal compute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from decoderlm.errors import DecoderLMError
from decoderlm.search.lm import Sample, SearchLM
from decoderlm.tasks import Problem, Task

SOLUTION_END = ("\n\n",)  # a worked solution ends at an empty line
STEP_END = ("\n",)  # a step is a line
Extract = Callable[[str], "str | None"]  # a completion's answer (None: it gives none)


class Verifier(Protocol):
    """Scores a partial or full solution of a prompt, higher is better (e.g. 0 to 1).

    Any function `def verifier(prompt: str, solution: str) -> float` is one."""

    def __call__(self, prompt: str, solution: str) -> float: ...


def oracle(task: Task, problem: Problem) -> Verifier:
    """The exact outcome verifier: 1.0 if the task's checker accepts the solution, else 0.0."""
    return lambda prompt, solution: float(task.check(problem, solution))


def process_oracle(task: Task, problem: Problem) -> Verifier:
    """An exact process verifier for tasks with one solution path (arithmetic): 1.0 while the
    partial solution's lines are the worked solution's first lines or the checker accepts it."""
    reference = problem.solution.splitlines(keepends=True)

    def verify(prompt: str, solution: str) -> float:
        lines = solution.splitlines(keepends=True)
        on_path = lines == reference[: len(lines)]
        return float(on_path or task.check(problem, solution))

    return verify


Top = tuple[tuple[int, float], ...]  # a step's likeliest next tokens, (id, log-probability)


@dataclass(frozen=True)
class Candidate:
    """A solution a strategy considered: its text, answer, score and the tokens generated for it.
    Beam search also says why it ended ("stop": end-of-text or a stop string; "length"), and gives
    each generated token with its log-probability and the likeliest tokens of its step."""

    text: str
    answer: str | None
    score: float
    tokens: int
    finish: str | None = None
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    tops: tuple[Top, ...] = ()


@dataclass(frozen=True)
class SearchResult:
    """What a strategy chose (`answer`, `text`), every candidate with its score, and the generated
    tokens spent (≤ the budget)."""

    strategy: str
    answer: str | None
    text: str
    candidates: tuple[Candidate, ...]
    tokens: int


class Budget:
    """Generated tokens: the most a search may spend, and what it has spent."""

    def __init__(self, tokens: int) -> None:
        if not (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 1):
            raise DecoderLMError(f"budget={tokens!r} must be an integer ≥ 1 (generated tokens)")
        self.total, self.spent = tokens, 0

    @property
    def left(self) -> int:
        return self.total - self.spent

    def charge(self, tokens: int) -> None:
        self.spent += tokens
        if self.spent > self.total:
            raise AssertionError(f"spent {self.spent} tokens of a budget of {self.total}")

    def sample(
        self,
        lm: SearchLM,
        prompts: list[str],
        n: int,
        max_tokens: int,
        stop: tuple[str, ...],
        temperature: float,
    ) -> list[list[Sample]] | None:
        """`lm.sample`, charged; None (and nothing spent) if its longest outcome would not fit."""
        if len(prompts) * n * max_tokens > self.left:
            return None
        samples = lm.sample(prompts, n, max_tokens, stop, temperature)
        self.charge(sum(s.tokens for group in samples for s in group))
        return samples


def check_positive(**values: int) -> None:
    """A one-line error naming the first of `values` that is not an integer ≥ 1."""
    for name, value in values.items():
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise DecoderLMError(f"{name}={value!r} must be an integer ≥ 1")


def best_result(strategy: str, candidates: tuple[Candidate, ...], spend: Budget) -> SearchResult:
    """The result whose choice is the highest-scored candidate (the first of equals)."""
    best = max(candidates, key=lambda c: c.score, default=None)
    if best is None:
        return SearchResult(strategy, None, "", candidates, spend.spent)
    return SearchResult(strategy, best.answer, best.text, candidates, spend.spent)


def cut_at_stop(text: str, stop: tuple[str, ...] = SOLUTION_END) -> str:
    """`text` up to its first stop string (which a stop string misses when it straddles the prompt)."""
    for end in stop:
        text = text.split(end)[0]
    return text
