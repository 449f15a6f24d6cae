"""`decoderlm attention`: attention heat-maps of a prompt to a PNG (logic in
decoderlm.inference.attention_maps and decoderlm.plot_attention)."""

from __future__ import annotations

import argparse

from decoderlm.commands import CHECKPOINT_HELP
from decoderlm.errors import DecoderLMError
from decoderlm.files import add_overwrite_argument, refuse_overwrite

HELP = "draw the attention weights of a prompt (one head, or all heads of a layer) to a PNG"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="PATH", help=CHECKPOINT_HELP)
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="the text to look at")
    parser.add_argument("--layer", type=int, default=0, metavar="L", help="layer (default 0)")
    parser.add_argument(
        "--head", type=int, metavar="H", help="one head (default: a grid of all heads of the layer)"
    )
    parser.add_argument("--out", required=True, metavar="PNG", help="output file")
    add_overwrite_argument(parser)


def run(args: argparse.Namespace) -> int:
    from decoderlm.inference.attention_maps import attention_maps, check_index
    from decoderlm.loading import load
    from decoderlm.plot_attention import plot_attention

    refuse_overwrite(args.out, overwrite=args.overwrite)
    model, tokenizer = load(args.checkpoint)
    if tokenizer is None:
        raise DecoderLMError(f"{args.checkpoint} has no tokenizer.json, so text cannot be encoded")
    config = model.config
    check_index("layer", args.layer, config.n_layers)
    if args.head is not None:
        check_index("head", args.head, config.n_heads)
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise DecoderLMError("--prompt is empty: give at least one token")
    if len(ids) > config.context_length:
        raise DecoderLMError(
            f"--prompt has {len(ids)} tokens; the model's context is {config.context_length}"
        )
    maps = attention_maps(model, ids)
    tokens = [tokenizer.decode([i]) for i in ids]
    out = plot_attention(maps.weights[args.layer, 0], tokens, args.out, args.layer, args.head)
    print(f"wrote {out}")
    for layer, entropy in enumerate(maps.entropy.tolist()):
        print(f"layer {layer}: mean attention entropy {entropy:.3f} nats")
    return 0
