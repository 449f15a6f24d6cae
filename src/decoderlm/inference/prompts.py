"""Prompts as token-id rows, their length checks, and the seeded generator a request samples with.

Shared by `generate`, `stream`, `evaluate` and the serving engine's input processor, so that a
prompt is refused with the same one-line error wherever it comes in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from decoderlm.errors import DecoderLMError

Prompt = Tensor | Sequence[Sequence[int]] | Sequence[int]


def prompt_rows(prompt: Prompt, vocab_size: int) -> list[list[int]]:
    """Normalise a prompt — (B, T) or (T,) ids, a list of id lists, or one id list — to id lists."""
    if isinstance(prompt, Tensor):
        if prompt.is_floating_point() or prompt.dim() not in (1, 2):
            raise DecoderLMError(
                f"prompt tensor must hold integer token ids, shape (B, T) or (T,); got "
                f"{prompt.dtype} of shape {tuple(prompt.shape)}"
            )
        prompt = prompt.tolist()
    rows = list(prompt)
    if rows and not isinstance(rows[0], Sequence | Tensor):
        rows = [rows]  # a single sequence of ids
    rows = [[int(t) for t in row] for row in rows]
    if not rows or any(len(row) == 0 for row in rows):
        raise DecoderLMError("empty prompt: give at least one token per row")
    bad = [t for row in rows for t in row if not 0 <= t < vocab_size]
    if bad:
        raise DecoderLMError(
            f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
        )
    return rows


def check_lengths(
    rows: list[list[int]], max_new_tokens: int, context_length: int, refill_past_context: bool
) -> None:
    """DecoderLMError if a prompt is longer than the context, or the generation would outgrow it."""
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 0):
        raise DecoderLMError(f"max_new_tokens={max_new_tokens!r} must be an integer ≥ 0")
    longest = max(len(row) for row in rows)
    if longest > context_length:
        raise DecoderLMError(
            f"prompt has {longest} tokens, more than the model's context_length={context_length}"
        )
    if longest + max_new_tokens > context_length and not refill_past_context:
        raise DecoderLMError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"context_length={context_length}; generate fewer tokens, or refill past it "
            "(refill_past_context=True, --refill-past-context)"
        )


def make_generator(
    seed: int | None, device: torch.device, sample: int = 0
) -> torch.Generator | None:
    """A generator on `device` for sample `sample` of a prompt, seeded with seed + sample
    (mod 2⁶⁴): sample 0 draws what a run with `seed` alone draws. None (torch's global generator)
    without a seed."""
    if seed is None:
        return None
    if not isinstance(seed, int):
        raise DecoderLMError(f"seed={seed!r} must be an integer (or None)")
    return torch.Generator(device=device).manual_seed((seed + sample) % 2**64)
