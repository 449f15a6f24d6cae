"""What a model's own files say about generating from it: the ids that end a generation and the
sampling defaults, after Hugging Face's `generation_config.json` and vLLM's `--generation-config
auto`.

The stop ids are read in order of authority, the first source that names any winning:

1. `generation_config.json` `eos_token_id` (an int or a list: Llama 3 lists three);
2. `config.json` `eos_token_id`;
3. `tokenizer_config.json` `eos_token` (its text, as the tokenizer's `special.eos`);
4. a GGUF file's `tokenizer.ggml.eos_token_id` and `tokenizer.ggml.eot_token_id` (the end of a
   chat turn where it differs);
5. else a guess from the token's spelling (`tokenizer.EOT_CANDIDATES`), with a warning.

A run directory of decoderlm's records its own in a `generation_config.json` (`write`). The stop
ids are not the document separator of training data (`Tokenizer.eot_id`): a chat model ends a
turn with `<|im_end|>` while its documents are separated by `<|endoftext|>`.

The sampling defaults (`temperature`, `top_p`, `top_k`, `repetition_penalty`) come from
`generation_config.json` only; requests and commands that leave one out take it (vLLM's
`--generation-config auto`; `vllm` turns that off).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from decoderlm.errors import DecoderLMError
from decoderlm.files import write_json

log = logging.getLogger(__name__)

FILE = "generation_config.json"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty")


@dataclass(frozen=True)
class GenerationConfig:
    """The ids that end a generation, where each came from, and the sampling defaults."""

    stop_ids: tuple[int, ...] = ()
    sources: tuple[str, ...] = ()  # one per stop id: the file and field it was read from
    defaults: dict[str, float | int] = field(default_factory=dict)  # of SAMPLING_FIELDS

    @property
    def guessed(self) -> bool:
        """Whether the stop ids were guessed from the tokens' spelling, not read from a file."""
        return any(source.startswith("guessed") for source in self.sources)


def read(path: str | Path, tokenizer: Any) -> GenerationConfig:
    """The generation config of the checkpoint at `path` (a run or Hugging Face directory, or a
    GGUF file) whose tokenizer is `tokenizer` (its `special` ids and vocabulary)."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    generation = _json(folder / FILE) if path.is_dir() else {}
    found = _ids(generation.get("eos_token_id"), f"{FILE} eos_token_id", tokenizer)
    if not found and path.is_dir():
        config = _json(folder / "config.json")
        found = _ids(config.get("eos_token_id"), "config.json eos_token_id", tokenizer)
    special = getattr(tokenizer, "special", None)
    if not found and special is not None:
        if path.is_dir():
            named = [(special.eos, "tokenizer_config.json eos_token")]
        else:  # a GGUF file
            named = [
                (special.eos, "GGUF tokenizer.ggml.eos_token_id"),
                (special.end_of_turn, "GGUF tokenizer.ggml.eot_token_id"),
            ]
        found = [(i, source) for i, source in named if i is not None]
    if not found:
        found = _guess(tokenizer)
    unique = list(dict.fromkeys(found))  # the first source of each id
    defaults = {k: generation[k] for k in SAMPLING_FIELDS if _number(generation.get(k))}
    if defaults.get("top_k", 1) < 1:  # 0 or -1: no top-k, as Hugging Face and vLLM read it
        del defaults["top_k"]
    return GenerationConfig(
        tuple(i for i, _ in unique), tuple(source for _, source in unique), defaults
    )


def write(folder: str | Path, config: GenerationConfig) -> None:
    """Record `config` (its stop ids and sampling defaults) in FOLDER/generation_config.json, as
    Hugging Face writes it; nothing when it has neither."""
    if config.stop_ids or config.defaults:
        content: dict[str, Any] = {"eos_token_id": list(config.stop_ids)} | config.defaults
        write_json(Path(folder) / FILE, content)


def _json(file: Path) -> dict[str, Any]:
    """A JSON object file's content; {} if there is none; DecoderLMError if it is not an object."""
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DecoderLMError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise DecoderLMError(f"{file} must hold a JSON object, not {type(value).__name__}")
    return value


def _ids(value: Any, source: str, tokenizer: Any) -> list[tuple[int, str]]:
    """The ids an `eos_token_id` field names (an int or a list of them); DecoderLMError for one
    that is not a token id of the vocabulary."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    size = tokenizer.vocab_size
    bad = [
        v for v in values if not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < size)
    ]
    if bad:
        raise DecoderLMError(
            f"{source} = {bad[0]!r} is not a token id of the vocabulary [0, {size})"
        )
    return [(v, source) for v in values]


def _guess(tokenizer: Any) -> list[tuple[int, str]]:
    """The tokenizer's end-of-text token by its spelling, with a warning; [] if it has none."""
    eot = getattr(tokenizer, "eot_id", None)
    if eot is None:
        return []
    log.warning(
        "decoderlm: the model's files name no end-of-sequence token; generation stops at token "
        "%d, guessed from its spelling",
        eot,
    )
    return [(eot, "guessed from the token's spelling")]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
