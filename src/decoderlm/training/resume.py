"""Exact resume: what a training run writes into its checkpoints, and how it continues from one.

A checkpoint holds the weights (a LoRA run's merged, its adapters beside them:
`decoderlm.training.model_init`), the optimizer moments, the step, the data sampler's position, the
RNG states, the elapsed time and the CPU thread count, so on the CPU in float32 a run stopped at
step s and resumed computes bit for bit the same losses as one that never stopped. The files are
written by `decoderlm.checkpoint` (the trainer state by `decoderlm.trainer_state`); under torchrun
every rank gathers its shards and rank 0 writes (`decoderlm.training.distributed`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from decoderlm import checkpoint, generation_config
from decoderlm.chat_template import TOKENIZER_CONFIG_FILE
from decoderlm.errors import DecoderLMError
from decoderlm.files import atomic_write, write_json
from decoderlm.model.config import ModelConfig
from decoderlm.tokenizer import Tokenizer
from decoderlm.training import distributed
from decoderlm.training.model_init import (
    publish_adapters,
    resumed_weights,
    stored_weights,
    write_beside_weights,
)
from decoderlm.training.runtime import rng_state, set_rng_state
from decoderlm.training.train_config import TrainConfig

# the run's files besides its config and weights, copied into every checkpoint as well
RUN_FILES = (checkpoint.TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, generation_config.FILE)


def write_run_files(
    out: Path, model_config: ModelConfig, train_config: TrainConfig, data_dir: Path
) -> None:
    """OUT/config.json (the model and training configs), OUT/tokenizer.json (the data's), for chat
    data OUT/tokenizer_config.json (the chat template the data was rendered with), and
    OUT/generation_config.json: the data's (a chat set's: its base model's stop ids), else its
    tokenizer's end-of-text token (what a model trained on its documents learns to end with)."""
    out.mkdir(parents=True, exist_ok=True)
    config = {"model": model_config.to_dict(), "train": train_config.to_dict()}
    write_json(out / checkpoint.CONFIG_FILE, config)
    for name in RUN_FILES:
        source = data_dir / name
        if source.is_file():
            atomic_write(out / name, lambda tmp, source=source: shutil.copyfile(source, tmp))
    if not (data_dir / generation_config.FILE).is_file():
        tokenizer = Tokenizer.from_file(data_dir / checkpoint.TOKENIZER_FILE)
        generation_config.write(out, tokenizer.generation)


def restore_checkpoint(trainer: Any, ckpt: Path, state: dict[str, Any]) -> None:
    """Continue `trainer` (a `decoderlm.training.trainer.Trainer`, untyped here: the trainer
    imports this module) from `ckpt` and its trainer `state`: weights, optimizer, counters, data
    position and RNG states."""
    weights, whole = resumed_weights(trainer.model, ckpt)  # a LoRA run's adapters alone
    check_optimizer_state(trainer.wrapped, ckpt, state["optimizer"])
    distributed.load_full_state_dicts(
        trainer.wrapped, trainer.optimizer, weights, state["optimizer"], trainer.info, strict=whole
    )
    cfg = trainer.cfg
    decay, no_decay = trainer.optimizer.param_groups  # the config, not the file, is the truth
    decay["weight_decay"], no_decay["weight_decay"] = cfg.weight_decay, 0.0
    for group in trainer.optimizer.param_groups:
        group["betas"], group["eps"] = (cfg.beta1, cfg.beta2), cfg.eps
    if trainer.scaler.is_enabled():
        trainer.scaler.load_state_dict(state["scaler"])
    trainer.sampler.load_state_dict(state["sampler"])
    trainer.step = state["step"]
    trainer.tokens_seen = state["tokens_seen"]
    trainer.elapsed_before = state["elapsed"]
    trainer.best_val_loss = state["best_val_loss"]
    trainer.last_checkpoint = ckpt
    set_rng_state(state["rng"])
    if trainer.device.type == "cpu" and not cfg.threads and "threads" in state:
        torch.set_num_threads(state["threads"])  # same summation order as before the stop


def check_optimizer_state(model: nn.Module, ckpt: Path, saved: dict[str, Any]) -> None:
    """A one-line error naming the first saved optimizer tensor whose shape is not its
    parameter's (torch would load it and train into NaN)."""
    moments = saved.get("state", {})
    for name, param in model.named_parameters():
        for key, value in moments.get(name, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != param.shape:
                raise DecoderLMError(
                    f"optimizer tensor 'optimizer/state/{name}/{key}' in {ckpt} has shape "
                    f"{tuple(value.shape)}, its parameter {tuple(param.shape)}: the trainer "
                    "state does not fit this model"
                )


def save_checkpoint(trainer: Any, val_loss: float | None) -> Path | None:
    """Write `trainer`'s checkpoint of its current step and rotate old ones; returns its directory
    (rank 0; None on the other ranks, which only gather their shards). A failed write stops every
    rank with its one-line error, the previous checkpoint intact."""
    model_sd, optim_sd = distributed.full_state_dicts(trainer.wrapped, trainer.optimizer)
    model, out = trainer.model, trainer.out

    def write() -> Path:
        state = {
            "step": trainer.step,
            "val_loss": val_loss,
            "best_val_loss": trainer.best_val_loss,
            "tokens_seen": trainer.tokens_seen,
            "elapsed": trainer.elapsed(),
            "data_dir": str(trainer.data_dir.resolve()),
            "optimizer": optim_sd,
            "scaler": trainer.scaler.state_dict(),
            "sampler": trainer.sampler.state_dict(),
            "rng": rng_state(),
            "threads": torch.get_num_threads(),  # reductions' order, for exact resume
        }
        try:
            saved = checkpoint.save_checkpoint(
                out,
                trainer.step,
                trainer.model_config,
                stored_weights(model, model_sd),  # a LoRA run's: merged
                state,
                train_config=trainer.cfg.to_dict(),
                run_files=[out / name for name in RUN_FILES if (out / name).is_file()],
                keep_last=trainer.cfg.keep_last,
                write_beside=lambda d: write_beside_weights(model, d, out, trainer.base),
            )
            publish_adapters(saved, out)
            return saved
        except OSError as exc:  # e.g. a read-only or full disk
            kept = trainer.last_checkpoint or "there is none"
            raise DecoderLMError(
                f"cannot save the checkpoint of step {trainer.step} in {trainer.out}: "
                f"{exc.strerror or exc}; the previous checkpoint is intact ({kept})"
            ) from None

    return distributed.run_on_main(write, trainer.info)  # the others wait
