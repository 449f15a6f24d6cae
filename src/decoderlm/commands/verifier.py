"""`decoderlm verifier`: train a learned verifier on a policy run's own samples of a task's train
problems, labelled by the task's exact checker (decoderlm.search.labelling), then trained by
decoderlm.training.verifier; with --rollouts also each step prefix, labelled by the share of
rollouts from it that are correct (a process verifier). `decoderlm search --verifier OUT` then
ranks and guides with it."""

from __future__ import annotations

import argparse

from decoderlm.commands.generate import add_cpu_kernels_argument
from decoderlm.files import add_overwrite_argument
from decoderlm.tasks import TASK_NAMES

HELP = "train a learned verifier on a policy's own samples, labelled by a task's exact checker"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", required=True, metavar="RUN", help="the policy's run directory")
    parser.add_argument("--task", required=True, choices=TASK_NAMES)
    parser.add_argument("--difficulty", type=int, help="default: the task's")
    parser.add_argument("--out", required=True, metavar="DIR", help="the verifier's run directory")
    parser.add_argument(
        "--problems", type=int, default=300, help="train-split problems sampled (default: 300)"
    )
    parser.add_argument("--samples", type=int, default=8, help="solutions a problem (default: 8)")
    parser.add_argument(
        "--rollouts",
        type=int,
        default=0,
        help="continuations per step prefix to label it (a process verifier; default 0: outcome)",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens a solution may take")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default: 300)")
    parser.add_argument("--batch-size", type=int, default=32, help="texts a step (default: 32)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0, help="problems, sampling and training")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_cpu_kernels_argument(parser)
    add_overwrite_argument(parser)


def run(args: argparse.Namespace) -> int:
    from decoderlm.files import ANY_ENTRY, refuse_overwrite
    from decoderlm.search.labelling import label_samples
    from decoderlm.search.lm import EngineLM, load_engine
    from decoderlm.tasks import get_task
    from decoderlm.training.verifier import train_verifier, verifier_config

    refuse_overwrite(args.out, overwrite=args.overwrite, inside=ANY_ENTRY)  # before sampling
    task = get_task(args.task)
    problems = task.problems(args.problems, args.difficulty, args.seed + 1, split="train")
    lm = EngineLM(load_engine(args.policy, args.cpu_kernels), seed=args.seed)
    labelled = label_samples(
        lm,
        task,
        problems,
        args.samples,
        rollouts=args.rollouts,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        progress=not args.quiet,
    )
    config = verifier_config(args.steps, args.batch_size, args.lr, args.seed)
    kind = "process" if args.rollouts else "outcome"
    summary = train_verifier(
        args.policy,
        labelled,
        args.out,
        config,
        kind=kind,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    texts = sum(len(examples) for examples in labelled)
    correct = sum(e.target for examples in labelled for e in examples)
    print(
        f"{kind} verifier in {args.out}: {texts:,} labelled texts ({correct / texts:.0%} correct) "
        f"· val loss {summary['val_loss']:.4f} · val accuracy {summary['val_accuracy']:.1%}"
    )
    return 0
