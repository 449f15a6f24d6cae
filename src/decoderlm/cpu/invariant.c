/* Batch-invariant kernels (decoderlm.cpu.invariant): a row's results do not depend on the rows
 * computed with it.
 *
 * invariant_linear: y = x Wᵀ where every output y[m, n] is summed in one fixed order, whatever the
 * number of rows M and the row's place m.
 *
 * y[m, n] = Σ_k x[m, k] · W[n, k] is accumulated in one float32 lane, in increasing k, by fused
 * multiply-adds from zero: acc ← fma(x[m, k], W[n, k], acc). A BLAS picks its blocking of K and
 * its kernels by the shape, so a row's sums change with the batch around it (Thinking Machines,
 * 2025, "Defeating Nondeterminism in LLM Inference"); here only the tiling of rows and outputs
 * changes with the shape, never an output's arithmetic. The product is a BLAS micro-kernel's outer
 * product (Goto and van de Geijn, 2008, "Anatomy of High-Performance Matrix Multiplication"): W
 * packed once into panels of PANEL outputs, (⌈N/PANEL⌉, K, PANEL) (`invariant_pack`), each step
 * of k broadcasts x[m, k] of R rows and multiplies it by the panel's two vectors of W[·, k], R × 2
 * accumulators in registers; a tile of fewer rows (the edge, a decode row) performs, per output,
 * the same operations in the same order (and the file is compiled without -ffast-math's
 * reassociation). bfloat16 operands are widened exactly to float32 (a 16-bit shift); the sums
 * round to bfloat16 once, to nearest even. Parallel over panels with OpenMP; each output is
 * computed by one thread, whole; the rows run in blocks of ROW_BLOCK, whose x stays in L2 while
 * the thread's panels stream past it.
 */
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#include <omp.h>
#include <stdint.h>

#include "vec.h"

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
#define ROW_BLOCK (10 * R) /* rows whose x a thread keeps while its panels pass */

/* Outputs per panel: what `invariant.pack` lays W out for. */
int64_t invariant_panel(void) { return PANEL; }

/* w (N, K) → p (⌈N/PANEL⌉, K, PANEL): p[j, k, i] = W[j · PANEL + i, k], zeros past N. */
void invariant_pack(const void *w, void *p, int64_t N, int64_t K, int bf16) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < panels; j++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t i = 0; i < PANEL; i++) {
                const int64_t n = j * PANEL + i, at = (j * K + k) * PANEL + i;
                if (bf16) ((uint16_t *)p)[at] = n < N ? ((const uint16_t *)w)[n * K + k] : 0;
                else ((float *)p)[at] = n < N ? ((const float *)w)[n * K + k] : 0.0f;
            }
}

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
TILE(full_bf16, uint16_t, load_bf16, scalar_bf16, R)
TILE(part_bf16, uint16_t, load_bf16, scalar_bf16, rm)
TILE(one_bf16, uint16_t, load_bf16, scalar_bf16, 1)

/* x (M, K), p = invariant_pack of W (N, K), y (M, N); x and y contiguous, float32 or bfloat16
 * (`bf16`). */
void invariant_linear(const void *x, const void *p, void *y, int64_t M, int64_t N, int64_t K,
                      int bf16) {
    const int64_t panels = (N + PANEL - 1) / PANEL, es = bf16 ? 2 : 4;
#pragma omp parallel
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t lo = panels * t / threads, hi = panels * (t + 1) / threads;
        float out[R * PANEL];
        for (int64_t mb = 0; mb < M; mb += ROW_BLOCK) {
            const int64_t mb_end = mb + ROW_BLOCK < M ? mb + ROW_BLOCK : M;
            for (int64_t j = lo; j < hi; j++) {
                const char *panel = (const char *)p + j * K * PANEL * es;
                const int64_t n0 = j * PANEL, rn = N - n0 < PANEL ? N - n0 : PANEL;
                for (int64_t m = mb; m < mb_end; m += R) {
                    const int64_t rm = mb_end - m < R ? mb_end - m : R;
                    const char *xm = (const char *)x + m * K * es;
                    if (bf16) (rm == R ? full_bf16 : rm == 1 ? one_bf16 : part_bf16)(xm, panel, out, rm, K);
                    else (rm == R ? full_f32 : rm == 1 ? one_f32 : part_f32)(xm, panel, out, rm, K);
                    for (int64_t r = 0; r < rm; r++)
                        for (int64_t i = 0; i < rn; i++) {
                            const float v = out[r * PANEL + i];
                            if (bf16) ((uint16_t *)y)[(m + r) * N + n0 + i] = to_bf16(v);
                            else ((float *)y)[(m + r) * N + n0 + i] = v;
                        }
                }
            }
        }
    }
}
