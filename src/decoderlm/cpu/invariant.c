/* Batch-invariant kernels (decoderlm.cpu.invariant): a row's results do not depend on the rows
 * computed with it.
 *
 * invariant_linear: y = x Wᵀ where every output y[m, n] is summed in one fixed order, whatever the
 * number of rows M and the row's place m.
 *
 * y[m, n] = Σ_k x[m, k] · W[n, k] is accumulated in float32 vector lanes L wide (16 with AVX-512,
 * 8 with AVX2, 1 without): lane l sums the products of k ≡ l (mod L) in increasing k, the last
 * K mod L inputs masked in (AVX-512) or added lane by lane (AVX2); then the lanes are added by
 * one fixed tree. A BLAS picks its blocking of K and its kernels by the shape, so a row's sums
 * change with the batch around it (Thinking Machines, 2025, "Defeating Nondeterminism in LLM
 * Inference"); here only the tiling of rows and outputs changes with the shape, never an output's
 * arithmetic: a full tile of R rows × C outputs (R · C accumulators, each row of x and of W
 * loaded once per step of k; R × C by the number of rows, below) and the partial tiles at the
 * edges perform, per output, the same operations in the same order (and the file is compiled
 * without -ffast-math's reassociation).
 * bfloat16 operands are widened exactly to float32 (a 16-bit shift); the sums round to bfloat16
 * once, to nearest even. Parallel over blocks of outputs with OpenMP; each output is
 * computed by one thread, whole.
 */
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#include <stdint.h>

#include "vec.h"

/* Two tile shapes, rows of x × outputs (rows of W), chosen by the number of rows M; neither
 * changes an output's arithmetic. WIDE for few rows: 4 × 4 accumulators and 4 W vectors in
 * AVX-512's 32 registers, 2 × 4 in AVX2's 16 (4 × 4 spills them there: 64 × 576 × 1536 float32
 * on a Zen 4 capped at AVX2, 1.21 against 1.47 ms). TALL from TALL_MIN rows: 8 × 2 (AVX-512) and
 * 6 × 2 (AVX2) load 2 W vectors per 16 and 12 multiply-adds, where WIDE loads 4 per 16 and 8
 * (576 × 1536 float32 on a Zen 4, 2 threads: 0-16% faster from 32 rows, up to 16% slower at 8-16
 * rows, where its partial tiles take a larger share). */
#if LANES == 8
#define WIDE_ROWS 2
#define TALL_ROWS 6
#else
#define WIDE_ROWS 4
#define TALL_ROWS 8
#endif
#define WIDE_OUTS 4
#define TALL_OUTS 2
#define TALL_MIN 32 /* rows from which the tall tile runs */
#define OUT_MAX (TALL_ROWS * TALL_OUTS > WIDE_ROWS * WIDE_OUTS ? TALL_ROWS * TALL_OUTS : WIDE_ROWS * WIDE_OUTS)
#define BLOCK 64 /* outputs per unit of parallel work (a multiple of both tiles' outputs) */

/* One step of k: acc[r][c] += x[r][k .. k + LANES) · w[c][k .. k + LANES), lane by lane, n of the
 * LANES inputs loaded (zeros after them). */
#define STEP(LOAD, C, RM, RN, n)                                                                   \
    do {                                                                                           \
        vec wv[C], xv;                                                                             \
        for (int c = 0; c < RN; c++) wv[c] = LOAD(w + c * K + k, n);                               \
        for (int r = 0; r < RM; r++) {                                                             \
            xv = LOAD(x + r * K + k, n);                                                           \
            for (int c = 0; c < RN; c++) acc[r][c] = vfma(xv, wv[c], acc[r][c]);                  \
        }                                                                                          \
    } while (0)

/* One tile of shape R × C: rows 0 .. rm − 1 of x against outputs 0 .. rn − 1 (rm ≤ R, rn ≤ C), the
 * sums into out (R × C). The full tile is the same code with RM = R and RN = C known to the
 * compiler, so that its accumulators stay in registers; per output every variant runs the same
 * operations. The whole vectors of k first, with loads of LANES known to the compiler (under
 * AVX2 a load of fewer lanes goes through the stack, and with it the accumulators: 84 against
 * ~200 GFLOP/s), then the last K mod LANES inputs, zeros after them. */
#define TILE(NAME, T, LOAD, R, C, RM, RN)                                                          \
    static void NAME(const void *xp, const void *wp, float *out, int64_t rm, int64_t rn,          \
                     int64_t K) {                                                                  \
        const T *x = xp, *w = wp;                                                                  \
        vec acc[R][C];                                                                             \
        (void)rm, (void)rn;                                                                        \
        for (int r = 0; r < RM; r++)                                                               \
            for (int c = 0; c < RN; c++) acc[r][c] = vzero();                                      \
        int64_t k = 0;                                                                             \
        for (; k + LANES <= K; k += LANES) STEP(LOAD, C, RM, RN, LANES);                           \
        if (k < K) STEP(LOAD, C, RM, RN, K - k);                                                   \
        for (int r = 0; r < RM; r++)                                                               \
            for (int c = 0; c < RN; c++) out[r * C + c] = vsum(acc[r][c]);                         \
    }
TILE(wide_f32, float, load_f32, WIDE_ROWS, WIDE_OUTS, WIDE_ROWS, WIDE_OUTS)
TILE(wide_part_f32, float, load_f32, WIDE_ROWS, WIDE_OUTS, rm, rn)
TILE(wide_one_f32, float, load_f32, WIDE_ROWS, WIDE_OUTS, 1, WIDE_OUTS) /* a decode row */
TILE(tall_f32, float, load_f32, TALL_ROWS, TALL_OUTS, TALL_ROWS, TALL_OUTS)
TILE(tall_part_f32, float, load_f32, TALL_ROWS, TALL_OUTS, rm, rn)
TILE(wide_bf16, uint16_t, load_bf16, WIDE_ROWS, WIDE_OUTS, WIDE_ROWS, WIDE_OUTS)
TILE(wide_part_bf16, uint16_t, load_bf16, WIDE_ROWS, WIDE_OUTS, rm, rn)
TILE(wide_one_bf16, uint16_t, load_bf16, WIDE_ROWS, WIDE_OUTS, 1, WIDE_OUTS)
TILE(tall_bf16, uint16_t, load_bf16, TALL_ROWS, TALL_OUTS, TALL_ROWS, TALL_OUTS)
TILE(tall_part_bf16, uint16_t, load_bf16, TALL_ROWS, TALL_OUTS, rm, rn)

typedef void (*tile_fn)(const void *, const void *, float *, int64_t, int64_t, int64_t);

/* A tile shape: rows × outs, its full tile, its partial one, and its tile of one row (or NULL). */
struct shape {
    int64_t rows, outs;
    tile_fn full, part, one;
};
static const struct shape WIDE[2] = {{WIDE_ROWS, WIDE_OUTS, wide_f32, wide_part_f32, wide_one_f32},
                                     {WIDE_ROWS, WIDE_OUTS, wide_bf16, wide_part_bf16, wide_one_bf16}};
static const struct shape TALL[2] = {{TALL_ROWS, TALL_OUTS, tall_f32, tall_part_f32, NULL},
                                     {TALL_ROWS, TALL_OUTS, tall_bf16, tall_part_bf16, NULL}};

/* x (M, K), w (N, K), y (M, N), contiguous; float32 or bfloat16 (`bf16`). */
void invariant_linear(const void *x, const void *w, void *y, int64_t M, int64_t N, int64_t K,
                      int bf16) {
    const struct shape *s = M >= TALL_MIN ? &TALL[bf16 != 0] : &WIDE[bf16 != 0];
    const int64_t blocks = (N + BLOCK - 1) / BLOCK, es = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        float out[OUT_MAX];
        const int64_t n_end = (b + 1) * BLOCK < N ? (b + 1) * BLOCK : N;
        for (int64_t m = 0; m < M; m += s->rows) {
            const int64_t rm = M - m < s->rows ? M - m : s->rows;
            for (int64_t n = b * BLOCK; n < n_end; n += s->outs) {
                const int64_t rn = n_end - n < s->outs ? n_end - n : s->outs;
                const tile_fn tile = rn < s->outs ? s->part
                                     : rm == s->rows ? s->full
                                     : rm == 1 && s->one ? s->one
                                                         : s->part;
                tile((const char *)x + m * K * es, (const char *)w + n * K * es, out, rm, rn, K);
                for (int64_t r = 0; r < rm; r++)
                    for (int64_t c = 0; c < rn; c++) {
                        const float v = out[r * s->outs + c];
                        if (bf16) ((uint16_t *)y)[(m + r) * N + n + c] = to_bf16(v);
                        else ((float *)y)[(m + r) * N + n + c] = v;
                    }
            }
        }
    }
}
