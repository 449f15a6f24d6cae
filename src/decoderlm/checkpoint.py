"""Run directories on disk, written atomically.

A run directory is what every command reads and writes:

    RUN/config.json        {"model": ModelConfig fields, "train": training settings (optional)}
    RUN/model.safetensors  the model's weights (a tied LM head is stored once, as tok_emb.weight)
    RUN/tokenizer.json     the tokenizer (Hugging Face `tokenizers` format), when there is one

Every file is written to a temporary name in the same directory, fsync'ed and renamed over the old one,
so a process killed mid-write leaves the previous file intact.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.model import DecoderLM

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success fsync it and rename it to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
        _fsync_dir(path.parent)
    finally:
        tmp_path.unlink(missing_ok=True)


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> None:
    """Call `write(tmp_path)` and atomically move the result to `path`."""
    with atomic_path(path) as tmp:
        write(tmp)


def write_json(path: str | Path, data: Any) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2) + "\n"))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def model_state_dict(model: DecoderLM) -> dict[str, torch.Tensor]:
    """The weights to store: plain tensors, contiguous, a tied head dropped (it is tok_emb.weight)."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        state.pop("head.weight", None)
    return state


def save_weights(path: str | Path, model: DecoderLM) -> None:
    atomic_write(
        path, lambda tmp: save_file(model_state_dict(model), str(tmp), metadata={"format": "pt"})
    )


def load_weights(model: DecoderLM, path: str | Path) -> None:
    """Load safetensors weights into `model`, with a one-line error naming any missing/misshaped tensor."""
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise DecoderLMError(f"cannot read weights from {path}: {exc}") from None
    expected = model_state_dict(model)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise DecoderLMError(
            f"weights in {path} do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise DecoderLMError(
                f"tensor {name!r} in {path} has shape {tuple(tensor.shape)}, "
                f"the config needs {tuple(expected[name].shape)}"
            )
    model.load_state_dict(state, strict=not model.config.tie_embeddings)


def read_run_config(run_dir: str | Path) -> dict[str, Any]:
    """config.json of a run directory: {"model": {...}, "train": {...}}."""
    path = Path(run_dir) / CONFIG_FILE
    if not Path(run_dir).is_dir():
        raise DecoderLMError(f"no such run directory: {run_dir}")
    if not path.is_file():
        raise DecoderLMError(f"{run_dir} is not a run directory: {CONFIG_FILE} is missing")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DecoderLMError(f"{path} is not valid JSON: {exc}") from None
    if "model" not in data:
        raise DecoderLMError(f"{path} has no 'model' section")
    return data


def save_model(
    run_dir: str | Path,
    model: DecoderLM,
    tokenizer: Any | None = None,
    train_config: dict[str, Any] | None = None,
) -> Path:
    """Write config.json, model.safetensors and (if given) tokenizer.json into `run_dir`."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_weights(run_dir / WEIGHTS_FILE, model)
    if tokenizer is not None:
        atomic_write(run_dir / TOKENIZER_FILE, lambda tmp: tokenizer.save(str(tmp)))
    config: dict[str, Any] = {"model": model.config.to_dict()}
    if train_config is not None:
        config["train"] = train_config
    write_json(run_dir / CONFIG_FILE, config)
    return run_dir


def load_model(
    run_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DecoderLM:
    """Build the model of a run directory and load its weights (in eval mode)."""
    config = ModelConfig.from_dict(read_run_config(run_dir)["model"])
    weights = Path(run_dir) / WEIGHTS_FILE
    if not weights.is_file():
        raise DecoderLMError(f"{run_dir} has no {WEIGHTS_FILE}")
    model = DecoderLM(config)
    load_weights(model, weights)
    model.to(device=device, dtype=dtype)
    return model.eval()
