"""`decoderlm quantize`: int8 / int4 / bf16 weight-only quantization (logic in decoderlm.quant)."""

from __future__ import annotations

import argparse
from pathlib import Path

from decoderlm.files import add_overwrite_argument

HELP = "quantize a run or Hugging Face checkpoint's weights to int8, int4 or bf16 (a new run directory)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # dest `source`: `args.run` is taken by the CLI's dispatch (decoderlm.cli).
    parser.add_argument("source", metavar="RUN_OR_HF_DIR", help="the float checkpoint")
    parser.add_argument(
        "--to",
        required=True,
        metavar="FORMAT",
        help=(
            "int8 (per output channel), int4 (per group of inputs, LM head int8) or bf16 "
            "(bfloat16 weights, float32 activations)"
        ),
    )
    parser.add_argument(
        "--group-size",
        type=int,
        metavar="G",
        help="int4: inputs per scale, 32, 64 or 128 (default 64)",
    )
    parser.add_argument("--out", required=True, help="output run directory (must be new or empty)")
    add_overwrite_argument(parser, "--force")


def run(args: argparse.Namespace) -> int:
    from decoderlm.checkpoint import TOKENIZER_FILE
    from decoderlm.commands.convert import _check_out
    from decoderlm.loading import load
    from decoderlm.quant.apply import check_settings, quantize
    from decoderlm.quant.io import save_quantized

    check_settings(args.to, args.group_size)
    source = Path(args.source)
    _check_out(source, Path(args.out), args.overwrite)
    model, _ = load(source)
    quantize(model, to=args.to, group_size=args.group_size)
    tokenizer_file = source / TOKENIZER_FILE
    out = save_quantized(args.out, model, tokenizer_file if tokenizer_file.is_file() else None)
    print(f"wrote {out}")
    return 0
