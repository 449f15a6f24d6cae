"""Can the learned verifier learn a check at this scale? A probe of `decoderlm.search.verifier`.

`decoderlm verifier` (the policy's network with a scalar head, trained on the policy's own
samples) does not beat the base rate on the test-time study's arithmetic. This separates "the
samples carry too little signal" from "the verifier cannot learn the check": it trains it, with the project's
trainer, on clean synthetic labels from a policy that solves every problem, in two cases:

- corrupted answer: each problem's worked solution (label 1) and the same solution with one
  digit of its answer line changed (label 0). Telling them apart needs comparing the answer with
  the scratchpad's last line, which the policy itself copies when it writes the answer.
- control: the same texts labelled by whether the answer's last digit is even, a label the final
  token shows by itself. If this is learned and the first is not, the training works and the check
  is what is not learned.

Each case is trained twice: labels at every solution token (`Example.solution_start`, the study's
default) and at the final token only. Reported: validation binary cross-entropy at the final
token (ln 2 = 0.693 is a constant guess) and accuracy, on held-out problems.

The policy: `--policy RUN`, or else the README recipe trained 1200 steps (about 100% greedy
accuracy at difficulty 5) into OUT/policy.

    python benchmarks/verifier_check.py --out /tmp/verifier-check [--policy RUN] [--steps 300]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from decoderlm import data
from decoderlm.lab.runner import environment
from decoderlm.model.config import ModelConfig
from decoderlm.search.verifier import Example
from decoderlm.tasks import Problem, corpus, get_task
from decoderlm.training.train_config import TrainConfig
from decoderlm.training.trainer import train
from decoderlm.training.verifier import train_verifier, verifier_config

DIFFICULTY = 5


def policy_run(out: Path) -> Path:
    """The README recipe trained 1200 steps: a policy that solves (nearly) every problem."""
    task, run = get_task("arithmetic"), out / "policy"
    if (run / "model.safetensors").is_file():
        return run
    text = out / "task.txt"
    text.write_text(corpus(task, 20_000, DIFFICULTY))
    data.prepare([text], out / "data", tokenizer="char", progress=False)
    model = ModelConfig.from_preset("llama-tiny", context_length=128)
    config = TrainConfig(batch_size=32, max_steps=1200, checkpoint_interval=0, peak_flops=1e12)
    train(model, config, out / "data", run, overwrite=True, progress=False)
    return run


def corrupted(problem: Problem, rng: random.Random) -> str:
    """The worked solution with one digit of its answer line changed."""
    solution = problem.solution.rstrip("\n")
    i = solution.rindex("answer: ") + len("answer: ") + rng.randrange(len(problem.answer))
    digit = str((int(solution[i]) + rng.randint(1, 9)) % 10)
    return solution[:i] + digit + solution[i + 1 :]


def labelled(case: str, every_token: bool, problems: list[Problem]) -> list[list[Example]]:
    """Per problem: its worked solution and a corrupted one, labelled for `case`."""
    rng, groups = random.Random(0), []
    for p in problems:
        texts = [p.solution.rstrip("\n"), corrupted(p, rng)]
        start = len(p.prompt) if every_token else None
        labels = [1.0, 0.0] if case == "corrupted answer" else [int(t[-1]) % 2 == 0 for t in texts]
        groups.append(
            [Example(p.prompt + t, float(y), start) for t, y in zip(texts, labels, strict=True)]
        )
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--policy", type=Path, help="a run that solves the task (default: train)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--problems", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    env = environment()
    print(f"# verifier check · {env['cpu']} · torch {env['torch']}")
    policy = args.policy or policy_run(args.out)
    problems = get_task("arithmetic").problems(args.problems, DIFFICULTY, seed=3, split="train")
    print(
        f"policy {policy}; {args.problems} problems × 2 texts; {args.steps} steps, lr {args.lr:g}"
    )
    print("| case | labels | val BCE (final token) | val accuracy | seconds |")
    print("|---|---|---|---|---|")
    for case in ("corrupted answer", "control: last digit even"):
        for every_token in (True, False):
            start = time.perf_counter()
            run = args.out / f"{case.split(':')[0].replace(' ', '-')}-{int(every_token)}"
            config = verifier_config(args.steps, 32, args.lr, seed=0)
            groups = labelled(case, every_token, problems)
            result = train_verifier(policy, groups, run, config, overwrite=True, progress=False)
            labels = "every solution token" if every_token else "final token"
            print(f"| {case} | {labels} | {result['val_loss']:.3f} | "
                  f"{result['val_accuracy']:.1%} | {time.perf_counter() - start:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
