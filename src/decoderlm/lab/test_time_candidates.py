"""Candidate tasks for the test-time study on a real model (`decoderlm.lab.test_time_real`):
seeded questions with exact integer answers, each read from the model's free text by
`decoderlm.tasks.word_problems.extract_answer`. The study measures the model's greedy accuracy on
each and searches on the one it names (`TestTimeRealSpec.task`), which should be solved 10–50% of
the time: search has room above and something to find."""

from __future__ import annotations

import random
from collections.abc import Callable

from decoderlm.tasks.word_problems import WORD_PROBLEMS

Question = tuple[str, int]  # the user message, its answer
WORDS = ("strawberry", "banana", "balloon", "mississippi", "committee", "raccoon", "pepper")
WORDS += ("engineer", "tomorrow", "assessment", "bookkeeper", "coffee", "letter", "cherry")
FRUITS = ("apple", "pear", "plum", "fig", "kiwi")
UNITS = (("kilometers", "meters", 1000), ("meters", "centimeters", 100))
UNITS += (("hours", "minutes", 60), ("minutes", "seconds", 60), ("kilograms", "grams", 1000))
UNITS += (("days", "hours", 24), ("weeks", "days", 7))


def _sum(digits: int) -> Callable[[random.Random], Question]:
    def make(rng: random.Random) -> Question:
        low, high = 10 ** (digits - 1), 10**digits - 1
        a, b = rng.randint(low, high), rng.randint(low, high)
        return f"What is {a} + {b}?", a + b

    return make


def _product(low: int, high: int) -> Callable[[random.Random], Question]:
    def make(rng: random.Random) -> Question:
        a, b = rng.randint(2, 9), rng.randint(low, high)
        return f"What is {a} * {b}?", a * b

    return make


def _letters(rng: random.Random) -> Question:
    word = rng.choice(WORDS)
    letter = rng.choice(sorted(set(word)))
    question = f"How many times does the letter '{letter}' appear in the word '{word}'?"
    return question, word.count(letter)


def _list_length(rng: random.Random) -> Question:
    items = [rng.choice(FRUITS) for _ in range(rng.randint(3, 8))]
    return f"How many words are in this list: {', '.join(items)}?", len(items)


def _units(rng: random.Random) -> Question:
    big, small, factor = rng.choice(UNITS)
    value = rng.randint(2, 12)
    return f"How many {small} are in {value} {big}?", value * factor


GENERATED: dict[str, Callable[[random.Random], Question]] = {
    "addition, 2 digits": _sum(2),
    "addition, 3 digits": _sum(3),
    "multiplication, 1 × 1 digit": _product(2, 9),
    "multiplication, 1 × 2 digits": _product(11, 29),
    "letters in a word": _letters,
    "words in a list": _list_length,
    "unit conversion": _units,
}
WORD_PROBLEM_STEPS = {"word problem, 1 step": 1, "word problem, 2 steps": 2}
CANDIDATES = (*GENERATED, *WORD_PROBLEM_STEPS)


def questions(name: str, n: int, seed: int = 0) -> list[Question]:
    """n questions of candidate `name`: the word problems' test split, or seeded draws."""
    if name in WORD_PROBLEM_STEPS:
        found = WORD_PROBLEMS.problems(n, WORD_PROBLEM_STEPS[name], seed=seed, split="test")
        return [(p.prompt, int(p.answer)) for p in found]
    rng = random.Random(f"{name}-{seed}")
    return [GENERATED[name](rng) for _ in range(n)]
