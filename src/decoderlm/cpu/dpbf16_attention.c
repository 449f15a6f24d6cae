/* Causal attention of a prefill pass in bfloat16 on AVX512-BF16's VDPBF16PS, for CPUs without AMX
 * tiles (decoderlm.cpu.bf16_attention): out = softmax(Q Kᵀ · scale + M) V as amx_attention.c
 * computes it, M causal, aligned bottom-right (query i of Tq sees keys 0 .. Tk − Tq + i), GQA's
 * query head h reading K/V head h / (H / Hkv), the tile multiplies replaced by the register-blocked
 * product of dpbf16.h.
 *
 * Two phases, parallel with OpenMP:
 * 1. Each (batch, K/V head)'s keys and values are laid out once in the pairs dpbf16.h reads: K as
 *    Tk16 / 16 blocks of 16 keys × D / 2 pairs of dims (block kb, pair r: dims 2r, 2r + 1 of keys
 *    16kb .. 16kb + 15), V as D / 16 blocks of 16 dims × Tk16 / 2 pairs of keys (block db, pair
 *    r: dims 16db .. 16db + 15 of keys 2r, 2r + 1); Tk16 = Tk rounded up to 16, zeros past Tk.
 * 2. Each group of ROWS queries of one head: S = Q Kᵀ over the keys its last query sees (float32
 *    sums of the bfloat16 products), each query's softmax (softmax_row.h: P = bf16(e), zeros for
 *    the keys it may not see, l in float32), then O = P V over those keys and out = bf16(O · (1 /
 *    l)). A group's queries past Tq are rows of zeros whose output is not stored.
 */
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dpbf16.h"
#include "softmax_row.h"
#include "vec.h"

/* One (batch, K/V head)'s keys k (Tk rows at stride ks, an even number of elements) and values v
 * (stride vs), each row D contiguous bfloat16, laid out as above: kp (Tk16 · D), vp (D · Tk16). A
 * pair of a key's dims is one 32-bit word of its row, gathered for 16 keys; a pair of keys' dims is
 * interleaved by widening each to 32 bits. */
static void lay_out(const uint16_t *k, const uint16_t *v, int64_t ks, int64_t vs, int64_t Tk, int64_t Tk16,
                    int64_t D, uint16_t *kp, uint16_t *vp) {
    const __m512i keys = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)(ks / 2))); /* word offsets of 16 rows */
    for (int64_t kb = 0; kb < Tk16 / 16; kb++) {
        const __mmask16 real = first(Tk - kb * 16);
        const uint32_t *words = (const uint32_t *)(k + kb * 16 * ks);
        for (int64_t r = 0; r < D / 2; r++)
            _mm512_storeu_si512(kp + (kb * (D / 2) + r) * 32,
                                _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, keys, words + r, 4));
    }
    for (int64_t r = 0; r < Tk16 / 2; r++) {
        const int64_t key = 2 * r;
        for (int64_t db = 0; db < D / 16; db++) {
            const __m256i even = key < Tk ? _mm256_loadu_si256((const __m256i *)(v + key * vs + db * 16)) : _mm256_setzero_si256();
            const __m256i odd = key + 1 < Tk ? _mm256_loadu_si256((const __m256i *)(v + (key + 1) * vs + db * 16)) : _mm256_setzero_si256();
            const __m512i pairs = _mm512_or_si512(_mm512_cvtepu16_epi32(even), _mm512_slli_epi32(_mm512_cvtepu16_epi32(odd), 16));
            _mm512_storeu_si512(vp + (db * (Tk16 / 2) + r) * 32, pairs);
        }
    }
}

/* acc = ROWS rows of x (x_stride apart) against `count` ≤ BLOCKS blocks from wb, over `pairs`:
 * the block count made a constant for dot_group. */
static void dot_blocks(const uint16_t *x, int64_t x_stride, int64_t pairs, const uint16_t *wb, int64_t w_stride,
                       int count, __m512 acc[ROWS][BLOCKS]) {
    switch (count) {
    case 1: dot_group(x, x_stride, pairs, wb, w_stride, ROWS, 1, 0, acc); break;
    case 2: dot_group(x, x_stride, pairs, wb, w_stride, ROWS, 2, 0, acc); break;
    case 3: dot_group(x, x_stride, pairs, wb, w_stride, ROWS, 3, 0, acc); break;
    default: dot_group(x, x_stride, pairs, wb, w_stride, ROWS, BLOCKS, 0, acc);
    }
}

/* q (B, H, Tq, D), k, v (B, Hkv, Tk, D), out (B, H, Tq, D), bfloat16, at the element strides
 * *_s[0..2] (batch, head, position); each row of D contiguous. D a multiple of 16, Tq ≤ Tk.
 * Returns 0, or 1 where memory for the layouts or a thread's rows could not be had (out unset). */
int prefill_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, int64_t B,
                           int64_t H, int64_t Hkv, int64_t Tq, int64_t Tk, int64_t D, float scale, const int64_t *q_s,
                           const int64_t *k_s, const int64_t *v_s, const int64_t *o_s) {
    const int64_t Tk16 = (Tk + 15) / 16 * 16, per_head = Tk16 * D, groups = (Tq + ROWS - 1) / ROWS;
    uint16_t *kp = malloc((size_t)(B * Hkv * per_head) * sizeof(uint16_t));
    uint16_t *vp = malloc((size_t)(B * Hkv * per_head) * sizeof(uint16_t));
    int failed = 0;
    if (kp == NULL || vp == NULL) {
        free(kp);
        free(vp);
        return 1;
    }
#pragma omp parallel
    {
        float *s = malloc((size_t)(ROWS * Tk16) * sizeof(float));
        uint16_t *p = malloc((size_t)(ROWS * Tk16) * sizeof(uint16_t)), *tail = calloc((size_t)(ROWS * D), sizeof(uint16_t));
        if (s == NULL || p == NULL || tail == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t bg = 0; bg < B * Hkv; bg++) {
            const int64_t b = bg / Hkv, g = bg % Hkv;
            lay_out(k + b * k_s[0] + g * k_s[1], v + b * v_s[0] + g * v_s[1], k_s[2], v_s[2], Tk, Tk16, D,
                    kp + bg * per_head, vp + bg * per_head);
        }
        if (!failed) {
            __m512 acc[ROWS][BLOCKS];
#pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < B * H * groups; w++) {
                const int64_t t = groups - 1 - w / (B * H), bh = w % (B * H); /* the longest groups first */
                const int64_t b = bh / H, h = bh % H, bg = b * Hkv + h / (H / Hkv);
                const int64_t i0 = t * ROWS, rows = Tq - i0 < ROWS ? Tq - i0 : ROWS;
                const int64_t seen = Tk - Tq + i0 + rows, width = (seen + 15) / 16 * 16; /* keys the last row sees */
                const uint16_t *qt = q + b * q_s[0] + h * q_s[1] + i0 * q_s[2], *kh = kp + bg * per_head;
                int64_t q_stride = q_s[2];
                if (rows < ROWS) { /* the last rows, then zeros */
                    for (int64_t m = 0; m < rows; m++) memcpy(tail + m * D, qt + m * q_s[2], (size_t)D * sizeof(uint16_t));
                    qt = tail, q_stride = D;
                }
                for (int64_t kb = 0; kb < width / 16; kb += BLOCKS) { /* S = Q Kᵀ, 64 keys a step */
                    const int count = width / 16 - kb < BLOCKS ? (int)(width / 16 - kb) : BLOCKS;
                    dot_blocks(qt, q_stride, D / 2, kh + kb * 16 * D, 16 * D, count, acc);
                    for (int64_t m = 0; m < ROWS; m++)
                        for (int c = 0; c < count; c++) _mm512_storeu_ps(s + m * width + (kb + c) * 16, acc[m][c]);
                }
                float l[ROWS];
                for (int64_t m = 0; m < ROWS; m++)
                    if (m < rows) l[m] = softmax_row(s + m * width, p + m * width, Tk - Tq + i0 + m + 1, width, scale);
                    else memset(p + m * width, 0, (size_t)width * sizeof(uint16_t));
                for (int64_t db = 0; db < D / 16; db += BLOCKS) { /* O = P V, 64 dims a step */
                    const int count = D / 16 - db < BLOCKS ? (int)(D / 16 - db) : BLOCKS;
                    dot_blocks(p, width, width / 2, vp + bg * per_head + db * 16 * Tk16, 16 * Tk16, count, acc);
                    for (int64_t m = 0; m < rows; m++) {
                        uint16_t *row = out + b * o_s[0] + h * o_s[1] + (i0 + m) * o_s[2] + db * 16;
                        const vec inverse = vset(1.0f / l[m]);
                        for (int c = 0; c < count; c++) store_bf16(row + c * 16, vmul(acc[m][c], inverse), LANES);
                    }
                }
            }
        }
        free(s);
        free(p);
        free(tail);
    }
    free(kp);
    free(vp);
    return failed;
}
