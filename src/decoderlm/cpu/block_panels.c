/* Products y = x Ŵᵀ of many rows with Ŵ in ggml's block formats (a decode step of many
 * sequences, a prompt's prefill): each thread unpacks the weights of PANEL outputs at a time into
 * a panel in its cache, never written to memory, and multiplies every row by it there, in tiles
 * of rows as a BLAS micro-kernel does (Goto and van de Geijn, 2008). Two kinds of panel:
 *   - integer panels (`block_tiles`, AVX-512 VNNI and AVX2, the quantized types): the blocks'
 *     integers, summed with the activations quantized as for block_linear.c's kernels by
 *     vpdpbusd (64 products an instruction, two per product: the activations' two int8) or
 *     vpdpwssd (Q8_0: 32, one per product); with AVX2 by vpmaddwd + vpaddd on both as int16
 *     (16 products in two instructions), the same integer sums;
 *   - dequantized panels (`block_panels`, every build and type): the weights' float32 values,
 *     summed by outer.h's FMA tile, 16 products an instruction (8 with AVX2).
 * And strips (`block_strips`, AVX-512 VNNI and AVX2): a few rows with the integer tiles'
 * arithmetic, read from the blocks as they lie, for a batch-invariant engine (a row's bits the
 * same at any number of rows; block_linear.py). Both builds' tiles and strips give a row the
 * same bits; each build's are in a file of their own, included below (block_panels_avx512.h,
 * block_panels_avx2.h).
 * SmolLM2-135M's 30 Q4_1 layers, their weights read from memory, 2 threads of a Zen 4: at 24 /
 * 32 / 64 rows 24.9 / 31.2 / 55.6 ms on integer panels, 61.5 / 69.5 / 107.5 on dequantized ones;
 * the AVX2 build's (the same CPU, 2026-12-07, medians of 15 interleaved rounds' ratios) at 9 / 16
 * / 32 / 64 rows 0.99× / 0.89× / 0.89× / 1.12× the time of its default products (the block
 * kernel up to 16 rows, then dequantized panels), its strips at 1 / 4 / 8 rows 1.05× / 1.03× /
 * 1.06×; on the Q8_0 head (int16 weights, twice its blocks' bytes in the panels) the strips
 * 1.18-1.26×, the tiles 1.25× at 9 and 16 rows and 0.80× / 0.95× at 32 / 64. */
#include "vec.h"
#include "outer.h"
#include "blocks.h"

#if ISA > 0
/* The 8 × 8 int32 matrix of rows r[0..7] → its transpose: 2 × 2 then 4 × 4 blocks within each
 * 128-bit half (unpack 32, then 64 bits), then the halves exchanged. */
INLINE void transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);     /* columns 0 and 4 of rows i .. i + 3 */
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]); /* 1 and 5 */
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
        r[4 + c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
    }
}

/* rows (PANEL, K) float32 → panel (K, PANEL): 8 × 8 blocks transposed in registers, the last K % 8
 * inputs one at a time. (SmolLM2's 30 Q4_1 layers at 64 rows on the AVX2 build: with a plain
 * loop of scalar copies the transposition took ~15% of the products' time.) */
static void transpose_panel(const float *rows, int64_t K, float *panel) {
    const int64_t whole = K - K % 8;
    for (int64_t k0 = 0; k0 < whole; k0 += 8)
        for (int64_t i0 = 0; i0 < PANEL; i0 += 8) {
            __m256i r[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_castps_si256(_mm256_loadu_ps(rows + (i0 + i) * K + k0));
            transpose8(r);
            for (int c = 0; c < 8; c++) _mm256_storeu_ps(panel + (k0 + c) * PANEL + i0, _mm256_castsi256_ps(r[c]));
        }
    for (int64_t k = whole; k < K; k++)
        for (int64_t i = 0; i < PANEL; i++) panel[k * PANEL + i] = rows[i * K + k];
}
/* Asks for the bytes of the rows n0 .. n0 + PANEL − 1 of Ŵ (N rows of row_bytes, one after the
 * other), into L2, while the tiles multiply the panel before them: the unpacking of a panel reads
 * 16 rows (AVX2: 8) at a time, a pattern the hardware prefetcher does not follow (SmolLM2's products, its
 * weights in memory, 2 threads of a Zen 4: its 30 layers at 8 / 16 rows 17.0 / 24.3 ms against
 * 19.9 / 26.2 without, its Q8_0 head 4.5 / 6.5 against 5.8 / 7.4). */
static void prefetch_panel(const uint8_t *W, int64_t n0, int64_t N, int64_t row_bytes) {
    const int64_t end = (n0 + PANEL < N ? n0 + PANEL : N) * row_bytes;
    for (int64_t at = n0 * row_bytes; at < end; at += 64) _mm_prefetch((const char *)W + at, _MM_HINT_T1);
}

/* Asks for a slice of the strip at `ahead` (`outputs` rows of blocks of `bytes`, one row after the
 * other; nothing from `end` on) into L2: the share of it that blocks blk .. blk + count − 1 are of
 * a row, so that the whole strip arrives over one pass of a strip's blocks. */
INLINE void prefetch_strip(const uint8_t *ahead, const uint8_t *end, int64_t blk, int64_t count, int bytes,
                           int outputs) {
    for (const uint8_t *p = ahead + blk * outputs * bytes; p < ahead + (blk + count) * outputs * bytes && p < end;
         p += 64)
        _mm_prefetch((const char *)p, _MM_HINT_T1);
}

#endif

#if ISA == 2
#include "block_panels_avx512.h"
#elif ISA == 1
#include "block_panels_avx2.h"
#endif

#if ISA > 0
/* All M rows against panel p (outputs n0 .. n0 + rn − 1) into y (M, N), IR rows a tile; the
 * tile's number of rows a constant in each call, so that its accumulators stay in registers. */
#define INT_TILES(T)                                                                                  \
    static void CAT(int_tiles, T)(const IntPanel *p, const void *acts, int64_t M, int64_t K, float *out, \
                                  int64_t n0, int64_t rn, int64_t N, float *y) {                      \
        for (int64_t m = 0; m < M; m += IR) {                                                         \
            switch (M - m < IR ? M - m : IR) {                                                        \
                case 1: int_tile(T, p, acts, m, 1, K, out); break;                                    \
                case 2: int_tile(T, p, acts, m, 2, K, out); break;                                    \
                case 3: int_tile(T, p, acts, m, 3, K, out); break;                                    \
                case 4: int_tile(T, p, acts, m, 4, K, out); break;                                    \
                case 5: int_tile(T, p, acts, m, 5, K, out); break;                                    \
                default: int_tile(T, p, acts, m, IR, K, out); break;                                  \
            }                                                                                         \
            for (int64_t r = 0; r < IR && m + r < M; r++)                                             \
                memcpy(y + (m + r) * N + n0, out + r * PANEL, sizeof(float) * (size_t)rn);            \
        }                                                                                             \
    }
INT_TILES(Q8_0)
INT_TILES(Q4_0)
INT_TILES(Q4_1)
INT_TILES(Q5_0)
INT_TILES(Q5_1)

/* All M rows against every strip of Ŵ into y (M, N); threads split the strips. */
#define STRIPS(T)                                                                                     \
    static void CAT(strips, T)(const void *acts, int64_t M, const uint8_t *W, int64_t N, int64_t K, float *y) { \
        _Pragma("omp parallel for schedule(static)")                                                  \
        for (int64_t n0 = 0; n0 < N; n0 += STRIP) {                                                   \
            const int64_t rn = N - n0 < STRIP ? N - n0 : STRIP;                                       \
            for (int64_t m0 = 0; m0 < M; m0 += STRIP_ROWS) {                                          \
                switch (M - m0 < STRIP_ROWS ? M - m0 : STRIP_ROWS) {                                  \
                    case 1: strip(T, acts, m0, 1, W, n0, rn, N, K, y); break;                         \
                    case 2: strip(T, acts, m0, 2, W, n0, rn, N, K, y); break;                         \
                    case 3: strip(T, acts, m0, 3, W, n0, rn, N, K, y); break;                         \
                    default: strip(T, acts, m0, STRIP_ROWS, W, n0, rn, N, K, y); break;               \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    }
STRIPS(Q8_0)
STRIPS(Q4_0)
STRIPS(Q4_1)
STRIPS(Q5_0)
STRIPS(Q5_1)

/* All M rows on the integer panels into y (M, N); threads split the panels. Returns −1 where a
 * buffer could not be allocated, else 0. */
static int tiles(const int type, const void *acts, int64_t M, const uint8_t *W, int64_t N, int64_t K, float *y) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const size_t scales = sizeof(float) * (size_t)(K / 32 * PANEL);
        IntPanel p = {aligned_alloc(64, (size_t)(2 * K * PANEL)), aligned_alloc(64, scales), aligned_alloc(64, scales)};
        float *out = aligned_alloc(64, sizeof(float) * IR * PANEL);
        failed = !p.u || !p.d || !p.m || !out;
        for (int64_t j = panels * t / threads; !failed && j < panels * (t + 1) / threads; j++) {
            const int64_t n0 = j * PANEL, rn = N - n0 < PANEL ? N - n0 : PANEL;
            int_panel(type, W, n0, rn, K, &p);
            prefetch_panel(W, j + 1 < panels * (t + 1) / threads ? n0 + PANEL : N, N, K * LAYOUTS[type].bytes / 32);
            switch (type) {
                case Q8_0: int_tiles_Q8_0(&p, acts, M, K, out, n0, rn, N, y); break;
                case Q4_0: int_tiles_Q4_0(&p, acts, M, K, out, n0, rn, N, y); break;
                case Q4_1: int_tiles_Q4_1(&p, acts, M, K, out, n0, rn, N, y); break;
                case Q5_0: int_tiles_Q5_0(&p, acts, M, K, out, n0, rn, N, y); break;
                case Q5_1: int_tiles_Q5_1(&p, acts, M, K, out, n0, rn, N, y); break;
            }
        }
        free(p.u), free(p.d), free(p.m), free(out);
    }
    return failed ? -1 : 0;
}

/* y (M, N) = x (M, K) Ŵᵀ, Ŵ (N, K) in blocks of a quantized `type`, in the integer tiles'
 * arithmetic: on the panels, or (`strips`) on STRIP output rows at a time read from the blocks;
 * x and y float32, or bfloat16 where x_bf16 (y rounded once). Returns −1 where a buffer could
 * not be allocated, else 0. */
static int quantized_products(int strips, int type, const void *x, int x_bf16, int64_t M, const uint8_t *W,
                              int64_t N, int64_t K, void *y) {
    const size_t acts_bytes = QUANTIZED_BYTES(type, M, K);
    char *buffer = malloc(acts_bytes + (x_bf16 ? sizeof(float) * (size_t)(M * N) : 0));
    if (buffer == NULL) return -1;
    QuantizedActs q;
    const void *acts = quantize(type, x, x_bf16, M, K, buffer, strips, &q);
    float *out_y = x_bf16 ? (float *)(buffer + acts_bytes) : y;
    int failed = 0;
    if (!strips) failed = tiles(type, acts, M, W, N, K, out_y);
    else switch (type) {
        case Q8_0: strips_Q8_0(acts, M, W, N, K, out_y); break;
        case Q4_0: strips_Q4_0(acts, M, W, N, K, out_y); break;
        case Q4_1: strips_Q4_1(acts, M, W, N, K, out_y); break;
        case Q5_0: strips_Q5_0(acts, M, W, N, K, out_y); break;
        case Q5_1: strips_Q5_1(acts, M, W, N, K, out_y); break;
    }
    if (!failed) store(out_y, x_bf16, M * N, y);
    free(buffer);
    return failed;
}

int FN(block_tiles)(int type, const void *x, int x_bf16, int64_t M, const uint8_t *W, int64_t N, int64_t K,
                    void *y) {
    return quantized_products(0, type, x, x_bf16, M, W, N, K, y);
}

int FN(block_strips)(int type, const void *x, int x_bf16, int64_t M, const uint8_t *W, int64_t N, int64_t K,
                     void *y) {
    return quantized_products(1, type, x, x_bf16, M, W, N, K, y);
}
#else
int FN(block_tiles)(int type, const void *x, int x_bf16, int64_t M, const uint8_t *W, int64_t N, int64_t K,
                    void *y) {
    (void)type, (void)x, (void)x_bf16, (void)M, (void)W, (void)N, (void)K, (void)y;
    return -1; /* the integer panels are AVX-512 VNNI and AVX2 code: block_linear.py asks block_linear_isa first */
}

int FN(block_strips)(int type, const void *x, int x_bf16, int64_t M, const uint8_t *W, int64_t N, int64_t K,
                     void *y) {
    return FN(block_tiles)(type, x, x_bf16, M, W, N, K, y); /* −1: AVX-512 VNNI and AVX2 code, as the panels */
}
#endif

/* y (M, N) = x (M, K) Ŵᵀ, x and y float32, for more rows than the block kernels take: each thread
 * dequantizes a panel of PANEL outputs at a time into its buffer, laid out (K, PANEL) as outer.h's
 * tiles read it (4 · K · PANEL bytes: 192 KiB at K = 1,536 with AVX-512, in L2), and multiplies all
 * M rows by it there, so that every weight is dequantized once per call and never written to memory
 * (on SmolLM2's layers 1.15-1.32× the speed of the weights dequantized whole and a GEMM from 17
 * to 256 rows of Q4_1, benchmarks/README.md). Threads split the panels. Returns −1 where a
 * buffer could not be allocated. */
int FN(block_panels)(int type, const float *x, int64_t M, const uint8_t *W, int64_t N, int64_t K, float *y) {
    const int64_t row_bytes = type == F16 || type == BF16 ? 2 * K : K / 32 * LAYOUTS[type].bytes;
    const int64_t panels = (N + PANEL - 1) / PANEL;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        float *panel = malloc(sizeof(float) * (size_t)(K * PANEL)), *rows = malloc(sizeof(float) * (size_t)(K * PANEL));
        failed = !panel || !rows;
        for (int64_t j = panels * t / threads; !failed && j < panels * (t + 1) / threads; j++) {
            const int64_t n0 = j * PANEL, rn = N - n0 < PANEL ? N - n0 : PANEL;
            for (int64_t i = 0; i < PANEL; i++) {
                if (i < rn) dequantize_row(type, W + (n0 + i) * row_bytes, K, rows + i * K);
                else memset(rows + i * K, 0, sizeof(float) * (size_t)K);
            }
#if ISA > 0
            transpose_panel(rows, K, panel);
#else
            for (int64_t k0 = 0; k0 < K; k0 += 16) /* rows (PANEL, K) → panel (K, PANEL), 16 lines in L1 */
                for (int64_t i = 0; i < PANEL; i++)
                    for (int64_t k = k0; k < k0 + 16 && k < K; k++) panel[k * PANEL + i] = rows[i * K + k];
#endif
            float out[R * PANEL];
            for (int64_t m = 0; m < M; m += R) {
                const int64_t rm = M - m < R ? M - m : R;
                (rm == R ? full_f32 : rm == 1 ? one_f32 : part_f32)(x + m * K, panel, out, rm, K);
                for (int64_t r = 0; r < rm; r++)
                    memcpy(y + (m + r) * N + n0, out + r * PANEL, sizeof(float) * (size_t)rn);
            }
        }
        free(panel);
        free(rows);
    }
    return failed ? -1 : 0;
}
