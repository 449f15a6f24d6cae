"""Linear recurrences over a matrix state, each in two forms that agree: chunked and recurrent.

Two recurrences carry the recurrent mixers (`linear_attention`, `gated_deltanet`, `mamba2`). Per
batch row and head the state S is (d_k, d_v), and a token t brings q_t, k_t (d_k,), v_t (d_v,)
and a log-decay g_t ≤ 0 (α_t = exp(g_t)):

- gated linear attention (decay 1 is the linear attention of Katharopoulos et al., 2020; a scalar
  decay per head is the SSD of Mamba-2, Dao & Gu, 2024):

      S_t = α_t S_{t−1} + k_t v_tᵀ,        o_t = S_tᵀ q_t

- the gated delta rule (Yang, Kautz & Hatamizadeh, 2024, "Gated Delta Networks"), β_t ∈ (0, 1):

      S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,        o_t = S_tᵀ q_t

  (the paper writes the transpose, S ∈ R^{d_v×d_k}: S_t = α_t S_{t−1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ).

The recurrent form (`recurrent_*`) steps token by token: O(1) work and memory per token, what
decoding needs. The chunked form (`chunk_*`) cuts the sequence into chunks of C tokens: inside a
chunk the tokens interact through a C × C matrix (parallel, matmuls), across chunks only through
the state, carried by a loop over the T / C chunks. Work is O(T·C·d) plus O(T·d_k·d_v), memory
O(T·C) — never a T × T tensor. A token with k_t = 0 (delta rule: β_t = 0) and g_t = 0 leaves the
state unchanged: that is how padding is kept out (`mask_padding`), and how T is padded up to a
multiple of C.

Shapes: q, k (B, H, T, d_k), v (B, H, T, d_v), g and β (B, H, T), state (B, H, d_k, d_v); each
returns (o (B, H, T, d_v), the state after the last token), both in float32 at least (float64
stays float64), as the arithmetic; the caller casts o back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _work_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def mask_padding(valid: Tensor | None, *xs: Tensor) -> list[Tensor]:
    """Zero every x (B, H, T, ...) at the tokens where valid (B, T) is False (left padding): with
    k = 0 (or β = 0) and g = 0 a token leaves the state unchanged. valid None: all are real."""
    if valid is None:
        return list(xs)
    b, t = valid.shape
    return [x * valid.view(b, 1, t, *[1] * (x.dim() - 3)).to(x.dtype) for x in xs]


def _chunked(x: Tensor, chunk: int) -> Tensor:
    """x (B, H, T, ...) → (B, H, N, C, ...), zero-padded at the end up to N·C tokens."""
    pad = (-x.shape[2]) % chunk
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
    return x.reshape(*x.shape[:2], -1, chunk, *x.shape[3:])


def _decays(g: Tensor) -> tuple[Tensor, Tensor]:
    """g (B, H, N, C) → G (B, H, N, C), the cumulative log-decay inside each chunk, and
    D (B, H, N, C, C) with D_ij = exp(G_i − G_j) for j ≤ i, 0 above the diagonal (the decay from
    token j to token i; masked before the exp, where it would overflow)."""
    cum = g.cumsum(-1)  # G_i = Σ_{j ≤ i} g_j
    upper = torch.ones(g.shape[-1], g.shape[-1], dtype=torch.bool, device=g.device).triu(1)
    return cum, (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()


def _initial(state: Tensor | None, q: Tensor, v: Tensor, dtype: torch.dtype) -> Tensor:
    if state is None:
        return q.new_zeros(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1], dtype=dtype)
    return state.to(dtype)


def chunk_gated_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, state: Tensor | None = None, chunk: int = 64
) -> tuple[Tensor, Tensor]:
    """S_t = exp(g_t) S_{t−1} + k_t v_tᵀ, o_t = S_tᵀ q_t, chunk by chunk. With G_i the cumulative
    log-decay of token i inside its chunk and S the state before the chunk:

        o_i = Σ_{j ≤ i} exp(G_i − G_j) (q_i·k_j) v_j + exp(G_i) Sᵀ q_i
        S'  = exp(G_C) S + Σ_j exp(G_C − G_j) k_j v_jᵀ
    """
    t, dtype = q.shape[2], _work_dtype(v)
    s = _initial(state, q, v, dtype)
    q, k, v = (_chunked(x.to(dtype), chunk) for x in (q, k, v))  # (B, H, N, C, d)
    cum, decay = _decays(_chunked(g.to(dtype), chunk))  # (B, H, N, C), (B, H, N, C, C)
    intra = (q @ k.transpose(-1, -2)) * decay @ v  # (B, H, N, C, d_v)
    q = q * cum.exp()[..., None]  # exp(G_i) q_i
    k = k * (cum[..., -1:] - cum).exp()[..., None]  # exp(G_C − G_j) k_j
    chunk_decay = cum[..., -1].exp()[..., None, None]  # (B, H, N, 1, 1)
    out = []
    for n in range(q.shape[2]):
        out.append(intra[:, :, n] + q[:, :, n] @ s)  # (B, H, C, d_v)
        s = s * chunk_decay[:, :, n] + k[:, :, n].transpose(-1, -2) @ v[:, :, n]
    return torch.cat(out, dim=2)[:, :, :t], s  # (B, H, T, d_v)


def recurrent_gated_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """S_t = exp(g_t) S_{t−1} + k_t v_tᵀ, o_t = S_tᵀ q_t, one token at a time, with
    o = exp(g) Sᵀq + (qᵀk) v: S read once for the product qᵀS and once for its update."""
    dtype = _work_dtype(v)
    s = _initial(state, q, v, dtype)
    q, k, v, g = (x.to(dtype) for x in (q, k, v, g))
    out = []
    for t in range(q.shape[2]):
        alpha = g[:, :, t, None, None].exp()  # (B, H, 1, 1)
        k_t, q_t, v_t = k[:, :, t, None, :], q[:, :, t, None, :], v[:, :, t, None, :]
        out.append(alpha * (q_t @ s) + (q_t * k_t).sum(-1, keepdim=True) * v_t)  # (B, H, 1, d_v)
        s = alpha * s + k_t.mT * v_t  # (B, H, d_k, d_v)
    return torch.cat(out, dim=2), s


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor | None = None,
    chunk: int = 64,
) -> tuple[Tensor, Tensor]:
    """The gated delta rule chunk by chunk, as transformers' `torch_chunk_gated_delta_rule`
    (the WY / UT form of Yang et al., 2024, §3.3). Inside a chunk, with D_ij = exp(G_i − G_j):

        A = I + strict_lower((β k)·kᵀ ⊙ D)               (C × C, unit lower triangular)
        U = A⁻¹ (β v),   W = A⁻¹ (β k ⊙ exp(G))           (triangular solves)
        V' = U − W S                                      (the new values, less what S predicts)
        o  = (q ⊙ exp(G)) S + (q kᵀ ⊙ D) V'
        S' = exp(G_C) S + (k ⊙ exp(G_C − G))ᵀ V'
    """
    t, dtype = q.shape[2], _work_dtype(v)
    s = _initial(state, q, v, dtype)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (_chunked(x.to(dtype), chunk) for x in (q, k, k_beta, v_beta))
    cum, decay = _decays(_chunked(g.to(dtype), chunk))  # (B, H, N, C), (B, H, N, C, C)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its strict lower triangle is A − I
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True
    )  # (B, H, N, C, d_k)
    attn = (q @ k.transpose(-1, -2)) * decay  # (B, H, N, C, C)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # (B, H, N, 1, 1)
    out = []
    for n in range(q.shape[2]):
        v_new = u[:, :, n] - w[:, :, n] @ s  # (B, H, C, d_v)
        out.append(q[:, :, n] @ s + attn[:, :, n] @ v_new)
        s = s * chunk_decay[:, :, n] + k[:, :, n].transpose(-1, -2) @ v_new
    return torch.cat(out, dim=2)[:, :, :t], s  # (B, H, T, d_v)


def recurrent_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ, o_t = S_tᵀ q_t, one token at a time:
    S ← α S + k δᵀ with the delta δ = β (v − (α S)ᵀ k) (the new value less what S predicts), and
    o = α Sᵀq + (qᵀk) δ, so that S is read once for both products (kᵀS and qᵀS) and once for its
    update."""
    dtype = _work_dtype(v)
    s = _initial(state, q, v, dtype)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    out = []
    for t in range(q.shape[2]):
        alpha = g[:, :, t, None, None].exp()  # α_t (B, H, 1, 1)
        k_t, q_t = k[:, :, t, None, :], q[:, :, t, None, :]  # (B, H, 1, d_k)
        ks, qs = k_t @ s, q_t @ s  # kᵀS, qᵀS (B, H, 1, d_v)
        delta = (v[:, :, t, None, :] - alpha * ks) * beta[:, :, t, None, None]  # (B, H, 1, d_v)
        s = alpha * s + k_t.mT * delta  # (B, H, d_k, d_v)
        out.append(alpha * qs + (q_t * k_t).sum(-1, keepdim=True) * delta)  # oᵀ (B, H, 1, d_v)
    return torch.cat(out, dim=2), s
