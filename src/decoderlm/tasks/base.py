"""What every task is: `Problem`, `Task` (seeded problems by split), the answer line, a corpus."""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from decoderlm.errors import DecoderLMError

SPLITS = ("train", "test")
TEST_SHARE = 10  # one prompt in this many is in the test split
MAX_DRAWS = 100  # problems drawn per problem returned before a split counts as too small
_ANSWER = re.compile(r"^answer:[ \t]*(.*\S)[ \t]*$", re.MULTILINE)


@dataclass(frozen=True)
class Problem:
    """One problem: what the model is given, a worked solution, the reference answer, and what the
    checker needs (`data`: the operands, or the numbers and the target)."""

    prompt: str
    solution: str  # the steps, one a line, then "answer: ...\n"
    answer: str
    data: tuple[Any, ...]

    @property
    def text(self) -> str:
        """The prompt and its worked solution: one example of a training corpus."""
        return self.prompt + self.solution


@dataclass(frozen=True)
class Task:
    """A task: `make(rng, difficulty)` draws a problem, `check` accepts or refuses a completion,
    `extract_answer` reads the answer a completion gives (None: it gives none)."""

    name: str
    default_difficulty: int
    make: Callable[[random.Random, int], Problem]
    check: Callable[[Problem, str], bool]
    extract_answer: Callable[[str], str | None]

    def problems(
        self, n: int, difficulty: int | None = None, seed: int = 0, split: str = "test"
    ) -> list[Problem]:
        """n problems of `split` at `difficulty` (default: the task's), the same for the same seed."""
        difficulty = self.default_difficulty if difficulty is None else difficulty
        for name, value, least in (("n", n, 1), ("difficulty", difficulty, 1)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
                raise DecoderLMError(f"{name}={value!r} must be an integer ≥ {least}")
        if split not in SPLITS:
            raise DecoderLMError(f"split={split!r} must be one of {', '.join(SPLITS)}")
        rng = random.Random(f"{self.name}-{difficulty}-{seed}-{split}")
        found: list[Problem] = []
        for _ in range(MAX_DRAWS * n):
            problem = self.make(rng, difficulty)
            if split_of(problem.prompt) == split:
                found.append(problem)
                if len(found) == n:
                    return found
        raise DecoderLMError(
            f"{self.name} at difficulty {difficulty} has too few problems in its {split} split"
        )


def split_of(prompt: str) -> str:
    """The split a prompt belongs to, by a stable hash of its text."""
    return "test" if zlib.crc32(prompt.encode()) % TEST_SHARE == 0 else "train"


def answer_line(completion: str) -> str | None:
    """What the first `answer: ...` line of a completion says (None: there is none)."""
    match = _ANSWER.search(completion)
    return None if match is None else match.group(1)


def corpus(task: Task, n: int, difficulty: int | None = None, seed: int = 0) -> str:
    """A training text: n train-split problems with their worked solutions, a blank line after
    each (the end of a solution, where a search stops)."""
    return "".join(p.text + "\n" for p in task.problems(n, difficulty, seed, split="train"))
