"""Run directories on disk, written atomically.

A run directory is what every command reads and writes:

    RUN/config.json        {"model": ModelConfig fields, "train": training settings (optional)}
    RUN/model.safetensors  the model's weights (a tied LM head is stored once, as tok_emb.weight)
    RUN/tokenizer.json     the tokenizer (Hugging Face `tokenizers` format), when there is one
    RUN/metrics.jsonl      training metrics, one JSON object per logged step

Every file is written atomically (`decoderlm.files`): a process killed mid-write leaves the
previous file intact.

Training adds checkpoints, each a complete run directory plus the trainer's state:

    RUN/checkpoints/step_00000500/{config.json, model.safetensors, tokenizer.json,
                                   trainer_state.json, trainer_state.safetensors}

(and the run's tokenizer_config.json and generation_config.json where it has them).

A checkpoint is written into a hidden temporary directory and renamed into place, so the set of
files appears all at once or not at all; RUN/model.safetensors is then pointed at the newest one.
The trainer state's two files are `decoderlm.trainer_state`'s.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from decoderlm import generation_config
from decoderlm.errors import DecoderLMError
from decoderlm.files import atomic_path, atomic_write, fsync_dir, write_json
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM
from decoderlm.trainer_state import STATE_FILE, save_trainer_state

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
METRICS_FILE = "metrics.jsonl"  # one JSON object per logged training step
CHECKPOINTS_DIR = "checkpoints"
_STEP_DIR = re.compile(r"step_(\d+)")
TIED_HEAD = ("head.weight", "head.blocks")  # what a tied head shares with the embedding


def model_state_dict(model: DecoderLM) -> dict[str, torch.Tensor]:
    """The weights to store: plain tensors, contiguous, a tied head dropped (it is tok_emb.weight)."""
    return weights_to_store(model.state_dict(), model.config)


def weights_to_store(
    state: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """A model state dict as stored: detached, contiguous, without a tied head's second copy
    (its weight, or the embedding's ggml blocks it reads)."""
    tied = TIED_HEAD if config.tie_embeddings else ()
    return {k: v.detach().contiguous() for k, v in state.items() if k not in tied}


def save_weights(path: str | Path, model: DecoderLM) -> None:
    atomic_write(
        path, lambda tmp: save_file(model_state_dict(model), str(tmp), metadata={"format": "pt"})
    )


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or a one-line error (a missing or truncated file)."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise DecoderLMError(f"cannot read weights from {path}: {exc}") from None


def load_weights(model: DecoderLM, path: str | Path) -> None:
    """Load safetensors weights into `model`, with a one-line error naming any missing/misshaped tensor."""
    state = check_weights(model, path)
    model.load_state_dict(state, strict=not model.config.tie_embeddings)


def check_weights(model: DecoderLM, path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, checked to be `model`'s (every one, of its shape); a
    one-line error naming any missing, unexpected or misshaped tensor."""
    state = read_weights(path)
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
    return state


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
    """Write config.json, model.safetensors and (if given) tokenizer.json and the tokenizer's
    generation_config.json (the ids that end a generation) into `run_dir`."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_weights(run_dir / WEIGHTS_FILE, model)
    if tokenizer is not None:
        atomic_write(run_dir / TOKENIZER_FILE, lambda tmp: tokenizer.save(str(tmp)))
        generation = getattr(tokenizer, "generation", None)
        if generation is not None:
            generation_config.write(run_dir, generation)
    config: dict[str, Any] = {"model": model.config.to_dict()}
    if train_config is not None:
        config["train"] = train_config
    write_json(run_dir / CONFIG_FILE, config)
    return run_dir


def load_model(
    run_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DecoderLM:
    """Build the model of a run directory and load its weights (in eval mode)."""
    run_config = read_run_config(run_dir)
    if "quantization" in run_config:  # written by decoderlm.quant.io
        raise DecoderLMError(f"{run_dir} holds quantized weights; load it with decoderlm.load")
    config = ModelConfig.from_dict(run_config["model"])
    weights = Path(run_dir) / WEIGHTS_FILE
    latest = latest_checkpoint(run_dir)
    if not weights.is_file() and latest is not None:  # killed before the newest was published
        weights = latest / WEIGHTS_FILE
    if not weights.is_file():
        raise DecoderLMError(f"{run_dir} has no {WEIGHTS_FILE}")
    model = DecoderLM(config)
    load_weights(model, weights)
    model.to(device=device, dtype=dtype)
    return model.eval()


# ---- training checkpoints -------------------------------------------------------------------


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first (temporary and half-deleted ones skipped)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.fullmatch(p.name)) and (p / STATE_FILE).is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def best_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint with the lowest validation loss (among those evaluated when saved), or None."""
    scored = [(checkpoint_val_loss(p), p) for p in list_checkpoints(run_dir)]
    scored = [(loss, p) for loss, p in scored if loss is not None]
    return min(scored, key=lambda item: item[0])[1] if scored else None


def checkpoint_val_loss(ckpt_dir: str | Path) -> float | None:
    """The validation loss a checkpoint was saved with; None if it has none or is unreadable."""
    try:
        return json.loads((Path(ckpt_dir) / STATE_FILE).read_text()).get("val_loss")
    except (OSError, ValueError, AttributeError):
        return None


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    train_config: dict[str, Any] | None = None,
    run_files: Sequence[Path] = (),
    keep_last: int = 2,
    write_beside: Callable[[Path], None] | None = None,
) -> Path:
    """Write RUN/checkpoints/step_<step> atomically, publish its weights as RUN/model.safetensors,
    and delete old checkpoints except the `keep_last` newest and the best (lowest val_loss).

    `weights`: the model's full state dict (plain names); `trainer_state`: a nested dict of
    JSON values, tensors and numpy arrays (see `save_trainer_state`); its "val_loss" (or None)
    ranks checkpoints for "best". `run_files`: the run's files copied in (its tokenizer.json,
    tokenizer_config.json, generation_config.json, those it has), so that the checkpoint loads
    as the run does; `write_beside(directory)` writes any other files the checkpoint holds (a
    LoRA run's adapters).
    """
    run_dir = Path(run_dir)
    root = run_dir / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(root)
    final = root / f"step_{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    tmp.chmod(0o755)  # mkdtemp's 0o700 would hide the checkpoint from other users
    try:
        save_file(weights_to_store(weights, config), str(tmp / WEIGHTS_FILE), {"format": "pt"})
        config_json: dict[str, Any] = {"model": config.to_dict()}
        if train_config is not None:
            config_json["train"] = train_config
        (tmp / CONFIG_FILE).write_text(json.dumps(config_json, indent=2) + "\n")
        for file in run_files:
            shutil.copyfile(file, tmp / Path(file).name)
        save_trainer_state(tmp, trainer_state)
        if write_beside is not None:
            write_beside(tmp)
        for file in tmp.iterdir():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        if final.exists():  # the same step saved again (a resumed run re-saving its last step)
            _discard(final)
        os.replace(tmp, final)
        fsync_dir(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    publish(final / WEIGHTS_FILE, run_dir / WEIGHTS_FILE)
    _rotate(run_dir, max(keep_last, 1))
    return final


def publish(src: Path, dst: Path) -> None:
    """Atomically make `dst` a copy of `src` (a hard link when the filesystem allows one)."""
    with atomic_path(dst) as tmp:
        tmp.unlink()
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)


def _rotate(run_dir: Path, keep_last: int) -> None:
    checkpoints = list_checkpoints(run_dir)
    keep = set(checkpoints[-keep_last:])
    best = best_checkpoint(run_dir)
    if best is not None:
        keep.add(best)
    for ckpt in checkpoints:
        if ckpt not in keep:
            _discard(ckpt)


def _discard(directory: Path) -> None:
    """Delete a checkpoint: renamed away first, so a kill mid-delete never leaves half of one."""
    trash = directory.with_name(f".trash-{directory.name}-{os.getpid()}")
    os.replace(directory, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_leftovers(root: Path) -> None:
    """Temporary and trash directories of saves or deletes that a killed process left behind."""
    for p in root.iterdir():
        if p.name.startswith((".tmp-", ".trash-")):
            shutil.rmtree(p, ignore_errors=True)
