"""The data a training run trains on: a new run's, prepared (the cached standard library, or its
inputs prepared into OUT/data, or a chat file rendered into OUT/data), or a resumed run's; either
way what the request gives (inputs, tokenizer, vocabulary size, chat file) must be what the
data's meta.json recorded, so that the same command plus `--resume` continues the run exactly
(`decoderlm.training.run.resolve_run` asks).

A chat file is a `--data` path ending in .jsonl (`is_chat_file`): conversations, one JSON object a
line (`decoderlm.data.chat`); anything else given as `--data` is a prepared data directory."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from decoderlm import checkpoint, data
from decoderlm.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    TOKENIZER_CONFIG_FILE,
    ChatTemplate,
    load_chat_template,
)
from decoderlm.data import chat
from decoderlm.errors import DecoderLMError
from decoderlm.loading import checkpoint_path
from decoderlm.model.config import ModelConfig
from decoderlm.tokenizer import Tokenizer

DEFAULT_TOKENIZER = "bpe"
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_HELD_OUT = 0.1  # the share of a chat file's conversations held out for validation
PREPARED_DIR = "data"  # OUT/data: the inputs of a run, prepared
CHAT_SUFFIX = ".jsonl"


def is_chat_file(path: str | Path) -> bool:
    """Whether a `--data` path is a chat file (a .jsonl file) rather than a data directory."""
    return Path(path).suffix == CHAT_SUFFIX and not Path(path).is_dir()


def prepare_chat_data(
    out: Path,
    chat_file: Path,
    base: str | Path | None,
    model_config: ModelConfig,
    held_out: float | None,
    overwrite: bool,
) -> Path:
    """OUT/data made from `chat_file` with the tokenizer and chat template of `base` (the model
    fine-tuned), its conversations cut to the model's context; or found there, made from the same
    file (a resumed run, or an attempt that stopped before its first checkpoint), unless
    `overwrite`. A one-line error if what is there was made from another file or share."""
    prepared = out / PREPARED_DIR
    context = model_config.context_length
    if (prepared / data.META_FILE).is_file() and not overwrite:
        meta = data.read_meta(prepared)
        _check_same_chat(prepared, meta, chat_file, held_out, context)
        return prepared
    if base is None:
        raise DecoderLMError(f"cannot resume: {prepared} holds no chat data; start the run again")
    tokenizer, template, tokenizer_config = chat_files(base)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise DecoderLMError(
            f"the tokenizer of {base} has {tokenizer.vocab_size} ids, its model "
            f"{model_config.vocab_size}: not a model and its own tokenizer"
        )
    share = DEFAULT_HELD_OUT if held_out is None else held_out
    meta = chat.prepare_chat(
        chat_file, prepared, tokenizer, template, context, share, tokenizer_config
    )
    _say(chat.summary(meta))
    return prepared


def chat_files(base: str | Path) -> tuple[Tokenizer, ChatTemplate, dict[str, Any] | None]:
    """The tokenizer and chat template of a checkpoint (a directory, a GGUF file or a model's
    name), and the tokenizer_config.json that carries the template and special tokens to the
    fine-tuned run (None: it has none, the default template applies)."""
    path = checkpoint_path(base)
    config: dict[str, Any] = {}
    if path.is_file():  # a GGUF file
        from decoderlm.gguf import open_gguf
        from decoderlm.gguf.tokenizer import tokenizer_from_gguf

        tokenizer = tokenizer_from_gguf(open_gguf(path))
    else:
        tokenizer = Tokenizer.from_file(path / checkpoint.TOKENIZER_FILE)
        if (path / TOKENIZER_CONFIG_FILE).is_file():
            config = json.loads((path / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
    template = load_chat_template(path, eos_token=Tokenizer.EOT)
    if template.source == DEFAULT_CHAT_TEMPLATE:
        return tokenizer, template, None
    config["chat_template"] = template.source  # also where the base kept it apart (.jinja, GGUF)
    special = tokenizer.special
    for key, token in (
        ("bos_token", special.bos),
        ("eos_token", special.eos),
        ("pad_token", special.pad),
    ):
        if token is not None:
            config.setdefault(key, tokenizer.backend.id_to_token(token))
    for key, text in (("bos_token", template.bos_token), ("eos_token", template.eos_token)):
        if text:
            config.setdefault(key, text)
    return tokenizer, template, config


def _check_same_chat(
    prepared: Path, meta: dict[str, Any], chat_file: Path, held_out: float | None, context: int
) -> None:
    """A one-line error unless `prepared` was made from `chat_file` (its contents), with the
    held-out share given (None: any) and the model's context."""
    if meta.get("kind") != "chat":
        raise DecoderLMError(
            f"{prepared} holds prepared text, not chat data: give the run's own data or a new --out"
        )
    recorded = meta["source"]
    given = chat.chat_source(
        chat_file, recorded["held_out"] if held_out is None else held_out, context
    )
    for key, what in (
        ("sha256", "contents"),
        ("held_out", "held-out share"),
        ("context_length", "context"),
    ):
        if given[key] != recorded[key]:
            raise DecoderLMError(
                f"{chat_file} differs from the chat data in {prepared} (made from "
                f"{recorded['chat']}) in its {what}: give the run's chat file and flags, "
                "--overwrite or a new --out"
            )


def _say(message: str) -> None:
    """One line on stderr (rank 0 under torchrun)."""
    if os.environ.get("RANK", "0") == "0":
        sys.stderr.write(f"decoderlm: {message}\n")
        sys.stderr.flush()


def resumed_data(
    out: Path,
    saved: Path,
    inputs: Sequence[str | Path] | None,
    tokenizer: str | None,
    vocab_size: int | None,
) -> Path:
    """The data a resumed run continues on: OUT/data when inputs are given (where they were
    prepared), else the directory the checkpoint names; what was given must match it."""
    if inputs is None:
        check_same_source(saved, None, tokenizer, vocab_size)
        return saved
    prepared = out / PREPARED_DIR
    if not (prepared / data.META_FILE).is_file():
        raise DecoderLMError(
            f"cannot resume with inputs: {prepared} holds no prepared data (this run trained on "
            f"{saved}); resume without --input"
        )
    check_same_source(prepared, inputs, tokenizer, vocab_size)
    return prepared


def prepare_data(
    out: Path,
    inputs: Sequence[str | Path] | None,
    tokenizer: str | None,
    vocab_size: int | None,
    progress: bool,
    overwrite: bool,
) -> Path:
    """A new run's data: the cached standard library, or `inputs` prepared into OUT/data (or
    found there, from an attempt that stopped before its first checkpoint, unless `overwrite`)."""
    if inputs is None:
        return data.prepare_default_corpus(
            tokenizer or DEFAULT_TOKENIZER, vocab_size or DEFAULT_VOCAB_SIZE, progress=progress
        )
    prepared = out / PREPARED_DIR
    if (prepared / data.META_FILE).is_file() and not overwrite:  # meta.json is written last
        check_same_source(prepared, inputs, tokenizer, vocab_size)
        return prepared
    tokenizer, vocab_size = tokenizer or DEFAULT_TOKENIZER, vocab_size or DEFAULT_VOCAB_SIZE
    data.prepare(list(inputs), prepared, tokenizer, vocab_size, progress=progress)
    return prepared


def check_same_source(
    data_dir: Path,
    inputs: Sequence[str | Path] | None,
    tokenizer: str | None,
    vocab_size: int | None,
) -> None:
    """A one-line error unless the given inputs, tokenizer and vocab_size (None: not given) are
    those `data_dir` was prepared from, as its meta.json recorded them."""
    source = data.read_meta(data_dir).get("source", {})
    recorded_inputs = source.get("inputs", [])
    if inputs is not None and _resolved(inputs) != _resolved(recorded_inputs):
        raise DecoderLMError(
            f"inputs {' '.join(map(str, inputs))} differ from {' '.join(recorded_inputs)}, "
            f"which {data_dir} was prepared from: give the run's inputs or a new --out"
        )
    recorded_tokenizer = source.get("tokenizer")
    if tokenizer is not None and _resolved([tokenizer]) != _resolved([recorded_tokenizer or ""]):
        raise DecoderLMError(
            f"tokenizer {tokenizer!r} differs from {recorded_tokenizer!r}, which {data_dir} was "
            "prepared with: give the run's tokenizer or a new --out"
        )
    recorded_vocab = source.get("vocab_size")  # recorded for BPE only
    if vocab_size is not None and recorded_vocab is not None and vocab_size != recorded_vocab:
        raise DecoderLMError(
            f"vocab_size={vocab_size} differs from {recorded_vocab}, which {data_dir} was "
            "prepared with: give the run's vocab_size or a new --out"
        )


def _resolved(paths: Sequence[str | Path]) -> list[Path]:
    """Absolute paths ("bpe" and "char" stay distinct from each other and from any file)."""
    return [Path(p).resolve() for p in paths]
