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

static inline float from_f32(float x) { return x; }
static inline float to_f32(float x) { return x; }

static inline float from_bf16(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16; /* bfloat16 is the top half of a float32 */
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

#define MAX_D 512 /* the largest head_dim */

#define DECODE_ATTENTION(NAME, T, LOAD, STORE)                                                     \
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
            float *scores = malloc(sizeof(float) * (size_t)longest);                               \
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
                    const int64_t lo = t0 > t_first ? t0 : t_first;                                \
                    const int64_t end = t0 + block_size < n ? t0 + block_size : n;                 \
                    for (int64_t t = lo; t < end; t++) {                                           \
                        const T *kt = kb + (t - t0) * token_stride;                                \
                        float s = 0.f;                                                             \
                        _Pragma("omp simd reduction(+ : s)") for (int64_t d = 0; d < D; d++) s +=  \
                            qf[d] * LOAD(kt[d]);                                                   \
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
                    const T *vb = v + block * block_stride + h * head_stride;                      \
                    const int64_t lo = t0 > t_first ? t0 : t_first;                                \
                    const int64_t end = t0 + block_size < n ? t0 + block_size : n;                 \
                    for (int64_t t = lo; t < end; t++) {                                           \
                        const T *vt = vb + (t - t0) * token_stride;                                \
                        const float w = scores[t];                                                 \
                        _Pragma("omp simd") for (int64_t d = 0; d < D; d++) acc[d] +=              \
                            w * LOAD(vt[d]);                                                       \
                    }                                                                              \
                }                                                                                  \
                const float inverse = 1.f / total;                                                 \
                for (int64_t d = 0; d < D; d++) out[p * D + d] = STORE(acc[d] * inverse);          \
            }                                                                                      \
            free(scores);                                                                          \
        }                                                                                          \
        return failed ? -1 : 0;                                                                    \
    }

DECODE_ATTENTION(decode_attention_f32, float, from_f32, to_f32)
DECODE_ATTENTION(decode_attention_bf16, uint16_t, from_bf16, to_bf16)
