"""`decoderlm search`: a test-time compute strategy on a reasoning task's test problems, at a budget
of generated tokens per problem (decoderlm.search); prints the accuracy and the tokens spent."""

from __future__ import annotations

import argparse

from decoderlm.commands import CHECKPOINT_HELP
from decoderlm.commands.generate import add_cpu_kernels_argument
from decoderlm.search import STRATEGY_NAMES
from decoderlm.tasks import TASK_NAMES

HELP = "accuracy of a search strategy (self-consistency, best-of-N, beam, MCTS) on a reasoning task"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="PATH", help=CHECKPOINT_HELP)
    parser.add_argument("--task", required=True, choices=TASK_NAMES)
    parser.add_argument("--strategy", required=True, choices=STRATEGY_NAMES)
    parser.add_argument(
        "--budget", type=int, default=4096, help="generated tokens per problem (default: 4096)"
    )
    parser.add_argument(
        "--n",
        type=int,
        help="samples (self-consistency, best-of-n; default: as many as the budget allows) or "
        "beams (beam, step-beam; default: 4)",
    )
    parser.add_argument(
        "--expand", type=int, default=4, help="steps sampled per expansion (step-beam, mcts)"
    )
    parser.add_argument(
        "--widening",
        type=float,
        default=0.0,
        metavar="ALPHA",
        help="mcts: expand a node again while it has had fewer than visits^ALPHA expansions "
        "(progressive widening, e.g. 0.5); 0 expands each node once (default)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="tokens a solution (a step, for step-beam and mcts) may take (default: 128)",
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    scorer = parser.add_mutually_exclusive_group()
    scorer.add_argument(
        "--oracle",
        action="store_true",
        help="best-of-n: rank by the task's exact checker instead of mean log-probability",
    )
    scorer.add_argument(
        "--verifier",
        metavar="RUN",
        help="a learned verifier (decoderlm verifier): best-of-n ranks by it, step-beam and mcts "
        "are guided by it instead of the task's process oracle",
    )
    parser.add_argument("--problems", type=int, default=20, help="test problems (default: 20)")
    parser.add_argument("--difficulty", type=int, help="default: the task's")
    parser.add_argument("--seed", type=int, default=0, help="problems and sampling (default: 0)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_cpu_kernels_argument(parser)


def run(args: argparse.Namespace) -> int:
    from decoderlm.search.evaluate import SearchOptions, evaluate
    from decoderlm.search.lm import EngineLM, load_engine
    from decoderlm.search.verifier import load_verifier
    from decoderlm.tasks import get_task

    task = get_task(args.task)
    problems = task.problems(args.problems, args.difficulty, args.seed, split="test")
    verifier = load_verifier(args.verifier, args.device) if args.verifier else None
    options = SearchOptions(
        args.n, args.expand, args.max_tokens, args.temperature, args.oracle, verifier, args.widening
    )
    engine = load_engine(args.checkpoint, args.cpu_kernels, args.device)
    lm = EngineLM(engine, seed=args.seed)
    score = evaluate(lm, task, problems, args.strategy, args.budget, options, not args.quiet)
    difficulty = task.default_difficulty if args.difficulty is None else args.difficulty
    print(
        f"{args.strategy} on {score.problems} {task.name} problems (difficulty {difficulty}): "
        f"accuracy {score.accuracy:.1%} ({score.correct}/{score.problems}) · "
        f"{score.tokens:,} generated tokens ({score.tokens / score.problems:,.0f} a problem, "
        f"budget {args.budget:,})"
    )
    return 0
