"""The `decoderlm` command line: one subcommand per module in `decoderlm.commands`.

Each command module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`, and
imports its heavy dependencies inside `run`, so `decoderlm --help` stays fast. User errors
(`DecoderLMError`) are printed as one line, `decoderlm: error: ...`, with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence

from decoderlm import __version__, commands
from decoderlm.errors import DecoderLMError

# The order in which `decoderlm --help` lists the commands: the main job's data flow.
ORDER = (
    "prepare",
    "train",
    "generate",
    "chat",
    "eval",
    "search",
    "verifier",
    "info",
    "convert",
    "quantize",
    "serve",
    "lab",
    "attention",
    "plot",
)


def _command_modules() -> dict[str, object]:
    names = [m.name for m in pkgutil.iter_modules(commands.__path__) if not m.name.startswith("_")]
    names.sort(key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))
    return {name: importlib.import_module(f"decoderlm.commands.{name}") for name in names}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="decoderlm", description="Decoder-only Transformer language models."
    )
    parser.add_argument("--version", action="version", version=f"decoderlm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in _command_modules().items():
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except DecoderLMError as exc:
        # One write of the whole line: print() writes the text and the newline separately, and
        # under torchrun another rank's line could land between the two on the shared stderr.
        sys.stderr.write(f"decoderlm: error: {exc}\n")
        sys.stderr.flush()
        return 2
    except KeyboardInterrupt:
        print("decoderlm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (`decoderlm generate ... | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
