"""Labelling the policy's own samples for a learned verifier (`decoderlm.search.verifier`).

The policy samples solutions of a task's problems; each is labelled by the task's exact checker,
1 or 0, at every token of its solution (the outcome label of Cobbe et al., 2021, "Training
Verifiers to Solve Math Word Problems"). With `rollouts` > 0 every step prefix of every sample is
labelled too, by the fraction of `rollouts` continuations from it that the checker accepts:
Math-Shepherd's soft estimate of the prefix's value (Wang et al., 2023, "Math-Shepherd", §3.3),
at its final token, which makes the verifier a process verifier that step-level beam search and
MCTS can ask about partial solutions.
"""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from decoderlm.search.lm import SearchLM
from decoderlm.search.strategies import SOLUTION_END
from decoderlm.search.verifier import Example
from decoderlm.tasks import Problem, Task

BATCH_SEQUENCES = 64  # sequences a call to the model samples at once


def label_samples(
    lm: SearchLM,
    task: Task,
    problems: Sequence[Problem],
    samples: int,
    *,
    rollouts: int = 0,
    max_tokens: int = 128,
    temperature: float = 1.0,
    progress: bool = False,
) -> list[list[Example]]:
    """Per problem: `samples` sampled solutions labelled by the checker and, with `rollouts` > 0,
    each of their step prefixes labelled by the fraction of `rollouts` continuations accepted.
    The problems are sampled BATCH_SEQUENCES // samples at a time (one batched call)."""
    labelled = []
    chunk = max(1, BATCH_SEQUENCES // samples)
    with tqdm(total=len(problems), desc="labelling", unit="problem", disable=not progress) as bar:
        for start in range(0, len(problems), chunk):
            group = problems[start : start + chunk]
            drawn = lm.sample(
                [p.prompt for p in group], samples, max_tokens, SOLUTION_END, temperature
            )
            for problem, solutions in zip(group, drawn, strict=True):
                texts = [s.text for s in solutions]
                start = len(problem.prompt)
                examples = [
                    Example(problem.prompt + t, float(task.check(problem, t)), start) for t in texts
                ]
                if rollouts:
                    examples += _step_values(
                        lm, task, problem, texts, rollouts, max_tokens, temperature
                    )
                labelled.append(examples)
            bar.update(len(group))
    return labelled


def _step_values(
    lm: SearchLM,
    task: Task,
    problem: Problem,
    solutions: list[str],
    rollouts: int,
    max_tokens: int,
    temperature: float,
) -> list[Example]:
    """Every proper step prefix of the solutions, labelled by the share of `rollouts`
    continuations from it that the checker accepts (one batched call)."""
    prefixes = sorted(
        {
            "".join(lines[:i])
            for lines in (t.splitlines(keepends=True) for t in solutions)
            for i in range(1, len(lines))
        }
    )
    if not prefixes:
        return []
    prompts = [problem.prompt + p for p in prefixes]
    continued = lm.sample(prompts, rollouts, max_tokens, SOLUTION_END, temperature)
    return [
        Example(prompt, sum(task.check(problem, prefix + c.text) for c in group) / rollouts)
        for prompt, prefix, group in zip(prompts, prefixes, continued, strict=True)
    ]
