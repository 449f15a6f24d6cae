"""Hugging Face config.json ↔ ModelConfig for the recurrent and hybrid families.

- Mamba-2 (`mamba2`, Mamba2ForCausalLM): every layer a Mamba-2 mixer, blocks without an MLP
  (x + Mixer(RMSNorm(x))), no positions;
- Bamba (`bamba`): Mamba-2 layers, softmax attention at `attn_layer_indices`, a SwiGLU MLP in every
  block, RoPE on half of each head (transformers hard-wires partial_rotary_factor 0.5);
- Qwen3.5 (`qwen3_5_text`; the language model of a `qwen3_5` checkpoint, under `text_config`):
  Gated DeltaNet layers and gated attention (q/k norm, an output gate), SwiGLU MLPs, RMSNorm with
  its gain stored as an offset from 1, partial RoPE. A `qwen3_5` checkpoint's vision tower is
  ignored; an export writes `qwen3_5_text`.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from decoderlm.errors import DecoderLMError
from decoderlm.hf.fields import (
    llama_like_from_hf,
    llama_like_to_hf,
    no_equivalent,
    partial_rotary_factor,
    require_hf,
    rope_to_hf,
)
from decoderlm.model.config import ModelConfig

log = logging.getLogger(__name__)

RECURRENT_MODEL_TYPES = ("mamba2", "bamba", "qwen3_5_text", "qwen3_5")
_ARCHITECTURES = {
    "mamba2": "Mamba2ForCausalLM",
    "bamba": "BambaForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
}
# Mamba-2 has no positions and no length limit; its config names none. The released models' training
# length becomes our context_length: the evaluation windows and a plain forward's bound (generate
# decodes past it: a recurrent state does not grow).
MAMBA2_CONTEXT = 2048
# Qwen3.5's layer kinds ↔ ours.
_QWEN3_5_LAYERS = {"linear_attention": "gdn", "full_attention": "attention"}
_NO_TIME_STEP_LIMIT = (0.0, math.inf)


def recurrent_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Our ModelConfig for a config.json of one of RECURRENT_MODEL_TYPES."""
    model_type = hf["model_type"]
    if model_type == "qwen3_5":
        log.warning("qwen3_5: importing the language model only; the vision tower is ignored")
        text = hf["text_config"]
        tied = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        hf = {**text, "tie_word_embeddings": tied}
    if hf.get("hidden_act", "silu") != "silu":
        raise DecoderLMError(f"{model_type} hidden_act={hf['hidden_act']!r} is not supported")
    if model_type == "mamba2":
        return _mamba2_config(hf)
    return _bamba_config(hf) if model_type == "bamba" else _qwen3_5_config(hf)


def _time_step_limit(hf: dict[str, Any], model_type: str) -> None:
    """Refuse a Δ clamp; transformers 5 writes ∞ as {"__float__": "Infinity"}."""
    limit = hf.get("time_step_limit") or _NO_TIME_STEP_LIMIT
    values = [float(v["__float__"] if isinstance(v, dict) else v) for v in limit]
    if tuple(values) != _NO_TIME_STEP_LIMIT:
        raise DecoderLMError(f"{model_type} time_step_limit={values} is not supported (Δ clamp)")


def _mamba2_config(hf: dict[str, Any]) -> ModelConfig:
    require_hf(hf, "use_conv_bias", True)
    require_hf(hf, "rms_norm", True)
    _time_step_limit(hf, "mamba2")
    n_layers = hf["num_hidden_layers"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        context_length=MAMBA2_CONTEXT,
        d_model=hf["hidden_size"],
        n_layers=n_layers,
        n_heads=hf["num_heads"],
        head_dim=hf["head_dim"],
        mlp="none",
        norm="rmsnorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        position="none",
        bias=bool(hf.get("use_bias", False)),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        dropout=0.0,
        layer_types=("mamba2",) * n_layers,
        recurrent_heads=hf["num_heads"],
        recurrent_key_heads=hf.get("n_groups", 8),
        recurrent_key_dim=hf["state_size"],
        recurrent_value_dim=hf["head_dim"],
        recurrent_conv=hf.get("conv_kernel", 4),
        recurrent_chunk=hf.get("chunk_size", 256),
        extra={"hf_model_type": "mamba2"},
    )


def _bamba_config(hf: dict[str, Any]) -> ModelConfig:
    require_hf(hf, "mamba_conv_bias", True)
    _time_step_limit(hf, "bamba")
    bias = bool(hf.get("attention_bias", False))
    if bool(hf.get("mlp_bias", False)) != bias or bool(hf.get("mamba_proj_bias", False)) != bias:
        raise DecoderLMError(
            "bamba with attention_bias, mlp_bias and mamba_proj_bias not all equal is not "
            "supported: decoderlm's bias covers every linear layer"
        )
    fields = llama_like_from_hf(hf, norm_eps=1e-5)
    d_model, n_layers = fields["d_model"], fields["n_layers"]
    attention = set(hf.get("attn_layer_indices") or ())
    if len(attention) >= n_layers:
        raise DecoderLMError("bamba without Mamba-2 layers is not supported (use llama)")
    m_heads, expand = hf.get("mamba_n_heads", 128), hf.get("mamba_expand", 2)
    m_head_dim = hf.get("mamba_d_head", "auto")
    m_head_dim = expand * d_model // m_heads if m_head_dim == "auto" else m_head_dim
    if m_heads * m_head_dim != expand * d_model:
        raise DecoderLMError(
            f"bamba mamba_n_heads·mamba_d_head={m_heads * m_head_dim} ≠ mamba_expand·hidden_size"
        )
    # transformers' Bamba overrides any partial_rotary_factor with 0.5.
    return ModelConfig(
        **fields,
        mlp="swiglu",
        norm="rmsnorm",
        position="rope",
        rotary_dim=fields["head_dim"] // 2,
        bias=bias,
        layer_types=tuple("attention" if i in attention else "mamba2" for i in range(n_layers)),
        recurrent_heads=m_heads,
        recurrent_key_heads=hf.get("mamba_n_groups", 1),
        recurrent_key_dim=hf.get("mamba_d_state", 256),
        recurrent_value_dim=m_head_dim,
        recurrent_conv=hf.get("mamba_d_conv", 4),
        recurrent_chunk=hf.get("mamba_chunk_size", 256),
        extra={"hf_model_type": "bamba"},
    )


def _qwen3_5_config(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("attention_bias", False):
        raise DecoderLMError(
            "qwen3_5 with attention_bias=True is not supported (its MLP has no biases)"
        )
    n_layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types") or [
        "full_attention"
        if (i + 1) % hf.get("full_attention_interval", 4) == 0
        else "linear_attention"
        for i in range(n_layers)
    ]
    unknown = sorted(set(kinds) - set(_QWEN3_5_LAYERS))
    if unknown:
        raise DecoderLMError(f"qwen3_5 layer type {unknown[0]!r} is not supported")
    fields = llama_like_from_hf(hf)
    rotary_dim = int(fields["head_dim"] * partial_rotary_factor(hf, default=0.25))  # transformers'
    return ModelConfig(
        **fields,
        mlp="swiglu",
        norm="rmsnorm_1p",
        position="rope",
        rotary_dim=rotary_dim,
        bias=False,
        qk_norm=True,
        attn_output_gate=True,
        layer_types=tuple(_QWEN3_5_LAYERS[kind] for kind in kinds),
        recurrent_heads=hf.get("linear_num_value_heads", 32),
        recurrent_key_heads=hf.get("linear_num_key_heads", 16),
        recurrent_key_dim=hf.get("linear_key_head_dim", 128),
        recurrent_value_dim=hf.get("linear_value_head_dim", 128),
        recurrent_conv=hf.get("linear_conv_kernel_dim", 4),
        extra={"hf_model_type": "qwen3_5_text"},
    )


def recurrent_family(config: ModelConfig) -> str | None:
    """The recurrent HF family whose layout our config's layers would take (None: not one of them):
    Gated DeltaNet or gated attention → qwen3_5_text; Mamba-2 without MLPs → mamba2, with → bamba."""
    kinds = {config.layer_type(i) for i in range(config.n_layers)}
    if "gdn" in kinds or config.attn_output_gate:
        return "qwen3_5_text"
    if "mamba2" in kinds:
        return "mamba2" if config.mlp == "none" else "bamba"
    return None


def recurrent_model_type(config: ModelConfig, family: str) -> str:
    """`family` (from `recurrent_family`) once our config is checked to fit it; else DecoderLMError."""
    c = config
    kinds = {c.layer_type(i) for i in range(c.n_layers)}
    mixer = {"qwen3_5_text": "gdn", "mamba2": "mamba2", "bamba": "mamba2"}[family]
    d_inner = c.recurrent_dims[0] * c.recurrent_dims[3]
    reasons = [
        (kinds <= {mixer, "attention"}, f"layer_types {sorted(kinds)} (one recurrent kind only)"),
        (c.norm_placement == "pre", "Post-LN blocks"),
        (c.attn_scale == "1/sqrt(head_dim)", f"attn_scale={c.attn_scale!r}"),
        (c.sliding_window is None, "a sliding_window"),
    ]
    if family == "mamba2":
        reasons += [
            (kinds == {"mamba2"}, "attention layers without MLPs"),
            (c.norm == "rmsnorm", f"norm={c.norm!r} (Mamba-2 uses rmsnorm)"),
            (c.position == "none", f"position={c.position!r} (Mamba-2 has none)"),
            (d_inner % c.d_model == 0, f"heads·head_dim={d_inner} not a multiple of d_model"),
        ]
    else:
        reasons += [
            (c.mlp == "swiglu", f"mlp={c.mlp!r} (uses swiglu)"),
            (c.position == "rope", f"position={c.position!r} (uses rope)"),
            (c.qkv_bias == c.bias, "qkv_bias ≠ bias"),
        ]
    if family == "bamba":
        reasons += [
            (c.norm == "rmsnorm", f"norm={c.norm!r} (Bamba uses rmsnorm)"),
            (not c.qk_norm, "qk_norm=True (Bamba has none)"),
            (c.rope_dim * 2 == c.head_dim, f"rotary_dim={c.rope_dim} (Bamba: head_dim / 2)"),
            (d_inner % c.d_model == 0, f"heads·head_dim={d_inner} not a multiple of d_model"),
        ]
    if family == "qwen3_5_text":
        reasons += [
            (c.norm == "rmsnorm_1p", f"norm={c.norm!r} (Qwen3.5 uses rmsnorm_1p)"),
            (c.qk_norm and c.attn_output_gate, "attention without qk_norm and an output gate"),
            (not c.bias, "biases (Qwen3.5 has none)"),
        ]
    for ok, reason in reasons:
        if not ok:
            no_equivalent(f"{reason}, for a {family}-style model")
    return family


def recurrent_config_to_hf(
    config: ModelConfig, family: str, common: dict[str, Any]
) -> dict[str, Any]:
    """The config.json of `family` for our config, `common` (vocabulary, tokens, dtype) included."""
    c = config
    heads, key_heads, key_dim, value_dim = c.recurrent_dims
    hf = {**common, "architectures": [_ARCHITECTURES[family]]}
    if family == "mamba2":
        return {
            **hf,
            "hidden_size": c.d_model,
            "num_hidden_layers": c.n_layers,
            "num_heads": heads,
            "head_dim": value_dim,
            "expand": heads * value_dim // c.d_model,
            "n_groups": key_heads,
            "state_size": key_dim,
            "conv_kernel": c.recurrent_conv,
            "chunk_size": c.recurrent_chunk,
            "use_bias": c.bias,
            "use_conv_bias": True,
            "layer_norm_epsilon": c.norm_eps,
            "residual_in_fp32": False,  # ours adds the residual in the model's dtype
            "hidden_act": "silu",
        }
    hf.update(llama_like_to_hf(c))
    scaling = rope_to_hf(c.rope_scaling) or {"rope_type": "default"}
    rope = {**scaling, "rope_theta": c.rope_theta}
    if family == "bamba":
        return {
            **hf,
            "rope_parameters": rope,
            "attn_layer_indices": [i for i in range(c.n_layers) if c.layer_type(i) == "attention"],
            "mamba_n_heads": heads,
            "mamba_d_head": value_dim,
            "mamba_expand": heads * value_dim // c.d_model,
            "mamba_n_groups": key_heads,
            "mamba_d_state": key_dim,
            "mamba_d_conv": c.recurrent_conv,
            "mamba_chunk_size": c.recurrent_chunk,
            "mamba_conv_bias": True,
            "mamba_proj_bias": c.bias,
            "attention_bias": c.bias,
            "mlp_bias": c.bias,
        }
    ours_to_theirs = {ours: theirs for theirs, ours in _QWEN3_5_LAYERS.items()}
    return {
        **hf,
        "rope_parameters": {**rope, "partial_rotary_factor": c.rope_dim / c.head_dim},
        "attention_bias": False,
        "layer_types": [ours_to_theirs[c.layer_type(i)] for i in range(c.n_layers)],
        "linear_num_value_heads": heads,
        "linear_num_key_heads": key_heads,
        "linear_key_head_dim": key_dim,
        "linear_value_head_dim": value_dim,
        "linear_conv_kernel_dim": c.recurrent_conv,
    }
