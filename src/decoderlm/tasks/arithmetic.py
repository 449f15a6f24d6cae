"""Multi-digit addition with a scratchpad (Nye et al., 2021, "Show Your Work"), one line a column.

Difficulty D: both operands have D digits. The worked solution adds from the right, each line
holding what is left of both operands, the carry and the result digits so far, so that every step
reads only the line above it::

    Q: 4821+357
    482+35 c0 r8
    48+3 c0 r78
    4+ c1 r178
    + c0 r5178
    answer: 5178
"""

from __future__ import annotations

import random

from decoderlm.tasks.base import Problem, Task, answer_line


def make(rng: random.Random, difficulty: int) -> Problem:
    """Two random `difficulty`-digit numbers to add."""
    low, high = 10 ** (difficulty - 1), 10**difficulty - 1
    a, b = rng.randint(low, high), rng.randint(low, high)
    return Problem(f"Q: {a}+{b}\n", scratchpad(a, b), str(a + b), (a, b))


def scratchpad(a: int, b: int) -> str:
    """The worked solution of a + b: one line a column, then the answer line."""
    left, right, carry, result, lines = str(a), str(b), 0, "", []
    while left or right:
        total = int(left[-1:] or 0) + int(right[-1:] or 0) + carry
        left, right, carry, result = left[:-1], right[:-1], total // 10, f"{total % 10}{result}"
        lines.append(f"{left}+{right} c{carry} r{result}")
    answer = f"{carry or ''}{result}"
    return "".join(line + "\n" for line in lines) + f"answer: {answer}\n"


def extract_answer(completion: str) -> str | None:
    """The integer of the completion's answer line, normalised (None: no integer answer)."""
    said = answer_line(completion)
    return str(int(said)) if said is not None and said.isdigit() else None


def check(problem: Problem, completion: str) -> bool:
    """Whether the completion's answer is the sum."""
    return extract_answer(completion) == problem.answer


ARITHMETIC = Task("arithmetic", 3, make, check, extract_answer)
