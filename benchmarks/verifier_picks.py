"""Why best-of-N with the test-time study's learned verifier falls as N grows: what it picks.

A verifier that cannot rank (scores that barely vary and carry no signal) makes best-of-N pick
the top of near-random scores. Identical samples score alike, and the policy's right samples are
mostly one text (its greedy path, repeated) while its wrong ones are many different texts; so a
blind pick is a uniform pick among the *distinct* texts of the N samples, whose accuracy falls as
N adds new wrong texts, below one sample's accuracy (a uniform pick among the samples).

This refits the study's verifier (`decoderlm.lab.test_time`, the same code and seeds) on the
policy of a finished study directory, draws N samples of each of the first --problems test
problems, and prints, for each N: best-of-N with the verifier, a uniform pick among the samples,
a uniform pick among the distinct texts (the blind verifier's expectation), the distinct texts,
and the spread of the verifier's scores.

    HF_HUB_OFFLINE=1 python benchmarks/verifier_picks.py benchmarks/lab/test-time-compute [--problems 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from decoderlm.lab import test_time
from decoderlm.search.lm import EngineLM, load_engine
from decoderlm.search.strategies import SOLUTION_END
from decoderlm.tasks import get_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("study", type=Path, help="a finished `decoderlm lab test-time-compute` OUT")
    parser.add_argument("--problems", type=int, default=50)
    args = parser.parse_args()
    spec = test_time.TestTimeSpec()
    policy = json.loads((args.study / "policy" / test_time.DONE_FILE).read_text())
    engine = load_engine(str(test_time.policy_dir(args.study, policy)))
    task = get_task(spec.task)
    verifier, _ = test_time.fit_study_verifier(spec, task, EngineLM(engine, seed=0), False)
    problems = task.problems(args.problems, spec.difficulty, seed=0, split="test")
    pools = EngineLM(engine, seed=0).sample(
        [p.prompt for p in problems], max(spec.ns), spec.max_tokens, SOLUTION_END, spec.temperature
    )
    print(f"{args.problems} test problems, {max(spec.ns)} samples each (temperature "
          f"{spec.temperature}), the study's verifier refit")  # fmt: skip
    print("| N | best-of-N (verifier) | uniform pick, samples | uniform pick, distinct texts | "
          "distinct texts | verifier score range |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    scored = []
    for problem, pool in zip(problems, pools, strict=True):
        scores = verifier.scores([problem.prompt + s.text for s in pool])
        checked = zip(pool, scores, strict=True)
        scored.append([(s.text, v, task.check(problem, s.text)) for s, v in checked])
    for n in spec.ns:
        best = blind = uniform = distinct = spread = 0.0
        for rows in scored:
            first = rows[:n]
            best += max(first, key=lambda r: r[1])[2]
            uniform += sum(r[2] for r in first) / n
            texts = {text: right for text, _, right in first}
            blind += sum(texts.values()) / len(texts)
            distinct += len(texts)
            spread += max(r[1] for r in first) - min(r[1] for r in first)
        k = len(scored)
        print(f"| {n} | {best / k:.1%} | {uniform / k:.1%} | {blind / k:.1%} | {distinct / k:.1f} | "
              f"{spread / k:.3f} |")  # fmt: skip
    every = [v for rows in scored for _, v, _ in rows]
    print(f"scores: mean {statistics.mean(every):.3f}, from {min(every):.3f} to {max(every):.3f}")


if __name__ == "__main__":
    main()
