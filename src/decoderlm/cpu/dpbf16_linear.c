/* bfloat16 linear layers on AVX512-BF16's VDPBF16PS, for CPUs without AMX tiles (AMD Zen 4,
 * Intel Cooper Lake): y = x Wᵀ over the weight layout of amx_linear.c, (⌈N/16⌉, K/2, 16, 2), with
 * the same entry point (decoderlm.cpu.bf16_linear). y[m, 16j .. 16j + 15] = Σ over pairs p of
 * W_j[p] · x[m, 2p .. 2p + 1], one instruction a pair (dpbf16.h), every output summed pair by pair
 * in the order of K whatever the rows beside it (`decoderlm.cpu.invariant` relies on it): the same
 * bits for a row alone or among others.
 *
 * Register blocking (dpbf16.h): ROWS rows of x against BLOCKS blocks of W at a time, ROWS × BLOCKS
 * float32 accumulators, the BLOCKS weight vectors of a pair loaded once for the ROWS rows, x's
 * pairs broadcast from memory. Each thread takes a contiguous range of blocks (balanced to one block);
 * within it, a group of BLOCKS blocks is read from memory by its first ROWS rows
 * (software-prefetched 6 KiB ahead, as in gemv.c) and from the cache by the others. Sums in
 * float32, rounded to bfloat16 once (or kept in float32: packed_linear_bf16_f32); SwiGLU's pairs of
 * blocks (gate j, up j) stored as bf16(silu(bf16(g))) ⊙ bf16(u), the bits of amx_linear.c's epilogue.
 */
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#include <omp.h>
#include <stdint.h>

#include "dpbf16.h"
#include "vec.h"

/* How a group's sums are stored: rounded to bfloat16, as SwiGLU's silu(g) ⊙ u, or in float32. */
enum store { STORE_BF16, STORE_SWIGLU, STORE_F32 };

/* The group's sums to y (rows of N outputs, bfloat16 or float32 as `store` says) from output block
 * j0; with STORE_SWIGLU, blocks 2i, 2i + 1 of the group are gate and up of output block j0 + i. */
static inline __attribute__((always_inline)) void
store_group(__m512 acc[ROWS][BLOCKS], int rows, int blocks, void *y, int64_t N, int64_t j0, enum store store) {
    for (int r = 0; r < rows; r++) {
        if (store == STORE_F32) {
            for (int b = 0; b < blocks; b++) {
                const int64_t out = (j0 + b) * 16;
                store_f32((float *)y + r * N + out, acc[r][b], N - out);
            }
            continue;
        }
        uint16_t *yr = (uint16_t *)y + r * N;
        if (store == STORE_SWIGLU) {
            for (int b = 0; b + 1 < blocks; b += 2) {
                const int64_t out = (j0 + b / 2) * 16;
                const vec gate = vround_bf16(acc[r][b]), up = vround_bf16(acc[r][b + 1]);
                store_bf16(yr + out, vmul(vround_bf16(vsilu(gate)), up), N - out);
            }
        } else {
            for (int b = 0; b < blocks; b++) {
                const int64_t out = (j0 + b) * 16;
                store_bf16(yr + out, acc[r][b], N - out);
            }
        }
    }
}

/* Rows of x against `blocks` ≤ BLOCKS blocks, ROWS at a time; the block count a constant per call
 * site, the last rows of M mod ROWS by their own constant. */
static inline __attribute__((always_inline)) void
group(const uint16_t *x, const uint16_t *wb, void *y, int64_t M, int64_t N, int64_t K, int64_t j0, int blocks,
      enum store store) {
    const int64_t row_bytes = N * (store == STORE_F32 ? 4 : 2);
    __m512 acc[ROWS][BLOCKS];
    int64_t m = 0;
    for (; m + ROWS <= M; m += ROWS) {
        dot_group(x + m * K, K, K / 2, wb, 16 * K, ROWS, blocks, m == 0, acc);
        store_group(acc, ROWS, blocks, (char *)y + m * row_bytes, N, j0, store);
    }
    switch (M - m) {
#define REST(R)                                                                                                        \
    case R:                                                                                                            \
        dot_group(x + m * K, K, K / 2, wb, 16 * K, R, blocks, m == 0, acc);                                            \
        store_group(acc, R, blocks, (char *)y + m * row_bytes, N, j0, store);                                          \
        break;
        REST(1) REST(2) REST(3) REST(4) REST(5)
#undef REST
    default: break;
    }
}

/* What the op's first call needs (bf16_linear_ops.cpp): nothing, on this kernel. */
int packed_linear_prepare(void) { return 0; }

/* y = x Wᵀ for x (M, K), w blocked as above, y (M, N); x and w contiguous bfloat16, y as `store` says.
 * With STORE_SWIGLU, w holds the gate's and the up projection's blocks in turns (2·⌈N/16⌉ blocks). */
static void linear(const uint16_t *x, const uint16_t *w, void *y, int64_t M, int64_t N, int64_t K, enum store store) {
    const int swiglu = store == STORE_SWIGLU;
    const int64_t width = swiglu ? 2 : 1, units = (N + 15) / 16; /* output blocks, each `width` of W */
#pragma omp parallel
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t first = units * t / threads, last = units * (t + 1) / threads;
        const int64_t step = BLOCKS / width; /* output blocks per group (BLOCKS even: a SwiGLU pair never straddles two) */
        int64_t j = first;
        for (; j + step <= last; j += step) group(x, w + j * width * 16 * K, y, M, N, K, j, BLOCKS, store);
        for (; j < last; j++) { /* the last < step output blocks of this thread, one at a time */
            if (swiglu) group(x, w + j * 2 * 16 * K, y, M, N, K, j, 2, store);
            else group(x, w + j * 16 * K, y, M, N, K, j, 1, store);
        }
    }
}

/* The entry point of both kernels (amx_linear.c): y bfloat16; with `swiglu`, y = silu(g) ⊙ u. */
void packed_linear_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N, int64_t K,
                        int swiglu) {
    linear(x, w, y, M, N, K, swiglu ? STORE_SWIGLU : STORE_BF16);
}

/* The same product, its float32 sums stored as they are: y (M, N) float32. */
void packed_linear_bf16_f32(const uint16_t *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K) {
    linear(x, w, y, M, N, K, STORE_F32);
}
