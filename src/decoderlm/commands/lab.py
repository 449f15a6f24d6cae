"""`decoderlm lab`: a controlled ablation study (logic in decoderlm.lab) into OUT: results.json,
report.md and the plots.

    decoderlm lab attention-variants --quick --out lab/attn
    decoderlm lab --spec study.toml --input corpus.txt --out lab/mine
    decoderlm lab test-time-compute --quick --out lab/ttc

test-time-compute (decoderlm.lab.test_time) trains its own policy on a reasoning task's corpus and
a learned verifier, then measures the search strategies: it takes no --data/--input/--budget-*.
test-time-real (decoderlm.lab.test_time_real) does the same searches with SmolLM2-135M-Instruct, the
real model, and a verifier head on its frozen states.

Without --data/--input a study trains on the Python standard library, char-level (the corpus
`decoderlm train` uses by default), prepared once into decoderlm's cache. The same command plus
--resume continues an interrupted study (the finished runs are kept); --overwrite starts it over.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from decoderlm.files import add_overwrite_argument, refuse_overwrite
from decoderlm.lab.studies import FULL_SEEDS, STUDIES, TEST_TIME, TEST_TIME_REAL

HELP = (
    "ablation studies (attention variants, positions, scaling, norm placement, GQA up-training, "
    "recurrent and hybrid layers) and test-time compute"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("study", nargs="?", metavar="STUDY", help=f"one of {', '.join(STUDIES)}")
    parser.add_argument("--spec", metavar="TOML", help="a study of your own (instead of STUDY)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--data", metavar="DIR", help="a prepared data directory (default: the standard library)"
    )
    source.add_argument(
        "--input", nargs="+", metavar="PATH", help="text files, prepared (char-level) into OUT/data"
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--budget-tokens", type=int, metavar="N", help="training tokens per run")
    budget.add_argument(
        "--budget-seconds", type=float, metavar="S", help="seconds of training per run"
    )
    parser.add_argument(
        "--seeds", type=int, metavar="K", help=f"seeds per variant (default {FULL_SEEDS})"
    )
    parser.add_argument("--quick", action="store_true", help="small models and budget (≤ 3 min)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--resume", action="store_true", help="continue the study in OUT, keeping its finished runs"
    )
    add_overwrite_argument(parser)


def run(args: argparse.Namespace) -> int:
    from decoderlm.errors import DecoderLMError
    from decoderlm.lab import report, runner, spec, studies

    if (args.study is None) == (args.spec is None):
        raise DecoderLMError(f"give a STUDY ({', '.join(STUDIES)}) or --spec FILE, not both")
    if args.seeds is not None and args.seeds < 1:
        raise DecoderLMError(f"--seeds={args.seeds} must be ≥ 1")
    if args.study == TEST_TIME:
        return _test_time(args)
    if args.study == TEST_TIME_REAL:
        return _test_time_real(args)
    _check_sources(args)
    study = studies.builtin(args.study, args.quick) if args.study else spec.load_spec(args.spec)
    study = study.with_budget(args.budget_tokens, args.budget_seconds, args.seeds)
    out = Path(args.out)
    written = ("data", "runs", "recall", runner.RESULTS_FILE, report.REPORT_FILE)
    other = "or --resume to continue the study"
    refuse_overwrite(out, overwrite=args.overwrite or args.resume, inside=written, other=other)
    if args.overwrite and not args.resume:  # start over: nothing of the old study is reused
        for name in ("runs", "recall", "data") if args.data is None else ("runs", "recall"):
            shutil.rmtree(out / name, ignore_errors=True)
    results = runner.run_study(
        study, args.out, args.data, args.input, progress=not args.quiet, command=_command()
    )
    print(f"wrote {report.write_report(results, args.out)}")
    return 0


def _check_sources(args: argparse.Namespace) -> None:
    """A one-line error naming the flag when --data or an --input path does not exist."""
    from decoderlm.errors import DecoderLMError

    if args.data is not None and not Path(args.data).is_dir():
        raise DecoderLMError(
            f"--data {args.data}: no such directory (a prepared data directory; leave --data "
            "out to train on the Python standard library)"
        )
    missing = [p for p in args.input or () if not Path(p).exists()]
    if missing:
        raise DecoderLMError(f"--input {missing[0]}: no such file or directory")


def _command() -> str:
    """The command line, when run as `decoderlm lab ...` (not from Python)."""
    return shlex.join(["decoderlm", *sys.argv[1:]]) if sys.argv[1:2] == ["lab"] else ""


def _search_study(args: argparse.Namespace, name: str, why: str, kept: tuple[str, ...]) -> Any:
    """The built-in test-time study `name` with --quick and --seeds applied; a one-line error for
    a lab option it does not use (--data, --input, --budget-*, --spec, and --resume unless
    `kept`)."""
    import dataclasses

    from decoderlm.errors import DecoderLMError
    from decoderlm.lab import studies

    unused = ("spec", "data", "input", "budget_tokens", "budget_seconds", "resume")
    given = [f for f in unused if f not in kept and getattr(args, f, None)]
    if given:
        raise DecoderLMError(f"{name} {why}: drop --{given[0].replace('_', '-')}")
    study = studies.builtin(name, args.quick)
    return study if args.seeds is None else dataclasses.replace(study, seeds=args.seeds)


def _test_time(args: argparse.Namespace) -> int:
    from decoderlm.lab import test_time, test_time_report
    from decoderlm.lab.runner import RESULTS_FILE

    study = _search_study(args, TEST_TIME, "trains its own policy on its task", ("resume",))
    written = ("data", "policy", "verifier", "task.txt", RESULTS_FILE, "report.md")
    other = "or --resume to keep its trained policy and verifier"
    refuse_overwrite(
        Path(args.out), overwrite=args.overwrite or args.resume, inside=written, other=other
    )
    if args.overwrite and not args.resume:
        for name in ("policy", "verifier"):
            shutil.rmtree(Path(args.out) / name, ignore_errors=True)
    results = test_time.run_study(study, args.out, progress=not args.quiet, command=_command())
    print(f"wrote {test_time_report.write_report(results, args.out)}")
    return 0


def _test_time_real(args: argparse.Namespace) -> int:
    """The real-model test-time study (`decoderlm.lab.test_time_real`): OUT, --quick, --seeds,
    --quiet and --overwrite; the lab's other options refused."""
    from decoderlm.lab import test_time_real, test_time_real_report

    study = _search_study(args, TEST_TIME_REAL, "searches with a model it loads itself", ())
    written = (test_time_real.RESULTS_FILE, test_time_real_report.REPORT_FILE)
    refuse_overwrite(Path(args.out), overwrite=args.overwrite, inside=written)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = test_time_real.run_study(study, args.out, progress=not args.quiet, command=_command())
    print(f"wrote {test_time_real_report.write_report(results, args.out)}")
    return 0
