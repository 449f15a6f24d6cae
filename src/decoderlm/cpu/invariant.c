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
 * changes with the shape, never an output's arithmetic. The product is outer.h's outer-product
 * tile on W packed once into panels of PANEL outputs, (⌈N/PANEL⌉, K, PANEL) (`invariant_pack`),
 * whose tile of fewer rows (the edge, a decode row) performs, per output, the same operations in
 * the same order (and the file is compiled without -ffast-math's reassociation). A bfloat16
 * output rounds its float32 sum once, to nearest even. Parallel over panels with OpenMP; each output is
 * computed by one thread, whole; the rows run in blocks of ROW_BLOCK, whose x stays in L2 while
 * the thread's panels stream past it.
 */
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#include <omp.h>
#include <stdint.h>

#include "vec.h"
#include "outer.h"

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
