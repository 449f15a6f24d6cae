/* One-row products y = x Wᵀ for decoding one sequence, which is bound by reading the weights: see
 * gemv.py. W is (N, K) row-major; every function computes y_n = Σ_k x_k W_nk in float32, one
 * output row after another, the rows split over OpenMP threads. Tails of K are read with masked
 * loads, so any N and K work. AVX-512 only: gemv.py builds this file on CPUs that have it. */
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

/* Each thread takes a contiguous run of output rows and reads them one after the other: one
 * sequential stream of weights per thread. (Four rows at a time, each x vector loaded once for the
 * four, read four interleaved streams: on a Zen 4, SmolLM2-135M-shaped products at ~19 GB/s
 * against 26-30 one row at a time; benchmarks/README.md, "One-row kernels".) */
#define FOR_ROWS(ROW)                              \
    _Pragma("omp parallel for schedule(static)")   \
    for (int64_t n = 0; n < N; n++) ROW(n);

/* Two accumulators per row, over alternate vectors of k, hide the latency of the sums. */

/* y_n = Σ_k x_k W_nk; x, W float32. */
INLINE float f32_row(const float *x, const float *w, int64_t K) {
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t k = 0; k < K; k += 32) {
        __mmask16 m0 = tail16(K - k), m1 = tail16(K - k - 16);
        PREFETCH(w + k);  /* the two cache lines this step reads, PREFETCH_BYTES on */
        PREFETCH(w + k + 16);
        acc[0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m0, w + k), _mm512_maskz_loadu_ps(m0, x + k), acc[0]);
        acc[1] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m1, w + k + 16), _mm512_maskz_loadu_ps(m1, x + k + 16), acc[1]);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
}

/* x (K,) float32, W (N, K) float32 → y (N,) float32. */
void gemv_f32(const float *x, const float *W, float *y, int64_t N, int64_t K) {
#define F32_ROW(n) y[n] = f32_row(x, W + (n) * K, K)
    FOR_ROWS(F32_ROW)
}

#ifdef __AVX512BF16__
/* y_n = Σ_k x_k W_nk; x, W bfloat16, pairs of products summed in float32 by vdpbf16ps. */
INLINE float bf16_row(const uint16_t *x, const uint16_t *w, int64_t K) {
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t k = 0; k < K; k += 64) {
        __mmask32 m0 = tail32(K - k), m1 = K - k > 32 ? tail32(K - k - 32) : 0;
        PREFETCH(w + k);  /* the two cache lines this step reads, PREFETCH_BYTES on */
        PREFETCH(w + k + 32);
        acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_maskz_loadu_epi16(m0, w + k),
                                  (__m512bh)_mm512_maskz_loadu_epi16(m0, x + k));
        acc[1] = _mm512_dpbf16_ps(acc[1], (__m512bh)_mm512_maskz_loadu_epi16(m1, w + k + 32),
                                  (__m512bh)_mm512_maskz_loadu_epi16(m1, x + k + 32));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
}

/* x (K,) bfloat16, W (N, K) bfloat16 → y (N,) bfloat16, each sum rounded once. */
void gemv_bf16(const uint16_t *x, const uint16_t *W, uint16_t *y, int64_t N, int64_t K) {
#define BF16_ROW(n) y[n] = to_bf16(bf16_row(x, W + (n) * K, K))
    FOR_ROWS(BF16_ROW)
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

/* Σ_k x_k w_k; x float32, w a row of `bytes`-wide weights that `widen` turns into float32 (int8,
 * or bfloat16). Each call site passes constants, so every variant compiles to its own loop. */
INLINE float widened_row(const float *x, const void *w, const int bytes,
                         __m512 (*widen)(__mmask16, const void *, int64_t), int64_t K) {
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t k = 0; k < K; k += 32) {
        __mmask16 m0 = tail16(K - k), m1 = tail16(K - k - 16);
        PREFETCH((const char *)w + k * bytes);
        acc[0] = _mm512_fmadd_ps(widen(m0, w, k), _mm512_maskz_loadu_ps(m0, x + k), acc[0]);
        acc[1] = _mm512_fmadd_ps(widen(m1, w, k + 16), _mm512_maskz_loadu_ps(m1, x + k + 16), acc[1]);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
}

/* x (K,) float32, W (N, K) bfloat16 → y (N,) float32: the products and sums of F.linear on the
 * float32 copy of W. */
void gemv_f32_bf16(const float *x, const uint16_t *W, float *y, int64_t N, int64_t K) {
#define F32_BF16_ROW(n) y[n] = widened_row(x, W + (n) * K, 2, widen_bf16, K)
    FOR_ROWS(F32_BF16_ROW)
}

/* x (K,) float32, W (N, K) int8, s (N,) float32 → y (N,) float32. */
void gemv_int8_f32(const float *x, const int8_t *W, const float *s, float *y, int64_t N, int64_t K) {
#define INT8_F32_ROW(n) y[n] = s[n] * widened_row(x, W + (n) * K, 1, widen_int8, K)
    FOR_ROWS(INT8_F32_ROW)
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
#define INT8_BF16_ROW(n) y[n] = to_bf16(s[n] * widened_row(xf, W + (n) * K, 1, widen_int8, K))
    FOR_ROWS(INT8_BF16_ROW)
    free(xf);
    return 0;
}

#endif
