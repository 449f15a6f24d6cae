"""`decoderlm info`: parameters, FLOPs per token and KV-cache memory of a checkpoint or preset."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from decoderlm.model.config import ModelConfig
    from decoderlm.model.lm import DecoderLM

HELP = "parameters, FLOPs per token and KV-cache size (vs MHA and MQA) of a checkpoint or preset"

CONTEXTS = (4096, 32768, 131072)
# The cache dtypes the table always shows ("int8": decoderlm.model.cache.storage, scales counted).
KV_DTYPES = ("float32", "bfloat16", "int8")
KV_DTYPE_NOTES = {"int8": " (int8 K/V + a float32 scale per token and head)"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="run or Hugging Face directory")
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
    from decoderlm.loading import read_config
    from decoderlm.model.config import ModelConfig
    from decoderlm.model.lm import DecoderLM

    config = ModelConfig.from_preset(args.preset) if args.preset else read_config(args.checkpoint)
    dtype = "int8" if args.dtype == "int8" else str(parse_dtype(args.dtype)).removeprefix("torch.")
    window, window_layers = _window(args, config)
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = DecoderLM(config)
    info = _info(args.preset or args.checkpoint, config, model, dtype, window, window_layers)
    if args.json:
        print(json.dumps(info))
    else:
        _print_table(info, config, _window_label(window, window_layers))
    return 0


def _window(args: argparse.Namespace, config: ModelConfig) -> tuple[int | None, int | None]:
    """(window W or None, the number of windowed layers or None: all): --window W in every layer,
    else the model's own sliding window."""
    from decoderlm.errors import DecoderLMError

    window, window_layers = getattr(config, "sliding_window", None), None
    if window is not None and getattr(config, "sliding_window_layers", None) is not None:
        window_layers = len(config.sliding_window_layers)
    if args.window is not None:  # a window of W tokens in every layer
        if args.window < 1:
            raise DecoderLMError(f"--window={args.window} must be a number of tokens ≥ 1")
        window, window_layers = args.window, None
    return window, window_layers


def _contexts(config: ModelConfig) -> tuple[int, ...]:
    """The contexts the cache's bytes are shown at: CONTEXTS and the model's own."""
    return tuple(sorted({*CONTEXTS, config.context_length}))


def _window_label(window: int | None, window_layers: int | None) -> str | None:
    """The table's name of the sliding window's rows; None without a window."""
    if window is None:
        return None
    return f"window {window:,}" + (f" in {window_layers} layers" if window_layers else "")


def _info(
    source: str,
    config: ModelConfig,
    model: DecoderLM,
    dtype: str,
    window: int | None,
    window_layers: int | None,
) -> dict[str, Any]:
    """What `--json` prints: the shape, parameters and FLOPs, and the cache's bytes in `dtype` and
    in each of KV_DTYPES (the K/V at each of `_contexts`, also in a sliding `window` of
    `window_layers` layers (None: all); the recurrent states at any context)."""
    from decoderlm.model.cache import attention_kind, kv_cache_table, recurrent_state_bytes

    dtypes = dict.fromkeys((*KV_DTYPES, dtype))
    return {
        "source": source,
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
        "kv_cache": kv_cache_table(
            config, _contexts(config), _kv_dtype(dtype), window, window_layers
        ),
        "kv_cache_by_dtype": {
            name: kv_cache_table(config, _contexts(config), _kv_dtype(name), window, window_layers)
            for name in dtypes
        },
        # per sequence at any context: the recurrent layers' conv and matrix states
        "recurrent_state_bytes": {
            name: recurrent_state_bytes(config, _state_dtype(name)) for name in dtypes
        },
    }


def _print_table(info: dict[str, Any], config: ModelConfig, window_label: str | None) -> None:
    """The shape, parameters and FLOPs, then the cache's bytes per dtype: a row per attention
    variant (this model's, MHA, MQA), with the window's row under each, and the recurrent state."""
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
    header = "".join(f"{_tokens(n):>12}" for n in _contexts(config))
    print("KV cache (batch 1)".ljust(30) + f"{'per token':>11}{header}")
    for name, rows in info["kv_cache_by_dtype"].items():
        print(f"  {name}{KV_DTYPE_NOTES.get(name, '')}")
        for row in rows:
            _print_cache_rows(row, window_label)
        if config.has_recurrent_layers:  # the same at every context
            state = _bytes(info["recurrent_state_bytes"][name])
            label = f"recurrent state, {config.n_layers - config.n_attention_layers} layers"
            print(f"    {label:<26}{'-':>11}" + f"{state:>12}" * len(_contexts(config)))


def _print_cache_rows(row: dict[str, Any], window_label: str | None) -> None:
    """One attention variant's cache bytes per token and at each context, and under it those of
    the sliding window, when there is one (`window_label`)."""
    heads = f"{row['n_kv_heads']} KV head" + ("s" if row["n_kv_heads"] > 1 else "")
    label = f"{row['attention']}, {heads}" + (" (this)" if row["variant"] == "model" else "")
    sizes = "".join(f"{_bytes(b):>12}" for b in row["bytes_at"].values())
    print(f"    {label:<26}{_bytes(row['bytes_per_token']):>11}{sizes}")
    if window_label is not None:
        sizes = "".join(f"{_bytes(b):>12}" for b in row["bytes_at_windowed"].values())
        print(f"      {window_label:<24}{'':>11}{sizes}")


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
