"""`decoderlm plot`: loss curves of one or more runs to a PNG (logic in decoderlm.plot)."""

from __future__ import annotations

import argparse
from pathlib import Path

from decoderlm.files import add_overwrite_argument, refuse_overwrite

HELP = "plot the train/val loss curves of runs (metrics.jsonl) to a PNG"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directories to compare")
    parser.add_argument("--out", metavar="PNG", help="output file (default: RUN/loss.png)")
    add_overwrite_argument(parser)


def run(args: argparse.Namespace) -> int:
    from decoderlm.plot import PLOT_FILE, plot_runs

    out = Path(args.out) if args.out is not None else Path(args.runs[0]) / PLOT_FILE
    refuse_overwrite(out, overwrite=args.overwrite)
    print(f"wrote {plot_runs(args.runs, out)}")
    return 0
