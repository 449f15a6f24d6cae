"""Hugging Face config.json ↔ ModelConfig for GPT-2 and the Llama family (Llama, Mistral, Qwen2, Qwen3);
the recurrent and hybrid families (Mamba-2, Bamba, Qwen3.5) are in `decoderlm.hf.recurrent`.

Reads both layouts of `transformers`: v4 (`rope_theta`, `rope_scaling` with `type` or `rope_type`,
`torch_dtype`) and v5 (`rope_parameters`, `dtype`). Writes the v4 layout, which v4 (≥ 4.45) and v5
both read. Every RoPE scaling type of ours is one of transformers' (`ROPE_SCALING_KEYS`, same keys);
the one difference is dynamic NTK, whose original length transformers takes from
max_position_embeddings: an imported dynamic model gets context_length = factor · that, and an
exported one max_position_embeddings = its original_max_position_embeddings.
"""

from __future__ import annotations

from typing import Any

from decoderlm.errors import DecoderLMError
from decoderlm.hf.fields import (
    GPT2_DEFAULTS,
    GPT2_FIELDS,
    fields_from_hf,
    fields_to_hf,
    llama_like_from_hf,
    llama_like_to_hf,
    no_equivalent,
    partial_rotary_factor,
    require_hf,
    rope_to_hf,
)
from decoderlm.hf.recurrent import (
    RECURRENT_MODEL_TYPES,
    recurrent_config_from_hf,
    recurrent_config_to_hf,
    recurrent_family,
    recurrent_model_type,
)
from decoderlm.model.config import ModelConfig

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = ("gpt2", *LLAMA_FAMILY, *RECURRENT_MODEL_TYPES)

# HF activation name → our MLP kind (GPT-2). "gelu_new" is the tanh approximation GPT-2 was trained with.
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
_ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Our ModelConfig for the contents of an HF config.json (dropout off: imported models are for use)."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise DecoderLMError(
            f"model_type={model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    try:
        if model_type in RECURRENT_MODEL_TYPES:
            return recurrent_config_from_hf(hf)
        return _gpt2_config(hf) if model_type == "gpt2" else _llama_config(hf, model_type)
    except KeyError as exc:
        raise DecoderLMError(f"{model_type} config.json has no {exc.args[0]!r}") from None


def _gpt2_config(hf: dict[str, Any]) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS:
        raise DecoderLMError(
            f"gpt2 activation_function={act!r} is not supported; supported: {', '.join(_GPT2_ACTIVATIONS)}"
        )
    require_hf(hf, "scale_attn_weights", True)
    require_hf(hf, "scale_attn_by_inverse_layer_idx", False)
    require_hf(hf, "add_cross_attention", False)
    return ModelConfig(
        **fields_from_hf(hf, GPT2_FIELDS, GPT2_DEFAULTS),
        mlp=_GPT2_ACTIVATIONS[act],
        norm="layernorm",
        position="learned",
        bias=True,
        dropout=0.0,
        extra={"hf_model_type": "gpt2"},
    )


def _llama_config(hf: dict[str, Any], model_type: str) -> ModelConfig:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise DecoderLMError(f"{model_type} hidden_act={act!r} is not supported; supported: silu")
    if model_type == "qwen2":  # q/k/v biases and no others, hard-wired in Qwen2
        bias, qkv_bias = False, True
    else:  # Llama/Qwen3: attention_bias covers q, k, v and o; mlp_bias the MLP
        bias = bool(hf.get("attention_bias", False))
        if bool(hf.get("mlp_bias", False)) != bias:
            raise DecoderLMError(
                f"{model_type} with attention_bias={hf.get('attention_bias')} and "
                f"mlp_bias={hf.get('mlp_bias')} is not supported: decoderlm's bias covers every "
                "linear layer (only q/k/v biases can be set apart)"
            )
        qkv_bias = bias
    if partial_rotary_factor(hf) != 1.0:
        raise DecoderLMError(
            "partial_rotary_factor != 1 is not supported (RoPE on every dimension)"
        )
    window, window_layers = _sliding_window_from_hf(hf, model_type)
    return ModelConfig(
        **llama_like_from_hf(hf),
        mlp="swiglu",
        norm="rmsnorm",
        position="rope",
        bias=bias,
        qkv_bias=qkv_bias,
        qk_norm=model_type == "qwen3",
        sliding_window=window,
        sliding_window_layers=window_layers,
        extra={"hf_model_type": model_type},
    )


def _sliding_window_from_hf(
    hf: dict[str, Any], model_type: str
) -> tuple[int | None, tuple[int, ...] | None]:
    """(sliding_window, sliding_window_layers) as transformers 5 reads the config.

    Mistral: `sliding_window` (default 4096) on every layer, null for none. Qwen2/Qwen3: only with
    `use_sliding_window`, on the layers `layer_types` marks "sliding_attention", or without
    `layer_types` on the layers ≥ `max_window_layers` (default 28). Llama has no window.
    """
    if model_type == "mistral":
        return hf.get("sliding_window", 4096), None
    if model_type not in ("qwen2", "qwen3") or not hf.get("use_sliding_window", False):
        return None, None
    window, n_layers = hf.get("sliding_window", 4096), hf["num_hidden_layers"]
    first = hf.get("max_window_layers", 28)
    kinds = hf.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(n_layers)
    ]
    layers = tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    if window is None or not layers:
        return None, None
    return window, None if len(layers) == n_layers else layers


def hf_model_type(config: ModelConfig) -> str:
    """The HF family our config maps onto; DecoderLMError saying why when there is none."""
    c = config
    family = recurrent_family(c)
    if family is not None:
        return recurrent_model_type(c, family)
    if c.has_recurrent_layers:  # linear attention: no HF family
        no_equivalent(f"layer_types={list(c.layer_types)}")
    if c.mlp == "none":
        no_equivalent("mlp='none' (blocks without an MLP) outside Mamba-2's layout")
    if c.rotary_dim not in (None, c.head_dim):
        no_equivalent(f"rotary_dim={c.rotary_dim} (the Llama family rotates the whole head)")
    if c.norm == "rmsnorm_1p":
        no_equivalent("norm='rmsnorm_1p' outside Qwen3.5's layout")
    if c.norm_placement != "pre":
        no_equivalent("Post-LN blocks (every supported HF family is Pre-LN)")
    if c.attn_scale != "1/sqrt(head_dim)":
        no_equivalent(f"attn_scale={c.attn_scale!r} (every supported HF family scales by 1/√d)")
    if c.position == "learned":
        reasons = [
            (c.norm == "layernorm", f"norm={c.norm!r} (GPT-2 uses layernorm)"),
            (c.mlp in ("gelu", "gelu_tanh"), f"mlp={c.mlp!r} (GPT-2 uses gelu/gelu_tanh)"),
            (c.bias and c.qkv_bias, "linear layers without bias (GPT-2 has biases everywhere)"),
            (c.n_kv_heads == c.n_heads, f"n_kv_heads={c.n_kv_heads} (GPT-2 is MHA only)"),
            (c.head_dim * c.n_heads == c.d_model, f"head_dim={c.head_dim} ≠ d_model/n_heads"),
            (not c.qk_norm, "qk_norm=True (GPT-2 has no q/k norm)"),
            (c.sliding_window is None, "a sliding_window (GPT-2 has none)"),
        ]
        family = "gpt2"
    elif c.position == "rope":
        reasons = [
            (c.norm == "rmsnorm", f"norm={c.norm!r} (the Llama family uses rmsnorm)"),
            (c.mlp == "swiglu", f"mlp={c.mlp!r} (the Llama family uses swiglu)"),
            (c.qkv_bias or not c.bias, "bias=True with qkv_bias=False (no HF family has that)"),
            (
                not (c.qk_norm and c.qkv_bias != c.bias),
                "qk_norm with qkv_bias ≠ bias (Qwen3 has one attention_bias)",
            ),
        ]
        family = "qwen3" if c.qk_norm else "qwen2" if c.qkv_bias and not c.bias else "llama"
        mistral = c.sliding_window is not None or c.extra.get("hf_model_type") == "mistral"
        if family == "llama" and not c.bias and mistral:  # Llama has no window, Mistral has
            family = "mistral"
        reasons += _sliding_window_reasons(c, family)
    else:
        no_equivalent(
            f"position={c.position!r} (HF GPT-2 has learned positions and the Llama family RoPE)"
        )
    for ok, reason in reasons:
        if not ok:
            no_equivalent(f"{reason}, for a {family}-style model with position={c.position!r}")
    return family


def _sliding_window_reasons(c: ModelConfig, family: str) -> list[tuple[bool, str]]:
    """(ok, reason) for the window: Mistral windows every layer, Qwen2/Qwen3 the last layers."""
    layers = c.sliding_window_layers
    if family in ("qwen2", "qwen3"):
        suffix = layers is None or layers == tuple(range(layers[0], c.n_layers))
        return [(suffix, f"sliding_window_layers={layers} (Qwen windows the layers from one on)")]
    return [
        (c.sliding_window is None or not c.bias, "a sliding_window with biases (Mistral has none)"),
        (layers is None, f"sliding_window_layers={layers} (Mistral windows every layer)"),
    ]


def config_to_hf(
    config: ModelConfig, dtype: str = "float32", eos_token_id: int | None = None
) -> dict[str, Any]:
    """An HF config.json dict for our config (v4 layout, which v5 also reads)."""
    c, model_type = config, hf_model_type(config)
    common = {
        "architectures": [_ARCHITECTURES.get(model_type)],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": c.tie_embeddings,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype,
    }
    if model_type in RECURRENT_MODEL_TYPES:
        return recurrent_config_to_hf(c, model_type, common)
    if model_type == "gpt2":
        return {
            **common,
            **fields_to_hf(c, GPT2_FIELDS),
            "activation_function": "gelu_new" if c.mlp == "gelu_tanh" else "gelu",
            "resid_pdrop": c.dropout,
            "embd_pdrop": c.dropout,
            "attn_pdrop": c.dropout,
        }
    hf = {
        **common,
        **llama_like_to_hf(c),
        "rope_theta": c.rope_theta,
        "rope_scaling": rope_to_hf(c.rope_scaling),
    }
    if model_type in ("llama", "qwen3"):
        hf["attention_bias"] = c.bias
    if model_type == "llama":
        hf["mlp_bias"] = c.bias
    if model_type == "mistral":
        hf["sliding_window"] = c.sliding_window
    if model_type in ("qwen2", "qwen3"):
        layers = c.sliding_window_layers or (0,)
        hf["use_sliding_window"] = c.sliding_window is not None
        hf["sliding_window"] = c.sliding_window
        hf["max_window_layers"] = layers[0] if c.sliding_window is not None else c.n_layers
    return hf
