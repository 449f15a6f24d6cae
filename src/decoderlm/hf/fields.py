"""Hugging Face config.json fields that every family reads or writes alike: the context length,
RoPE (v5 `rope_parameters` or v4 `rope_theta` + `rope_scaling`), required values, and the export
refusal."""

from __future__ import annotations

from typing import Any, NoReturn

from decoderlm.errors import DecoderLMError
from decoderlm.model.config import ROPE_SCALING_KEYS, ModelConfig

ROPE_TYPES = ("default", *ROPE_SCALING_KEYS)


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
