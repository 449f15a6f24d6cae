"""`decoderlm plot`: loss curves of one or more runs to a PNG (logic in decoderlm.plot)."""

from __future__ import annotations

import argparse

HELP = "plot the train/val loss curves of runs (metrics.jsonl) to a PNG"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directories to compare")
    parser.add_argument("--out", metavar="PNG", help="output file (default: RUN/loss.png)")


def run(args: argparse.Namespace) -> int:
    from decoderlm.plot import plot_runs

    print(f"wrote {plot_runs(args.runs, args.out)}")
    return 0
