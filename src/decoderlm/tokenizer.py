"""Tokenizers: byte-level BPE, character-level, and any Hugging Face `tokenizer.json`.

Every kind is a `tokenizers.Tokenizer` underneath, so every run and data directory stores one
`tokenizer.json` and loading is the same for all of them.

- Byte-level BPE (Sennrich et al., 2016, over bytes as in GPT-2, Radford et al., 2019): the GPT-2
  pre-tokenizer regex, then merges learned from the data. Every string round-trips, since any
  byte sequence is spelled by the 256 base tokens.
- Character-level (nanoGPT's shakespeare_char): one token per Unicode code point seen in the data,
  ids in sorted character order, then `<|endoftext|>`. Encoding a character the data never had raises
  a `DecoderLMError` naming it (no silent unknown token: it would corrupt the text without a word).

`encode` never adds a BOS/EOS template (a loaded Llama tokenizer would otherwise prepend `<s>`):
documents are separated explicitly by `eot_id`. `encode_prompt` applies the tokenizer's own
template (its post-processor: a BOS first where the model's tokenizer adds one), for the text of a
completion prompt, as vLLM does; a chat prompt is the chat template's text, which writes its own.
`decode` keeps special tokens, so decode(encode(x)) == x also for text that contains
`<|endoftext|>`.

The special tokens a model file names (a GGUF file's metadata, a `tokenizer_config.json` beside a
`tokenizer.json`) stay on the tokenizer as `special` (`SpecialIds`: BOS, EOS, end of turn, pad).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

from decoderlm.errors import DecoderLMError
from decoderlm.files import require_file

# End-of-text / end-of-sequence tokens of common tokenizer.json files, in order of preference:
# ours and GPT-2's, Llama 3's, Llama 2's and Mistral's, Gemma's, Llama 3's chat turn end.
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
TOKENIZER_CONFIG = "tokenizer_config.json"  # Hugging Face's: the special tokens' texts


@dataclass(frozen=True)
class SpecialIds:
    """The ids of the special tokens a model file names (None: it names none)."""

    bos: int | None = None
    eos: int | None = None
    end_of_turn: int | None = None  # a chat turn's end, where it differs from eos (GGUF's eot)
    pad: int | None = None


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with the few operations the library needs."""

    EOT = "<|endoftext|>"

    def __init__(self, backend: tokenizers.Tokenizer, special: SpecialIds | None = None) -> None:
        self.backend = backend  # the wrapped `tokenizers.Tokenizer`, for anything not wrapped here
        self.special = special or SpecialIds()
        vocab = backend.get_vocab(with_added_tokens=True)
        # Ids are in range(vocab_size); a file may leave holes, so this is max id + 1, not len().
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        self._eot_id = next((vocab[t] for t in EOT_CANDIDATES if t in vocab), None)

    @classmethod
    def train_bpe(cls, texts: Iterable[str], vocab_size: int = 8192) -> Tokenizer:
        """Byte-level BPE with `vocab_size` tokens (256 bytes + merges + `<|endoftext|>`)."""
        if not isinstance(vocab_size, int) or vocab_size < 257:
            raise DecoderLMError(
                f"vocab_size={vocab_size!r}: byte-level BPE needs at least 257 "
                "(256 bytes + <|endoftext|>)"
            )
        backend = tokenizers.Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[cls.EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
            show_progress=False,
        )
        backend.train_from_iterator(texts, trainer)
        return cls(backend)

    @classmethod
    def train_char(cls, texts: Iterable[str]) -> Tokenizer:
        """One token per character of `texts` (sorted, as in nanoGPT), then `<|endoftext|>`."""
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        vocab = {c: i for i, c in enumerate(sorted(chars))}
        vocab[cls.EOT] = len(vocab)
        backend = tokenizers.Tokenizer(models.WordLevel(vocab))
        # Oniguruma's (?m) lets `.` match newlines too, so every code point is its own piece.
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?m)."), behavior="isolated")
        backend.decoder = decoders.Fuse()  # join the characters back without separators
        backend.add_special_tokens([cls.EOT])
        return cls(backend)

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face `tokenizer.json` (GPT-2's, Llama's, ours); a directory means DIR/tokenizer.json."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.exists():
            raise DecoderLMError(f"no such tokenizer file: {path}")
        require_file(path)  # a FIFO or a device: the error says so
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception for every parse error
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DecoderLMError(f"{path} is not a valid tokenizer.json: {reason}") from None
        return cls(backend, _special_ids(path.with_name(TOKENIZER_CONFIG), backend))

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included: every id is in range(vocab_size)."""
        return self._vocab_size

    @property
    def eot_id(self) -> int | None:
        """Id of `<|endoftext|>` (or the file's end-of-text/eos token), None if it has none."""
        return self._eot_id

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a completion prompt: the tokenizer's template applied (a BOS first where
        the model's tokenizer adds one)."""
        try:
            return self.backend.encode(text, add_special_tokens=True).ids
        except Exception as exc:
            raise self._encode_error([text], exc) from None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (in parallel in Rust), without any BOS/EOS template."""
        try:
            encodings = self.backend.encode_batch(texts, add_special_tokens=False)
        except Exception as exc:  # WordLevel without an unknown token: a character never seen
            raise self._encode_error(texts, exc) from None
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        bad = [i for i in ids if not 0 <= int(i) < self._vocab_size]
        if bad:
            raise DecoderLMError(
                f"token id {bad[0]} is out of range for a vocabulary of {self._vocab_size}"
            )
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as a Hugging Face `tokenizer.json`."""
        self.backend.save(str(path))

    def _encode_error(self, texts: list[str], exc: Exception) -> DecoderLMError:
        vocab = self.backend.get_vocab(with_added_tokens=True)
        unknown = sorted({c for text in texts for c in text if c not in vocab})
        if isinstance(self.backend.model, models.WordLevel) and unknown:
            shown = ", ".join(repr(c) for c in unknown[:10])
            more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
            return DecoderLMError(
                f"characters not in the character vocabulary ({self._vocab_size} tokens): "
                f"{shown}{more}"
            )
        return DecoderLMError(f"cannot encode text: {str(exc).splitlines()[0]}")

    def __repr__(self) -> str:
        kind = type(self.backend.model).__name__
        return f"Tokenizer({kind}, vocab_size={self._vocab_size}, eot_id={self._eot_id})"


def _special_ids(config_file: Path, backend: tokenizers.Tokenizer) -> SpecialIds:
    """BOS, EOS and pad of a `tokenizer_config.json` (their texts, or {"content": text}), as ids of
    `backend`; none when there is no such file or it is not JSON."""
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return SpecialIds()
    if not isinstance(config, dict):
        return SpecialIds()

    def token_id(key: str) -> int | None:
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        return backend.token_to_id(token) if isinstance(token, str) else None

    return SpecialIds(
        bos=token_id("bos_token"), eos=token_id("eos_token"), pad=token_id("pad_token")
    )
