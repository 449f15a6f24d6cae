"""Input checks shared by the attention kernels: `decoderlm.model.flash.flash_attention` and the
Triton kernel of `decoderlm.model.kernels.flash_triton` (which adds its own limits). A module of its
own so that the kernel imports it without importing `flash`, which imports the kernel."""

from __future__ import annotations

import torch
from torch import Tensor

from decoderlm.errors import DecoderLMError


def check_inputs(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, caller: str
) -> None:
    """Raise DecoderLMError, one line, for inputs no attention kernel can take (shared by
    `flash_attention` and the Triton kernel, which adds its own limits)."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise DecoderLMError(
            f"{caller}: q must be 4-D (B, Hq, Tq, D) and k, v 4-D of one shape (B, Hkv, Tk, D); "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    (b, h_q, _, d), (b_k, h_kv, t_k, d_k) = q.shape, k.shape
    if b != b_k or d != d_k:
        raise DecoderLMError(
            f"{caller}: q {tuple(q.shape)} and k/v {tuple(k.shape)} must share batch and head_dim"
        )
    if h_kv == 0 or h_q % h_kv:
        raise DecoderLMError(
            f"{caller}: query heads {h_q} must be a multiple of key/value heads {h_kv}"
        )
    if not q.is_floating_point() or not (q.dtype == k.dtype == v.dtype):
        raise DecoderLMError(
            f"{caller}: q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (b, t_k)
    ):
        raise DecoderLMError(
            f"{caller}: key_padding_mask must be bool of shape (B, Tk) = ({b}, {t_k}), got "
            f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
        )
