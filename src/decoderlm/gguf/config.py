"""GGUF metadata ↔ the Hugging Face config.json it came from, so that `decoderlm.hf`'s mapping
makes the ModelConfig (and, writing, makes the metadata from our config's config.json).

llama.cpp's converter (`convert_hf_to_gguf.py`) writes a config.json's fields under `{arch}.…`
keys; `FIELDS` is that mapping, one table per architecture, read by `hf_config` and written by
`gguf_metadata`. As transformers' GGUF loader does (`transformers/modeling_gguf_pytorch_utils.py`):
the model type is `general.architecture` (a llama whose `general.name` says Mistral is mistral);
the head is tied when the file has no `output.weight`; the vocabulary is the tokenizer's when the
metadata gives no size. Where llama.cpp states more than transformers reads, it is read too:
`attention.key_length` (head_dim), `attention.sliding_window`, biases (from the tensors present),
linear and YaRN scaling (`rope.scaling.*`), and Llama 3's scaling, which llama.cpp writes as the
`rope_freqs` tensor (a divisor of each RoPE frequency, `LlamaModel.generate_extra_tensors`)
rather than as metadata: `llama3_scaling` recovers its parameters from it, and refuses divisors
that Llama 3's formula does not reproduce.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from decoderlm.errors import DecoderLMError
from decoderlm.gguf.reader import GGUFFile
from decoderlm.hf import config_from_hf, config_to_hf
from decoderlm.model.config import ModelConfig
from decoderlm.model.positional import rope_inverse_frequencies

# (key under "{arch}.", config.json key) of each architecture: the one place they are mapped.
_LLAMA_FIELDS = (
    ("vocab_size", "vocab_size"),
    ("context_length", "max_position_embeddings"),
    ("embedding_length", "hidden_size"),
    ("block_count", "num_hidden_layers"),
    ("feed_forward_length", "intermediate_size"),
    ("attention.head_count", "num_attention_heads"),
    ("attention.head_count_kv", "num_key_value_heads"),
    ("attention.key_length", "head_dim"),
    ("attention.layer_norm_rms_epsilon", "rms_norm_eps"),
    ("attention.sliding_window", "sliding_window"),
    ("rope.freq_base", "rope_theta"),
)
_GPT2_FIELDS = (
    ("vocab_size", "vocab_size"),
    ("context_length", "n_positions"),
    ("embedding_length", "n_embd"),
    ("block_count", "n_layer"),
    ("feed_forward_length", "n_inner"),
    ("attention.head_count", "n_head"),
    ("attention.layer_norm_epsilon", "layer_norm_epsilon"),
)
FIELDS = {
    "llama": _LLAMA_FIELDS,
    "qwen2": _LLAMA_FIELDS,
    "qwen3": _LLAMA_FIELDS,
    "gpt2": _GPT2_FIELDS,
}
ARCHITECTURES = tuple(FIELDS)
ROPE_FREQS = "rope_freqs.weight"
LLAMA3_ORIGINAL_LENGTH = 8192  # llama.cpp's default, and Llama 3.x's; only L/low and L/high matter
_ROPE_SCALING = ("linear", "yarn")  # the kinds `rope.scaling.type` names that decoderlm reads


def model_type(file: GGUFFile) -> str:
    """The config.json model_type of the file; DecoderLMError for an architecture not read."""
    arch = file.architecture
    if arch not in FIELDS:
        raise DecoderLMError(
            f"{file.path}: architecture {arch!r} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)} (and mistral, written as llama)"
        )
    if arch == "llama" and "mistral" in str(file.get("general.name", "")).lower():
        return "mistral"
    return arch


def hf_config(file: GGUFFile) -> dict[str, Any]:
    """The config.json (a dict) the file's metadata and tensor table stand for."""
    arch, kind = file.architecture, model_type(file)
    hf: dict[str, Any] = {"model_type": kind}
    for key, theirs in FIELDS[arch]:
        value = file.get(f"{arch}.{key}")
        if value is not None:
            hf[theirs] = value
    names = file.tensors
    hf["tie_word_embeddings"] = "output.weight" not in names
    if "vocab_size" not in hf and "tokenizer.ggml.tokens" in file.reader.fields:
        hf["vocab_size"] = len(file.reader.fields["tokenizer.ggml.tokens"].data)
    if arch == "gpt2":
        return hf
    if kind in ("llama", "mistral", "qwen3"):  # one bias switch for attention, one for the MLP
        hf["attention_bias"] = "blk.0.attn_q.bias" in names
        hf["mlp_bias"] = "blk.0.ffn_up.bias" in names
    if kind == "mistral":
        hf.setdefault("sliding_window", None)  # llama.cpp's llama attends to the whole context
    rope_dims = file.get(f"{arch}.rope.dimension_count")
    head_dim = hf.get("head_dim") or (rope_dims if arch == "llama" else None)
    if head_dim is None and "hidden_size" in hf and "num_attention_heads" in hf:
        head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    hf["head_dim"] = head_dim
    if rope_dims is not None and head_dim:
        hf["partial_rotary_factor"] = rope_dims / head_dim
    hf["rope_scaling"] = _rope_scaling(file, arch, hf)
    return hf


def _rope_scaling(file: GGUFFile, arch: str, hf: dict[str, Any]) -> dict[str, Any] | None:
    kind = file.get(f"{arch}.rope.scaling.type")
    if ROPE_FREQS in file.tensors:
        factors = torch.from_numpy(np.array(file.tensors[ROPE_FREQS].data, dtype=np.float64))
        return llama3_scaling(factors, hf["head_dim"], hf.get("rope_theta", 10000.0), file.path)
    if kind in (None, "none"):
        return None
    if kind not in _ROPE_SCALING:
        raise DecoderLMError(
            f"{file.path}: rope.scaling.type={kind!r} is not supported; supported: "
            f"none, {', '.join(_ROPE_SCALING)} (and Llama 3's rope_freqs)"
        )
    scaling = {"rope_type": kind, "factor": file.get(f"{arch}.rope.scaling.factor", 1.0)}
    if kind == "yarn":
        original = file.get(f"{arch}.rope.scaling.original_context_length")
        scaling["original_max_position_embeddings"] = original
    return scaling


def llama3_scaling(
    factors: torch.Tensor, head_dim: int, theta: float, source: Any = "the file"
) -> dict[str, Any] | None:
    """Llama 3's RoPE scaling whose frequency divisors (head_dim/2,) are `factors`, or None when
    they are all 1.

    The divisor is 1 for wavelengths λ < L/high, `factor` for λ > L/low and
    1 / ((1 − s)/factor + s) between, s = (L/λ − low)/(high − low); s is linear in 1/λ, so the
    divisors between give low and high (L fixed: only L/low and L/high count). The result must
    reproduce every divisor, else DecoderLMError.
    """
    if factors.shape != (head_dim // 2,):
        raise DecoderLMError(
            f"{source}: rope_freqs has shape {tuple(factors.shape)}; the metadata implies "
            f"({head_dim // 2},)"
        )
    if torch.all(factors == 1):
        return None
    factor = float(factors.max())
    inv_freq = rope_inverse_frequencies(head_dim, theta)
    wavelen = 2 * math.pi / inv_freq
    between = (factors > 1) & (factors < factor)
    if int(between.sum()) < 2:
        raise DecoderLMError(
            f"{source}: rope_freqs has fewer than two frequencies between 1 and {factor}, too few "
            "to recover Llama 3's scaling from"
        )
    s = (1 / factors[between] - 1 / factor) / (
        1 - 1 / factor
    )  # s = L/((high − low)·λ) − low/(high − low)
    slope, intercept = np.polyfit((1 / wavelen[between]).numpy(), s.numpy(), 1)
    length = LLAMA3_ORIGINAL_LENGTH
    low = round(float(-intercept * length / slope), 6)
    high = round(low + float(length / slope), 6)
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": length,
    }
    if not torch.allclose(frequency_factors(scaling, head_dim, theta), factors, rtol=1e-5):
        raise DecoderLMError(f"{source}: rope_freqs are not Llama 3's RoPE scaling")
    return scaling


def frequency_factors(scaling: dict[str, Any], head_dim: int, theta: float) -> torch.Tensor:
    """The divisor of each RoPE frequency (head_dim/2,) float64 that `scaling` applies: the
    `rope_freqs` llama.cpp multiplies θ_i's period by."""
    kind = {**scaling, "type": scaling.get("type", scaling.get("rope_type"))}
    return rope_inverse_frequencies(head_dim, theta) / rope_inverse_frequencies(
        head_dim, theta, kind
    )


def read_config(file: GGUFFile) -> ModelConfig:
    """The ModelConfig of the file: its config.json through `decoderlm.hf.config_from_hf`."""
    try:
        return config_from_hf(hf_config(file))
    except DecoderLMError as exc:
        raise DecoderLMError(f"{file.path}: {exc}") from None


def gguf_metadata(
    config: ModelConfig, name: str
) -> tuple[str, dict[str, Any], torch.Tensor | None]:
    """(architecture, {key: value}, rope_freqs or None) of the GGUF file for our config, called
    `name`: its config.json (`decoderlm.hf.config_to_hf`) through FIELDS. A Mistral without a
    window is a Llama (llama.cpp writes both as llama)."""
    try:
        hf = config_to_hf(config)
    except DecoderLMError as exc:
        raise DecoderLMError(f"cannot export to GGUF, which goes through {exc}") from None
    kind = hf["model_type"]
    arch = "llama" if kind == "mistral" else kind
    if arch not in FIELDS:
        raise DecoderLMError(
            f"cannot export a {kind} model to GGUF; supported: {', '.join(ARCHITECTURES)}"
        )
    if hf.get("sliding_window") is not None:
        raise DecoderLMError(
            "cannot export a sliding window to GGUF: llama.cpp's llama, qwen2 and qwen3 attend "
            "to the whole context"
        )
    meta = {
        f"{arch}.{key}": hf[theirs] for key, theirs in FIELDS[arch] if hf.get(theirs) is not None
    }
    meta["general.name"] = name
    rope_freqs = None
    if arch != "gpt2":
        meta[f"{arch}.rope.dimension_count"] = config.rope_dim
        meta[f"{arch}.attention.value_length"] = config.head_dim
        scaling = hf.get("rope_scaling")
        kind = None if scaling is None else scaling["rope_type"]
        if kind == "llama3" and arch == "llama":
            rope_freqs = frequency_factors(scaling, config.head_dim, config.rope_theta).float()
        elif kind in _ROPE_SCALING:
            meta[f"{arch}.rope.scaling.type"] = kind
            meta[f"{arch}.rope.scaling.factor"] = float(scaling["factor"])
            if kind == "yarn":
                original = scaling["original_max_position_embeddings"]
                meta[f"{arch}.rope.scaling.original_context_length"] = original
        elif kind is not None:
            raise DecoderLMError(
                f"cannot export RoPE scaling {kind!r} to GGUF's {arch}; supported: "
                f"{', '.join(_ROPE_SCALING)}{' and llama3' if arch == 'llama' else ''}"
            )
    return arch, meta, rope_freqs
