/* The outer-product tile of decoderlm.cpu's float products (invariant.c's batch-invariant linear,
 * block_linear.c's panels of dequantized blocks): a BLAS micro-kernel (Goto and van de Geijn, 2008,
 * "Anatomy of High-Performance Matrix Multiplication"). A weight W (N, K) is laid out in panels of
 * PANEL outputs, (K, PANEL) each; each step of k broadcasts x[m, k] of R rows and multiplies it by
 * the panel's two vectors of W[·, k], R × 2 accumulators in registers. y[m, n] = Σ_k x[m, k] · W[n, k]
 * is accumulated in one float32 lane, in increasing k, by fused multiply-adds from zero, whatever
 * the number of rows: a tile of fewer rows (the edge, a decode row) performs, per output, the same
 * operations in the same order. bfloat16 operands are widened exactly to float32 (a 16-bit shift).
 * Include "vec.h" first. */
#ifndef DECODERLM_OUTER_H
#define DECODERLM_OUTER_H

/* Rows per tile: R × 2 accumulators, 2 W vectors and a broadcast x in the registers (AVX-512's 32:
 * 8 × 2; AVX2's 16: 6 × 2). */
#if LANES == 16
#define R 8
#elif LANES == 8
#define R 6
#else
#define R 4
#endif
#define PANEL (2 * LANES) /* outputs per panel */

static inline float scalar_f32(const float *p) { return *p; }
static inline float scalar_bf16(const uint16_t *p) { return from_bf16(*p); }

/* One tile: rows 0 .. RM − 1 of x (at a stride of K) against one panel p (K, PANEL), the sums into
 * out (R, PANEL). The full tile is the same code with RM = R known to the compiler, so that its
 * accumulators stay in registers; per output every variant runs the same operations. */
#define TILE(NAME, T, LOAD, SCALAR, RM)                                                            \
    static void NAME(const void *xp, const void *pp, float *out, int64_t rm, int64_t K) {         \
        const T *x = xp, *p = pp;                                                                  \
        vec acc[R][2];                                                                             \
        (void)rm;                                                                                  \
        for (int r = 0; r < RM; r++) acc[r][0] = acc[r][1] = vzero();                              \
        for (int64_t k = 0; k < K; k++) {                                                          \
            const vec w0 = LOAD(p + k * PANEL, LANES), w1 = LOAD(p + k * PANEL + LANES, LANES);    \
            for (int r = 0; r < RM; r++) {                                                         \
                const vec xb = vset(SCALAR(x + r * K + k));                                        \
                acc[r][0] = vfma(xb, w0, acc[r][0]);                                               \
                acc[r][1] = vfma(xb, w1, acc[r][1]);                                               \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < RM; r++) {                                                             \
            store_f32(out + r * PANEL, acc[r][0], LANES);                                          \
            store_f32(out + r * PANEL + LANES, acc[r][1], LANES);                                  \
        }                                                                                          \
    }
TILE(full_f32, float, load_f32, scalar_f32, R)
TILE(part_f32, float, load_f32, scalar_f32, rm)
TILE(one_f32, float, load_f32, scalar_f32, 1) /* a decode row */

#endif
