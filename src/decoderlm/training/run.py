"""Resolving a training run: which directory, which checkpoint, which data, which configuration.

`resolve_run` is the one place that turns a request (the CLI's flags and TOML file, or `train()`'s
arguments) into a `Run`:

- the run directory: OUT, else with `resume` the newest run under runs/, else runs/<date-time>;
- resume: OUT's latest checkpoint (the one before it if its trainer state is torn); its saved
  TrainConfig (with the time limit a new run resolved, `TrainConfig.time_limit`) is the base that
  given fields override (so `--resume --max-steps 2000` changes only the step limit), its model is
  the model; a run that stopped before its first checkpoint starts again from step 0;
- overwriting: a new run never writes over what OUT holds unless `overwrite` (which also drops
  OUT's checkpoints and re-prepares OUT/data);
- `init_from`: a checkpoint (a run or Hugging Face directory, a GGUF file or a model name) whose
  model and weights a new run starts from (fine-tuning; `decoderlm.training.model_init`);
- data (`decoderlm.training.run_data`): a prepared data directory, or inputs prepared into OUT/data, or the Python standard
  library (the main job), or a chat file (conversations, JSON Lines) rendered into OUT/data with
  the chat template of the model initialised from. When resuming, or when OUT/data is already there, the inputs, tokenizer
  and vocabulary size given must be those its meta.json recorded, so that the same command plus
  `--resume` continues the run exactly;
- agreement: model fields given for a resumed run must equal its saved model's; for an initialised
  run too, except those that carry no weights (`INIT_FROM_FREE_FIELDS`), so that
  `--init-from RUN --context-length 4096 --rope-scaling '{...}'` extends a run's context.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from decoderlm import checkpoint, data, trainer_state
from decoderlm.data.chat import read_conversations
from decoderlm.errors import DecoderLMError
from decoderlm.files import refuse_overwrite
from decoderlm.loading import read_config
from decoderlm.model.config import ModelConfig
from decoderlm.training import distributed
from decoderlm.training.run_data import (
    PREPARED_DIR,
    is_chat_file,
    prepare_chat_data,
    prepare_data,
    resumed_data,
)
from decoderlm.training.train_config import TrainConfig

DEFAULT_PRESET = "llama-tiny"  # the main job's model: RoPE, GQA, RMSNorm, SwiGLU (`ModelConfig`)
# What the main job's samples continue (its corpus is Python source). No trailing space: byte-level
# BPE joins a space to the word after it (" foo"), so "def " would make the model start a new word.
MAIN_JOB_PROMPT = "def"
RUNS_DIR = Path("runs")  # where runs go without --out: runs/<date-time>
# Model fields an initialised run may change: no weight depends on them (RoPE and sinusoidal
# positions are recomputed for any length; learned positions make context_length a weight shape).
INIT_FROM_FREE_FIELDS = ("context_length", "rope_scaling")
# What a new run writes in OUT besides checkpoints/ and data/.
RUN_FILES = (
    checkpoint.CONFIG_FILE,
    checkpoint.WEIGHTS_FILE,
    checkpoint.TOKENIZER_FILE,
    checkpoint.METRICS_FILE,
)


@dataclass(frozen=True)
class Run:
    """Everything a training run starts from; made by `resolve_run`, consumed by the Trainer."""

    out: Path  # the run directory
    model_config: ModelConfig  # with the data's vocab_size
    train_config: TrainConfig
    data_dir: Path  # a prepared data directory
    meta: dict[str, Any]  # its meta.json
    info: distributed.DistInfo  # where this process sits in the job
    checkpoint: Path | None = None  # the checkpoint a resumed run continues
    state: dict[str, Any] = field(default_factory=dict)  # that checkpoint's trainer state
    init_from: Path | None = None  # the run whose weights a new run starts from


def resolve_run(
    out_dir: str | Path | None = None,
    *,
    resume: bool = False,
    overwrite: bool = False,
    init_from: str | Path | None = None,
    model: ModelConfig | dict[str, Any] | None = None,
    preset: str | None = None,
    train: TrainConfig | dict[str, Any] | None = None,
    data_dir: str | Path | None = None,
    inputs: Sequence[str | Path] | None = None,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
    held_out: float | None = None,
    progress: bool = True,
) -> Run:
    """The run that these arguments describe, its data prepared (rank 0 first, under torchrun).

    `data_dir` may be a chat file (`is_chat_file`: a .jsonl file), rendered with the chat template
    of `init_from` into OUT/data (`decoderlm.training.run_data.prepare_chat_data`), `held_out` of
    its conversations (default 0.1) the validation split.

    `model`/`train`: a whole config, or a dict of fields over the base: for the model `preset`
    (default llama-tiny) or, without a preset, the resumed/initialised run's model; for training
    the resumed run's saved TrainConfig, else the defaults. `tokenizer` and `vocab_size` default
    to "bpe" and 8192 where data is prepared; None elsewhere means "not given" (nothing to check).
    Joins the torchrun job (`distributed.init_distributed`) on the run's device.
    """
    if data_dir is not None and inputs is not None:
        raise DecoderLMError("give either a data directory or inputs to prepare, not both")
    chat_data = data_dir is not None and is_chat_file(data_dir)
    if chat_data:  # a malformed chat file fails before --overwrite clears anything in OUT
        read_conversations(data_dir)
    out = Path(out_dir) if out_dir is not None else latest_run() if resume else default_run_dir()
    ckpt, state = _resume_point(out, resume, overwrite)
    saved_config = checkpoint.read_run_config(ckpt) if ckpt is not None else {}
    if isinstance(train, TrainConfig):
        train_config = train
    else:
        train_config = TrainConfig.from_dict({**saved_config.get("train", {}), **(train or {})})
    if ckpt is None:  # the time limit as saved: a resumed run keeps it, whatever its flags change
        train_config = dataclasses.replace(train_config, max_time=train_config.time_limit)
    info = distributed.init_distributed(train_config.device)
    _check_lora(train_config, init_from, ckpt)
    source = ckpt if ckpt is not None else init_from

    if chat_data:
        if source is None:
            raise DecoderLMError(
                "chat data is rendered with the chat template of the model it fine-tunes: "
                "give that model with --init-from"
            )
        model_config = _model_config(model, preset, source, None, None, ckpt is None)
        found = _chat_data(
            out, Path(data_dir), init_from, ckpt, model_config, held_out, overwrite, info
        )
        return Run(
            out=out,
            model_config=model_config,
            train_config=train_config,
            data_dir=found,
            meta=data.read_meta(found),
            info=info,
            checkpoint=ckpt,
            state=state,
            init_from=Path(init_from) if init_from is not None and ckpt is None else None,
        )
    if held_out is not None:
        raise DecoderLMError("--held-out applies to chat data (--data FILE.jsonl)")
    if data_dir is not None:
        found = Path(data_dir)
    elif ckpt is not None:
        found = resumed_data(out, Path(state["data_dir"]), inputs, tokenizer, vocab_size)
    else:

        def prepare() -> Path:
            return prepare_data(out, inputs, tokenizer, vocab_size, progress, overwrite)

        found = distributed.run_on_main(prepare, info)  # a failure stops every rank
        if not info.is_main:  # rank 0 has prepared it: this only finds it
            found = prepare()
        if inputs is None and train_config.sample_prompt == "":  # the main job
            train_config = dataclasses.replace(train_config, sample_prompt=MAIN_JOB_PROMPT)
    meta = data.read_meta(found)
    model_config = _model_config(model, preset, source, found, meta["vocab_size"], ckpt is None)
    return Run(
        out=out,
        model_config=model_config,
        train_config=train_config,
        data_dir=found,
        meta=meta,
        info=info,
        checkpoint=ckpt,
        state=state,
        init_from=Path(init_from) if init_from is not None and ckpt is None else None,
    )


def default_run_dir() -> Path:
    return RUNS_DIR / datetime.now().strftime("%Y%m%d-%H%M%S")


def latest_run(runs_dir: str | Path = RUNS_DIR) -> Path:
    """The most recently checkpointed run under `runs_dir` (for `--resume` without `--out`)."""
    runs = [p for p in Path(runs_dir).glob("*") if checkpoint.latest_checkpoint(p) is not None]
    if not runs:
        raise DecoderLMError(f"no run with a checkpoint in {runs_dir}/: give --out RUN to resume")
    return max(runs, key=lambda p: checkpoint.latest_checkpoint(p).stat().st_mtime)


def _resume_point(out: Path, resume: bool, overwrite: bool) -> tuple[Path | None, dict[str, Any]]:
    """(checkpoint, its trainer state) a resumed run continues, or (None, {}) for a run that starts
    at step 0: a new one (OUT must hold no run, unless `overwrite`) or, when resuming, one that
    stopped before its first checkpoint."""
    checkpoints = checkpoint.list_checkpoints(out)
    if resume and checkpoints:
        return _readable_checkpoint(checkpoints)
    if resume and _started(out):
        _say(f"{out} has no checkpoint yet: starting the run from step 0")
        return None, {}
    if resume:
        raise DecoderLMError(f"cannot resume: {out} has no checkpoint (start without --resume)")
    if checkpoints and not overwrite:
        raise DecoderLMError(
            f"{out} already holds a run (checkpoint {checkpoints[-1].name}): pass --resume to "
            "continue it, --overwrite to start it over, or choose another --out"
        )
    other = "or --resume to continue the run"
    refuse_overwrite(out, overwrite=overwrite, inside=RUN_FILES, other=other)
    if overwrite:  # what would mix with the new run: the old one's checkpoints and curves
        for name in (checkpoint.CHECKPOINTS_DIR, "tensorboard"):
            shutil.rmtree(out / name, ignore_errors=True)
    return None, {}


def _readable_checkpoint(checkpoints: list[Path]) -> tuple[Path, dict[str, Any]]:
    """The newest of `checkpoints` (oldest first) whose trainer state reads, and that state; a
    torn state falls back to the checkpoint before it, saying so."""
    *older, newest = checkpoints
    try:
        return newest, trainer_state.load_trainer_state(newest)
    except trainer_state.TornStateError as exc:
        if not older:
            raise
        _say(f"warning: {exc}; resuming from the checkpoint before it, {older[-1].name}")
        return _readable_checkpoint(older)


def _started(out: Path) -> bool:
    """Whether `decoderlm train` started a run in `out` (its config.json has a "train" section, or
    it prepared OUT/data) that stopped before its first checkpoint."""
    try:
        return "train" in checkpoint.read_run_config(out)
    except DecoderLMError:
        return (out / PREPARED_DIR).is_dir() and not (out / checkpoint.CONFIG_FILE).exists()


def _say(message: str) -> None:
    """One line on stderr, for what the user should know but is not an error (once per job)."""
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for every rank
        sys.stderr.write(f"decoderlm: {message}\n")
        sys.stderr.flush()


def _chat_data(
    out: Path,
    chat_file: Path,
    init_from: str | Path | None,
    ckpt: Path | None,
    model_config: ModelConfig,
    held_out: float | None,
    overwrite: bool,
    info: distributed.DistInfo,
) -> Path:
    """OUT/data made from the chat file with the template of the model fine-tuned (rank 0 makes
    it, the other ranks find it); the model comes first, its context cuts the conversations."""
    base = init_from if ckpt is None else None

    def prepare(again: bool) -> Path:
        return prepare_chat_data(out, chat_file, base, model_config, held_out, again)

    found = distributed.run_on_main(lambda: prepare(overwrite and ckpt is None), info)
    return found if info.is_main else prepare(False)


def _check_lora(cfg: TrainConfig, init_from: str | Path | None, ckpt: Path | None) -> None:
    """LoRA adapts a model given by --init-from (or a resumed LoRA run), under one process or DDP."""
    if not cfg.lora_rank:
        return
    if init_from is None and ckpt is None:
        raise DecoderLMError(
            "--lora-rank adapts a trained model: give it with --init-from (a run or Hugging Face "
            "directory, a GGUF file or a model name)"
        )
    if cfg.strategy == "fsdp":
        raise DecoderLMError(
            "LoRA trains with --strategy ddp under torchrun (fsdp would shard a frozen base)"
        )


def _model_config(
    model: ModelConfig | dict[str, Any] | None,
    preset: str | None,
    source: str | Path | None,
    data_dir: Path | None,
    vocab: int | None,
    initialising: bool,
) -> ModelConfig:
    """The model to train, with the data's vocabulary size (None: the source's, for chat data
    made with its own tokenizer): the source's (a resumed run, or the checkpoint initialised from),
    which the requested fields must agree with (but for the free fields of an initialised run,
    taken from the request); else the requested one."""
    saved = read_config(source) if source else None
    vocab = saved.vocab_size if vocab is None and saved is not None else vocab
    requested = model if isinstance(model, ModelConfig) else None
    if preset is not None or (isinstance(model, dict) and model):
        fields = model if isinstance(model, dict) else {}
        if preset is None and saved is not None:
            requested = ModelConfig.from_dict({**saved.to_dict(), **fields})
        else:
            requested = ModelConfig.from_preset(preset or DEFAULT_PRESET, **fields)
    if requested is not None:
        requested = dataclasses.replace(requested, vocab_size=vocab)
    if saved is None:
        return requested or ModelConfig.from_preset(DEFAULT_PRESET, vocab_size=vocab)
    if saved.vocab_size != vocab:
        raise DecoderLMError(
            f"the model in {source} has vocab_size={saved.vocab_size}, the data in "
            f"{data_dir} has {vocab}: use data made with the run's tokenizer.json"
        )
    if requested is None:
        return saved
    free = _free_fields(saved) if initialising else ()
    mine, theirs = requested.to_dict(), saved.to_dict()
    for name in mine:
        if name != "extra" and name not in free and mine[name] != theirs[name]:
            rule = (
                f"with --init-from only {' and '.join(free)} may change (no weight depends on them)"
                if initialising
                else "the model of a resumed run is fixed"
            )
            raise DecoderLMError(
                f"model field {name}={mine[name]!r} differs from {source}'s "
                f"{name}={theirs[name]!r}; {rule}"
            )
    return dataclasses.replace(saved, **{name: getattr(requested, name) for name in free})


def _free_fields(saved: ModelConfig) -> tuple[str, ...]:
    """The fields an initialised run may change (INIT_FROM_FREE_FIELDS, less a learned table's length)."""
    if saved.position == "learned":
        return tuple(name for name in INIT_FROM_FREE_FIELDS if name != "context_length")
    return INIT_FROM_FREE_FIELDS
