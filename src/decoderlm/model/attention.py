"""Scaled dot-product attention and multi-head causal self-attention with shared K/V heads.

softmax(QKᵀ/√d_k + M)V from Vaswani et al. (2017); multi-query attention (Shazeer, 2019) and
grouped-query attention (Ainslie et al., 2023): `n_heads` query heads share `n_kv_heads` K/V heads,
each K/V head serving a contiguous group of `n_heads / n_kv_heads` query heads.

Masks are boolean, True = "may attend". Causal masks are aligned bottom-right: query i of Tq attends
keys j ≤ i + (Tk − Tq), which is the usual lower triangle when Tq == Tk and the right rule when the
queries are the last Tq positions of a longer (cached) key sequence.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from decoderlm.model.config import ModelConfig
from decoderlm.model.layers import make_norm
from decoderlm.model.positional import apply_rope


class LayerCache(Protocol):
    """What attention needs from a KV cache: store the new keys/values, return all keys/values to attend."""

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...


def causal_mask(t_q: int, t_k: int, device: torch.device | str | None = None) -> Tensor:
    """(t_q, t_k) bool, True where query i may attend key j: j ≤ i + t_k − t_q.

    From int32 positions: traced by torch.compile, the comparison is computed inside the softmax
    kernel, and int32 lanes cost less than tril's int64 indices there.
    """
    i = torch.arange(t_q, dtype=torch.int32, device=device)[:, None] + (t_k - t_q)  # (t_q, 1)
    j = torch.arange(t_k, dtype=torch.int32, device=device)  # (t_k,)
    return j <= i


def build_mask(
    t_q: int, t_k: int, causal: bool, key_padding_mask: Tensor | None, device: torch.device
) -> Tensor | None:
    """Combine causality and a key-padding mask (B, Tk) into one (B|1, 1, Tq, Tk) bool mask, or None."""
    mask = causal_mask(t_q, t_k, device) if causal and t_q > 1 else None
    if key_padding_mask is not None:
        keys = key_padding_mask[:, None, None, :].bool()  # (B, 1, 1, Tk)
        mask = keys if mask is None else keys & mask
    return mask


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """softmax(QKᵀ/√d_k + M)V, returning (output, weights).

    q: (B, H, Tq, D); k, v: (B, Hkv, Tk, D) with H a multiple of Hkv (GQA/MQA without copying K/V).
    mask: bool (True = attend; False → M = −∞) or additive float, broadcastable to (B, H, Tq, Tk).
    Rows whose keys are all masked get zero weights (and a zero output, zero gradients), as torch
    SDPA does.
    """
    b, h, t_q, d = q.shape
    h_kv, t_k = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    acc_dtype = torch.promote_types(q.dtype, torch.float32)  # scores and softmax in ≥ float32
    q_grouped = q.reshape(b, h_kv, h // h_kv, t_q, d)  # (B, Hkv, G, Tq, D)
    scores = q_grouped @ k.unsqueeze(2).transpose(-2, -1)  # QKᵀ: (B, Hkv, G, Tq, Tk)
    scores = scores.reshape(b, h, t_q, t_k).to(acc_dtype) * scale  # QKᵀ/√d_k: (B, H, Tq, Tk)
    if torch.compiler.is_compiling():
        weights = _masked_softmax_traced(scores, mask)
    else:
        weights = _masked_softmax_eager(scores, mask)
    weights = weights.to(q.dtype)  # (B, H, Tq, Tk)
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    out = dropped.reshape(b, h_kv, h // h_kv, t_q, t_k) @ v.unsqueeze(2)  # (B, Hkv, G, Tq, D)
    return out.reshape(b, h, t_q, d), weights


def _masked_softmax_eager(scores: Tensor, mask: Tensor | None) -> Tensor:
    """softmax(scores + M) by torch's one-pass kernel; a row with every key masked (0/0) → zeros."""
    if mask is None:
        return torch.softmax(scores, dim=-1)
    if mask.dtype != torch.bool:
        return torch.softmax(scores + mask, dim=-1).nan_to_num(0.0)  # additive
    hidden = ~mask
    # The masked_fill's backward also zeroes the gradient of a row with every key masked.
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).masked_fill(hidden, 0.0)


def _masked_softmax_traced(scores: Tensor, mask: Tensor | None) -> Tensor:
    """softmax(scores + M) as torch.compile fuses it best: M additive (its backward is the identity,
    where a masked_fill's needs the mask again) and `softmax_zero_if_empty`, whose guard for empty
    rows acts on per-row scalars. At B·H = 48, T = 64 (bf16, causal), forward + backward of the
    attention took 575 µs against 808 µs for the eager form compiled."""
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, float("-inf")).to(scores.dtype)  # M = 0 or −∞
    return softmax_zero_if_empty(scores if mask is None else scores + mask)


def softmax_zero_if_empty(scores: Tensor) -> Tensor:
    """softmax over the last dim, with zeros for a row whose scores are all −∞ (every key masked).

    softmax(s)_j = e^(s_j − m) / Σ_k e^(s_k − m) for any m; m = max_k s_k keeps it finite, and m needs
    no gradient. A row with a finite score has Σ ≥ e^0 = 1; in a row of −∞ every e^(s_j − m) is 0,
    so a finite m and Σ clamped to ≥ 1 make its weights (and their gradients) 0, not 0/0.
    """
    row_max = scores.amax(dim=-1, keepdim=True).detach()  # (..., 1)
    exp = torch.exp(scores - row_max.clamp_min(torch.finfo(scores.dtype).min))
    return exp / exp.sum(dim=-1, keepdim=True).clamp_min(1.0)


def blockwise_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
    block_size: int = 128,
    dropout_p: float = 0.0,
) -> Tensor:
    """`scaled_dot_product_attention`, `block_size` queries at a time (no weights returned).

    Each block of queries is scored only against the keys it may see: with a causal mask, those
    up to its last query (bottom-right alignment, as `causal_mask`). About half of the masked upper
    triangle is never computed at long T, and no tensor larger than (B, H, block, Tk) is held.
    q (B, H, Tq, D), k/v (B, Hkv, Tk, D), key_padding_mask (B, Tk) → (B, H, Tq, D).
    """
    t_q, t_k = q.shape[2], k.shape[2]
    outs = []
    for start in range(0, t_q, block_size):
        stop = min(start + block_size, t_q)
        seen = stop + t_k - t_q if causal else t_k  # keys visible to the block's last query
        keys = None if key_padding_mask is None else key_padding_mask[:, :seen]
        mask = build_mask(stop - start, seen, causal, keys, q.device)
        q_block, k_seen, v_seen = q[:, :, start:stop], k[:, :, :seen], v[:, :, :seen]
        outs.append(
            scaled_dot_product_attention(q_block, k_seen, v_seen, mask, dropout_p=dropout_p)[0]
        )
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (B, H, Tq, D)


def blockwise_is_faster(q: Tensor, t_k: int) -> bool:
    """Whether `blockwise_attention` beats torch's fused SDPA kernel for this shape.

    From `python benchmarks/cpu_attention.py --threads 2` (torch 2.13 CPU, 2 cores; ms, fused vs
    formula) on two CPUs: an Intel one with avx512_bf16 (bf16 rows) and an AMD EPYC with AVX2 only
    (fp32 rows, 2026-12-01). Elsewhere, and on accelerators, the fused kernel is used.
    - Training in bf16/fp16: torch's CPU flash-attention backward is slow at short context (T=64:
      2.91 vs 1.05 eager, 3.01 vs 0.83 compiled); compiled, the formula still wins at T=256 (3.04
      vs 1.94), eagerly not reliably (2.85 vs 2.44 in that run, 2.86 vs 3.60 in another).
    - Training in fp32, compiled: the formula wins up to T=256 (T=64: 2.18 vs 1.49, T=128: 2.76 vs
      2.55, T=256: 4.12 vs 3.13); eagerly the fused kernel does (T=64: 1.86 vs 2.07).
    - Decoding one token: the fused kernel is slow in bf16 over a masked cache (0.74 vs 0.48 at 2048
      slots), and under torch.compile inductor fuses the formula (0.74 vs 0.09 bf16, 0.11 vs 0.08
      fp32).
    - Prefill in bf16/fp16 under torch.compile: 3.15 vs 2.48 at T=512, 29.4 vs 15.4 at T=2048.
    """
    if q.device.type != "cpu":
        return False
    reduced = q.dtype in (torch.bfloat16, torch.float16)
    compiling = torch.compiler.is_compiling()
    if q.requires_grad:
        return t_k <= 256 if compiling else reduced and t_k <= 128
    if q.shape[2] == 1:
        return reduced or compiling
    return reduced and compiling


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
) -> tuple[Tensor, Tensor | None]:
    """Dispatch attention to a backend. q (B, H, Tq, D), k/v (B, Hkv, Tk, D) → ((B, H, Tq, D), weights).

    `math` is the explicit formula (the only one that returns weights), `sdpa` is torch's fused
    kernel (or `blockwise_attention` on the CPU shapes where that is faster, `blockwise_is_faster`),
    `flash` is our FlashAttention-2 (`decoderlm.model.flash`). K/V heads are never repeated in memory
    by our code: GQA goes to SDPA as `enable_gqa` and to the other two by indexing/reshaping.
    """
    t_q, t_k = q.shape[2], k.shape[2]
    if need_weights or backend == "math":
        mask = build_mask(t_q, t_k, causal, key_padding_mask, q.device)
        return scaled_dot_product_attention(q, k, v, mask, dropout_p=dropout_p)
    if backend == "flash":
        from decoderlm.model.flash import flash_attention

        return flash_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask), None
    if blockwise_is_faster(q, t_k):
        out = blockwise_attention(
            q, k, v, causal=causal, key_padding_mask=key_padding_mask, dropout_p=dropout_p
        )
        return out, None
    gqa = q.shape[1] != k.shape[1]
    if key_padding_mask is None and (not causal or t_q == t_k):
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=causal and t_q > 1, dropout_p=dropout_p, enable_gqa=gqa
        )
    else:
        mask = build_mask(t_q, t_k, causal, key_padding_mask, q.device)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa
        )
    return out, None


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with `n_kv_heads` K/V heads (MHA, GQA or MQA), optional RoPE and qk-norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
        )
        self.backend = config.attn_backend
        self.dropout_p = config.dropout
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv = nn.Linear(
            config.d_model, q_size + 2 * kv_size, bias=config.qkv_bias
        )  # fused W_Q|W_K|W_V
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
        q = q.view(b, t, self.n_heads, self.head_dim)  # (B, T, H, hd)
        k = k.view(b, t, self.n_kv_heads, self.head_dim)  # (B, T, Hkv, hd)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, hd), (B, Hkv, T, hd)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)  # (B, Hkv, Tk, hd)
        out, weights = attend(
            q,
            k,
            v,
            causal=causal,
            key_padding_mask=key_padding_mask,
            backend=self.backend,
            dropout_p=self.dropout_p if self.training else 0.0,
            need_weights=need_weights,
        )
        out = out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)  # (B, T, H·hd)
        out = self.resid_dropout(self.proj(out))  # (B, T, d_model)
        return (out, weights) if need_weights else out
