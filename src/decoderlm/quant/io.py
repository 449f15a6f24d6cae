"""Quantized run directories: a run directory (see `decoderlm.checkpoint`) whose config.json has a
"quantization" section and whose model.safetensors holds the quantized layers' buffers:

    RUN/config.json        {"model": {...}, "quantization": {"to": "int4", "group_size": 64}}
    RUN/model.safetensors  tok_emb.weight, norms: float; blocks.0.attn.qkv.weight_q (int8, or
                           uint8 with two int4 values per byte), ….scale, ….offset (int4), ….bias
    RUN/tokenizer.json     copied from the source

A run converted from a GGUF file keeps its ggml blocks: {"to": "gguf", "types": {"tok_emb":
"Q8_0", "blocks.0.attn.qkv": "Q4_1", …}} and the modules' `blocks` (uint8) in model.safetensors.

`decoderlm.load` builds the model on the meta device, swaps in empty quantized layers and assigns
the file's tensors to them, so generate, eval and serve take a quantized run like any other.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from decoderlm import checkpoint
from decoderlm.errors import DecoderLMError
from decoderlm.files import atomic_write, write_json
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM
from decoderlm.quant.apply import (
    GGUF,
    check_settings,
    materialize,
    quantization_of,
    swap_blocks,
    swap_empty,
)

QUANTIZATION_KEY = "quantization"


def read_quantization(run_config: dict[str, Any]) -> dict[str, Any] | None:
    """The "quantization" section of a run's config.json (checked), or None for a float run."""
    section = run_config.get(QUANTIZATION_KEY)
    if section is None:
        return None
    if not isinstance(section, dict) or "to" not in section:
        raise DecoderLMError(f"config.json's {QUANTIZATION_KEY!r} section needs a 'to' field")
    if section["to"] == GGUF:
        types = section.get("types")
        if not isinstance(types, dict) or not all(isinstance(v, str) for v in types.values()):
            raise DecoderLMError(
                f"config.json's {QUANTIZATION_KEY!r} section needs 'types': {{module: ggml type}}"
            )
        return {"to": GGUF, "types": types}
    return {
        "to": section["to"],
        "group_size": check_settings(section["to"], section.get("group_size")),
    }


def save_quantized(
    run_dir: str | Path, model: DecoderLM, tokenizer_file: str | Path | None = None
) -> Path:
    """Write a quantized `model` (see `quantize`) as a run directory; returns it."""
    quantization = quantization_of(model)
    if quantization is None:
        raise DecoderLMError("the model is not quantized; call decoderlm.quant.quantize first")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint.save_weights(run_dir / checkpoint.WEIGHTS_FILE, model)
    if tokenizer_file is not None:
        atomic_write(
            run_dir / checkpoint.TOKENIZER_FILE, lambda tmp: shutil.copyfile(tokenizer_file, tmp)
        )
    config = {"model": model.config.to_dict(), QUANTIZATION_KEY: quantization}
    write_json(run_dir / checkpoint.CONFIG_FILE, config)
    return run_dir


def load_quantized(
    run_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DecoderLM:
    """The model of a quantized run directory, in eval mode; `dtype` casts the float tensors
    (embeddings, norms, scales, biases), never the integer weights."""
    run_config = checkpoint.read_run_config(run_dir)
    quantization = read_quantization(run_config)
    if quantization is None:
        raise DecoderLMError(f"{run_dir} is not a quantized run (no {QUANTIZATION_KEY!r} section)")
    weights = Path(run_dir) / checkpoint.WEIGHTS_FILE
    if not weights.is_file():
        raise DecoderLMError(f"{run_dir} has no {checkpoint.WEIGHTS_FILE}")
    with torch.device("meta"):  # shapes only: the file holds the weights
        model = DecoderLM(ModelConfig.from_dict(run_config["model"]))
        if quantization["to"] == GGUF:
            swap_blocks(model, quantization["types"])
        else:
            swap_empty(model, quantization["to"], quantization["group_size"])
    materialize(model, checkpoint.check_weights(model, weights))
    model.to(device=device, dtype=dtype)
    return model.eval()
