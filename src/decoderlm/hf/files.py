"""Hugging Face model directories on disk: read (safetensors, sharded, opt-in pickle) and write.

An HF directory holds config.json (with "model_type"), model.safetensors or shards listed in
model.safetensors.index.json, and usually tokenizer.json. Weights are never unpickled unless the
caller says so, and then only through `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from decoderlm import checkpoint, generation_config
from decoderlm.errors import DecoderLMError
from decoderlm.files import atomic_write, write_json
from decoderlm.hf.config import config_from_hf, config_to_hf
from decoderlm.hf.weights import state_dict_from_hf, state_dict_to_hf
from decoderlm.model.lm import DecoderLM

if TYPE_CHECKING:
    from decoderlm.tokenizer import Tokenizer

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def is_hf_checkpoint(path: str | Path) -> bool:
    """True for a directory whose config.json names a `model_type` (ours has a "model" section instead)."""
    config = Path(path) / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "model_type" in data and "model" not in data


def read_hf_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_dir():
        raise DecoderLMError(f"no such Hugging Face model directory: {path}")
    file = path / "config.json"
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise DecoderLMError(
            f"{path} is not a Hugging Face model directory: config.json is missing"
        ) from None
    except ValueError as exc:
        raise DecoderLMError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise DecoderLMError(f"{file} has no 'model_type': not a Hugging Face model config")
    return data


def read_hf_weights(path: str | Path, allow_pickle: bool = False) -> dict[str, Tensor]:
    """All tensors of an HF directory: model.safetensors, its shards, or (opt-in) pytorch_model.bin."""
    path = Path(path)
    if (path / SAFETENSORS).is_file():
        return _load_safetensors(path / SAFETENSORS)
    if (path / SAFETENSORS_INDEX).is_file():
        return _load_sharded(path, SAFETENSORS_INDEX, _load_safetensors)
    pickled = [name for name in (PICKLE, PICKLE_INDEX) if (path / name).is_file()]
    if pickled and not allow_pickle:
        raise DecoderLMError(
            f"{path} has only {pickled[0]}, a pickle that can run code when loaded; convert it to "
            "safetensors, or pass --allow-pickle (allow_pickle=True) to load it with "
            "torch.load(weights_only=True)"
        )
    if pickled:
        if pickled[0] == PICKLE:
            return _load_pickle(path / PICKLE)
        return _load_sharded(path, PICKLE_INDEX, _load_pickle)
    raise DecoderLMError(f"{path} has no {SAFETENSORS}, {SAFETENSORS_INDEX} or {PICKLE}")


def _load_safetensors(file: Path) -> dict[str, Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as exc:
        raise DecoderLMError(f"cannot read weights from {file}: {exc}") from None


def _load_pickle(file: Path) -> dict[str, Tensor]:
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # an unpickling error, a truncated file, a forbidden global
        raise DecoderLMError(
            f"cannot read weights from {file}: {str(exc).splitlines()[0]}"
        ) from None


def _load_sharded(path: Path, index_name: str, load: Any) -> dict[str, Tensor]:
    """Shards listed by an index's "weight_map" {tensor name: shard file}."""
    try:
        weight_map = json.loads((path / index_name).read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise DecoderLMError(f"{path / index_name} is not a valid shard index: {exc}") from None
    state: dict[str, Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not (path / shard).is_file():
            raise DecoderLMError(f"shard {shard!r} listed in {path / index_name} is missing")
        state.update(load(path / shard))
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise DecoderLMError(f"tensor {missing[0]!r} listed in {path / index_name} is in no shard")
    return state


def load_hf(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    allow_pickle: bool = False,
) -> tuple[DecoderLM, Tokenizer | None]:
    """A DecoderLM (eval mode) and its tokenizer (None without tokenizer.json) from an HF directory.

    dtype None keeps our default float32, as `checkpoint.load_model` does.
    """
    path = Path(path)
    config = config_from_hf(read_hf_config(path))
    state = state_dict_from_hf(read_hf_weights(path, allow_pickle), config, source=str(path))
    model = DecoderLM(config)
    model.load_state_dict(state, strict=not config.tie_embeddings)
    model.to(device=device, dtype=dtype)
    tokenizer = None
    if (path / TOKENIZER).is_file():
        from decoderlm.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_file(path / TOKENIZER)
    return model.eval(), tokenizer


def import_hf(
    hf_dir: str | Path,
    run_dir: str | Path,
    dtype: torch.dtype | None = None,
    allow_pickle: bool = False,
) -> Path:
    """Convert an HF directory into a run directory (config.json, model.safetensors, tokenizer.json)."""
    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    model, _ = load_hf(hf_dir, dtype=dtype, allow_pickle=allow_pickle)
    checkpoint.save_model(run_dir, model)
    _copy_file(hf_dir / TOKENIZER, run_dir / checkpoint.TOKENIZER_FILE)
    return run_dir


def to_hf(
    model: DecoderLM, eos_token_id: int | list[int] | None = None, bos_token_id: int | None = None
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(HF config.json dict, HF state dict) for our model; DecoderLMError if no HF family fits."""
    config = model.config
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    hf_config = config_to_hf(config, dtype, eos_token_id, bos_token_id)
    return hf_config, state_dict_to_hf(checkpoint.model_state_dict(model), config)


def export_hf(source: str | Path | DecoderLM, out_dir: str | Path) -> Path:
    """Write an HF directory (config.json, model.safetensors, tokenizer files) from a run dir or a model.

    `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` loads it with no missing or
    unexpected keys; with a tokenizer.json in the run, `AutoTokenizer.from_pretrained` too.
    """
    out_dir = Path(out_dir)
    tokenizer_file = None
    if isinstance(source, DecoderLM):
        model = source
    else:
        model = checkpoint.load_model(source)
        tokenizer_file = Path(source) / checkpoint.TOKENIZER_FILE
    tokenizer = _run_tokenizer(source, tokenizer_file)
    stop_ids = () if tokenizer is None else tokenizer.generation.stop_ids
    eos = stop_ids[0] if len(stop_ids) == 1 else list(stop_ids) or None
    hf_config, state = to_hf(model, eos, None if tokenizer is None else tokenizer.eot_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(
        out_dir / SAFETENSORS, lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"})
    )
    if tokenizer is not None:
        _copy_file(tokenizer_file, out_dir / TOKENIZER)
        tok_config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model.config.context_length,
        }
        if stop_ids:
            tok_config["eos_token"] = tokenizer.backend.id_to_token(stop_ids[0])
        if tokenizer.eot_id is not None:
            tok_config["bos_token"] = tokenizer.backend.id_to_token(tokenizer.eot_id)
        write_json(out_dir / TOKENIZER_CONFIG, tok_config)
        generation_config.write(out_dir, tokenizer.generation)
    write_json(out_dir / "config.json", hf_config)
    return out_dir


def _run_tokenizer(source: Any, tokenizer_file: Path | None) -> Any:
    """The run's tokenizer with its generation config (the ids that end a generation), or None
    when it has no tokenizer.json."""
    if tokenizer_file is None or not tokenizer_file.is_file():
        return None
    from decoderlm.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_file)
    tokenizer.generation = generation_config.read(source, tokenizer)
    return tokenizer


def _copy_file(src: Path, dst: Path) -> None:
    if src.is_file():
        atomic_write(dst, lambda tmp: shutil.copyfile(src, tmp))
