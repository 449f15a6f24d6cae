"""Which calls of `decoderlm.model.attention.attend` the CPU's prompt-attention kernels compute
(`bf16_attention`, `f32_attention`): a prompt's causal attention, softmax(QKᵀ/√d_k + M)V with M
causal and aligned bottom-right, over Tq > 1 queries and Tk ≥ Tq keys, GQA's query heads a
multiple of the K/V heads, no key padding mask, no window, no dropout, no gradient."""

from __future__ import annotations

import torch
from torch import Tensor


def is_prompt_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    key_padding_mask: Tensor | None,
    window: int | None,
    dropout_p: float,
    dtype: torch.dtype,
    dims_multiple: int,
) -> bool:
    """Whether q (B, H, Tq, D), k/v (B, Hkv, Tk, D) and the options make such a call on the CPU, in
    `dtype`, D a multiple of `dims_multiple`."""
    return (
        causal
        and key_padding_mask is None
        and window is None
        and dropout_p == 0.0
        and 1 < q.shape[2] <= k.shape[2]
        and q.dtype == k.dtype == v.dtype == dtype
        and q.device.type == k.device.type == v.device.type == "cpu"
        and q.shape[3] % dims_multiple == 0
        and q.shape[1] % k.shape[1] == 0
        and not (torch.is_grad_enabled() and q.requires_grad)
    )
