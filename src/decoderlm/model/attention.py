"""Scaled dot-product attention and multi-head causal self-attention with shared K/V heads.

softmax(QKᵀ/√d_k + M)V from Vaswani et al. (2017); multi-query attention (Shazeer, 2019) and
grouped-query attention (Ainslie et al., 2023): `n_heads` query heads share `n_kv_heads` K/V heads,
each K/V head serving a contiguous group of `n_heads / n_kv_heads` query heads.

The masks (causal, bottom-right aligned, with an optional sliding window, and key padding) are
built by `decoderlm.model.masks`; a KV cache is any `decoderlm.model.cache.LayerCache`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from decoderlm.model.cache.protocol import LayerCache
from decoderlm.model.config import ModelConfig
from decoderlm.model.flash import flash_attention
from decoderlm.model.layers import make_norm
from decoderlm.model.masks import (
    MaskedSoftmax,
    build_mask,
    effective_window,
    keep_mask,
    masked_softmax,
)
from decoderlm.model.positional import apply_rope


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    softmax: MaskedSoftmax = masked_softmax,
) -> tuple[Tensor, Tensor]:
    """softmax(QKᵀ/√d_k + M)V, returning (output, weights).

    q: (B, H, Tq, D); k, v: (B, Hkv, Tk, D) with H a multiple of Hkv (GQA/MQA without copying K/V).
    mask, broadcastable to (B, H, Tq, Tk), in one of two conventions:
    - keep-mask: bool, True = attend; or float with values only 0 and 1 (at least one 1),
      1 = attend, as the seeds build it: `torch.tril(torch.ones(T, T))`;
    - additive: float with values only 0 (attend) and −∞ (hidden), added to the scores as M.
    Any other mask is refused (DecoderLMError). Rows whose keys are all masked get zero weights (and
    a zero output, zero gradients), as torch SDPA does. `softmax(scores, keep)` computes the weights
    (decoderlm.cpu passes a form that torch.compile fuses better).
    """
    b, h, t_q, d = q.shape
    h_kv, t_k = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    keep = None if mask is None else keep_mask(mask)
    acc_dtype = torch.promote_types(q.dtype, torch.float32)  # scores and softmax in ≥ float32
    # A group's G query heads are G·Tq rows against its one K/V head (row g·Tq + t: head
    # h_kv·G + g, query t), so each K/V head is read once; a broadcast over G would copy it G times.
    q_rows = q.reshape(b, h_kv, h // h_kv * t_q, d)  # (B, Hkv, G·Tq, D)
    scores = q_rows @ k.transpose(-2, -1)  # QKᵀ: (B, Hkv, G·Tq, Tk)
    scores = scores.reshape(b, h, t_q, t_k).to(acc_dtype) * scale  # QKᵀ/√d_k: (B, H, Tq, Tk)
    weights = softmax(scores, keep).to(q.dtype)  # (B, H, Tq, Tk)
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    out = dropped.reshape(b, h_kv, h // h_kv * t_q, t_k) @ v  # (B, Hkv, G·Tq, D)
    return out.reshape(b, h, t_q, d), weights


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
    backend: str = "sdpa",
    dropout_p: float = 0.0,
    need_weights: bool = False,
    scale: float | None = None,
    window: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Dispatch attention to a backend. q (B, H, Tq, D), k/v (B, Hkv, Tk, D) → ((B, H, Tq, D), weights).

    `math` is the explicit formula (the only one that returns weights), `sdpa` is torch's fused
    kernel, `flash` is our FlashAttention-2 (`decoderlm.model.flash`). K/V heads are never repeated
    in memory: GQA goes to SDPA as `enable_gqa` and to the other two by indexing/reshaping.
    scale multiplies QKᵀ (None: 1/√D). window: with causal, each query sees its last `window`
    keys only (math and sdpa through the mask; flash skips the key tiles outside it).
    """
    t_q, t_k = q.shape[2], k.shape[2]
    window = effective_window(causal, window, t_k)
    if need_weights or backend == "math":
        mask = build_mask(t_q, t_k, causal, key_padding_mask, q.device, window)
        return scaled_dot_product_attention(q, k, v, mask, scale=scale, dropout_p=dropout_p)
    if backend == "flash":
        out = flash_attention(
            q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, window=window
        )
        return out, None
    gqa = q.shape[1] != k.shape[1]
    if gqa and t_q == 1:  # one query per head: a group's G heads are G query rows of its K/V head
        b, h, _, d = q.shape
        mask = build_mask(1, t_k, causal, key_padding_mask, q.device, window)  # (B|1, 1, 1, Tk)
        out = F.scaled_dot_product_attention(
            q.reshape(b, k.shape[1], h // k.shape[1], d),  # (B, Hkv, G, D)
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout_p,
            scale=scale,
        )  # (B, Hkv, G, D): each K/V head read once, where enable_gqa reads it per query head
        return out.reshape(b, h, 1, d), None
    no_mask = key_padding_mask is None and window is None and (not causal or t_q == t_k)
    if no_mask:  # is_causal needs no mask tensor
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=causal and t_q > 1, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
        )
    else:
        mask = build_mask(t_q, t_k, causal, key_padding_mask, q.device, window)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
        )
    return out, None


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with `n_kv_heads` K/V heads (MHA, GQA or MQA), optional RoPE,
    qk-norm and output gate, and the sliding window of its layer (`ModelConfig.layer_window(layer)`).

    The output gate (`attn_output_gate`, Qwen3.5's gated attention): with o the heads' outputs
    concatenated (H·hd per token) and G a gate projection of the block input x,

        out = W_O (o ⊙ sigmoid(x W_G))

    W_G's rows sit in the fused projection after W_Q's: [W_Q | W_G | W_K | W_V]."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.window = config.layer_window(layer)  # None: every earlier key
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
        )
        self.backend = config.attn_backend
        self.scale = None if config.attn_scale == "1/sqrt(head_dim)" else 1.0  # None: 1/√head_dim
        self.softmax_scale = self.head_dim**-0.5 if self.scale is None else self.scale  # its value
        # The attention function, `attend` or one with its signature (decoderlm.cpu.optimize).
        self.attend: Callable[..., tuple[Tensor, Tensor | None]] = attend
        # R_m x, `apply_rope` or one with its signature (decoderlm.cpu.fused).
        self.apply_rope: Callable[[Tensor, Tensor, Tensor], Tensor] = apply_rope
        self.dropout_p = config.dropout
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.gated = config.attn_output_gate
        q_rows = 2 * q_size if self.gated else q_size  # W_Q, then W_G if gated
        self.split_sizes = (q_rows, kv_size, kv_size)
        self.qkv = nn.Linear(
            config.d_model, sum(self.split_sizes), bias=config.qkv_bias
        )  # fused W_Q|W_K|W_V (W_Q|W_G|W_K|W_V with the output gate)
        self.proj = nn.Linear(q_size, config.d_model, bias=config.bias)  # W_O
        self.q_norm = make_norm(config, self.head_dim) if config.qk_norm else None
        self.k_norm = make_norm(config, self.head_dim) if config.qk_norm else None
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None = None,
        key_padding_mask: Tensor | None = None,
        kv_cache: LayerCache | None = None,
        causal: bool = True,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor | None]:
        """x (B, T, d_model) → (B, T, d_model); with need_weights, also the (B, H, T, Tk) weights.

        rope: cos/sin for the positions of x; key_padding_mask: (B, Tk) bool over the keys attended
        (the cache's keys when a cache is given); kv_cache: receives this step's K/V and returns all.
        """
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(self.split_sizes, dim=-1)
        if self.gated:
            q, gate = q.chunk(2, dim=-1)  # (B, T, H·hd) each
        q = q.view(b, t, self.n_heads, self.head_dim)  # (B, T, H, hd)
        k = k.view(b, t, self.n_kv_heads, self.head_dim)  # (B, T, Hkv, hd)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, hd), (B, Hkv, T, hd)
        if rope is not None:
            q, k = self.apply_rope(q, *rope), self.apply_rope(k, *rope)
        out, weights = None, None  # (B, H, T, hd) once attended
        if kv_cache is not None and not need_weights:
            out = kv_cache.attend_in_place(q, k, v, self.softmax_scale)  # None: not handled
        if out is None:
            if kv_cache is not None:
                k, v = kv_cache.update(k, v)  # (B, Hkv, Tk, hd)
                if kv_cache.key_padding_mask is not None:  # its keys' mask replaces the caller's
                    key_padding_mask = kv_cache.key_padding_mask
            out, weights = self.attend(
                q,
                k,
                v,
                causal=causal,
                key_padding_mask=key_padding_mask,
                backend=self.backend,
                dropout_p=self.dropout_p if self.training else 0.0,
                need_weights=need_weights,
                scale=self.scale,
                window=self.window,
            )
        out = out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)  # (B, T, H·hd)
        if self.gated:
            out = out * torch.sigmoid(gate)  # o ⊙ sigmoid(x W_G)
        out = self.resid_dropout(self.proj(out))  # (B, T, d_model)
        return (out, weights) if need_weights else out
