"""Attention masks: the causal rule (with an optional sliding window), key padding, masked softmax.

Masks built here are boolean, True = "may attend". Causal masks are aligned bottom-right: query i
of Tq attends keys j ≤ i + (Tk − Tq), which is the usual lower triangle when Tq == Tk and the right
rule when the queries are the last Tq positions of a longer (cached) key sequence.

Sliding-window attention (Beltagy et al., 2020, Longformer; Jiang et al., 2023, Mistral 7B) keeps
only the last W keys of each query, itself included: i − W < j ≤ i + (Tk − Tq), the rule of
transformers' `sliding_window_causal_mask_function`. A window only narrows causal attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from decoderlm.errors import DecoderLMError

MaskedSoftmax = Callable[[Tensor, Tensor | None], Tensor]


def causal_mask(
    t_q: int, t_k: int, device: torch.device | str | None = None, window: int | None = None
) -> Tensor:
    """(t_q, t_k) bool, True where query i may attend key j: j ≤ i + t_k − t_q, and with a window
    also j > i + t_k − t_q − window.

    From int32 positions: traced by torch.compile, the comparison is computed inside the softmax
    kernel, and int32 lanes cost less than tril's int64 indices there.
    """
    i = torch.arange(t_q, dtype=torch.int32, device=device)[:, None] + (t_k - t_q)  # (t_q, 1)
    j = torch.arange(t_k, dtype=torch.int32, device=device)  # (t_k,)
    return (j <= i) if window is None else (j <= i) & (j > i - window)


def effective_window(causal: bool, window: int | None, t_k: int) -> int | None:
    """The window if it hides any of t_k keys from some query, else None (no window to apply)."""
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise DecoderLMError(f"sliding window={window!r} must be a positive integer or None")
    return window if causal and window is not None and window < t_k else None


def build_mask(
    t_q: int,
    t_k: int,
    causal: bool,
    key_padding_mask: Tensor | None,
    device: torch.device,
    window: int | None = None,
) -> Tensor | None:
    """Combine causality (with an optional sliding window) and a key-padding mask (B, Tk) into
    one (B|1, 1, Tq, Tk) bool mask, or None."""
    window = effective_window(causal, window, t_k)
    needed = causal and (t_q > 1 or window is not None)  # one query sees every key but the window's
    mask = causal_mask(t_q, t_k, device, window) if needed else None
    if key_padding_mask is not None:
        keys = key_padding_mask[:, None, None, :].bool()  # (B, 1, 1, Tk)
        mask = keys if mask is None else keys & mask
    return mask


def masked_softmax(scores: Tensor, keep: Tensor | None) -> Tensor:
    """softmax(scores + M), M = 0 where `keep` else −∞; a row with every key masked (0/0) → zeros.

    The second masked_fill also zeroes the gradient of a row with every key masked.
    """
    if keep is None:
        return torch.softmax(scores, dim=-1)
    hidden = ~keep
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).masked_fill(hidden, 0.0)


def keep_mask(mask: Tensor) -> Tensor:
    """The bool keep-mask (True = attend) of a mask in either convention of
    `scaled_dot_product_attention`; any other mask is refused."""
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        zero, one = mask == 0, mask == 1
        if bool((zero | one).all()) and bool(one.any()):
            return one  # the seeds' float keep-mask: 1 = attend, 0 = hidden
        if bool((zero | (mask == float("-inf"))).all()):
            return zero  # additive: M = 0 (attend) or −∞ (hidden)
    values = mask.unique().tolist()  # sorted
    shown = ", ".join(map(str, values[:4])) + (", ..." if len(values) > 4 else "")
    raise DecoderLMError(
        f"attention mask of dtype {mask.dtype} has values {{{shown}}}; allowed: a keep-mask (bool, "
        "or float of only 0 and 1: 1 = attend) or an additive mask (float of only 0 and -inf)"
    )
