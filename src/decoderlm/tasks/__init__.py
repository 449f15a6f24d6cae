"""Reasoning tasks with exact checkers, for test-time compute (`decoderlm.search`) and for training
corpora (`decoderlm prepare --task`): multi-digit addition written step by step with a scratchpad
(Nye et al., 2021, "Show Your Work: Scratchpads for Intermediate Computation with Language
Models"), Countdown (as in TinyZero / Gandhi et al., 2024, "Stream of Search"), and word problems
for an instruction-tuned chat model, answered in free text (`word_problems`).

A task makes seeded `Problem`s at a difficulty, each with a prompt and a worked solution (one line
a step, a last `answer: ...` line), and checks a model's completion exactly: `check(problem,
completion)`. Problems are split by a hash of their prompt into a train and a test split, so that
a corpus for training never holds the problems a search is scored on.
"""

from __future__ import annotations

from decoderlm.errors import DecoderLMError
from decoderlm.tasks.arithmetic import ARITHMETIC
from decoderlm.tasks.base import SPLITS, Problem, Task, answer_line, corpus, split_of
from decoderlm.tasks.countdown import COUNTDOWN
from decoderlm.tasks.word_problems import WORD_PROBLEMS

TASKS = {task.name: task for task in (ARITHMETIC, COUNTDOWN, WORD_PROBLEMS)}
TASK_NAMES = tuple(TASKS)


def get_task(name: str) -> Task:
    """The task called `name`; a one-line error naming the others."""
    if name not in TASKS:
        raise DecoderLMError(f"unknown task {name!r}; the tasks are {', '.join(TASKS)}")
    return TASKS[name]


__all__ = [
    "SPLITS",
    "TASKS",
    "TASK_NAMES",
    "Problem",
    "Task",
    "answer_line",
    "corpus",
    "get_task",
    "split_of",
]
