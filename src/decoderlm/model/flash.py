"""FlashAttention-2 (Dao, 2023, arXiv:2307.08691) in PyTorch, as a `torch.autograd.Function`.

Exact attention softmax(QKᵀ·scale + M)V without ever holding the (Tq, Tk) score matrix: the forward
walks query tiles × key tiles with an online softmax (running row max m and normaliser l, Milakov &
Gimelshein 2018) and keeps only the output O and the log-sum-exp L = m + log l of each row. The
backward recomputes each probability tile as P = exp(S − L) and uses D = rowsum(dO ∘ O), so the
memory kept for backward is O(T·d), not O(T²).

Layout: q (B, Hq, Tq, D) is viewed as (B, Hkv, G, Tq, D), G = Hq/Hkv, and the G query heads that
share one K/V head become extra rows of the same tile. K and V are indexed, never repeated; dK and
dV sum over the group for free in dSᵀQ and Pᵀ dO. Every tile op is a batched matmul over B·Hkv.
The queries are the last Tq of Tk positions (a KV cache), so the causal rule is bottom-right
aligned: query i may attend key j iff j ≤ i + (Tk − Tq). Key tiles entirely above the diagonal are
skipped and only tiles crossing it are masked. A sliding window W also hides j ≤ i + (Tk − Tq) − W:
query tile [i0, i1) then reads keys (i0 + Tk − Tq − W, i1 + Tk − Tq) only, so the work and the
scratch tiles are O(T·W), not O(T²). Math is in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from decoderlm.model.flash_inputs import check_inputs
from decoderlm.model.kernels import triton_available
from decoderlm.model.masks import effective_window

# Tile sizes. A tile is (B·Hkv, G·BLOCK_Q, BLOCK_K) scores: big enough that the matmuls are
# BLAS-sized and Python overhead vanishes, small enough (2 MiB in fp32 at G = 4) to stay in cache
# (the tile-size sweep is in benchmarks/README.md, "attention.py").
BLOCK_Q = 128  # query positions per tile (× G rows for the G query heads of one K/V head)
BLOCK_K = 512  # key positions per tile
MAX_TILE_ELEMENTS = 1 << 21  # shrink BLOCK_Q for many heads so one fp32 score tile stays ≤ 8 MiB


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
) -> Tensor:
    """softmax(QKᵀ·scale + M)V by FlashAttention-2: q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D) → like q.

    causal: bottom-right aligned mask (query i attends key j iff j ≤ i + Tk − Tq).
    window: with causal, also j > i + Tk − Tq − window (the last `window` keys); None = no window.
    key_padding_mask: (B, Tk) bool, True = valid key. A query with no valid key gets output 0.
    scale: defaults to 1/√D. Returns q's dtype; float16/bfloat16 are accumulated in float32.
    """
    check_inputs(q, k, v, key_padding_mask, "flash_attention")
    window = effective_window(causal, window, k.shape[2])
    if (
        q.is_cuda and triton_available()
    ):  # on a GPU: the IO-aware Triton kernel (decoderlm.model.kernels); imports triton
        from decoderlm.model.kernels import flash_triton

        if q.shape[-1] in flash_triton.HEAD_DIMS and q.dtype in flash_triton.DTYPES:
            return flash_triton.flash_attention_triton(
                q,
                k,
                v,
                causal=causal,
                key_padding_mask=key_padding_mask,
                scale=scale,
                window=window,
            )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _FlashAttention.apply(q, k, v, Masking(causal, window), key_padding_mask, scale)


class Masking(NamedTuple):
    """Which keys each query sees besides the padding mask: causal, and a window (None = none)."""

    causal: bool
    window: int | None


class _FlashAttention(torch.autograd.Function):
    """Forward keeps q, k, v, O, L for backward; backward recomputes probabilities tile by tile."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        masking: Masking,
        key_padding_mask: Tensor | None,
        scale: float,
    ) -> Tensor:
        out, lse = _flash_forward(q, k, v, masking, key_padding_mask, scale)
        ctx.save_for_backward(q, k, v, out, lse, key_padding_mask)  # O(T·d): no (Tq, Tk) tensor
        ctx.masking, ctx.scale = masking, scale
        return out

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, d_out: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, None, None, None]:
        q, k, v, out, lse, key_padding_mask = ctx.saved_tensors
        dq, dk, dv = _flash_backward(
            q, k, v, out, lse, d_out, ctx.masking, key_padding_mask, ctx.scale
        )
        return dq, dk, dv, None, None, None


def _flash_forward(
    q: Tensor, k: Tensor, v: Tensor, masking: Masking, key_padding_mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """O (B, Hq, Tq, D) in q's dtype and L = logsumexp(S) (B, Hq, Tq), +inf for empty rows."""
    b, h_q, t_q, d = q.shape
    h_kv, t_k = k.shape[1], k.shape[2]
    g, n = h_q // h_kv, b * h_kv
    acc = _acc_dtype(q.dtype)
    q5 = q.reshape(b, h_kv, g, t_q, d)  # (B, Hkv, G, Tq, D), a view
    k3, v3 = k.reshape(n, t_k, d), v.reshape(n, t_k, d)  # (N, Tk, D), tiles cast to acc when used
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (B, Hq, Tq, D)
    lse = torch.empty(b, h_q, t_q, dtype=acc, device=q.device)  # (B, Hq, Tq)
    out5, lse4 = out.view(b, h_kv, g, t_q, d), lse.view(b, h_kv, g, t_q)
    block_q = _block_q(n, g)
    s_buf = q.new_empty(_tile_numel(n, g, block_q, t_q, t_k, masking), dtype=acc)  # every S tile
    for i0, i1, key_tiles in _tiles(t_q, t_k, masking, block_q):
        rows = g * (i1 - i0)
        qi = _gather_rows(q5, i0, i1, acc).mul_(scale)  # Q·scale: (N, R, D), R = G·bq
        o = torch.zeros(n, rows, d, dtype=acc, device=q.device)  # unnormalised output
        m = torch.full((n, rows), float("-inf"), dtype=acc, device=q.device)  # running row max
        l_ = torch.zeros(n, rows, dtype=acc, device=q.device)  # running normaliser l
        for j0, j1, masked in key_tiles:
            kj, vj = k3[:, j0:j1].to(acc), v3[:, j0:j1].to(acc)  # (N, bk, D)
            s = torch.bmm(qi, kj.mT, out=_tile(s_buf, n, rows, j1 - j0))  # S = Q Kᵀ·scale
            _apply_mask(s, b, g, (i0, i1, j0, j1), t_k - t_q, masking, masked, key_padding_mask)
            m_new = torch.maximum(m, s.amax(dim=-1))  # m' = max(m, rowmax(S))
            m_sub = m_new.masked_fill(m_new == float("-inf"), 0.0)  # row all masked so far: no ∞−∞
            p = s.sub_(m_sub.unsqueeze(-1)).exp_()  # e^(S−m'): (N, R, bk)
            alpha = (m - m_sub).exp_()  # e^(m−m')
            l_.mul_(alpha).add_(p.sum(dim=-1))  # l' = e^(m−m')·l + rowsum(e^(S−m'))
            o.mul_(alpha.unsqueeze(-1)).baddbmm_(p, vj)  # O' = e^(m−m')·O + e^(S−m')·V
            m = m_new
        empty = l_ == 0  # rows with no valid key: O = 0, L = +inf so that backward P = e^(S−L) = 0
        o.div_(l_.masked_fill(empty, 1.0).unsqueeze(-1))  # O = O' / l
        out5[:, :, :, i0:i1] = o.view(b, h_kv, g, i1 - i0, d)
        lse_i = (m + l_.log()).masked_fill_(empty, float("inf"))  # L = m + log l: (N, R)
        lse4[:, :, :, i0:i1] = lse_i.view(b, h_kv, g, i1 - i0)
    return out, lse


def _flash_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    d_out: Tensor,
    masking: Masking,
    key_padding_mask: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV from the saved O and L, recomputing every probability tile P = exp(S − L)."""
    b, h_q, t_q, d = q.shape
    h_kv, t_k = k.shape[1], k.shape[2]
    g, n = h_q // h_kv, b * h_kv
    acc = _acc_dtype(q.dtype)
    q5, o5, do5 = (x.reshape(b, h_kv, g, t_q, d) for x in (q, out, d_out))  # (B, Hkv, G, Tq, D)
    lse4 = lse.view(b, h_kv, g, t_q)
    k3, v3 = k.reshape(n, t_k, d), v.reshape(n, t_k, d)  # (N, Tk, D), tiles cast to acc when used
    dq = torch.empty(b, h_q, t_q, d, dtype=q.dtype, device=q.device)
    dk3 = torch.zeros(n, t_k, d, dtype=acc, device=q.device)  # accumulated over query tiles
    dv3 = torch.zeros(n, t_k, d, dtype=acc, device=q.device)
    dq5 = dq.view(b, h_kv, g, t_q, d)
    block_q = _block_q(n, g)
    numel = _tile_numel(n, g, block_q, t_q, t_k, masking)
    s_buf, ds_buf = (q.new_empty(numel, dtype=acc) for _ in range(2))
    for i0, i1, key_tiles in _tiles(t_q, t_k, masking, block_q):
        rows = g * (i1 - i0)
        qi = _gather_rows(q5, i0, i1, acc).mul_(scale)  # Q·scale: (N, R, D)
        doi = _gather_rows(do5, i0, i1, acc)  # dO: (N, R, D)
        oi = _gather_rows(o5, i0, i1, acc)  # O: (N, R, D)
        neg_di = -(doi * oi).sum(dim=-1, keepdim=True)  # −D = −rowsum(dO∘O): (N, R, 1)
        neg_li = -lse4[:, :, :, i0:i1].reshape(n, rows, 1)  # −L: (N, R, 1)
        dqi = torch.zeros(n, rows, d, dtype=acc, device=q.device)
        for j0, j1, masked in key_tiles:
            bk = j1 - j0
            kj, vj = k3[:, j0:j1].to(acc), v3[:, j0:j1].to(acc)  # (N, bk, D)
            s, ds = _tile(s_buf, n, rows, bk), _tile(ds_buf, n, rows, bk)  # scratch (N, R, bk)
            torch.baddbmm(neg_li.expand(n, rows, bk), qi, kj.mT, out=s)  # S − L = Q Kᵀ·scale − L
            _apply_mask(s, b, g, (i0, i1, j0, j1), t_k - t_q, masking, masked, key_padding_mask)
            p = s.exp_()  # P = exp(S − L)
            dv3[:, j0:j1].baddbmm_(p.mT, doi)  # dV += Pᵀ dO
            torch.baddbmm(neg_di.expand(n, rows, bk), doi, vj.mT, out=ds)  # dP − D, dP = dO Vᵀ
            ds.mul_(p)  # dS = P ∘ (dP − D)
            dqi.baddbmm_(ds, kj)  # dQ += dS K  (·scale below)
            dk3[:, j0:j1].baddbmm_(ds.mT, qi)  # dK += dSᵀ Q·scale (summed over the group rows)
        dq5[:, :, :, i0:i1] = dqi.mul_(scale).view(b, h_kv, g, i1 - i0, d)
    dk = dk3.view(b, h_kv, t_k, d).to(k.dtype)
    dv = dv3.view(b, h_kv, t_k, d).to(v.dtype)
    return dq, dk, dv


def _tiles(
    t_q: int, t_k: int, masking: Masking, block_q: int
) -> Iterator[tuple[int, int, list[tuple[int, int, bool]]]]:
    """Yield (i0, i1, [(j0, j1, needs_mask), ...]) for each query tile [i0, i1).

    With `causal`, query i sees keys j ≤ i + (Tk − Tq): key tiles past the last query's limit are
    skipped, and only tiles with a key beyond the first query's limit need the causal mask. A
    window W also hides keys j ≤ i + (Tk − Tq) − W: the tiles start at the first query's first
    key, and a tile reaching below the last query's first key needs the mask.
    """
    offset, window = t_k - t_q, masking.window
    for i0 in range(0, t_q, block_q):
        i1 = min(i0 + block_q, t_q)
        k_end = min(t_k, i1 + offset) if masking.causal else t_k  # keys ≥ k_end: hidden to all
        k_start = 0 if window is None else max(0, i0 + offset - window + 1)  # below: hidden to all
        key_tiles = []
        for j0 in range(k_start, max(k_end, k_start), BLOCK_K):
            j1 = min(j0 + BLOCK_K, k_end)
            crosses = masking.causal and j1 - 1 > i0 + offset  # last key past the first row's limit
            below = window is not None and j0 <= i1 - 1 + offset - window  # first key < last row's
            key_tiles.append((j0, j1, crosses or below))
        yield i0, i1, key_tiles


def _apply_mask(
    s: Tensor,
    b: int,
    g: int,
    tile: tuple[int, int, int, int],
    offset: int,
    masking: Masking,
    masked: bool,
    key_padding_mask: Tensor | None,
) -> None:
    """Set S to −∞ in place where the causal rule, the window or the padding mask hides the key.

    tile = (i0, i1, j0, j1): queries [i0, i1) × keys [j0, j1); `masked`: the tile crosses the
    causal diagonal or the window's lower edge (else only the padding mask applies).
    """
    i0, i1, j0, j1 = tile
    blocked = None
    if masked:
        rows = torch.arange(i0, i1, device=s.device).unsqueeze(1) + offset  # (bq, 1): i + Tk − Tq
        cols = torch.arange(j0, j1, device=s.device)  # (bk,)
        blocked = cols > rows if masking.causal else None  # j > i + Tk − Tq: (bq, bk)
        if masking.window is not None:
            outside = cols <= rows - masking.window  # j ≤ i + Tk − Tq − W: (bq, bk)
            blocked = outside if blocked is None else blocked | outside
    if key_padding_mask is not None:
        pad = ~key_padding_mask[:, j0:j1].view(b, 1, 1, 1, j1 - j0)  # (B, 1, 1, 1, bk)
        blocked = pad if blocked is None else pad | blocked
    if blocked is not None:
        s.view(b, -1, g, i1 - i0, j1 - j0).masked_fill_(blocked, float("-inf"))


def _tile_numel(n: int, g: int, block_q: int, t_q: int, t_k: int, masking: Masking) -> int:
    """Elements of the largest score tile, (N, G·min(BLOCK_Q, Tq), bk): bk = min(BLOCK_K, Tk),
    and with a window W at most the bq + W − 1 keys a query tile reads."""
    block_k = min(BLOCK_K, t_k)
    if masking.window is not None:
        block_k = min(block_k, min(block_q, t_q) + masking.window - 1)
    return n * g * min(block_q, t_q) * block_k


def _tile(buf: Tensor, n: int, rows: int, cols: int) -> Tensor:
    """The first n·rows·cols elements of a flat scratch buffer, as a contiguous (n, rows, cols)."""
    return buf[: n * rows * cols].view(n, rows, cols)


def _gather_rows(x5: Tensor, i0: int, i1: int, dtype: torch.dtype) -> Tensor:
    """Positions [i0, i1) of x5 (B, Hkv, G, T, D) as one tile (B·Hkv, G·(i1−i0), D) of `dtype`."""
    b, h_kv, g, _, d = x5.shape
    tile = torch.empty(b, h_kv, g, i1 - i0, d, dtype=dtype, device=x5.device)
    return tile.copy_(x5[:, :, :, i0:i1]).view(b * h_kv, g * (i1 - i0), d)


def _block_q(n: int, g: int) -> int:
    """Query positions per tile: BLOCK_Q, fewer when B·Hkv·G·BLOCK_Q·BLOCK_K exceeds the cap."""
    return max(1, min(BLOCK_Q, MAX_TILE_ELEMENTS // (n * g * BLOCK_K)))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32
