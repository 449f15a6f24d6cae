"""`decoderlm eval`: loss, perplexity and bits per byte on a text file (logic in decoderlm.inference.evaluate)."""

from __future__ import annotations

import argparse
import json

from decoderlm.commands import CHECKPOINT_HELP
from decoderlm.commands.generate import (
    add_cpu_kernels_argument,
    add_kv_cache_dtype_argument,
    add_weights_arguments,
    load_model_and_tokenizer,
)

HELP = "loss, perplexity and bits per byte of a checkpoint on a text file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="PATH", help=CHECKPOINT_HELP)
    parser.add_argument("--input", required=True, metavar="PATH", help="UTF-8 text file")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--context-length", type=int, metavar="T", help="window length (default: the model's)"
    )
    parser.add_argument(
        "--stride",
        type=int,
        metavar="S",
        help="start a window every S tokens, scoring its last S (default: T, non-overlapping)",
    )
    parser.add_argument(
        "--max-tokens", type=int, metavar="N", help="evaluate the first N tokens only"
    )
    parser.add_argument("--batch-size", type=int, metavar="B", help="windows per forward pass")
    parser.add_argument(
        "--bucket-width",
        type=int,
        metavar="W",
        help="window positions per loss bucket in the per-position table (default: T/8)",
    )
    add_weights_arguments(parser)
    add_cpu_kernels_argument(parser)
    add_kv_cache_dtype_argument(parser)


def run(args: argparse.Namespace) -> int:
    from decoderlm.inference.evaluate import evaluate_file

    model, tokenizer = load_model_and_tokenizer(args)
    result = evaluate_file(
        model,
        tokenizer,
        args.input,
        context_length=args.context_length,
        stride=args.stride,
        max_tokens=args.max_tokens,
        batch_size=args.batch_size,
        progress=not args.json,
        cpu_kernels=args.cpu_kernels,
        kv_cache_dtype=args.kv_cache_dtype,
        bucket_width=args.bucket_width,
    )
    if args.json:
        source = {"checkpoint": args.checkpoint, "input": args.input}
        print(json.dumps({**source, "kv_cache_dtype": args.kv_cache_dtype, **result.to_dict()}))
        return 0
    windows = (
        "non-overlapping windows"
        if result.stride == result.context_length
        else f"windows every {result.stride} tokens"
    )
    print(
        f"loss {result.loss:.4f} nats/token · perplexity {result.perplexity:.3f} · "
        f"bits per byte {result.bits_per_byte:.4f}\n"
        f"{result.n_tokens:,} tokens, {result.n_bytes:,} bytes, {windows} of "
        f"{result.context_length} tokens"
        + (f", through an {args.kv_cache_dtype} KV cache" if args.kv_cache_dtype else "")
    )
    print("loss per window position (context tokens seen by the predicting token):")
    width = result.bucket_width
    for k, (loss, n) in enumerate(zip(result.bucket_losses, result.bucket_tokens, strict=True)):
        end = min((k + 1) * width, result.context_length)
        shown = "      —" if loss is None else f"{loss:7.4f}"
        print(f"  positions {k * width:>6}–{end - 1:<6} {shown}  ({n:,} tokens)")
    return 0
