/* Fused elementwise kernels of a decoder pass (decoderlm.cpu.fused): each reads its inputs once
 * and writes its output once, where PyTorch's eager formula makes a pass over memory per
 * operation. Each rounds where the formula it replaces rounds (bfloat16 to nearest even, vec.h),
 * so a result differs from it only where a sum taken in another order, or e^x's last ulp, crosses
 * a rounding boundary.
 *
 * fused_rms_norm: y = g ⊙ bf16(x / √(mean(x²) + ε)) per row (Zhang & Sennrich, 2019, in the order
 *     of transformers' Llama), or, with an offset, y = bf16(x / √(mean(x²) + ε) ⊙ (offset + g))
 *     (Gemma's gain stored as g − 1).
 * fused_rope: y = bf16(x·cos) + bf16(rotate_half(x)·sin) over the first R dimensions of each head
 *     vector (Su et al., 2021, RoFormer), the others copied.
 * fused_silu_mul: y = bf16(g · 1/(1 + e^−g)) ⊙ u (SwiGLU's gate: Shazeer, 2020).
 *
 * Batch-invariant (decoderlm.cpu.invariant): a row is walked LANES elements at a time, its last
 * ones masked (vec.h), so every element goes through the same instructions whichever rows are
 * around it; a row's sum of squares is LANES partial sums added by one fixed tree. float32 (bf16
 * = 0) or bfloat16 (bf16 = 1) operands, all of one dtype; parallel over rows (OpenMP) where the
 * work pays for the threads.
 */
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#include <math.h>
#include <stdint.h>

#include "vec.h"

#define PARALLEL_MIN 32768 /* elements below which one thread does it all */
#define INLINE static inline __attribute__((always_inline))

INLINE vec load(const void *p, int64_t i, int64_t n, const int bf16) {
    return bf16 ? load_bf16((const uint16_t *)p + i, n) : load_f32((const float *)p + i, n);
}

INLINE void store(void *p, int64_t i, vec v, int64_t n, const int bf16) {
    if (bf16) store_bf16((uint16_t *)p + i, v, n);
    else store_f32((float *)p + i, v, n);
}

INLINE vec rounded(vec v, const int bf16) { return bf16 ? vround_bf16(v) : v; }

/* One row of x (dim) at x + in, of y at y + out; g (dim). */
INLINE void rms_norm_row(const void *x, const void *g, void *y, int64_t in, int64_t out,
                         int64_t dim, float eps, float offset, const int bf16) {
    vec squares = vzero();
    for (int64_t i = 0; i < dim; i += LANES) {
        const vec v = load(x, in + i, dim - i, bf16);
        squares = vfma(v, v, squares);
    }
    const float mean = vsum(squares) / (float)dim;
    const vec inv = vset((float)(1.0 / sqrt((double)(mean + eps)))); /* correctly rounded */
    for (int64_t i = 0; i < dim; i += LANES) {
        const vec v = vmul(load(x, in + i, dim - i, bf16), inv), gain = load(g, i, dim - i, bf16);
        const vec normed = offset != 0.0f ? vmul(v, vadd(vset(offset), gain)) : vmul(gain, rounded(v, bf16));
        store(y, out + i, normed, dim - i, bf16);
    }
}

/* One head vector (D) of x at x + in, of y at y + out, its cos and sin (R) at cs. */
INLINE void rope_head(const void *x, const void *cos, const void *sin, void *y, int64_t in,
                      int64_t out, int64_t cs, int64_t D, int64_t R, const int bf16) {
    const int64_t half = R / 2;
    for (int64_t i = 0; i < half; i += LANES) { /* rotate_half(x) = (−x₂, x₁) */
        const int64_t n = half - i;
        const vec x1 = load(x, in + i, n, bf16), x2 = load(x, in + half + i, n, bf16);
        const vec c1 = load(cos, cs + i, n, bf16), s1 = load(sin, cs + i, n, bf16);
        const vec c2 = load(cos, cs + half + i, n, bf16), s2 = load(sin, cs + half + i, n, bf16);
        store(y, out + i, vsub(rounded(vmul(x1, c1), bf16), rounded(vmul(x2, s1), bf16)), n, bf16);
        store(y, out + half + i, vadd(rounded(vmul(x2, c2), bf16), rounded(vmul(x1, s2), bf16)), n, bf16);
    }
    for (int64_t i = R; i < D; i += LANES) store(y, out + i, load(x, in + i, D - i, bf16), D - i, bf16);
}

/* One row (n) of g, u and y, from element at. */
INLINE void silu_mul_row(const void *g, const void *u, void *y, int64_t at, int64_t n, const int bf16) {
    for (int64_t i = 0; i < n; i += LANES) {
        const vec silu = vsilu(load(g, at + i, n - i, bf16));
        store(y, at + i, vmul(rounded(silu, bf16), load(u, at + i, n - i, bf16)), n - i, bf16);
    }
}

/* The entry points, parallel over rows; each row's body compiled for float32 and for bfloat16.
 *
 * x, y (rows, dim), row r of x at r·x_stride elements, y contiguous; g (dim). */
void fused_rms_norm(const void *x, const void *g, void *y, int64_t rows, int64_t dim,
                    int64_t x_stride, float eps, float offset, int bf16) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16) rms_norm_row(x, g, y, r * x_stride, r * dim, dim, eps, offset, 1);
        else rms_norm_row(x, g, y, r * x_stride, r * dim, dim, eps, offset, 0);
    }
}

/* x (B, H, T, D) at strides (sb, sh, st, 1) elements; cos, sin (B or 1, T, R) contiguous, cs_b
 * elements apart (0: one table for every row); y (B, T, H, D) contiguous. */
void fused_rope(const void *x, const void *cos, const void *sin, void *y, int64_t B, int64_t H,
                int64_t T, int64_t D, int64_t R, int64_t sb, int64_t sh, int64_t st, int64_t cs_b,
                int bf16) {
#pragma omp parallel for collapse(2) schedule(static) if (B * T * H * D >= PARALLEL_MIN)
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t in = b * sb + h * sh + t * st, out = ((b * T + t) * H + h) * D;
                if (bf16) rope_head(x, cos, sin, y, in, out, b * cs_b + t * R, D, R, 1);
                else rope_head(x, cos, sin, y, in, out, b * cs_b + t * R, D, R, 0);
            }
}

/* g, u, y (rows, n) contiguous. */
void fused_silu_mul(const void *g, const void *u, void *y, int64_t rows, int64_t n, int bf16) {
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16) silu_mul_row(g, u, y, r * n, n, 1);
        else silu_mul_row(g, u, y, r * n, n, 0);
    }
}
