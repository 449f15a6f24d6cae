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
 * arithmetic: a full tile of ROWS rows × 4 outputs (4 · ROWS accumulators, each row of x and of W
 * loaded once per step of k) and the partial tiles at the edges perform, per output, the same
 * operations in the same order (and the file is compiled without -ffast-math's reassociation).
 * bfloat16 operands are widened exactly to float32 (a 16-bit shift); the sums round to bfloat16
 * once, to nearest even. Parallel over blocks of outputs with OpenMP; each output is
 * computed by one thread, whole.
 */
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#include <stdint.h>

#include "vec.h"

/* Rows of x per tile: 4 × 4 accumulators and 4 W vectors fit AVX-512's 32 registers; AVX2 has 16,
 * where 2 × 4 runs without spilling them (float32, 64 × 576 × 1536 on a Zen 4 capped at AVX2: 1.21
 * against 1.47 ms). The tile changes no output's arithmetic. */
#if LANES == 8
#define ROWS 2
#else
#define ROWS 4
#endif
#define OUTS 4 /* outputs (rows of W) per tile */
#define BLOCK 64 /* outputs per unit of parallel work */

/* One step of k: acc[r][c] += x[r][k .. k + LANES) · w[c][k .. k + LANES), lane by lane, n of the
 * LANES inputs loaded (zeros after them). */
#define STEP(LOAD, RM, RN, n)                                                                      \
    do {                                                                                           \
        vec wv[OUTS], xv;                                                                          \
        for (int c = 0; c < RN; c++) wv[c] = LOAD(w + c * K + k, n);                               \
        for (int r = 0; r < RM; r++) {                                                             \
            xv = LOAD(x + r * K + k, n);                                                           \
            for (int c = 0; c < RN; c++) acc[r][c] = vfma(xv, wv[c], acc[r][c]);                  \
        }                                                                                          \
    } while (0)

/* One tile: rows 0 .. rm − 1 of x against outputs (rows of w) 0 .. rn − 1 (rm ≤ ROWS, rn ≤ OUTS),
 * the sums into out (ROWS × OUTS). FULL is the same code with rm = ROWS and rn = OUTS known to the
 * compiler, so that its 16 accumulators stay in registers; per output both run the same
 * operations. The whole vectors of k first, with loads of LANES known to the compiler (under
 * AVX2 a load of fewer lanes goes through the stack, and with it the accumulators: 84 against
 * ~200 GFLOP/s), then the last K mod LANES inputs, zeros after them. */
#define TILE(NAME, T, LOAD, RM, RN)                                                                \
    static void NAME(const T *x, const T *w, float *out, int64_t rm, int64_t rn, int64_t K) {     \
        vec acc[ROWS][OUTS];                                                                       \
        (void)rm, (void)rn;                                                                        \
        for (int r = 0; r < RM; r++)                                                               \
            for (int c = 0; c < RN; c++) acc[r][c] = vzero();                                      \
        int64_t k = 0;                                                                             \
        for (; k + LANES <= K; k += LANES) STEP(LOAD, RM, RN, LANES);                              \
        if (k < K) STEP(LOAD, RM, RN, K - k);                                                      \
        for (int r = 0; r < RM; r++)                                                               \
            for (int c = 0; c < RN; c++) out[r * OUTS + c] = vsum(acc[r][c]);                      \
    }
TILE(full_f32, float, load_f32, ROWS, OUTS)
TILE(part_f32, float, load_f32, rm, rn)
TILE(full_bf16, uint16_t, load_bf16, ROWS, OUTS)
TILE(part_bf16, uint16_t, load_bf16, rm, rn)
TILE(one_f32, float, load_f32, 1, OUTS) /* a decode pass of one row */
TILE(one_bf16, uint16_t, load_bf16, 1, OUTS)

/* x (M, K), w (N, K), y (M, N), contiguous; float32 or bfloat16 (`bf16`). */
void invariant_linear(const void *x, const void *w, void *y, int64_t M, int64_t N, int64_t K,
                      int bf16) {
    const int64_t blocks = (N + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        float out[ROWS * OUTS];
        const int64_t n_end = (b + 1) * BLOCK < N ? (b + 1) * BLOCK : N;
        for (int64_t m = 0; m < M; m += ROWS) {
            const int64_t rm = M - m < ROWS ? M - m : ROWS;
            for (int64_t n = b * BLOCK; n < n_end; n += OUTS) {
                const int64_t rn = n_end - n < OUTS ? n_end - n : OUTS;
                const int full = rn == OUTS && rm == ROWS, one = rn == OUTS && rm == 1;
                const uint16_t *xh = (const uint16_t *)x + m * K, *wh = (const uint16_t *)w + n * K;
                const float *xf = (const float *)x + m * K, *wf = (const float *)w + n * K;
                if (bf16) (full ? full_bf16 : one ? one_bf16 : part_bf16)(xh, wh, out, rm, rn, K);
                else (full ? full_f32 : one ? one_f32 : part_f32)(xf, wf, out, rm, rn, K);
                for (int64_t r = 0; r < rm; r++)
                    for (int64_t c = 0; c < rn; c++) {
                        const float v = out[r * OUTS + c];
                        if (bf16) ((uint16_t *)y)[(m + r) * N + n + c] = to_bf16(v);
                        else ((float *)y)[(m + r) * N + n + c] = v;
                    }
            }
        }
    }
}
