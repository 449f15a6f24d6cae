/* The register-blocked product of AVX512-BF16's VDPBF16PS for decoderlm.cpu's kernels
 * (dpbf16_linear.c, dpbf16_attention.c): rows of x against blocks of 16 outputs laid out in pairs
 * of inputs, (blocks, pairs, 16, 2), one zmm register per pair of a block (the layout of
 * `decoderlm.cpu.bf16_linear.pack`). VDPBF16PS adds to each of its 16 float32 lanes the two
 * products of that lane's pair of weights with a pair of x's inputs broadcast to every lane, so each
 * output is summed pair by pair in order, whatever the rows beside it. */
#ifndef DECODERLM_DPBF16_H
#define DECODERLM_DPBF16_H

#include <immintrin.h>
#include <stdint.h>

#define PREFETCH_BYTES 6144 /* not a multiple of 4 KiB: see gemv.c */
#define ROWS 6              /* ROWS × BLOCKS float32 accumulators, BLOCKS weight vectors: 28 of 32 zmm */
#define BLOCKS 4

/* acc[r][b] = Σ_{p < pairs} x_r[2p .. 2p + 1] · W_b[p] for `rows` ≤ ROWS rows of x (`x_stride`
 * elements apart) and `blocks` ≤ BLOCKS blocks from wb (`w_stride` elements apart); `rows` and
 * `blocks` are constants after inlining, so the loops unroll into registers. The sums build in
 * local registers and are written to acc at the end: a vector type may alias anything, so sums
 * kept in acc itself would be stored back after every step. `fetch`: prefetch the blocks ahead
 * (the first rows to read them from memory). */
static inline __attribute__((always_inline)) void dot_group(const uint16_t *x, int64_t x_stride, int64_t pairs,
                                                             const uint16_t *wb, int64_t w_stride, int rows,
                                                             int blocks, int fetch, __m512 acc[ROWS][BLOCKS]) {
    __m512 sum[ROWS][BLOCKS];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 8
        for (int b = 0; b < BLOCKS; b++) sum[r][b] = _mm512_setzero_ps();
    const int32_t *xr[ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++) xr[r] = (const int32_t *)(x + (r < rows ? r : 0) * x_stride);
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh w[BLOCKS];
#pragma GCC unroll 8
        for (int b = 0; b < BLOCKS; b++) {
            if (b >= blocks) break;
            const uint16_t *at = wb + b * w_stride + p * 32;
            if (fetch) _mm_prefetch((const char *)at + PREFETCH_BYTES, _MM_HINT_T0);
            w[b] = (__m512bh)_mm512_loadu_si512(at);
        }
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) {
            if (r >= rows) break;
            const __m512bh xp = (__m512bh)_mm512_set1_epi32(xr[r][p]);
#pragma GCC unroll 8
            for (int b = 0; b < BLOCKS; b++) {
                if (b >= blocks) break;
                sum[r][b] = _mm512_dpbf16_ps(sum[r][b], xp, w[b]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 8
        for (int b = 0; b < BLOCKS; b++) acc[r][b] = sum[r][b];
}

#endif
