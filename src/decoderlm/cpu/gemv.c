/* One-row products y = x Wᵀ for decoding one sequence, which is bound by reading the weights: see
 * gemv.py. W is (N, K) row-major; every function computes y_n = Σ_k x_k W_nk in float32, four
 * output rows at a time (each x vector loaded once for the four), the blocks of rows split over
 * OpenMP threads. Tails of K are read with masked loads, so any N and K work. AVX-512 only:
 * gemv.py builds this file on CPUs that have it. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#ifdef __AVX512F__

#define INLINE static inline __attribute__((always_inline))

/* Each row's weights are prefetched this far ahead of the loads: the hardware prefetcher alone
 * ramps up too slowly for matrices of a few hundred KB. Not a multiple of 4 KiB: at 4, 8 and
 * 12 KiB the bfloat16 kernel read its weights ~20% slower than at 5 or 6 KiB (benchmarks/README.md,
 * llama_cpp.py, has the distances measured). Prefetches past the end of W do not fault. */
#define PREFETCH_BYTES 6144
#define PREFETCH(p) _mm_prefetch((const char *)(p) + PREFETCH_BYTES, _MM_HINT_T0)

/* float32 → bfloat16, rounding to nearest even (finite inputs). */
INLINE uint16_t to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    return (uint16_t)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);
}

INLINE __mmask16 tail16(int64_t left) {
    return left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

INLINE __mmask32 tail32(int64_t left) {
    return left >= 32 ? 0xffffffffu : (__mmask32)((1u << left) - 1);
}

/* Blocks of four rows, then the last N mod 4 one at a time; ROWS is a constant in each call of
 * BLOCK, so the accumulators stay in registers. */
#define FOR_ROW_BLOCKS(BLOCK)                                  \
    _Pragma("omp parallel for schedule(static)")               \
    for (int64_t n0 = 0; n0 < N; n0 += 4) {                    \
        if (N - n0 >= 4) BLOCK(n0, 4);                         \
        else for (int64_t n = n0; n < N; n++) BLOCK(n, 1);     \
    }

/* y_n = Σ_k x_k W_nk for rows n0..n0+rows−1; x, W float32. */
INLINE void f32_block(const float *x, const float *W, float *y, int64_t n0, int64_t K, const int rows) {
    __m512 acc[4];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __mmask16 m = tail16(K - k);
        __m512 xv = _mm512_maskz_loadu_ps(m, x + k);
        for (int r = 0; r < rows; r++) {
            PREFETCH(W + (n0 + r) * K + k);
            acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, W + (n0 + r) * K + k), xv, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) y[n0 + r] = _mm512_reduce_add_ps(acc[r]);
}

/* x (K,) float32, W (N, K) float32 → y (N,) float32. */
void gemv_f32(const float *x, const float *W, float *y, int64_t N, int64_t K) {
#define F32_BLOCK(n, rows) f32_block(x, W, y, n, K, rows)
    FOR_ROW_BLOCKS(F32_BLOCK)
}

#ifdef __AVX512BF16__
/* y_n = Σ_k x_k W_nk, rounded to bfloat16; x, W bfloat16, pairs of products summed in float32
 * by vdpbf16ps. */
INLINE void bf16_block(const uint16_t *x, const uint16_t *W, uint16_t *y, int64_t n0, int64_t K, const int rows) {
    __m512 acc[4];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __mmask32 m = tail32(K - k);
        __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + k);
        for (int r = 0; r < rows; r++) {
            PREFETCH(W + (n0 + r) * K + k);
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_maskz_loadu_epi16(m, W + (n0 + r) * K + k), xv);
        }
    }
    for (int r = 0; r < rows; r++) y[n0 + r] = to_bf16(_mm512_reduce_add_ps(acc[r]));
}

/* x (K,) bfloat16, W (N, K) bfloat16 → y (N,) bfloat16. */
void gemv_bf16(const uint16_t *x, const uint16_t *W, uint16_t *y, int64_t N, int64_t K) {
#define BF16_BLOCK(n, rows) bf16_block(x, W, y, n, K, rows)
    FOR_ROW_BLOCKS(BF16_BLOCK)
}
#endif

/* 16 weights of row w from input k on (m of them valid), widened to float32: exact. */
INLINE __m512 widen_int8(__mmask16 m, const void *w, int64_t k) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, (const int8_t *)w + k)));
}

INLINE __m512 widen_bf16(__mmask16 m, const void *w, int64_t k) {  /* the bits shifted up */
    __m256i bits = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* y_n = s_n Σ_k x_k W_nk; x float32, W of `bytes`-wide weights that `widen` turns into float32
 * (int8, or bfloat16), s NULL for 1, y float32 or (bf16_out) bfloat16. Two accumulators per row,
 * over alternate 16s of k, hide the conversions' latency. Each call site passes constants, so
 * every variant compiles to its own loop. */
INLINE void widened_block(const float *x, const void *W, const int bytes,
                          __m512 (*widen)(__mmask16, const void *, int64_t), const float *s, void *y,
                          int64_t n0, int64_t K, const int rows, const int bf16_out) {
    __m512 acc[8];
    for (int r = 0; r < 2 * rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __mmask16 m0 = tail16(K - k), m1 = tail16(K - k - 16);
        __m512 x0 = _mm512_maskz_loadu_ps(m0, x + k), x1 = _mm512_maskz_loadu_ps(m1, x + k + 16);
        for (int r = 0; r < rows; r++) {
            const char *w = (const char *)W + (n0 + r) * K * bytes;
            PREFETCH(w + k * bytes);
            acc[2 * r] = _mm512_fmadd_ps(widen(m0, w, k), x0, acc[2 * r]);
            acc[2 * r + 1] = _mm512_fmadd_ps(widen(m1, w, k + 16), x1, acc[2 * r + 1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float v = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * r], acc[2 * r + 1]));
        if (s != NULL) v *= s[n0 + r];
        if (bf16_out) ((uint16_t *)y)[n0 + r] = to_bf16(v);
        else ((float *)y)[n0 + r] = v;
    }
}

/* x (K,) float32, W (N, K) bfloat16 → y (N,) float32: the products and sums of F.linear on the
 * float32 copy of W. */
void gemv_f32_bf16(const float *x, const uint16_t *W, float *y, int64_t N, int64_t K) {
#define F32_BF16_BLOCK(n, rows) widened_block(x, W, 2, widen_bf16, NULL, y, n, K, rows, 0)
    FOR_ROW_BLOCKS(F32_BF16_BLOCK)
}

/* x (K,) float32, W (N, K) int8, s (N,) float32 → y (N,) float32. */
void gemv_int8_f32(const float *x, const int8_t *W, const float *s, float *y, int64_t N, int64_t K) {
#define INT8_F32_BLOCK(n, rows) widened_block(x, W, 1, widen_int8, s, y, n, K, rows, 0)
    FOR_ROW_BLOCKS(INT8_F32_BLOCK)
}

/* As gemv_int8_f32 for bfloat16 x and y: x widened to float32 first (exact), each y rounded once.
 * Returns -1 without the memory for the widened x, else 0. */
int gemv_int8_bf16(const uint16_t *x, const int8_t *W, const float *s, uint16_t *y, int64_t N, int64_t K) {
    float *xf = malloc(sizeof(float) * (size_t)K);
    if (xf == NULL) return -1;
    for (int64_t k = 0; k < K; k++) {
        union { uint32_t u; float f; } v = {(uint32_t)x[k] << 16};
        xf[k] = v.f;
    }
#define INT8_BF16_BLOCK(n, rows) widened_block(xf, W, 1, widen_int8, s, y, n, K, rows, 1)
    FOR_ROW_BLOCKS(INT8_BF16_BLOCK)
    free(xf);
    return 0;
}

#endif
