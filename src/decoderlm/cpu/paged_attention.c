/* Decode attention read in place from a KV cache (decoderlm.cpu.paged_attention).
 *
 * One query token per row: out[b, h] = softmax(q[b, h] · K_bᵀ · scale) V_b, where K_b / V_b are
 * row b's keys / values first[b] .. lengths[b] − 1, stored in the blocks table[b, 0],
 * table[b, 1], ... (block_size tokens each). Nothing is gathered: each key and value row is read
 * once, where it lies, and converted to float32 on the fly; scores, softmax and the weighted sum
 * are in float32.
 *
 * Layouts, by strides (in elements): key t of K/V head h in block j starts at
 * k + j · block_stride + h · head_stride + t · token_stride. The paged pool (num_blocks,
 * block_size, Hkv, D) has (block_size · Hkv · D, D, Hkv · D); the static cache (B, Hkv, S, D) is
 * one block of S tokens per row, (Hkv · S · D, S · D, D), with table NULL (row b's block is b).
 * first NULL: every row starts at key 0. q, out (B, H, D) and table (B, W), first, lengths (B,)
 * int64 are contiguous. Query head hq reads K/V head hq / (H / Hkv) (MHA, GQA and MQA).
 * Parallel over (row, query head) with OpenMP: the runtime torch itself loaded, so its threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

static inline float from_f32(float x) { return x; }
static inline float to_f32(float x) { return x; }

#define MAX_D 512 /* the largest head_dim */

/* Per key: its score q·k_t (the query already scaled) and o += p_t v_t, float32 throughout. With
 * AVX-512, 16 dimensions per instruction, the rest one by one (all of them without AVX-512): left
 * to the compiler, these loops over a head_dim known only at run time came out scalar. */
#ifdef __AVX512F__
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t *p) { /* bfloat16 → the top half of float32 */
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#define DOT16(LOAD16, q, k, D, d, s)                                                               \
    {                                                                                              \
        __m512 sum16 = _mm512_setzero_ps();                                                        \
        for (; d + 16 <= D; d += 16) sum16 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), LOAD16(k + d), sum16); \
        s = _mm512_reduce_add_ps(sum16);                                                           \
    }
#define AXPY16(LOAD16, w, x, y, D, d)                                                              \
    {                                                                                              \
        const __m512 w16 = _mm512_set1_ps(w);                                                      \
        for (; d + 16 <= D; d += 16)                                                               \
            _mm512_storeu_ps(y + d, _mm512_fmadd_ps(w16, LOAD16(x + d), _mm512_loadu_ps(y + d)));   \
    }
#else
#define DOT16(LOAD16, q, k, D, d, s)
#define AXPY16(LOAD16, w, x, y, D, d)
#endif

#define KEY_OPS(SUFFIX, T, LOAD)                                                                   \
    static inline float dot_##SUFFIX(const float *q, const T *k, int64_t D) {                      \
        int64_t d = 0;                                                                             \
        float s = 0.f;                                                                             \
        DOT16(load16_##SUFFIX, q, k, D, d, s)                                                      \
        for (; d < D; d++) s += q[d] * LOAD(k[d]);                                                 \
        return s;                                                                                  \
    }                                                                                              \
    static inline void axpy_##SUFFIX(float w, const T *x, float *y, int64_t D) {                   \
        int64_t d = 0;                                                                             \
        AXPY16(load16_##SUFFIX, w, x, y, D, d)                                                     \
        for (; d < D; d++) y[d] += w * LOAD(x[d]);                                                 \
    }

KEY_OPS(f32, float, from_f32)
KEY_OPS(bf16, uint16_t, from_bf16)

/* The pool's blocks lie anywhere, so the hardware prefetcher cannot follow a row's keys from one
 * block to the next, and within a block of the paged layout one head reads only D of every
 * Hkv · D values: each token's row of this head is prefetched one block ahead, from the row's next
 * block (none in the static layout, whose rows are one block each). */
static inline void prefetch(const void *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i, 0, 3);
}
/* Block j + 1 of row b (at this head) in pool X, or NULL where the row ends within block j. */
#define NEXT_BLOCK(X)                                                                              \
    (table && (j + 1) * block_size < n ? X + table[b * W + j + 1] * block_stride + h * head_stride \
                                       : NULL)

#define DECODE_ATTENTION(NAME, SUFFIX, T, LOAD, STORE)                                             \
    int NAME(const T *q, const T *k, const T *v, const int64_t *table, const int64_t *first,       \
             const int64_t *lengths, T *out, int64_t B, int64_t H, int64_t Hkv, int64_t D,         \
             int64_t block_size, int64_t W, int64_t block_stride, int64_t head_stride,             \
             int64_t token_stride, float scale) {                                                  \
        const int64_t G = H / Hkv; /* query heads per K/V head */                                  \
        if (D > MAX_D) return -2;                                                                  \
        int64_t longest = 0;                                                                       \
        for (int64_t b = 0; b < B; b++) longest = lengths[b] > longest ? lengths[b] : longest;     \
        int failed = 0;                                                                            \
        _Pragma("omp parallel") {                                                                  \
            /* 64-byte aligned in every thread: the vectorised sum of the exponentials below then \
             * splits its loop the same way whichever thread computes a row (its order of sums \
             * does not depend on the batch: `Engine(batch_invariant=True)`) */                 \
            float *scores = aligned_alloc(64, (sizeof(float) * (size_t)longest + 63) / 64 * 64);   \
            if (scores == NULL) failed = 1;                                                        \
            _Pragma("omp for schedule(static)") for (int64_t p = 0; p < B * H; p++) {              \
                if (scores == NULL) continue;                                                      \
                const int64_t b = p / H, h = (p % H) / G, n = lengths[b];                          \
                const int64_t t_first = first ? first[b] : 0;                                      \
                const int64_t j_first = t_first / block_size; /* the block holding key t_first */  \
                float qf[MAX_D], acc[MAX_D], top = -3.0e38f;                                       \
                for (int64_t d = 0; d < D; d++) qf[d] = LOAD(q[p * D + d]) * scale;                \
                for (int64_t j = j_first; j * block_size < n; j++) { /* s_t = q·k_t · scale */    \
                    const int64_t block = table ? table[b * W + j] : b, t0 = j * block_size;       \
                    const T *kb = k + block * block_stride + h * head_stride;                      \
                    const T *kn = NEXT_BLOCK(k);                                                   \
                    const int64_t lo = t0 > t_first ? t0 : t_first;                                \
                    const int64_t end = t0 + block_size < n ? t0 + block_size : n;                 \
                    for (int64_t t = lo; t < end; t++) {                                           \
                        if (kn) prefetch(kn + (t - t0) * token_stride, D * (int64_t)sizeof(T));    \
                        const float s = dot_##SUFFIX(qf, kb + (t - t0) * token_stride, D);         \
                        scores[t] = s;                                                             \
                        top = s > top ? s : top;                                                   \
                    }                                                                              \
                }                                                                                  \
                float total = 0.f; /* p_t = exp(s_t − max s) / Σ_t exp(s_t − max s) */             \
                _Pragma("omp simd reduction(+ : total)") for (int64_t t = t_first; t < n; t++) {   \
                    scores[t] = expf(scores[t] - top);                                             \
                    total += scores[t];                                                            \
                }                                                                                  \
                for (int64_t d = 0; d < D; d++) acc[d] = 0.f;                                      \
                for (int64_t j = j_first; j * block_size < n; j++) { /* o = Σ_t p_t v_t */        \
                    const int64_t block = table ? table[b * W + j] : b, t0 = j * block_size;       \
                    const T *vb = v + block * block_stride + h * head_stride, *vn = NEXT_BLOCK(v);  \
                    const int64_t lo = t0 > t_first ? t0 : t_first;                                \
                    const int64_t end = t0 + block_size < n ? t0 + block_size : n;                 \
                    for (int64_t t = lo; t < end; t++) {                                           \
                        if (vn) prefetch(vn + (t - t0) * token_stride, D * (int64_t)sizeof(T));    \
                        axpy_##SUFFIX(scores[t], vb + (t - t0) * token_stride, acc, D);            \
                    }                                                                              \
                }                                                                                  \
                const float inverse = 1.f / total;                                                 \
                for (int64_t d = 0; d < D; d++) out[p * D + d] = STORE(acc[d] * inverse);          \
            }                                                                                      \
            free(scores);                                                                          \
        }                                                                                          \
        return failed ? -1 : 0;                                                                    \
    }

DECODE_ATTENTION(decode_attention_f32, f32, float, from_f32, to_f32)
DECODE_ATTENTION(decode_attention_bf16, bf16, uint16_t, from_bf16, to_bf16)
