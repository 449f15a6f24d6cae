"""`decoderlm info`: parameters, FLOPs per token and KV-cache memory of a checkpoint or preset,
at 4k, 32k and 128k tokens and at the model's own context."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from decoderlm.commands import CHECKPOINT_HELP

if TYPE_CHECKING:
    import torch

HELP = "parameters, FLOPs per token and KV-cache size (vs MHA and MQA) of a checkpoint or preset"

CONTEXTS = (4096, 32768, 131072)
# The cache dtypes the table always shows ("int8": decoderlm.model.cache.storage, scales counted).
KV_DTYPES = ("float32", "bfloat16", "int8")
KV_DTYPE_NOTES = {"int8": " (int8 K/V + a float32 scale per token and head)"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="PATH", help=CHECKPOINT_HELP)
    source.add_argument("--preset", metavar="NAME", help="a ModelConfig preset, e.g. llama-55m")
    parser.add_argument(
        "--dtype",
        default="float32",
        help="KV-cache dtype of the JSON 'kv_cache' rows: float32 (default), bfloat16, float16, int8",
    )
    parser.add_argument(
        "--window",
        type=int,
        metavar="W",
        help="also show a sliding window of W tokens (default: the model's sliding_window, if any)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    import torch

    from decoderlm.dtypes import parse_dtype
    from decoderlm.errors import DecoderLMError
    from decoderlm.loading import read_config
    from decoderlm.model.cache import (
        attention_kind,
        kv_cache_table,
        recurrent_state_bytes,
    )
    from decoderlm.model.cache.sizes import attention_layers
    from decoderlm.model.config import ModelConfig
    from decoderlm.model.lm import DecoderLM

    config = ModelConfig.from_preset(args.preset) if args.preset else read_config(args.checkpoint)
    dtype = "int8" if args.dtype == "int8" else str(parse_dtype(args.dtype)).removeprefix("torch.")
    window, window_layers = getattr(config, "sliding_window", None), None
    if window is not None and getattr(config, "sliding_window_layers", None) is not None:
        window_layers = len(config.sliding_window_layers)
    if args.window is not None:  # a window of W tokens in every layer
        if args.window < 1:
            raise DecoderLMError(f"--window={args.window} must be a number of tokens ≥ 1")
        window, window_layers = args.window, None
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = DecoderLM(config)
    contexts = tuple(sorted({*CONTEXTS, config.context_length}))  # and the model's own
    info = {
        "source": args.preset or args.checkpoint,
        "attention": attention_kind(config),
        "n_layers": config.n_layers,
        "n_heads": config.n_heads,
        "n_kv_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "context_length": config.context_length,
        "parameters": model.num_params(),
        "forward_flops_per_token": model.flops_per_token(training=False),
        "training_flops_per_token": model.flops_per_token(training=True),
        "kv_cache_dtype": dtype,
        "kv_cache_window": window,
        "kv_cache_window_layers": config.n_layers if window_layers is None else window_layers,
        "kv_cache": kv_cache_table(config, contexts, _kv_dtype(dtype), window, window_layers),
        "kv_cache_by_dtype": {
            name: kv_cache_table(config, contexts, _kv_dtype(name), window, window_layers)
            for name in dict.fromkeys((*KV_DTYPES, dtype))
        },
        # per sequence at any context: the recurrent layers' conv and matrix states
        "recurrent_state_bytes": {
            name: recurrent_state_bytes(config, _state_dtype(name))
            for name in dict.fromkeys((*KV_DTYPES, dtype))
        },
    }
    if args.json:
        print(json.dumps(info))
        return 0
    print(
        f"{info['source']}: {config.n_layers} layers, d_model {config.d_model}, "
        f"{config.n_heads} heads of {config.head_dim}, {info['attention']} with "
        f"{config.n_kv_heads} KV heads, context {config.context_length:,}, vocab {config.vocab_size:,}"
    )
    print(f"parameters         {info['parameters']:,}")
    print(
        f"FLOPs per token    {_si(info['forward_flops_per_token'])} forward, "
        f"{_si(info['training_flops_per_token'])} training (at context {config.context_length:,})"
    )
    header = "".join(f"{_tokens(n):>12}" for n in contexts)
    if window is not None:
        layers = info["kv_cache_window_layers"]
        window_label = f"window {window:,}" + (f" in {layers} layers" if window_layers else "")
    print("KV cache (batch 1)".ljust(30) + f"{'per token':>11}{header}")
    for name, rows in info["kv_cache_by_dtype"].items():
        print(f"  {name}{KV_DTYPE_NOTES.get(name, '')}")
        for row in rows:
            heads = f"{row['n_kv_heads']} KV head" + ("s" if row["n_kv_heads"] > 1 else "")
            label = f"{row['attention']}, {heads}" + (
                " (this)" if row["variant"] == "model" else ""
            )
            sizes = "".join(f"{_bytes(row['bytes_at'][n]):>12}" for n in contexts)
            print(f"    {label:<26}{_bytes(row['bytes_per_token']):>11}{sizes}")
            if window is not None:
                sizes = "".join(f"{_bytes(row['bytes_at_windowed'][n]):>12}" for n in contexts)
                print(f"      {window_label:<24}{'':>11}{sizes}")
        if config.has_recurrent_layers:  # the same at every context
            state = _bytes(info["recurrent_state_bytes"][name])
            label = f"recurrent state, {config.n_layers - attention_layers(config)} layers"
            print(f"    {label:<26}{'-':>11}" + f"{state:>12}" * len(contexts))
    return 0


def _state_dtype(name: str) -> torch.dtype:
    """The recurrent states' dtype beside a KV dtype: the same, float32 beside int8 K/V."""
    from decoderlm.dtypes import parse_dtype

    return parse_dtype("float32" if name == "int8" else name)


def _kv_dtype(name: str) -> torch.dtype | str:
    """The `dtype` argument of decoderlm.model.cache.sizes for a dtype name ("int8" stays a name)."""
    from decoderlm.dtypes import parse_dtype

    return name if name == "int8" else parse_dtype(name)


def _si(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} "


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _tokens(n: int) -> str:
    return f"{n // 1024}k ctx" if n % 1024 == 0 else f"{n} ctx"
