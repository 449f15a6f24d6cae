"""`decoderlm prepare`: text files (default: the Python standard library) → a data directory; or,
with --task, a corpus of a reasoning task's problems and worked solutions (`decoderlm.tasks`),
written to OUT/task.txt and tokenized by characters."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from decoderlm.files import add_overwrite_argument, refuse_overwrite
from decoderlm.tasks import TASK_NAMES

TASK_FILE = "task.txt"
HELP = "Tokenize text files (default: the Python stdlib) into train.bin, val.bin and meta.json."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input",
        nargs="+",
        metavar="PATH",
        help="files and directories (searched recursively); default: the Python standard library "
        "source of this interpreter, tests excluded",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="the data directory to write")
    parser.add_argument(
        "--tokenizer",
        default="bpe",
        metavar="bpe|char|FILE",
        help="train byte-level BPE or a character vocabulary, or load a tokenizer.json (default: bpe)",
    )
    parser.add_argument(
        "--vocab-size", type=int, default=8192, help="BPE vocabulary size (default: 8192)"
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        help="the last fraction of the corpus (by characters) that becomes val.bin (default: 0.1)",
    )
    parser.add_argument(
        "--include",
        nargs="+",
        metavar="GLOB",
        help="file globs to take from directories (default: common text and source extensions)",
    )
    parser.add_argument("--max-files", type=int, help="use only the first N files (sorted paths)")
    parser.add_argument(
        "--dtype", choices=("uint16", "uint32"), help="token file dtype (default: from the vocab)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    task = parser.add_argument_group("a reasoning task's corpus (instead of --input)")
    task.add_argument("--task", choices=TASK_NAMES, help="write and tokenize N worked problems")
    task.add_argument("--difficulty", type=int, help="digits (arithmetic) or numbers (countdown)")
    task.add_argument("--n", type=int, default=20000, help="problems (default: 20000)")
    task.add_argument("--seed", type=int, default=0, help="the problems' seed (default: 0)")
    add_overwrite_argument(parser)


def run(args: argparse.Namespace) -> int:
    import warnings

    from decoderlm.data import DATA_FILES, prepare

    inputs, tokenizer = args.input, args.tokenizer
    refuse_overwrite(args.out, overwrite=args.overwrite, inside=(*DATA_FILES, TASK_FILE))
    if args.task is not None:
        inputs, tokenizer = [_write_task(args)], "char"
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        meta = prepare(
            inputs,
            args.out,
            tokenizer=tokenizer,
            vocab_size=args.vocab_size,
            val_fraction=args.val_fraction,
            include=args.include,
            max_files=args.max_files,
            progress=not args.quiet,
            dtype=args.dtype,
        )
    tokens = meta["train_tokens"] + meta["val_tokens"]
    print(
        f"wrote {args.out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
        f"({meta['dtype']}, vocab {meta['vocab_size']:,}, {meta['n_documents']:,} document(s), "
        f"{(meta['train_bytes'] + meta['val_bytes']) / max(tokens, 1):.2f} bytes/token)"
    )
    return 0


def _write_task(args: argparse.Namespace) -> Path:
    """OUT/task.txt: the task's corpus, the text that is then tokenized."""
    from decoderlm.errors import DecoderLMError
    from decoderlm.files import atomic_write
    from decoderlm.tasks import corpus, get_task

    if args.input or args.tokenizer != "bpe":
        raise DecoderLMError(
            "--task writes its own text, tokenized by characters: drop --input and --tokenizer"
        )
    text = corpus(get_task(args.task), args.n, args.difficulty, args.seed)
    path = Path(args.out, TASK_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return path


def _show_warning(message: Warning | str, *args: object, **kwargs: object) -> None:
    """Warnings as one line, written above the progress bar instead of through it."""
    from tqdm.auto import tqdm

    tqdm.write(f"decoderlm: warning: {message}", file=sys.stderr)
