"""The word-problem task: its stories say what the worked solution computes, and its answer is read
from free text as a reader would — the number after the last answer marker, else the last number
— with hand-checked completions in the styles a small chat model writes."""

from __future__ import annotations

import pytest

from decoderlm.tasks import get_task
from decoderlm.tasks.word_problems import extract_answer, normalise

TASK = get_task("word-problems")


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("Lily has 15 + 8 = 23 books now.\n#### 23\nThe answer is: 23", "23"),
        ("The answer is 23.", "23"),
        ("Answer: **1,250** books", "1250"),
        ("answer = -4", "-4"),
        ("So the final answer is $12.", "12"),
        ("18 + 21 = 39", "39"),  # no marker: the last number
        ("He had 5, bought 4: 9 apples.\n\nThat is 4 more than 5", "5"),  # the last number, wrong
        ("The answer is 7, since 3 + 4 = 7 and 7 > 5.", "7"),  # the marker wins over 5
        ("#### 9\nBen now holds 10 cards", "9"),
        ("23.0 books", "23"),
        ("about 2.50 each", "2.5"),
        ("I cannot tell.", None),
        ("", None),
    ],
)
def test_answers_are_read_from_free_text(completion: str, answer: str | None) -> None:
    assert extract_answer(completion) == answer


def test_numbers_are_normalised_so_equal_values_compare_equal() -> None:
    assert normalise("1,000") == normalise("1000.00") == "1000"
    assert normalise("0.50") == "0.5"
    assert normalise("15, 8") is None  # not a number: a list


def test_the_checker_accepts_the_count_in_any_wording_and_nothing_else() -> None:
    problem = TASK.problems(1, 1, seed=0)[0]
    name, item, start, (bought,) = problem.data
    count = int(problem.answer)
    assert bought == f"buys {count - start} more"
    assert problem.prompt == (
        f"{name} has {start} {item} and {bought}. How many {item} does {name} have now?"
    )
    assert TASK.check(problem, f"{name} has {start} + {count - start} = {count} {item}.")
    assert TASK.check(problem, f"#### {count}\nThe answer is: {count}")
    assert not TASK.check(problem, f"The answer is {count + 1}.")
    assert not TASK.check(problem, f"{name} has {count} {item}, and {start} before.")


@pytest.mark.parametrize("difficulty", [1, 2, 3, 5])
def test_each_change_is_a_line_and_the_count_never_goes_below_one(difficulty: int) -> None:
    for problem in TASK.problems(40, difficulty, seed=1):
        lines = problem.solution.splitlines()
        assert len(lines) == difficulty + 1 and lines[-1] == f"answer: {problem.answer}"
        counts = [int(line.split(" = ")[1]) for line in lines[:-1]]
        assert min(counts) >= 1
        assert problem.prompt.count(" more") == (difficulty + 1) // 2
        assert problem.prompt.count(" away") == difficulty // 2
