"""FlashAttention-2 as Triton kernels: forward, backward, GQA, bottom-right causal and key-padding masks.

Dao (2023), "FlashAttention-2", on the IO-aware tiling of Dao et al. (2022): a program holds a tile of Q
(or of K/V) in on-chip memory and streams the other operand through it with an online softmax, so no
(Tq, Tk) tensor ever reaches device memory. The forward saves only O and the log-sum-exp L of each
query row; the backward recomputes P = exp(S − L) tile by tile:

    S = scale · QKᵀ,  P = softmax(S),  O = PV
    dV = Pᵀ dO,  dP = dO Vᵀ,  dS = P ∘ (dP − D) with D = rowsum(dO ∘ O),  dQ = scale · dS K,
    dK = scale · dSᵀ Q

The softmax runs in base 2 (exp2 is one instruction): S₂ = S · log₂e, L₂ = m₂ + log₂ ℓ. The forward
and dQ kernels walk their key tiles in two stages, as in Triton's fused-attention tutorial: tiles that
every query row of the program sees in full (no mask), then those on the causal diagonal or the
sequence tail (masked); the dK/dV kernel masks every tile. Causal tiles above the diagonal are never
visited, nor, with a sliding window W (query i sees keys i + Tk − Tq − W < j ≤ i + Tk − Tq), those
below it: the forward and dQ programs then start with the masked tiles on the window's lower edge,
and a dK/dV program stops at the last query that sees its keys, so the work is O(T·W). Query head h reads K/V head h // (Hq / Hkv), and the dK/dV program of a K/V head loops over
its group of query heads, so K/V are never repeated in memory. Plain pointer arithmetic (no block
pointers) keeps the same code running compiled on a GPU and under `TRITON_INTERPRET=1` on a CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from decoderlm.errors import DecoderLMError
from decoderlm.model.flash_inputs import check_inputs
from decoderlm.model.masks import effective_window

HEAD_DIMS = (16, 32, 64, 128)  # powers of two (tl.arange) that fit a tile in on-chip memory
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634  # exp(x) = exp2(x · log₂e)


@triton.jit
def _load_rows(base, rows, n_rows, stride, HEAD_DIM: tl.constexpr):
    """(BLOCK, HEAD_DIM) tile of rows `rows`. Rows ≥ n_rows re-read row n_rows − 1, so no load needs
    a mask: each kernel masks the scores of such rows and keys, or never stores them."""
    safe_rows = tl.minimum(rows, n_rows - 1)
    return tl.load(base + safe_rows[:, None] * stride + tl.arange(0, HEAD_DIM)[None, :])


@triton.jit
def _load_row_stats(base, rows, n_rows):
    """(BLOCK,) per-row fp32 statistics (L₂ or D), rows clamped as in _load_rows."""
    return tl.load(base + tl.minimum(rows, n_rows - 1))


@triton.jit
def _visible(i, j, t_q, t_k, shift, window, CAUSAL: tl.constexpr):
    """Whether query i may attend key j (broadcastable index tiles): both in range, and, if causal,
    i + (Tk − Tq) − window < j ≤ i + (Tk − Tq), the bottom-right-aligned band (window = Tk: the
    whole lower triangle)."""
    ok = (i < t_q) & (j < t_k)
    if CAUSAL:
        ok = ok & (j <= i + shift) & (j > i + shift - window)
    return ok


@triton.jit
def _key_ok(pad_ptr, cols, t_k):
    """(BLOCK_N,) bool: key j is a real token (key-padding mask True, stored as uint8) and j < Tk."""
    return tl.load(pad_ptr + cols, mask=cols < t_k, other=0) != 0


@triton.jit
def _store_rows(base, tile, rows, n_rows, stride, HEAD_DIM: tl.constexpr):
    """Store the rows < n_rows of a (BLOCK, HEAD_DIM) fp32 tile, cast to the destination dtype."""
    ptrs = base + rows[:, None] * stride + tl.arange(0, HEAD_DIM)[None, :]
    tl.store(ptrs, tile.to(base.dtype.element_ty), mask=rows[:, None] < n_rows)


@triton.jit
def _query_tile_key_ranges(start_m, t_q, t_k, window, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):  # fmt: skip
    """For query rows [start_m, start_m + BLOCK_M): keys below lo and from hi on are visible to
    no row; [lo, mid) to some (masked: the window's lower edge), [mid, full) to every row (no mask
    needed), [full, hi) to some (masked: causal diagonal, key tail). lo, mid, full are multiples
    of BLOCK_N; without a window (window = Tk) lo = mid = 0."""
    if CAUSAL:
        shift = t_k - t_q
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + shift, 0), t_k)
        full = tl.minimum(tl.maximum(start_m + 1 + shift, 0), t_k) // BLOCK_N * BLOCK_N
        lo = tl.maximum(start_m + shift - window + 1, 0) // BLOCK_N * BLOCK_N  # 1st row's 1st key
        last_row_first = tl.maximum(start_m + BLOCK_M + shift - window, 0)  # the last row's
        mid = tl.minimum(tl.cdiv(last_row_first, BLOCK_N) * BLOCK_N, full)
        mid = tl.maximum(mid, lo)
    else:
        hi = t_k
        full = t_k // BLOCK_N * BLOCK_N
        lo = 0
        mid = 0
    return lo, mid, full, hi


# ----------------------------------------------------------------------------------------- forward


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, q, rows, k_base, v_base, pad_ptr, stride_kt, stride_vt, start, end,
    t_q, t_k, window, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax over key tiles [start, end): fold each tile's scores into (Õ, ℓ, m)."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base, cols, t_k, stride_kt, HEAD_DIM)  # (BLOCK_N, HEAD_DIM)
        v = _load_rows(v_base, cols, t_k, stride_vt, HEAD_DIM)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # S₂: (BLOCK_M, BLOCK_N)
        if MASKED:
            visible = _visible(rows[:, None], cols[None, :], t_q, t_k, t_k - t_q, window, CAUSAL)
            s = tl.where(visible, s, -float("inf"))
        if HAS_PAD:
            s = tl.where(_key_ok(pad_ptr, cols, t_k)[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # m' = max(m, rowmax(S₂))
        m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # row with no visible key yet: no NaN
        p = tl.math.exp2(s - m_use[:, None])  # P̃ = exp2(S₂ − m')
        alpha = tl.math.exp2(m_i - m_use)  # exp2(m − m') rescales what was summed so far
        l_i = l_i * alpha + tl.sum(p, 1)  # ℓ' = exp2(m − m') ℓ + rowsum(P̃)
        # Õ' = exp2(m − m') Õ + P̃V
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q, K, V, OUT, LSE, PAD, qk_scale,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot, stride_pad,
    n_heads, group, t_q, t_k, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M query rows of one (batch, head) → O rows and L₂ = m + log₂ ℓ."""
    start_m = tl.program_id(0) * BLOCK_M
    h, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    bh = b * n_heads + h  # row of the (B·Hq, Tq) statistics L₂ and D
    h_kv = h // group  # GQA: the K/V head this query head reads
    rows = start_m + tl.arange(0, BLOCK_M)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, rows, t_q, stride_qt, HEAD_DIM)
    k_base, v_base = K + b * stride_kb + h_kv * stride_kh, V + b * stride_vb + h_kv * stride_vh
    pad_ptr = PAD + b * stride_pad if HAS_PAD else PAD
    lo, mid, full, hi = _query_tile_key_ranges(start_m, t_q, t_k, window, BLOCK_M, BLOCK_N, CAUSAL)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)  # running row max m (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running normaliser ℓ
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # unnormalised output Õ
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, rows, k_base, v_base, pad_ptr, stride_kt, stride_vt, lo, mid,
        t_q, t_k, window, qk_scale, HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_PAD, PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, rows, k_base, v_base, pad_ptr, stride_kt, stride_vt, mid, full,
        t_q, t_k, window, qk_scale, HEAD_DIM, BLOCK_N, False, CAUSAL, HAS_PAD, PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, rows, k_base, v_base, pad_ptr, stride_kt, stride_vt, full, hi,
        t_q, t_k, window, qk_scale, HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_PAD, PRECISION,
    )  # fmt: skip
    seen = l_i > 0  # rows with no visible key get O = 0 and L₂ = +∞ (so the backward's P = 0)
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]  # O = Õ / ℓ
    lse = tl.where(seen, m_i + tl.math.log2(l_safe), float("inf"))  # L₂ = m + log₂ ℓ
    _store_rows(OUT + b * stride_ob + h * stride_oh, out, rows, t_q, stride_ot, HEAD_DIM)
    tl.store(LSE + bh * t_q + rows, lse, mask=rows < t_q)


# ---------------------------------------------------------------------------------------- backward


@triton.jit
def _attn_bwd_delta(
    OUT, DO, DELTA, stride_ob, stride_oh, stride_ot, stride_dob, stride_doh, stride_dot,
    n_heads, t_q, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Preprocess: D = rowsum(dO ∘ O) in fp32, one (B, H, Tq) entry per query row."""
    start_m = tl.program_id(0) * BLOCK_M
    h, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    bh = b * n_heads + h  # row of the (B·Hq, Tq) statistics L₂ and D
    rows = start_m + tl.arange(0, BLOCK_M)
    o = _load_rows(OUT + b * stride_ob + h * stride_oh, rows, t_q, stride_ot, HEAD_DIM)
    do = _load_rows(DO + b * stride_dob + h * stride_doh, rows, t_q, stride_dot, HEAD_DIM)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # D = rowsum(dO ∘ O)
    tl.store(DELTA + bh * t_q + rows, delta, mask=rows < t_q)


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v, cols, key_ok, q_base, do_base, lse_base, delta_base,
    stride_qh, stride_qt, stride_doh, stride_dot, group, start, end, t_q, t_k, window, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Accumulate query tiles [start, end) of every query head of the group into this key tile's
    dK, dV: one flat loop over (head, tile) pairs, which needs fewer registers than nested loops.
    Works on transposed tiles (keys × queries) so that dK, dV need no transpose. Every tile is
    masked, as in Dao's Triton backward: a split into masked and unmasked loops, as the forward
    does, spills registers here (dK, dV accumulators and K, V tiles already fill them)."""
    n_tiles = tl.cdiv(end - start, BLOCK_M)
    for it in range(0, group * n_tiles):
        g = (it // n_tiles).to(tl.int64)  # query head h0 + g of the group
        rows = start + (it % n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        q = _load_rows(q_base + g * stride_qh, rows, t_q, stride_qt, HEAD_DIM)  # (BLOCK_M, D)
        do = _load_rows(do_base + g * stride_doh, rows, t_q, stride_dot, HEAD_DIM)
        lse = _load_row_stats(lse_base + g * t_q, rows, t_q)  # L₂: (BLOCK_M,)
        delta = _load_row_stats(delta_base + g * t_q, rows, t_q)  # D: (BLOCK_M,)
        # S₂ᵀ: (BLOCK_N, BLOCK_M)
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
        p_t = tl.math.exp2(s_t - lse[None, :])  # Pᵀ = exp2(S₂ − L₂)ᵀ
        visible_t = _visible(rows[None, :], cols[:, None], t_q, t_k, t_k - t_q, window, CAUSAL)
        p_t = tl.where(visible_t, p_t, 0.0)
        if HAS_PAD:
            p_t = tl.where(key_ok[:, None], p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)  # dV += Pᵀ dO
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # dPᵀ = V dOᵀ
        ds_t = p_t * (dp_t - delta[None, :])  # dSᵀ = Pᵀ ∘ (dPᵀ − D)
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)  # dK += dSᵀ Q (× scale later)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, PAD, qk_scale, scale,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot, stride_pad,
    stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
    n_heads, group, t_q, t_k, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_N keys of one (batch, K/V head) → dK, dV summed over its query-head group."""
    start_n = tl.program_id(0) * BLOCK_N
    h_kv, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    cols = start_n + tl.arange(0, BLOCK_N)
    k = _load_rows(K + b * stride_kb + h_kv * stride_kh, cols, t_k, stride_kt, HEAD_DIM)
    v = _load_rows(V + b * stride_vb + h_kv * stride_vh, cols, t_k, stride_vt, HEAD_DIM)
    key_ok = _key_ok(PAD + b * stride_pad, cols, t_k) if HAS_PAD else cols < t_k
    # Causal: query rows before lo see none of these keys (j ≤ i + Tk − Tq fails for all j ≥ start_n),
    # nor rows from hi on (j > i + Tk − Tq − window fails for all j < start_n + BLOCK_N).
    shift = t_k - t_q
    lo = tl.minimum(tl.maximum(start_n - shift, 0), t_q) // BLOCK_M * BLOCK_M if CAUSAL else 0
    hi = tl.minimum(tl.maximum(start_n + BLOCK_N - 1 - shift + window, lo), t_q) if CAUSAL else t_q
    h0 = h_kv * group  # the group's query heads are h0 .. h0 + group − 1
    q_base, do_base = Q + b * stride_qb + h0 * stride_qh, DO + b * stride_dob + h0 * stride_doh
    lse_base, delta_base = LSE + (b * n_heads + h0) * t_q, DELTA + (b * n_heads + h0) * t_q
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dk, dv = _dkdv_tiles(
        dk, dv, k, v, cols, key_ok, q_base, do_base, lse_base, delta_base,
        stride_qh, stride_qt, stride_doh, stride_dot, group, lo, hi, t_q, t_k, window, qk_scale,
        HEAD_DIM, BLOCK_M, CAUSAL, HAS_PAD, PRECISION,
    )  # fmt: skip
    dk = dk * scale  # dK = scale · dSᵀ Q
    _store_rows(DK + b * stride_dkb + h_kv * stride_dkh, dk, cols, t_k, stride_dkt, HEAD_DIM)
    _store_rows(DV + b * stride_dvb + h_kv * stride_dvh, dv, cols, t_k, stride_dvt, HEAD_DIM)


@triton.jit
def _dq_tiles(
    dq, q, do, lse, delta, rows, k_base, v_base, pad_ptr, stride_kt, stride_vt, start, end,
    t_q, t_k, window, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Accumulate key tiles [start, end) into this query tile's dQ."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base, cols, t_k, stride_kt, HEAD_DIM)  # (BLOCK_N, HEAD_DIM)
        v = _load_rows(v_base, cols, t_k, stride_vt, HEAD_DIM)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # S₂: (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(s - lse[:, None])  # P = exp2(S₂ − L₂)
        if MASKED:
            visible = _visible(rows[:, None], cols[None, :], t_q, t_k, t_k - t_q, window, CAUSAL)
            p = tl.where(visible, p, 0.0)
        if HAS_PAD:
            p = tl.where(_key_ok(pad_ptr, cols, t_k)[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # dP = dO Vᵀ
        ds = p * (dp - delta[:, None])  # dS = P ∘ (dP − D)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)  # dQ += dS K (× scale later)
    return dq


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ, PAD, qk_scale, scale,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot, stride_pad,
    stride_dqb, stride_dqh, stride_dqt,
    n_heads, group, t_q, t_k, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M query rows of one (batch, head) → dQ."""
    start_m = tl.program_id(0) * BLOCK_M
    h, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    bh = b * n_heads + h  # row of the (B·Hq, Tq) statistics L₂ and D
    h_kv = h // group
    rows = start_m + tl.arange(0, BLOCK_M)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, rows, t_q, stride_qt, HEAD_DIM)
    do = _load_rows(DO + b * stride_dob + h * stride_doh, rows, t_q, stride_dot, HEAD_DIM)
    lse = _load_row_stats(LSE + bh * t_q, rows, t_q)  # L₂: (BLOCK_M,)
    delta = _load_row_stats(DELTA + bh * t_q, rows, t_q)  # D: (BLOCK_M,)
    k_base, v_base = K + b * stride_kb + h_kv * stride_kh, V + b * stride_vb + h_kv * stride_vh
    pad_ptr = PAD + b * stride_pad if HAS_PAD else PAD
    lo, mid, full, hi = _query_tile_key_ranges(start_m, t_q, t_k, window, BLOCK_M, BLOCK_N, CAUSAL)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    dq = _dq_tiles(
        dq, q, do, lse, delta, rows, k_base, v_base, pad_ptr, stride_kt, stride_vt, lo, mid,
        t_q, t_k, window, qk_scale, HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_PAD, PRECISION,
    )  # fmt: skip
    dq = _dq_tiles(
        dq, q, do, lse, delta, rows, k_base, v_base, pad_ptr, stride_kt, stride_vt, mid, full,
        t_q, t_k, window, qk_scale, HEAD_DIM, BLOCK_N, False, CAUSAL, HAS_PAD, PRECISION,
    )  # fmt: skip
    dq = _dq_tiles(
        dq, q, do, lse, delta, rows, k_base, v_base, pad_ptr, stride_kt, stride_vt, full, hi,
        t_q, t_k, window, qk_scale, HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_PAD, PRECISION,
    )  # fmt: skip
    dq = dq * scale  # dQ = scale · dS K
    _store_rows(DQ + b * stride_dqb + h * stride_dqh, dq, rows, t_q, stride_dqt, HEAD_DIM)


# ------------------------------------------------------------------------------------ host side

# Under TRITON_INTERPRET=1 the decorator returns an interpreted function instead of a JITFunction.
INTERPRETED = not isinstance(_attn_fwd, triton.runtime.JITFunction)


def _tiles(kernel: str, head_dim: int, dtype: torch.dtype, sm: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of a kernel ("fwd", "dkdv", "dq") on compute
    capability `sm` (major: 8 Ampere, 9 Hopper).

    Shapes follow Triton's fused-attention tutorial: a 128-row query tile against 64-key tiles
    forward; for dK/dV a 128-key tile against 32-row query steps, and the mirror image for dQ. The
    warps, stages and smaller tiles (fp32; Ampere at head_dim 128) were picked by compiling for
    sm_80 and sm_90 without a GPU (`benchmarks/flash_gpu.py --compile-only`) to avoid register
    spills; only dK/dV at head_dim 128 on sm_90 still spills (~130 bytes). Not yet timed on a GPU.
    The interpreter gets small tiles, so test-sized inputs still cross several tiles, diagonals
    and tails.
    """
    if INTERPRETED:
        return {"fwd": (32, 16, 1, 1), "dkdv": (16, 32, 1, 1), "dq": (32, 16, 1, 1)}[kernel]
    if dtype == torch.float32:
        return {"fwd": (64, 16, 8, 2), "dkdv": (16, 64, 8, 2), "dq": (32, 16, 4, 2)}[kernel]
    ampere_d128 = head_dim > 64 and sm < 9
    if kernel == "fwd":
        return (128, 32 if ampere_d128 else 64, 8, 3)
    if kernel == "dkdv":
        return (32, 64, 4, 3) if ampere_d128 else (32, 128, 8, 3)
    return (128, 32, 8, 3)


def _sm(x: Tensor) -> int:
    """Compute capability major of x's device (0 on a CPU, under the interpreter)."""
    return torch.cuda.get_device_capability(x.device)[0] if x.is_cuda else 0


def _precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: fp32 inputs honour torch.set_float32_matmul_precision."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"  # ignored for 16-bit inputs


def _row_major(x: Tensor) -> Tensor:
    """x with a unit stride on the last (head_dim) axis, which the kernels' pointer arithmetic assumes."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> None:
    """Raise DecoderLMError, in one line, for any input the kernels cannot take."""
    check_inputs(q, k, v, key_padding_mask, "flash_attention_triton")
    d = q.shape[-1]
    if d not in HEAD_DIMS:
        raise DecoderLMError(
            f"head_dim={d} is not supported by the Triton flash kernel (allowed: {HEAD_DIMS})"
        )
    if q.dtype not in DTYPES:
        raise DecoderLMError(
            f"flash_attention_triton: dtype {q.dtype} is not one of float16, bfloat16, float32"
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if (x.shape[2] - 1) * x.stride(2) + d >= 2**31:
            raise DecoderLMError(
                f"{name} is too long for the kernels' 32-bit row offsets: T={x.shape[2]} with a "
                f"row stride of {x.stride(2)} elements (need T × stride < 2³¹)"
            )
    if not INTERPRETED and not (q.is_cuda and k.device == q.device and v.device == q.device):
        raise DecoderLMError(
            f"flash_attention_triton needs q, k, v on one CUDA device; got {q.device}, {k.device}, "
            f"{v.device} (on a CPU use decoderlm.model.flash.flash_attention)"
        )


def _bht_strides(x: Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _forward(
    q: Tensor, k: Tensor, v: Tensor, pad: Tensor | None, causal: bool, window: int, scale: float
) -> tuple[Tensor, Tensor]:
    """Launch the forward: (O (B, Hq, Tq, D) laid out like q, L₂ (B, Hq, Tq) fp32)."""
    b, n_heads, t_q, d = q.shape
    t_k = k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty(b, n_heads, t_q, device=q.device, dtype=torch.float32)
    block_m, block_n, num_warps, num_stages = _tiles("fwd", d, q.dtype, _sm(q))
    grid = (triton.cdiv(t_q, block_m), n_heads, b)  # (query tile, head, batch)
    if o.numel():
        _attn_fwd[grid](
            q, k, v, o, lse, pad, scale * LOG2E,
            *_bht_strides(q), *_bht_strides(k), *_bht_strides(v), *_bht_strides(o),
            pad.stride(0) if pad is not None else 0,
            n_heads, n_heads // k.shape[1], t_q, t_k, window,
            HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, HAS_PAD=pad is not None,
            PRECISION=_precision(q.dtype),
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return o, lse


def _backward(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
    pad: Tensor | None, causal: bool, window: int, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Launch the preprocess, dK/dV and dQ kernels: (dq, dk, dv) laid out like (q, k, v)."""
    b, n_heads, t_q, d = q.shape
    n_kv_heads, t_k = k.shape[1], k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = torch.empty_like(lse)  # D = rowsum(dO ∘ O): (B, Hq, Tq) fp32
    sm = _sm(q)
    block_m, _, num_warps, _ = _tiles("dq", d, q.dtype, sm)
    _attn_bwd_delta[(triton.cdiv(t_q, block_m), n_heads, b)](
        o, do, delta, *_bht_strides(o), *_bht_strides(do), n_heads, t_q,
        HEAD_DIM=d, BLOCK_M=block_m, num_warps=num_warps,
    )  # fmt: skip
    common = dict(CAUSAL=causal, HAS_PAD=pad is not None, HEAD_DIM=d, PRECISION=_precision(q.dtype))
    strides = (
        *_bht_strides(q), *_bht_strides(k), *_bht_strides(v), *_bht_strides(do),
        pad.stride(0) if pad is not None else 0,
    )  # fmt: skip
    sizes = (n_heads, n_heads // n_kv_heads, t_q, t_k, window)
    block_m, block_n, num_warps, num_stages = _tiles("dkdv", d, q.dtype, sm)
    _attn_bwd_dkdv[(triton.cdiv(t_k, block_n), n_kv_heads, b)](
        q, k, v, do, lse, delta, dk, dv, pad, scale * LOG2E, scale,
        *strides, *_bht_strides(dk), *_bht_strides(dv), *sizes,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, **common,
    )  # fmt: skip
    block_m, block_n, num_warps, num_stages = _tiles("dq", d, q.dtype, sm)
    _attn_bwd_dq[(triton.cdiv(t_q, block_m), n_heads, b)](
        q, k, v, do, lse, delta, dq, pad, scale * LOG2E, scale, *strides, *_bht_strides(dq), *sizes,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, **common,
    )  # fmt: skip
    return dq, dk, dv


class FlashAttentionTriton(torch.autograd.Function):
    """Autograd wrapper: saves q, k, v, O and L₂ (B, Hq, Tq) — nothing of size Tq × Tk."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        pad: Tensor | None,
        causal: bool,
        window: int,
        scale: float,
    ) -> Tensor:
        o, lse = _forward(q, k, v, pad, causal, window, scale)
        ctx.save_for_backward(q, k, v, o, lse, pad)
        ctx.causal, ctx.window, ctx.scale = causal, window, scale
        return o

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, do: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, None, None, None, None]:
        q, k, v, o, lse, pad = ctx.saved_tensors
        dq, dk, dv = _backward(
            q, k, v, o, lse, _row_major(do), pad, ctx.causal, ctx.window, ctx.scale
        )
        return dq, dk, dv, None, None, None, None


def flash_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
) -> Tensor:
    """softmax(QKᵀ·scale + M)V by the Triton FlashAttention-2 kernels; differentiable in q, k, v.

    q: (B, Hq, Tq, D); k, v: (B, Hkv, Tk, D) with Hq a multiple of Hkv (query head h reads K/V head
    h // (Hq / Hkv)); D in HEAD_DIMS; float16, bfloat16 or float32 on a CUDA device (or on a CPU
    under TRITON_INTERPRET=1). causal: query i attends key j iff j ≤ i + (Tk − Tq).
    window: with causal, also j > i + (Tk − Tq) − window (the last `window` keys); None = none.
    key_padding_mask: (B, Tk) bool, True = real key; a row with no key to attend returns 0.
    scale: default 1/√D. Returns (B, Hq, Tq, D) with q's dtype and memory layout.
    """
    _check_inputs(q, k, v, key_padding_mask)
    window = effective_window(causal, window, k.shape[2])
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    pad = None if key_padding_mask is None else key_padding_mask.contiguous().view(torch.uint8)
    band = k.shape[2] if window is None else window  # the kernels' window: Tk hides no key
    return FlashAttentionTriton.apply(
        _row_major(q), _row_major(k), _row_major(v), pad, causal, band, scale
    )
