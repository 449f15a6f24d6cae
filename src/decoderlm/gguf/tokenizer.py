"""The tokenizer a GGUF file describes (`tokenizer.ggml.*`), as a `tokenizers.Tokenizer`, and back
(`tokenizer_metadata`, for byte-level BPE).

Two models, as llama.cpp (`llama-vocab.cpp`) and transformers' GGUF loader
(`transformers/integrations/gguf/gguf_tokenizer_mapping.py`) read them:

- `gpt2`: byte-level BPE: the tokens (spelled in GPT-2's byte alphabet), the merges, and the text
  split before merging by the regex `tokenizer.ggml.pre` names (`PRE_TOKENIZERS`: GPT-2's,
  SmolLM's — each digit apart, then GPT-2's —, Llama 3's, Qwen2's);
- `llama`: SentencePiece BPE: the tokens ("▁" for a space, `<0x0A>` byte tokens for what no token
  spells) merged best score first — the merges are recovered from the scores as transformers'
  `generate_merges` does —, a "▁" before the text when `add_space_prefix`.

Tokens typed control (3) match whole as special tokens, user-defined ones (4) whole as plain
ones. The ids the file names — BOS, EOS, end of turn, padding — stay on decoderlm's `Tokenizer`,
and `add_bos_token` (`add_eos_token`) becomes the tokenizer's post-processor, which
`Tokenizer.encode_prompt` applies to a completion prompt (as vLLM and llama.cpp do); a chat prompt
is the chat template's text, which writes its own BOS.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from decoderlm.errors import DecoderLMError
from decoderlm.gguf.reader import GGUFFile, open_gguf
from decoderlm.tokenizer import SpecialIds, Tokenizer

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # llama.cpp's token types (SentencePiece's; 6 byte)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> Any:  # GPT-2's own regex, inside ByteLevel
    return pre_tokenizers.ByteLevel(add_prefix_space=False)


def _digits_then_gpt2() -> Any:  # llama.cpp's smollm: "\p{N}", then GPT-2's regex
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )


def _split(regex: str) -> Callable[[], Any]:
    return lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# tokenizer.ggml.pre → the pre-tokenizer (the first name of a kind is the one written).
PRE_TOKENIZERS: dict[str, Callable[[], Any]] = {
    "gpt2": _gpt2,
    "default": _gpt2,
    "smollm": _digits_then_gpt2,
    "llama-bpe": _split(_LLAMA3_SPLIT),
    "llama3": _split(_LLAMA3_SPLIT),
    "llama-v3": _split(_LLAMA3_SPLIT),
    "qwen2": _split(_QWEN2_SPLIT),
    "deepseek-r1-qwen": _split(_QWEN2_SPLIT),
}
_IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3")  # a whole-word token wins (llama.cpp, Llama 3)


def tokenizer_from_gguf(file: GGUFFile) -> Tokenizer:
    """decoderlm's Tokenizer for the file's `tokenizer.ggml.*` metadata."""
    kind = file.require("tokenizer.ggml.model")
    tokens = file.require("tokenizer.ggml.tokens")
    types = file.get("tokenizer.ggml.token_type") or []
    if kind == "gpt2":
        backend = _byte_level(file, tokens)
        add_bos = bool(file.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        backend = _sentencepiece(file, tokens)
        add_bos = bool(file.get("tokenizer.ggml.add_bos_token", True))  # llama.cpp's default
    else:
        raise DecoderLMError(
            f"{file.path}: tokenizer.ggml.model={kind!r} is not supported; supported: gpt2, llama"
        )
    _add_special_tokens(backend, tokens, types, byte_level=kind == "gpt2")
    ids = SpecialIds(
        bos=_token_id(file, "bos_token_id", len(tokens)),
        eos=_token_id(file, "eos_token_id", len(tokens)),
        end_of_turn=_token_id(file, "eot_token_id", len(tokens)),
        pad=_token_id(file, "padding_token_id", len(tokens)),
    )
    add_eos = bool(file.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _template(tokens, ids, add_bos, add_eos)
    return Tokenizer(backend, ids)


def _token_id(file: GGUFFile, key: str, vocab: int) -> int | None:
    value = file.get(f"tokenizer.ggml.{key}")
    if value is not None and not 0 <= value < vocab:
        raise DecoderLMError(
            f"{file.path}: tokenizer.ggml.{key}={value} is outside the {vocab} tokens"
        )
    return value


def _byte_level(file: GGUFFile, tokens: list[str]) -> tokenizers.Tokenizer:
    pre = file.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise DecoderLMError(
            f"{file.path}: tokenizer.ggml.pre={pre!r} is not supported; supported: "
            f"{', '.join(PRE_TOKENIZERS)}"
        )
    vocab = {  # a token spelled outside the byte alphabet is re-spelled in it, as transformers does
        t if set(t) <= GPT2_ALPHABET else "".join(GPT2_BYTES[b] for b in t.encode()): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in file.get("tokenizer.ggml.merges") or []]
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
    backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    return backend


def _gpt2_bytes() -> dict[int, str]:
    """GPT-2's byte → character map: printable bytes stand for themselves, the others for
    characters from U+0100 on (`bytes_to_unicode`)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + n) for n, b in enumerate(others)})
    return chars


GPT2_BYTES = _gpt2_bytes()
GPT2_ALPHABET = frozenset(GPT2_BYTES.values())


def _sentencepiece(file: GGUFFile, tokens: list[str]) -> tokenizers.Tokenizer:
    scores = file.get("tokenizer.ggml.scores")
    if scores is None and file.get("tokenizer.ggml.merges") is None:
        raise DecoderLMError(f"{file.path}: a llama tokenizer needs tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    if file.get("tokenizer.ggml.merges") is not None:
        merges = [tuple(m.split(" ", 1)) for m in file.get("tokenizer.ggml.merges")]
    else:
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores, strict=False)))
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    prefix = bool(file.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges: every split of a token into two tokens, best score first
    (ties: shorter left, then shorter right piece), as transformers' `generate_merges`."""
    merges = []
    for token, score in scores.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token))]
        pairs = sorted(
            (p for p in pairs if p[0] in vocab and p[1] in vocab),
            key=lambda p: (vocab[p[0]], vocab[p[1]]),
        )
        merges += [(left, right, score) for left, right in pairs]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(
    backend: tokenizers.Tokenizer, tokens: list[str], types: list[int], byte_level: bool
) -> None:
    """Control tokens match whole as special tokens, user-defined ones as plain added tokens. In a
    byte-level vocabulary a control token spelled outside the byte alphabet is a llama.cpp
    mislabel, skipped (as transformers does)."""
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types, strict=False)
        if kind == CONTROL and (not byte_level or set(t) <= GPT2_ALPHABET)
    ]
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == USER_DEFINED
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user)


def _template(
    tokens: list[str], ids: SpecialIds, add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    """The post-processor adding BOS before (EOS after) a prompt, as the file says."""
    specials = [
        (tokens[i], i) for i, on in ((ids.bos, add_bos), (ids.eos, add_eos)) if on and i is not None
    ]
    single = ["$A"]
    if add_bos and ids.bos is not None:
        single.insert(0, tokens[ids.bos])
    if add_eos and ids.eos is not None:
        single.append(tokens[ids.eos])
    return processors.TemplateProcessing(single=single, special_tokens=specials)


def read_chat_template(path: str | Path) -> tuple[str | None, str, str]:
    """(the file's `tokenizer.chat_template` or None, the BOS text, the EOS text)."""
    file = open_gguf(path)
    tokens = file.get("tokenizer.ggml.tokens") or []

    def text(key: str) -> str:
        index = file.get(f"tokenizer.ggml.{key}")
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else ""

    source = file.get("tokenizer.chat_template")
    return (source if isinstance(source, str) else None), text("bos_token_id"), text("eos_token_id")


def tokenizer_metadata(tokenizer: Tokenizer) -> dict[str, Any]:
    """The `tokenizer.ggml.*` metadata of a byte-level BPE tokenizer (decoderlm's own, or one
    read from a gpt2-model GGUF file or a GPT-2/Llama 3/Qwen2-style tokenizer.json): its
    pre-tokenizer named by PRE_TOKENIZERS, its tokens in id order, their types (special added
    tokens control, other added ones user-defined) and merges; DecoderLMError for another kind."""
    backend = tokenizer.backend
    model = json.loads(backend.to_str())["model"]
    pre = _pre_tokenizer_name(backend)
    if model.get("type") != "BPE" or pre is None:
        raise DecoderLMError(
            "cannot export this tokenizer to GGUF: decoderlm writes byte-level BPE tokenizers "
            f"whose pre-tokenizer is one of {', '.join(PRE_TOKENIZERS)}"
        )
    vocab = backend.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise DecoderLMError("cannot export a tokenizer whose ids have gaps to GGUF")
    added = {t.content: t.special for t in backend.get_added_tokens_decoder().values()}
    types = [(CONTROL if added[t] else USER_DEFINED) if t in added else NORMAL for t in tokens]
    special = tokenizer.special
    eos = special.eos if special.eos is not None else tokenizer.eot_id
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [
            m if isinstance(m, str) else " ".join(m) for m in model["merges"]
        ],
        "tokenizer.ggml.add_bos_token": special.bos is not None
        and tokenizer.encode_prompt("x")[:1] == [special.bos],
    }
    for key, value in (
        ("bos_token_id", special.bos),
        ("eos_token_id", eos),
        ("eot_token_id", special.end_of_turn),
        ("padding_token_id", special.pad),
    ):
        if value is not None:
            meta[f"tokenizer.ggml.{key}"] = value
    return meta


def _pre_tokenizer_name(backend: tokenizers.Tokenizer) -> str | None:
    """The name in PRE_TOKENIZERS of `backend`'s pre-tokenizer (None: none of them)."""
    ours = json.loads(backend.to_str()).get("pre_tokenizer")
    for name, make in PRE_TOKENIZERS.items():
        probe = tokenizers.Tokenizer(models.BPE())
        probe.pre_tokenizer = make()
        if json.loads(probe.to_str())["pre_tokenizer"] == ours:
            return name
    return None
