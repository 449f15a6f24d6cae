"""The reasoning tasks: worked solutions pass their exact checkers, problems are reproducible and
split, the checkers accept any right answer and only right answers, and `prepare --task` writes a
corpus the trainer reads."""

from __future__ import annotations

import json

import pytest

from decoderlm.cli import main
from decoderlm.errors import DecoderLMError
from decoderlm.tasks import TASK_NAMES, get_task, split_of


@pytest.mark.parametrize("name", TASK_NAMES)
@pytest.mark.parametrize("difficulty", [2, 4])
def test_worked_solutions_pass_their_checker(name: str, difficulty: int) -> None:
    task = get_task(name)
    for problem in task.problems(30, difficulty, seed=3):
        assert task.check(problem, problem.solution)
        assert task.extract_answer(problem.solution) == problem.answer
        assert all(line for line in problem.solution.splitlines())  # one line a step


@pytest.mark.parametrize("name", TASK_NAMES)
def test_problems_are_reproducible_for_a_seed(name: str) -> None:
    task = get_task(name)
    assert task.problems(20, seed=5) == task.problems(20, seed=5)
    assert task.problems(20, seed=5) != task.problems(20, seed=6)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_train_and_test_splits_are_disjoint(name: str) -> None:
    task = get_task(name)
    train = {p.prompt for p in task.problems(300, 2, split="train")}
    test = {p.prompt for p in task.problems(30, 2, split="test")}
    assert not train & test
    assert {split_of(prompt) for prompt in test} == {"test"}


def test_arithmetic_scratchpad_adds_column_by_column() -> None:
    task = get_task("arithmetic")
    problem = task.problems(1, 3)[0]
    a, b = problem.data
    lines = problem.solution.splitlines()
    assert len(lines) == 4 and lines[-1] == f"answer: {a + b}"
    assert lines[-2] == f"+ c{(a + b) // 1000} r{(a + b) % 1000:03d}"
    assert task.check(problem, f"junk\nanswer: {a + b}\n\nQ: more")
    assert not task.check(problem, f"answer: {a + b + 1}")
    assert not task.check(problem, f"the answer is {a + b}")


def test_countdown_accepts_any_valid_expression() -> None:
    task = get_task("countdown")
    problem = task.problems(1, 3)[0]
    (x, y, _), _ = problem.data
    assert task.check(problem, f"answer: {problem.answer}")
    assert task.check(problem, f"answer: ({problem.answer})+{x}-{x}") is False  # x twice
    assert task.check(problem, f"answer: {problem.answer} + 0") is False  # 0 is not given
    assert task.check(problem, f"answer: ({problem.answer})*({y}/{y})") is False  # y twice
    assert task.check(problem, f"answer: {' '.join(problem.answer)}")  # spaces are fine


def test_countdown_checker_is_exact_and_refuses_reused_or_foreign_numbers() -> None:
    task = get_task("countdown")
    make = type(task.problems(1)[0])
    seven = make("Countdown: 7 2 2 -> 7\n", "", "7/2*2", ((7, 2, 2), 7))
    assert task.check(seven, "answer: 7/2*2")  # 3.5 · 2, exactly
    assert task.check(seven, "answer: 7")  # not every number needs using
    assert task.check(seven, "answer: 2*7/2")  # another expression
    assert not task.check(seven, "answer: (2 + 2) * 7 / (2 + 2)")  # 2 four times
    assert not task.check(seven, "answer: 14/2")  # 14 is not given
    assert not task.check(seven, "answer: 7/(2-2)")  # division by zero
    assert not task.check(seven, "answer: -(-7)")  # only binary + - * /
    assert not task.check(seven, "answer: __import__('os')")
    assert not task.check(seven, "answer: 7.0")


def test_unknown_task_and_bad_difficulty_are_one_line_errors() -> None:
    with pytest.raises(DecoderLMError, match="unknown task 'chess'"):
        get_task("chess")
    with pytest.raises(DecoderLMError, match="difficulty=0"):
        get_task("arithmetic").problems(1, 0)


def test_prepare_task_writes_a_char_corpus_of_train_problems(tmp_path) -> None:
    out = tmp_path / "data"
    argv = ["prepare", "--task", "arithmetic", "--difficulty", "2", "--n", "200", "--quiet"]
    assert main([*argv, "--out", str(out)]) == 0
    text = (out / "task.txt").read_text()
    assert text.startswith("Q: ") and text.count("answer: ") == 200
    assert {split_of(block.split("\n")[0] + "\n") for block in text.split("\n\n")[:-1]} == {"train"}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["source"]["tokenizer"] == "char" and meta["train_tokens"] > 0
    assert main([*argv, "--out", str(out)]) == 2  # no overwriting without --overwrite
