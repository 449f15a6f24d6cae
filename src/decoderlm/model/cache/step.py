"""`CacheStep`: what the next forward pass writes to a cache and reads from it, filled by the caller
once per step and handed to the whole cache with `seek(step)`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from decoderlm.errors import DecoderLMError


@dataclass(frozen=True, eq=False)
class CacheStep:
    """The new tokens of one forward pass, the same for every layer.

    slots: (T,) long, the cache positions of the T new tokens, consecutive and ascending (a prefill
        0..T−1, a decoding step (n,)); every row of the batch writes the same positions.
    end: keys are the cache positions [0, end), this step's included: the tokens held after it.
        None attends the whole buffer, a fixed shape for compilation; the caller's key mask then
        hides the unfilled slots (and `rollback` is refused: the caller's mask is the state).
    valid: (B, T) bool, True where a new token is real, False at left padding; None: all are.
        Caches whose keys are in slot order leave padding to the caller's key mask; a cache that
        reorders its keys (the ring) builds its own mask from it.
    """

    slots: Tensor
    end: int | None = None
    valid: Tensor | None = None

    @classmethod
    def span(
        cls, start: int, n_new: int, device: torch.device | str, valid: Tensor | None = None
    ) -> CacheStep:
        """n_new tokens at positions start .. start + n_new − 1, the keys [0, start + n_new)."""
        slots = torch.arange(start, start + n_new, device=device)  # (T,)
        return cls(slots, start + n_new, valid)


def check_rollback(n: int, end: int | None, cache: str) -> None:
    """DecoderLMError unless 0 ≤ n ≤ end, with an `end` known."""
    if end is None:
        raise DecoderLMError(
            f"{cache} cannot roll back a step seeked with end=None (the whole buffer, masked by "
            "the caller): roll back by the caller's key mask and next slot instead"
        )
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= end:
        raise DecoderLMError(f"rollback n={n!r} must be an integer in [0, {end}], the tokens held")
