"""Chat data for supervised fine-tuning: conversations rendered with a model's own chat template,
the loss on the assistant's tokens only.

A chat file is JSON Lines, one conversation a line in the OpenAI shape,

    {"messages": [{"role": "system", "content": "…"}, {"role": "user", "content": "…"},
                  {"role": "assistant", "content": "…"}, …]}

with roles in `ROLES`. Each conversation is rendered by the template (`decoderlm.chat_template`)
and tokenized whole; which tokens are the assistant's comes from the rendering, not from guessing
at markers: for assistant turn i, the text of messages[:i] rendered with the generation prompt is
where the turn starts, messages[:i + 1] rendered without it is where the turn ends, so the turn is
its content and whatever the template closes it with (ChatML's `<|im_end|>\\n`). A token is
trained when its first character lies in such a span (trl's assistant-only loss, found without
`{% generation %}` marks in the template).

What goes in and what is counted: a line that is not a JSON object of messages is a one-line error
with its number, and so is an unknown role; a conversation without an assistant turn is skipped,
one longer than the context is cut to its first context_length + 1 tokens (skipped if no
assistant token is left), and each is counted. A `held_out` share of the conversations (a seeded
choice) is the validation split.

On disk (`prepare_chat`), a directory like `decoderlm prepare`'s: meta.json (the source, its
sha256, the counts), tokenizer.json, tokenizer_config.json (the chat template) and
generation_config.json (the base model's stop ids), and per split
`train.safetensors` / `val.safetensors`: ids (int32, all conversations end to end), trained
(uint8, 1 where a token is the assistant's) and offsets (int64, conversation k is
ids[offsets[k]:offsets[k + 1]]).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from decoderlm import generation_config
from decoderlm.chat_template import TOKENIZER_CONFIG_FILE, ChatTemplate, TemplateRenderError
from decoderlm.errors import DecoderLMError
from decoderlm.files import atomic_write, write_json
from decoderlm.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
TRAINED_ROLE = "assistant"
HELD_OUT_SEED = 0  # the held-out choice depends on the data alone, not on the run's seed
SPLIT_FILES = {"train": "train.safetensors", "val": "val.safetensors"}
IGNORE = -100  # the target of a position the loss skips (F.cross_entropy's ignore_index)


@dataclass(frozen=True)
class ChatSplit:
    """Encoded conversations: ids and trained flags end to end, conversation k at
    [offsets[k], offsets[k + 1])."""

    ids: np.ndarray  # (N,) int32
    trained: np.ndarray  # (N,) uint8
    offsets: np.ndarray  # (n + 1,) int64

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def conversation(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.offsets[k], self.offsets[k + 1]
        return self.ids[lo:hi], self.trained[lo:hi]

    def targets(self, k: int) -> int:
        """Trained targets of conversation k: its trained tokens after the first."""
        lo, hi = self.offsets[k], self.offsets[k + 1]
        return int(self.trained[lo + 1 : hi].sum())


def read_conversations(path: str | Path) -> list[list[dict[str, Any]]]:
    """The conversations of a chat file (blank lines skipped); a one-line error naming the line
    of the first malformed one."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DecoderLMError(f"no such chat file: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DecoderLMError(f"cannot read chat file {path}: {exc}") from None
    conversations = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            conversations.append(_messages(line, f"{path}:{number}"))
    if not conversations:
        raise DecoderLMError(f"{path} holds no conversation")
    return conversations


def _messages(line: str, where: str) -> list[dict[str, Any]]:
    """The messages of one line, checked: a list of {"role": one of ROLES, "content": str}."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DecoderLMError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from None
    messages = value.get("messages") if isinstance(value, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DecoderLMError(f'{where}: expected {{"messages": [{{"role": …, "content": …}}, …]}}')
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise DecoderLMError(f"{where}: message {i} is not an object with a role")
        if message["role"] not in ROLES:
            raise DecoderLMError(
                f"{where}: message {i} has role {message['role']!r}; allowed: {', '.join(ROLES)}"
            )
        if not isinstance(message.get("content"), str):
            raise DecoderLMError(f"{where}: message {i} ({message['role']}) has no text content")
    return messages


def assistant_spans(messages: list[dict[str, Any]], template: ChatTemplate) -> tuple[str, list]:
    """(the conversation's text, [(start, end) character span of each assistant turn])."""
    text = template.render(messages, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != TRAINED_ROLE:
            continue
        before = template.render(messages[:i], add_generation_prompt=True)
        through = template.render(messages[: i + 1], add_generation_prompt=False)
        if not (
            text.startswith(before) and text.startswith(through) and len(before) <= len(through)
        ):
            raise TemplateRenderError(
                f"the chat template does not render turn {i}'s conversation so far as the start of "
                "the whole: cannot tell the assistant's tokens"
            )
        spans.append((len(before), len(through)))
    return text, spans


def encode_conversation(
    messages: list[dict[str, Any]], template: ChatTemplate, tokenizer: Tokenizer
) -> tuple[list[int], list[int]]:
    """(token ids, trained flags) of a conversation: a token is trained when it starts inside an
    assistant turn's span."""
    text, spans = assistant_spans(messages, template)
    try:
        encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    except Exception as exc:  # a character a character vocabulary lacks
        raise DecoderLMError(
            f"cannot encode the conversation: {str(exc).splitlines()[0]}"
        ) from None
    trained = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in encoding.offsets]
    return encoding.ids, trained


@dataclass
class ChatCounts:
    """What preparing a chat file kept, skipped and cut."""

    conversations: int = 0
    no_assistant: int = 0  # skipped: no assistant turn
    truncated: int = 0  # cut to the context (still trained on what is left)
    too_long: int = 0  # skipped: no assistant token within the context


def encode_conversations(
    conversations: list[list[dict[str, Any]]],
    template: ChatTemplate,
    tokenizer: Tokenizer,
    context_length: int,
    source: str = "the chat file",
) -> tuple[list[tuple[list[int], list[int]]], ChatCounts]:
    """Each kept conversation's (ids, trained), at most context_length + 1 tokens, and the counts."""
    counts = ChatCounts(conversations=len(conversations))
    kept = []
    for number, messages in enumerate(conversations, start=1):
        if not any(m["role"] == TRAINED_ROLE for m in messages):
            counts.no_assistant += 1
            continue
        try:
            ids, trained = encode_conversation(messages, template, tokenizer)
        except DecoderLMError as exc:
            raise DecoderLMError(f"{source}, conversation {number}: {exc}") from None
        if len(ids) > context_length + 1:  # x and y are its first and last context_length tokens
            ids, trained = ids[: context_length + 1], trained[: context_length + 1]
            if not any(trained[1:]):
                counts.too_long += 1
                continue
            counts.truncated += 1
        kept.append((ids, trained))
    return kept, counts


def split_held_out(n: int, held_out: float) -> np.ndarray:
    """Whether each of n conversations is held out: round(held_out · n) of them, at least one
    and at most n − 1, a seeded choice."""
    if not 0 < held_out < 1:
        raise DecoderLMError(f"held_out={held_out!r} must be between 0 and 1 (exclusive)")
    count = min(max(round(held_out * n), 1), n - 1)
    chosen = np.random.default_rng(HELD_OUT_SEED).permutation(n)[:count]
    mask = np.zeros(n, dtype=bool)
    mask[chosen] = True
    return mask


def _to_split(rows: list[tuple[list[int], list[int]]]) -> ChatSplit:
    lengths = [len(ids) for ids, _ in rows]
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lengths)
    ids = np.fromiter((i for r, _ in rows for i in r), dtype=np.int32, count=int(offsets[-1]))
    trained = np.fromiter((t for _, f in rows for t in f), dtype=np.uint8, count=int(offsets[-1]))
    return ChatSplit(ids, trained, offsets)


def prepare_chat(
    chat_file: str | Path,
    out: str | Path,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    context_length: int,
    held_out: float,
    tokenizer_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Encode `chat_file` into the data directory `out` (see the module docstring); returns its
    meta.json. `tokenizer_config`: the tokenizer_config.json written beside tokenizer.json (the
    chat template and special tokens), so that a run trained on it chats as its base did."""
    chat_file, out = Path(chat_file), Path(out)
    conversations = read_conversations(chat_file)
    rows, counts = encode_conversations(
        conversations, template, tokenizer, context_length, str(chat_file)
    )
    if len(rows) < 2:
        raise DecoderLMError(
            f"{chat_file}: {len(rows)} conversation(s) with an assistant turn; training needs "
            "at least 2 (one to train on, one held out)"
        )
    held = split_held_out(len(rows), held_out)
    splits = {
        "train": _to_split([r for r, h in zip(rows, held, strict=True) if not h]),
        "val": _to_split([r for r, h in zip(rows, held, strict=True) if h]),
    }
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(out / "tokenizer.json")
    if tokenizer_config is not None:
        write_json(out / TOKENIZER_CONFIG_FILE, tokenizer_config)
    generation_config.write(out, tokenizer.generation)  # the base model's stop ids
    for name, split in splits.items():
        tensors = {
            "ids": torch.from_numpy(split.ids),
            "trained": torch.from_numpy(split.trained),
            "offsets": torch.from_numpy(split.offsets),
        }
        atomic_write(out / SPLIT_FILES[name], lambda tmp, t=tensors: save_file(t, str(tmp)))
    meta = {
        "kind": "chat",
        "source": chat_source(chat_file, held_out, context_length),
        "vocab_size": tokenizer.vocab_size,
        **{f"{k}": v for k, v in vars(counts).items()},
    }
    for name, split in splits.items():
        meta[f"{name}_conversations"] = len(split)
        meta[f"{name}_tokens"] = int(split.offsets[-1])
        meta[f"{name}_trained_tokens"] = sum(split.targets(k) for k in range(len(split)))
    write_json(out / "meta.json", meta)  # last: its presence means the directory is complete
    return meta


def chat_source(chat_file: Path, held_out: float, context_length: int) -> dict[str, Any]:
    """What a chat data directory was made from: the file (path and sha256), the held-out share
    and the context its conversations were cut to."""
    try:
        digest = hashlib.sha256(chat_file.read_bytes()).hexdigest()
    except OSError as exc:
        raise DecoderLMError(f"cannot read chat file {chat_file}: {exc}") from None
    return {
        "chat": str(chat_file.resolve()),
        "sha256": digest,
        "held_out": held_out,
        "context_length": context_length,
    }


def load_chat_split(data_dir: str | Path, split: str) -> ChatSplit:
    """A split of a chat data directory; a one-line error for a missing or inconsistent file."""
    path = Path(data_dir) / SPLIT_FILES[split]
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise DecoderLMError(f"cannot read chat data from {path}: {exc}") from None
    try:
        result = ChatSplit(
            tensors["ids"].numpy(), tensors["trained"].numpy(), tensors["offsets"].numpy()
        )
    except KeyError as exc:
        raise DecoderLMError(f"{path} lacks the tensor {exc}") from None
    offsets = result.offsets
    if (
        len(offsets) < 1
        or offsets[0] != 0
        or offsets[-1] != len(result.ids)
        or np.any(np.diff(offsets) < 1)
    ):
        raise DecoderLMError(f"{path}: its offsets do not cut its ids into conversations")
    return result


def summary(meta: dict[str, Any]) -> str:
    """One line: what a chat data directory holds and what preparing it left out."""
    left = []
    if meta["no_assistant"]:
        left.append(f"{meta['no_assistant']} without an assistant turn skipped")
    if meta["too_long"]:
        left.append(f"{meta['too_long']} with no assistant token within the context skipped")
    if meta["truncated"]:
        left.append(f"{meta['truncated']} cut to the context")
    context = meta["source"]["context_length"]
    return (
        f"chat data: {meta['conversations']:,} conversations"
        + (f" ({'; '.join(left)}, context {context} tokens)" if left else "")
        + f"; train {meta['train_conversations']:,} ({meta['train_tokens']:,} tokens, "
        f"{meta['train_trained_tokens']:,} trained), held out {meta['val_conversations']:,} "
        f"({meta['val_tokens']:,} tokens, {meta['val_trained_tokens']:,} trained)"
    )
