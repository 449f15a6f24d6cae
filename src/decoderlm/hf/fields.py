"""Hugging Face config.json fields that every family reads or writes alike: the shape of the
Llama-like families (one table, `LLAMA_LIKE_FIELDS`, read by `llama_like_from_hf` and written by
`llama_like_to_hf`), the context length, RoPE (v5 `rope_parameters` or v4 `rope_theta` +
`rope_scaling`), required values, and the export refusal."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from decoderlm.errors import DecoderLMError
from decoderlm.model.config import ROPE_SCALING_KEYS, ModelConfig

ROPE_TYPES = ("default", *ROPE_SCALING_KEYS)

# ModelConfig field ↔ config.json key: the one place each family's plain renames are written, read
# by `fields_from_hf` and written by `fields_to_hf`. The Llama-like families (Llama, Mistral, Qwen2,
# Qwen3, Bamba, Qwen3.5) share one table; their context and RoPE go through the functions below.
LLAMA_LIKE_FIELDS = (
    ("vocab_size", "vocab_size"),
    ("d_model", "hidden_size"),
    ("n_layers", "num_hidden_layers"),
    ("n_heads", "num_attention_heads"),
    ("n_kv_heads", "num_key_value_heads"),
    ("head_dim", "head_dim"),
    ("d_ff", "intermediate_size"),
    ("norm_eps", "rms_norm_eps"),
    ("tie_embeddings", "tie_word_embeddings"),
)
GPT2_FIELDS = (
    ("vocab_size", "vocab_size"),
    ("context_length", "n_positions"),
    ("d_model", "n_embd"),
    ("n_layers", "n_layer"),
    ("n_heads", "n_head"),
    ("d_ff", "n_inner"),
    ("norm_eps", "layer_norm_epsilon"),
    ("tie_embeddings", "tie_word_embeddings"),
)
# transformers' defaults for keys a config.json may leave out: a value, or one computed from the
# fields read before it.
Default = Any | Callable[[dict[str, Any]], Any]
GPT2_DEFAULTS: dict[str, Default] = {
    "d_ff": lambda f: 4 * f["d_model"],
    "norm_eps": 1e-5,
    "tie_embeddings": True,
}


def llama_like_defaults(norm_eps: float) -> dict[str, Default]:
    """transformers' defaults of the Llama-like families, whose RMSNorm ε differs by family."""
    return {
        "n_kv_heads": lambda f: f["n_heads"],
        "head_dim": lambda f: f["d_model"] // f["n_heads"],
        "norm_eps": norm_eps,
        "tie_embeddings": False,
    }


def fields_from_hf(
    hf: dict[str, Any], table: tuple[tuple[str, str], ...], defaults: dict[str, Default]
) -> dict[str, Any]:
    """ModelConfig keyword arguments for `table`'s (ours, theirs) pairs: config.json's value, else
    the default; KeyError naming the key where there is neither."""
    fields: dict[str, Any] = {}
    for ours, theirs in table:
        if hf.get(theirs) is not None:
            fields[ours] = hf[theirs]
        elif ours in defaults:
            default = defaults[ours]
            fields[ours] = default(fields) if callable(default) else default
        else:
            raise KeyError(theirs)
    return fields


def fields_to_hf(config: ModelConfig, table: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """The config.json keys of `table` for our config."""
    return {theirs: getattr(config, ours) for ours, theirs in table}


def llama_like_from_hf(hf: dict[str, Any], norm_eps: float = 1e-6) -> dict[str, Any]:
    """ModelConfig keyword arguments a Llama-like config.json gives alike: LLAMA_LIKE_FIELDS, the
    context length and RoPE; dropout off (imported models are for use)."""
    rope_theta, rope_scaling = rope_from_hf(hf)
    return {
        **fields_from_hf(hf, LLAMA_LIKE_FIELDS, llama_like_defaults(norm_eps)),
        "context_length": context_length(hf, rope_scaling),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "dropout": 0.0,
    }


def llama_like_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The config.json keys of LLAMA_LIKE_FIELDS, the context, the SiLU activation and the
    attention dropout for our config; each family adds its RoPE layout and its own keys."""
    return {
        **fields_to_hf(config, LLAMA_LIKE_FIELDS),
        "max_position_embeddings": max_positions_to_hf(config),
        "hidden_act": "silu",
        "attention_dropout": config.dropout,
    }


def context_length(hf: dict[str, Any], rope_scaling: dict[str, Any] | None) -> int:
    """max_position_embeddings (times the factor for dynamic NTK, whose original length it is).

    A sliding window is not a context: it goes to `ModelConfig.sliding_window`."""
    length = max_positions(hf)
    if rope_scaling is not None and rope_scaling["type"] == "dynamic":
        length = round(rope_scaling["factor"] * length)
    return length


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, our rope_scaling) from v5 `rope_parameters` or v4 `rope_theta` + `rope_scaling`."""
    params = _rope_parameters(hf)
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise DecoderLMError(
            f"rope_type={kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    if kind == "default":
        return theta, None
    required, optional = ROPE_SCALING_KEYS[kind]
    scaling = {"type": kind}
    scaling.update({k: params[k] for k in (*required, *optional) if params.get(k) is not None})
    if "original_max_position_embeddings" in required:
        scaling["original_max_position_embeddings"] = _original_length(hf, params, kind)
    return theta, scaling


def _rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    return {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}


def partial_rotary_factor(hf: dict[str, Any], default: float = 1.0) -> float:
    """The fraction of a head that RoPE rotates (transformers: rotary_dim = int(head_dim · it))."""
    return _rope_parameters(hf).get(
        "partial_rotary_factor", hf.get("partial_rotary_factor", default)
    )


def _original_length(hf: dict[str, Any], params: dict[str, Any], kind: str) -> int:
    """L₀ where transformers takes it: max_position_embeddings for dynamic; for the others a
    top-level original_max_position_embeddings (Phi-3's place), else the RoPE parameters' one,
    else max_position_embeddings."""
    key = "original_max_position_embeddings"
    if kind == "dynamic":
        return max_positions(hf)
    return int(hf.get(key) or params.get(key) or max_positions(hf))


def max_positions(hf: dict[str, Any]) -> int:
    return int(hf.get("max_position_embeddings", 2048))  # transformers' Llama default


def require_hf(hf: dict[str, Any], key: str, value: bool) -> None:
    if key in hf and bool(hf[key]) != value:
        raise DecoderLMError(f"{key}={hf[key]} is not supported; decoderlm needs {key}={value}")


def no_equivalent(reason: str) -> NoReturn:
    raise DecoderLMError(f"cannot export to Hugging Face: no HF model family has {reason}")


def max_positions_to_hf(config: ModelConfig) -> int:
    """context_length, or for dynamic NTK its original length (which transformers reads there)."""
    scaling = config.rope_scaling
    if scaling is not None and _scaling_type(scaling) == "dynamic":
        return scaling["original_max_position_embeddings"]
    return config.context_length


def rope_to_hf(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    if scaling is None:
        return None
    kind = _scaling_type(scaling)
    out = {k: v for k, v in scaling.items() if k not in ("type", "rope_type")}
    if kind == "dynamic":  # written as max_position_embeddings instead
        del out["original_max_position_embeddings"]
    return {"rope_type": kind, **out}


def _scaling_type(scaling: dict[str, Any]) -> str:
    return scaling.get("type", scaling.get("rope_type"))
