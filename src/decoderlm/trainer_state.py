"""A trainer's state on disk: trainer_state.json + trainer_state.safetensors, nothing pickled.

The state is a nested dict stored as JSON (readable: step, counters, RNG states, data position,
hyperparameters) with every tensor and numpy array (optimizer moments, RNG bytes) in a safetensors
file beside it, each under its path in the dict.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from decoderlm.errors import DecoderLMError

STATE_FILE = "trainer_state.json"
STATE_TENSORS_FILE = "trainer_state.safetensors"


class TornStateError(DecoderLMError):
    """A checkpoint's trainer state cannot be read (a truncated or unreadable file)."""


def save_trainer_state(directory: str | Path, state: dict[str, Any]) -> None:
    """Write `state` as trainer_state.json + trainer_state.safetensors into `directory`.

    Tensors and numpy arrays go to the safetensors file, each under its path in the dict
    ("optimizer/state/head.weight/exp_avg"); the JSON keeps the structure, with tuples and
    non-string dict keys marked so that `load_trainer_state` returns the same types.
    """
    directory = Path(directory)
    tensors: dict[str, torch.Tensor] = {}
    data = _encode(state, "", tensors)
    save_file(tensors, str(directory / STATE_TENSORS_FILE))
    (directory / STATE_FILE).write_text(json.dumps(data, indent=1) + "\n")


def load_trainer_state(directory: str | Path) -> dict[str, Any]:
    """The dict saved by `save_trainer_state` (tensors on the CPU), or a one-line error:
    `TornStateError` when a file cannot be read."""
    directory = Path(directory)
    try:
        data = json.loads((directory / STATE_FILE).read_text())
        tensors = load_file(str(directory / STATE_TENSORS_FILE))
    except (OSError, ValueError, SafetensorError) as exc:  # JSONDecodeError is a ValueError
        raise TornStateError(f"cannot read the trainer state in {directory}: {exc}") from None
    try:
        return _decode(data, tensors)
    except KeyError as exc:
        raise DecoderLMError(
            f"the trainer state in {directory} names tensor {exc.args[0]!r}, which "
            f"{STATE_TENSORS_FILE} lacks"
        ) from None


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    path = path.removeprefix("/")
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().cpu().contiguous().clone()
        return {"__tensor__": path}
    if isinstance(obj, np.ndarray):  # e.g. numpy's RNG key (uint32); stored as int64
        tensors[path] = torch.from_numpy(obj.astype(np.int64))
        return {"__ndarray__": path, "dtype": str(obj.dtype)}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, f"{path}/{k}", tensors) for k, v in obj.items()}
        return {"__items__": [[k, _encode(v, f"{path}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple | list):
        items = [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return tensors[obj["__ndarray__"]].numpy().astype(obj["dtype"])
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {k: _decode(v, tensors) for k, v in obj["__items__"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}
