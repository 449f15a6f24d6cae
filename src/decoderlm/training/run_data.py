"""The data a training run trains on: a new run's, prepared (the cached standard library, or its
inputs prepared into OUT/data), or a resumed run's; either way what the request gives (inputs,
tokenizer, vocabulary size) must be what the data's meta.json recorded, so that the same command
plus `--resume` continues the run exactly (`decoderlm.training.run.resolve_run` asks)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from decoderlm import data
from decoderlm.errors import DecoderLMError

DEFAULT_TOKENIZER = "bpe"
DEFAULT_VOCAB_SIZE = 8192
PREPARED_DIR = "data"  # OUT/data: the inputs of a run, prepared


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
