/* Causal attention of a prefill pass in bfloat16 on Intel AMX tiles (decoderlm.cpu.bf16_attention):
 * out = softmax(Q Kᵀ · scale + M) V for every (batch, head), M causal, aligned bottom-right (query i
 * of Tq sees keys 0 .. Tk − Tq + i), GQA's query head h reading K/V head h / (H / Hkv).
 *
 * Two phases, parallel with OpenMP:
 * 1. Each (batch, K/V head)'s keys and values are laid out once for the tile multiply (TDPBF16PS:
 *    A 16 rows × 32 bfloat16, B 32 × 16 as 16 rows of (column, pair), C 16 × 16 float32):
 *    Kᵀ as B tiles of 16 keys × 32 dims (row r: the 16 keys' dims 2r, 2r + 1), V as B tiles of
 *    32 keys × 16 dims (row r: the 16 dims of keys 2r, 2r + 1); keys past Tk are zeros.
 * 2. Each tile of 16 queries of one head: S = Q Kᵀ over the keys its last query sees (16 × 16 C
 *    tiles, float32 sums of the bfloat16 products), then for each query its softmax in float32,
 *    e_j = exp(s_j · scale − max), l = Σ e_j over its visible keys, P = bf16(e) (zeros for the
 *    keys it may not see), then O = P V over 32 keys a step and out = bf16(O · (1 / l)) — the
 *    rounding points of torch's CPU flash-attention kernel for bfloat16 (exp of the float32 scores,
 *    P rounded for the product, the sum and 1 / l in float32), one pass over the keys since
 *    a row of scores (≤ Tk floats) stays in the cache.
 * Query tiles of a head share its K/V layout from the cache; a query past Tq (the last tile of a
 * length that is not a multiple of 16) is a row of zeros whose output is not stored.
 */
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "softmax_row.h"
#include "vec.h"

#define TILE 512 /* bfloat16 elements of one A or B tile: 16 rows × 64 bytes */

/* Tiles 0-3 (C), 4 (A), 5 and 6 (B), each 16 rows of 64 bytes. */
static void configure(void) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 7; t++) cfg.bytes_per_row[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

/* One (batch, K/V head)'s keys k (Tk rows at stride ks) and values v (stride vs), each row D
 * contiguous bfloat16, laid out for the tiles: kp (Tk32 / 16 blocks × D / 32 tiles), vp (Tk32 / 32
 * blocks × D / 16 tiles), Tk32 = Tk rounded up to 32, zeros past Tk. A K tile's row r is the pair
 * of dims (2r, 2r + 1) of 16 keys: one 32-bit word of each key's row, gathered; a V tile's row r
 * is 16 dims of keys 2r and 2r + 1, interleaved by widening each to 32 bits. */
static void lay_out(const uint16_t *k, const uint16_t *v, int64_t ks, int64_t vs, int64_t Tk, int64_t Tk32,
                    int64_t D, uint16_t *kp, uint16_t *vp) {
    const __m512i keys = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)(ks / 2))); /* word offsets of 16 rows */
    for (int64_t kb = 0; kb < Tk32 / 16; kb++) {
        const __mmask16 real = first(Tk - kb * 16 > 0 ? Tk - kb * 16 : 0);
        for (int64_t dc = 0; dc < D / 32; dc++) {
            uint32_t *tile = (uint32_t *)(kp + (kb * (D / 32) + dc) * TILE); /* [dim pair r][key j] */
            const uint32_t *words = (const uint32_t *)(k + kb * 16 * ks + dc * 32);
            for (int64_t r = 0; r < 16; r++)
                _mm512_storeu_si512(tile + r * 16, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, keys, words + r, 4));
        }
    }
    for (int64_t kc = 0; kc < Tk32 / 32; kc++)
        for (int64_t r = 0; r < 16; r++) {
            const int64_t key = kc * 32 + 2 * r;
            for (int64_t db = 0; db < D / 16; db++) { /* [key pair r][dim d][2] */
                const __m256i even = key < Tk ? _mm256_loadu_si256((const __m256i *)(v + key * vs + db * 16)) : _mm256_setzero_si256();
                const __m256i odd = key + 1 < Tk ? _mm256_loadu_si256((const __m256i *)(v + (key + 1) * vs + db * 16)) : _mm256_setzero_si256();
                const __m512i pairs = _mm512_or_si512(_mm512_cvtepu16_epi32(even), _mm512_slli_epi32(_mm512_cvtepu16_epi32(odd), 16));
                _mm512_storeu_si512(vp + (kc * (D / 16) + db) * TILE + r * 32, pairs);
            }
        }
}

/* C tile c (0-3): the tile number of an AMX instruction is an immediate. */
#define FOR_TILE(c, op)                                                                                            \
    switch (c) {                                                                                                   \
    case 0: op(0); break;                                                                                          \
    case 1: op(1); break;                                                                                          \
    case 2: op(2); break;                                                                                          \
    default: op(3);                                                                                                \
    }

static inline void zero_tiles(int count) {
#define ZERO(c) _tile_zero(c)
    for (int c = 0; c < count; c++) FOR_TILE(c, ZERO)
#undef ZERO
}

/* C tiles 0 .. count − 1 (count ≤ 4) += A · B_c: A (tile 4) loaded once from a, its rows `stride`
 * bytes apart; B_c (tiles 5 and 6 in turns) the tile at b + c · step. */
static inline void multiply(const uint16_t *a, int64_t stride, const uint16_t *b, int64_t step, int count) {
    _tile_loadd(4, a, stride);
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (count > 1) { _tile_loadd(6, b + step, 64); _tile_dpbf16ps(1, 4, 6); }
    if (count > 2) { _tile_loadd(5, b + 2 * step, 64); _tile_dpbf16ps(2, 4, 5); }
    if (count > 3) { _tile_loadd(6, b + 3 * step, 64); _tile_dpbf16ps(3, 4, 6); }
}

/* C tile c (c < count) to the 16 × 16 floats at out + 16 c, rows `stride` bytes apart. */
static inline void store_tiles(float *out, int64_t stride, int count) {
#define STORE(c) _tile_stored(c, out + (c) * 16, stride)
    for (int c = 0; c < count; c++) FOR_TILE(c, STORE)
#undef STORE
}

/* q (B, H, Tq, D), k, v (B, Hkv, Tk, D), out (B, H, Tq, D), bfloat16, at the element strides
 * *_s[0..2] (batch, head, position); each row of D contiguous. D a multiple of 32, Tq ≤ Tk.
 * Returns 0, or 1 where memory for the layouts or a thread's rows could not be had (out unset). */
int prefill_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, int64_t B,
                        int64_t H, int64_t Hkv, int64_t Tq, int64_t Tk, int64_t D, float scale, const int64_t *q_s,
                        const int64_t *k_s, const int64_t *v_s, const int64_t *o_s) {
    const int64_t Tk32 = (Tk + 31) / 32 * 32, per_head = Tk32 * D, tiles_q = (Tq + 15) / 16;
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
        float *s = malloc((size_t)(16 * Tk32) * sizeof(float)), o[16 * 64];
        uint16_t *p = malloc((size_t)(16 * Tk32) * sizeof(uint16_t)), *tail = calloc((size_t)(16 * D), sizeof(uint16_t));
        if (s == NULL || p == NULL || tail == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t bg = 0; bg < B * Hkv; bg++) {
            const int64_t b = bg / Hkv, g = bg % Hkv;
            lay_out(k + b * k_s[0] + g * k_s[1], v + b * v_s[0] + g * v_s[1], k_s[2], v_s[2], Tk, Tk32, D,
                    kp + bg * per_head, vp + bg * per_head);
        }
        if (!failed) {
            configure();
#pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < B * H * tiles_q; w++) {
                const int64_t t = tiles_q - 1 - w / (B * H), bh = w % (B * H); /* the longest tiles first */
                const int64_t b = bh / H, h = bh % H, bg = b * Hkv + h / (H / Hkv);
                const int64_t i0 = t * 16, rows = Tq - i0 < 16 ? Tq - i0 : 16;
                const int64_t seen = Tk - Tq + i0 + rows, width = (seen + 31) / 32 * 32; /* keys the last row sees */
                const uint16_t *qt = q + b * q_s[0] + h * q_s[1] + i0 * q_s[2];
                int64_t q_stride = q_s[2];
                if (rows < 16) { /* the last rows, then zeros */
                    for (int64_t m = 0; m < rows; m++) memcpy(tail + m * D, qt + m * q_s[2], (size_t)D * sizeof(uint16_t));
                    qt = tail, q_stride = D;
                }
                for (int64_t kb = 0; kb < (seen + 15) / 16; kb += 4) { /* S = Q Kᵀ, 64 keys a step */
                    const int count = (seen + 15) / 16 - kb < 4 ? (int)((seen + 15) / 16 - kb) : 4;
                    zero_tiles(count);
                    for (int64_t dc = 0; dc < D / 32; dc++) /* B: 16 keys × 32 dims, the group's tiles D / 32 apart */
                        multiply(qt + dc * 32, q_stride * 2, kp + bg * per_head + (kb * (D / 32) + dc) * TILE, (D / 32) * TILE, count);
                    store_tiles(s + kb * 16, width * 4, count);
                }
                float l[16];
                for (int64_t m = 0; m < 16; m++)
                    if (m < rows) l[m] = softmax_row(s + m * width, p + m * width, Tk - Tq + i0 + m + 1, width, scale);
                    else memset(p + m * width, 0, (size_t)width * sizeof(uint16_t));
                for (int64_t db = 0; db < D / 16; db += 4) { /* O = P V, 64 dims a step */
                    const int count = D / 16 - db < 4 ? (int)(D / 16 - db) : 4;
                    zero_tiles(count);
                    for (int64_t kc = 0; kc < width / 32; kc++) /* B: 32 keys × 16 dims, the group's tiles adjacent */
                        multiply(p + kc * 32, width * 2, vp + bg * per_head + (kc * (D / 16) + db) * TILE, TILE, count);
                    store_tiles(o, count * 64, count);
                    for (int64_t m = 0; m < rows; m++) {
                        uint16_t *row = out + b * o_s[0] + h * o_s[1] + (i0 + m) * o_s[2] + db * 16;
                        const vec inverse = vset(1.0f / l[m]);
                        for (int c = 0; c < count; c++)
                            store_bf16(row + c * 16, vmul(_mm512_loadu_ps(o + (m * count + c) * 16), inverse), LANES);
                    }
                }
            }
            _tile_release();
        }
        free(s);
        free(p);
        free(tail);
    }
    free(kp);
    free(vp);
    return failed;
}
