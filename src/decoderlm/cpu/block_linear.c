/* Products y = x Ŵᵀ of a few rows (block_panels.c takes many) with Ŵ in ggml's block formats,
 * computed from the blocks as a GGUF file stores them (see block_linear.py for the arithmetic and the formats' layouts, quant/blocks.py for the
 * formats). x is (M, K) float32 or bfloat16, Ŵ (N, K) rows of blocks, y (M, N) in x's dtype.
 *
 * This file is compiled once per instruction set, each build naming its functions after VARIANT
 * (block_linear_native, …): ISA says what the build's flags allow: 2 = AVX-512 with VNNI (BW, VL),
 * 1 = AVX2 with FMA and F16C, 0 = portable C. The Python side calls the variant it picks.
 *
 * Q8_0 weights: each block of 32 activations is rounded to int16, x_j ≈ e c_j, e = max|x| / 32767,
 * c = round(x / e) (|x_j − e c_j| ≤ e / 2); a block's dot product with the weights' int8 q_j,
 * widened to int16, is summed exactly in int32 (AVX-512 VNNI's vpdpwssd, AVX2's vpmaddwd) and
 * scaled once by d · e in float32:
 *     y = Σ_blocks d e Σ_j q_j c_j
 * 4- and 5-bit weights (Q4_0, Q4_1, Q5_0, Q5_1): each block of 32 activations is quantized to
 * two int8 vectors, x_j ≈ e (256 a_j + b_j), e = max|x| / (127 · 256), a = round(x / 256e),
 * b = round(x / e − 256 a) ∈ [−127, 127] (|x_j − e(256 a_j + b_j)| ≤ e); a block's dot product
 * with the weights' integers q_j is then 256 Σ q_j a_j + Σ q_j b_j, summed exactly in int32 (VNNI's
 * vpdpbusd; AVX2's vpmaddwd against c = 256 a + b as one int16 for the 4-bit types, vpmaddubsw +
 * vpmaddwd against a and b apart for the 5-bit ones), and scaled once by d · e in float32:
 *     y = Σ_blocks d e (Σ_j (q_j − z) (256 a_j + b_j)) + m Σ_j x_j
 * (z the type's zero point, m the _1 types' minimum, Σ_j x_j the float sum of the block's inputs).
 * The SIMD code feeds their integers as unsigned bytes, 64 to a vpdpbusd, and subtracts
 * z Σ_j (256 a_j + b_j) after. Q8_0's signed bytes would need that correction too: widened to
 * int16 instead, one vpdpwssd takes a block with none, for half the activations' error (a
 * 1536 × 576 product in cache, one thread of a Zen 4: 37 µs against 42 as two int8).
 * F16 and BF16 weights, and decoderlm.quant's Int8Linear and Int4Linear (`int_linear`), are
 * widened to float32 and summed by FMA. Threads split the output rows (OpenMP, torch's thread
 * count). */
#include "blocks.h"

/* Rows of four x rows at most; ROWS is a constant in each call, so the accumulators stay in registers.
 * Each kernel computes y[r][n] for x rows m0 .. m0 + ROWS − 1 and one output row n. */
#define MAX_ROWS 4

#if ISA == 2
/* The scales d of blocks b0 and b1 in lanes 0-7 and 8-15 (the lanes of their dot products), and
 * in *dm [d0, m0, d1, m1] (the minimums m; zeros where the type has none). */
INLINE __m512 halves_pair(const uint8_t *b0, const uint8_t *b1, __m128 *dm, const int has_min) {
    __m128i halves = _mm_insert_epi32(_mm_cvtsi32_si128((int)load32(b0)), (int)load32(b1), 1);
    if (!has_min) halves = _mm_and_si128(halves, _mm_set1_epi32(0xffff));  /* bytes 2-3: not a minimum */
    *dm = _mm_cvtph_ps(halves);
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
                                 _mm512_castps128_ps512(*dm));
}

/* Adds blocks blk and blk + 1 of row n to the accumulators of x rows m0 .. m0 + rows − 1; with
 * `last`, block blk alone (the last of an odd row: block blk + 1's activations and sums masked to
 * zero). The dot products go to 16 lanes; the zero point's and the minimum's terms of both blocks
 * to 4, in one FMA: [d0, m0, d1, m1] · [−z, 1, −z, 1] · [e0 Σ0 (256a + b), Σ0 x, e1 …, Σ1 x]. (Against
 * the terms in 16 lanes: a 1536 × 576 Q4_1 product in cache, one thread of a Zen 4, 40.2 µs
 * against 47.1; Q5_1 44.9 against 51.7, Q4_0 alike.) */
INLINE void pair_step(const int type, const Acts *acts, int64_t m0, const int rows, const uint8_t *b0,
                      int64_t K, int64_t blk, const int last, __m512 *acc, __m128 *acc4) {
    const Layout L = LAYOUTS[type];
    const uint8_t *b1 = last ? b0 : b0 + L.bytes;
    const __mmask64 mq = last ? 0xffffffffull : ~0ull;
    const __mmask16 ml = last ? 0x00ff : 0xffff;
    const float zero = L.zero_shift ? (float)(1 << L.zero_shift) : 0.0f;
    const __m128 terms = _mm_setr_ps(-zero, L.min ? 1.0f : 0.0f, -zero, L.min ? 1.0f : 0.0f);
    _mm_prefetch((const char *)b0 + PREFETCH_BYTES, _MM_HINT_T0);
    const __m512i u = unpack_pair(type, b0, b1);
    __m128 dm;
    const __m512 d = halves_pair(b0, b1, &dm, L.min);
    const __m128 dm_terms = _mm_mul_ps(dm, terms);
    for (int r = 0; r < rows; r++) {
        const int64_t q = (m0 + r) * K + blk * 32, lane = q / 4, at = q / 32;
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_maskz_loadu_epi8(mq, acts->a + q));
        dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(dot, 8), u, _mm512_maskz_loadu_epi8(mq, acts->b + q));
        const __m512 scale = _mm512_mul_ps(d, _mm512_maskz_loadu_ps(ml, acts->e + lane));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
        acc4[r] = _mm_fmadd_ps(dm_terms, _mm_maskz_loadu_ps(last ? 0x3 : 0xf, acts->block_sums + 2 * at), acc4[r]);
    }
}

INLINE void quant_rows(const int type, const Acts *acts, int64_t m0, const int rows, const uint8_t *W,
                       int64_t n, int64_t N, int64_t K, float *y) {
    const Layout L = LAYOUTS[type];
    const int64_t nb = K / 32;
    const uint8_t *row = W + n * nb * L.bytes;
    __m512 acc[MAX_ROWS];
    __m128 acc4[MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps(), acc4[r] = _mm_setzero_ps();
    int64_t blk = 0;
    for (; blk + 2 <= nb; blk += 2) pair_step(type, acts, m0, rows, row + blk * L.bytes, K, blk, 0, acc, acc4);
    if (blk < nb) pair_step(type, acts, m0, rows, row + blk * L.bytes, K, blk, 1, acc, acc4);
    for (int r = 0; r < rows; r++) {
        const __m128 h = _mm_add_ps(acc4[r], _mm_movehl_ps(acc4[r], acc4[r]));
        y[(m0 + r) * N + n] = _mm512_reduce_add_ps(acc[r]) + _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
}

/* Adds Q8_0 block blk (at b) to the accumulators of x rows m0 .. m0 + rows − 1: its 32 weights
 * widened to int16, one vpdpwssd with each row's 32 activations into 16 int32 lanes, scaled by d·e. */
INLINE void q8_step(const Wide *acts, int64_t m0, const int rows, const uint8_t *b, int64_t K, int64_t blk,
                    __m512 *acc) {
    _mm_prefetch((const char *)b + PREFETCH_BYTES, _MM_HINT_T0);
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(b + LAYOUTS[Q8_0].qs)));
    const float d = half_to_float(load16(b));
    for (int r = 0; r < rows; r++) {
        const int64_t at = (m0 + r) * K + blk * 32;
        const __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(acts->c + at));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(d * acts->e[at / 32]), acc[r]);
    }
}

/* A row's float32 partial sums, in one vector of this build's lanes. */
typedef __m512 Acc;
INLINE Acc acc_zero(void) { return _mm512_setzero_ps(); }
INLINE float acc_sum(Acc a, Acc b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }

#elif ISA == 1
INLINE float hsum256(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* A block's integers as `block_dot` takes them: a 4-bit type's as int16 (`block_words`), a 5-bit
 * type's as unsigned bytes in w[0] (`unpack_block`). */
INLINE void dot_words(const int type, const uint8_t *b, __m256i w[2]) {
    if (LAYOUTS[type].qh < 0) {
        block_words(type, b, w);
    } else {
        w[0] = unpack_block(type, b), w[1] = _mm256_setzero_si256();
    }
}

/* Σ over one block (at q) of u_j (256 a_j + b_j) in eight int32 lanes. A 4-bit type's against c =
 * 256 a + b (`join_acts`): pairs of int16 products in int32 (|·| ≤ 2 · 15 · 32,639). A 5-bit
 * type's against a and b apart: pairs of products in int16 (|·| ≤ 2 · 31 · 127), then pairs of
 * pairs in int32. (The 5-bit types' bytes widened to int16 cost more than the int16 products
 * save at one row: a 1536 × 576 product in cache, one thread of a Zen 4 running this AVX2 code,
 * 73-78 µs against 68-71 for Q5_0 and Q5_1; Q4_0 and Q4_1 48-50 µs against 54-56.) */
INLINE __m256i block_dot(const int type, const __m256i w[2], const Acts *acts, int64_t q) {
    if (LAYOUTS[type].qh < 0)
        return _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i *)(acts->c + q))),
                                _mm256_madd_epi16(w[1], _mm256_loadu_si256((const __m256i *)(acts->c + q + 16))));
    const __m256i av = _mm256_loadu_si256((const __m256i *)(acts->a + q));
    const __m256i bv = _mm256_loadu_si256((const __m256i *)(acts->b + q));
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(w[0], av), _mm256_set1_epi16(256)),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(w[0], bv), _mm256_set1_epi16(1)));
}

/* Two blocks at a time: their scales and minimums converted together ([d0, m0, d1, m1]), the zero
 * point's and the minimum's terms of both summed in one 4-lane FMA with the activations' per-block
 * (e Σ (256 a + b), Σ x): d0 (−z e0 Σ0) + m0 Σx0 + d1 (…) + m1 (…). (Against one block at a time
 * with each term in 8 lanes: 43.8 µs against 53.0 for a 1536 × 576 Q4_1 product, Q4_0
 * alike; one thread of a loaded Sapphire Rapids running this AVX2 code.) */
INLINE void quant_rows(const int type, const Acts *acts, int64_t m0, const int rows, const uint8_t *W,
                       int64_t n, int64_t N, int64_t K, float *y) {
    const Layout L = LAYOUTS[type];
    const int64_t nb = K / 32;
    const uint8_t *row = W + n * nb * L.bytes;
    const float zero = L.zero_shift ? (float)(1 << L.zero_shift) : 0.0f;
    const __m128 terms = _mm_setr_ps(-zero, L.min ? 1.0f : 0.0f, -zero, L.min ? 1.0f : 0.0f);
    __m256 acc[MAX_ROWS];
    __m128 acc4[MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps(), acc4[r] = _mm_setzero_ps();
    for (int64_t blk = 0; blk < nb; blk += 2) {
        const int pair = blk + 1 < nb;  /* the last block of an odd row stands alone */
        const uint8_t *b0 = row + blk * L.bytes, *b1 = b0 + L.bytes;
        _mm_prefetch((const char *)b0 + PREFETCH_BYTES, _MM_HINT_T0);
        /* [d0, m0, d1, m1]; an _0 type's bytes 2-3 are not a minimum: cleared */
        __m128i halves = _mm_insert_epi32(_mm_cvtsi32_si128((int)load32(b0)), pair ? (int)load32(b1) : 0, 1);
        if (!L.min) halves = _mm_and_si128(halves, _mm_set1_epi32(0xffff));
        const __m128 dm = _mm_cvtph_ps(halves), dm_terms = _mm_mul_ps(dm, terms);
        __m256i w0[2], w1[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        dot_words(type, b0, w0);
        if (pair) dot_words(type, b1, w1);
        for (int r = 0; r < rows; r++) {
            const int64_t q = (m0 + r) * K + blk * 32, at = q / 32;
            const __m128 e = pair ? _mm_castpd_ps(_mm_load_sd((const double *)(acts->block_e + at)))
                                  : _mm_load_ss(acts->block_e + at);
            const __m128 de = _mm_mul_ps(dm, _mm_unpacklo_ps(e, e));  /* [d0 e0, ·, d1 e1, ·] */
            const __m128 sums = pair ? _mm_loadu_ps(acts->block_sums + 2 * at)
                                     : _mm_castpd_ps(_mm_load_sd((const double *)(acts->block_sums + 2 * at)));
            acc4[r] = _mm_fmadd_ps(dm_terms, sums, acc4[r]);
            const __m256i dot0 = block_dot(type, w0, acts, q);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot0), _mm256_broadcastss_ps(de), acc[r]);
            if (pair) {
                const __m256i dot1 = block_dot(type, w1, acts, q + 32);
                const __m128 de1 = _mm_movehl_ps(de, de);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot1), _mm256_broadcastss_ps(de1), acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        __m128 h = _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1)), acc4[r]);
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        y[(m0 + r) * N + n] = _mm_cvtss_f32(h);
    }
}

/* Adds Q8_0 block blk (at b) to the accumulators of x rows m0 .. m0 + rows − 1: its weights
 * widened to int16 in two halves of 16, multiplied with each row's activations in pairs into
 * int32 by vpmaddwd (|·| ≤ 2 · 128 · 32767), scaled by d·e. */
INLINE void q8_step(const Wide *acts, int64_t m0, const int rows, const uint8_t *b, int64_t K, int64_t blk,
                    __m256 *acc) {
    _mm_prefetch((const char *)b + PREFETCH_BYTES, _MM_HINT_T0);
    const uint8_t *q = b + LAYOUTS[Q8_0].qs;
    const __m256i low = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
    const __m256i high = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16)));
    const float d = half_to_float(load16(b));
    for (int r = 0; r < rows; r++) {
        const int64_t at = (m0 + r) * K + blk * 32;
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(low, _mm256_loadu_si256((const __m256i *)(acts->c + at))),
                                             _mm256_madd_epi16(high, _mm256_loadu_si256((const __m256i *)(acts->c + at + 16))));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * acts->e[at / 32]), acc[r]);
    }
}

typedef __m256 Acc;
INLINE Acc acc_zero(void) { return _mm256_setzero_ps(); }
INLINE float acc_sum(Acc a, Acc b) { return hsum256(_mm256_add_ps(a, b)); }

#else
/* Value j of a 4- or 5-bit block, with the zero point subtracted: the signed integer the weight scales. */
INLINE int block_value(const int type, const uint8_t *blk, int j) {
    const Layout L = LAYOUTS[type];
    int v = j < 16 ? blk[L.qs + j] & 15 : blk[L.qs + j - 16] >> 4;
    if (L.qh >= 0) v |= ((load32(blk + L.qh) >> j) & 1) << 4;
    return v - (L.zero_shift ? 1 << L.zero_shift : 0);
}

INLINE void quant_rows(const int type, const Acts *acts, int64_t m0, const int rows, const uint8_t *W,
                       int64_t n, int64_t N, int64_t K, float *y) {
    const Layout L = LAYOUTS[type];
    const int64_t nb = K / 32;
    const uint8_t *row = W + n * nb * L.bytes;
    float acc[MAX_ROWS] = {0};
    for (int64_t blk = 0; blk < nb; blk++) {
        const uint8_t *b0 = row + blk * L.bytes;
        int v[32];
        for (int j = 0; j < 32; j++) v[j] = block_value(type, b0, j);
        const float d = half_to_float(load16(b0)), m = L.min ? half_to_float(load16(b0 + 2)) : 0.0f;
        for (int r = 0; r < rows; r++) {
            const int64_t q = (m0 + r) * K + blk * 32, at = q / 32;
            int32_t dot = 0;
            for (int j = 0; j < 32; j++) dot += v[j] * (256 * acts->a[q + j] + acts->b[q + j]);
            acc[r] += d * acts->block_e[at] * (float)dot + m * acts->block_sums[2 * at + 1];
        }
    }
    for (int r = 0; r < rows; r++) y[(m0 + r) * N + n] = acc[r];
}

INLINE void q8_rows(const Wide *acts, int64_t m0, const int rows, const uint8_t *W, int64_t n, int64_t N,
                    int64_t K, float *y) {
    const Layout L = LAYOUTS[Q8_0];
    const int64_t nb = K / 32;
    const uint8_t *row = W + n * nb * L.bytes;
    float acc[MAX_ROWS] = {0};
    for (int64_t blk = 0; blk < nb; blk++) {
        const uint8_t *b0 = row + blk * L.bytes;
        const float d = half_to_float(load16(b0));
        for (int r = 0; r < rows; r++) {
            const int64_t at = (m0 + r) * K + blk * 32;
            int32_t dot = 0;
            for (int j = 0; j < 32; j++) dot += (int8_t)b0[L.qs + j] * acts->c[at + j];
            acc[r] += d * acts->e[at / 32] * (float)dot;
        }
    }
    for (int r = 0; r < rows; r++) y[(m0 + r) * N + n] = acc[r];
}
#endif

#if ISA > 0
/* Q8_0 (`q8_step`): blocks alternate between two accumulators per row, which hides the FMAs'
 * latency. */
INLINE void q8_rows(const Wide *acts, int64_t m0, const int rows, const uint8_t *W, int64_t n, int64_t N,
                    int64_t K, float *y) {
    const int64_t nb = K / 32, bytes = LAYOUTS[Q8_0].bytes;
    const uint8_t *row = W + n * nb * bytes;
    Acc even[MAX_ROWS], odd[MAX_ROWS];
    for (int r = 0; r < rows; r++) even[r] = odd[r] = acc_zero();
    int64_t blk = 0;
    for (; blk + 2 <= nb; blk += 2) {
        q8_step(acts, m0, rows, row + blk * bytes, K, blk, even);
        q8_step(acts, m0, rows, row + (blk + 1) * bytes, K, blk + 1, odd);
    }
    if (blk < nb) q8_step(acts, m0, rows, row + blk * bytes, K, blk, even);
    for (int r = 0; r < rows; r++) y[(m0 + r) * N + n] = acc_sum(even[r], odd[r]);
}
#endif

/* Weights widened to float32 and summed by FMA. `kind` F16 or BF16 (2 bytes a weight), or I8 (one
 * int8: decoderlm.quant.Int8Linear's). */
enum { I8 = 16 };

INLINE float weight_at(const int kind, const void *w, int64_t k) {
    if (kind == I8) return (float)((const int8_t *)w)[k];
    const uint16_t bits = ((const uint16_t *)w)[k];
    return kind == F16 ? half_to_float(bits) : bf16_to_float(bits);
}

#if ISA == 2
/* Weights k .. k + 15 (m of them valid) as float32. */
INLINE __m512 widen16(const int kind, const void *w, int64_t k, __mmask16 m) {
    if (kind == I8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, (const int8_t *)w + k)));
    const __m256i bits = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + k);
    return kind == F16 ? _mm512_cvtph_ps(bits) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

INLINE __mmask16 tail16(int64_t left) { return left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1); }
#elif ISA == 1
/* Weights k .. k + 7 as float32. */
INLINE __m256 widen8(const int kind, const void *w, int64_t k) {
    if (kind == I8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)w + k))));
    const __m128i bits = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
    return kind == F16 ? _mm256_cvtph_ps(bits) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

#endif

/* out[r] = Σ_k x[r][k] w[k] for k in [0, K), w (K,) of `kind`, ROWS rows of x (float32, rows K
 * apart). Two accumulators per row, over alternate vectors of k, hide the FMAs' latency. */
INLINE void widened_dot(const int kind, const float *x, const int rows, const void *w, int64_t K, float *out) {
#if ISA == 2
    const int bytes = kind == I8 ? 1 : 2;
    __m512 acc[2 * MAX_ROWS];
    for (int r = 0; r < 2 * rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask16 m0 = tail16(K - k), m1 = tail16(K - k - 16);
        _mm_prefetch((const char *)w + k * bytes + PREFETCH_BYTES, _MM_HINT_T0);
        const __m512 w0 = widen16(kind, w, k, m0), w1 = widen16(kind, w, k + 16, m1);
        for (int r = 0; r < rows; r++) {
            acc[2 * r] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(m0, x + r * K + k), acc[2 * r]);
            acc[2 * r + 1] = _mm512_fmadd_ps(w1, _mm512_maskz_loadu_ps(m1, x + r * K + k + 16), acc[2 * r + 1]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * r], acc[2 * r + 1]));
#elif ISA == 1
    const int bytes = kind == I8 ? 1 : 2;
    __m256 acc[2 * MAX_ROWS];
    for (int r = 0; r < 2 * rows; r++) acc[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        _mm_prefetch((const char *)w + k * bytes + PREFETCH_BYTES, _MM_HINT_T0);
        const __m256 w0 = widen8(kind, w, k), w1 = widen8(kind, w, k + 8);
        for (int r = 0; r < rows; r++) {
            acc[2 * r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K + k), acc[2 * r]);
            acc[2 * r + 1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * K + k + 8), acc[2 * r + 1]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = hsum256(_mm256_add_ps(acc[2 * r], acc[2 * r + 1]));
    for (; k < K; k++)
        for (int r = 0; r < rows; r++) out[r] += x[r * K + k] * weight_at(kind, w, k);
#else
    float acc[MAX_ROWS][8] = {{0}};  /* eight partial sums per row, as eight SIMD lanes */
    for (int64_t k = 0; k < K; k++) {
        const float wk = weight_at(kind, w, k);
        for (int r = 0; r < rows; r++) acc[r][k % 8] += x[r * K + k] * wk;
    }
    for (int r = 0; r < rows; r++) {
        out[r] = 0.0f;
        for (int lane = 0; lane < 8; lane++) out[r] += acc[r][lane];
    }
#endif
}

/* Float weights: y[r][n] = Σ_k x[r][k] W[n][k] for ROWS rows of x (float32), W float16 or bfloat16. */
INLINE void float_rows(const int type, const float *x, int64_t m0, const int rows, const uint16_t *W,
                       int64_t n, int64_t N, int64_t K, float *y) {
    float out[MAX_ROWS];
    widened_dot(type, x + m0 * K, rows, W + n * K, K, out);
    for (int r = 0; r < rows; r++) y[(m0 + r) * N + n] = out[r];
}

/* Grouped int4 (decoderlm.quant.Int4Linear): byte j of a row holds q_2j (low nibble) and q_2j+1
 * (high nibble), so x comes split into its even and odd inputs xe, xo (M, K/2), and group g of G
 * inputs has scale s and offset o: out[r] = Σ_g s_g Σ_{k∈g} x_k q_k + o_g xs[r][g] (xs (M, K/G)
 * the groups' sums of x). Even and odd inputs go to accumulators of their own. */
INLINE void int4_dot(const float *xe, const float *xo, const float *xs, const int rows, const uint8_t *w,
                     const float *scale, const float *offset, int64_t K, int64_t G, float *out) {
    const int64_t groups = K / G;
    for (int r = 0; r < rows; r++) out[r] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        float part[MAX_ROWS];
#if ISA == 2
        __m512 even_acc[MAX_ROWS], odd_acc[MAX_ROWS];
        for (int r = 0; r < rows; r++) even_acc[r] = odd_acc[r] = _mm512_setzero_ps();
        for (int64_t j = g * G / 2; j < (g + 1) * G / 2; j += 16) {  /* 16 bytes: 32 weights */
            _mm_prefetch((const char *)(w + j) + PREFETCH_BYTES, _MM_HINT_T0);
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + j)));
            const __m512 even = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
            const __m512 odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
            for (int r = 0; r < rows; r++) {
                even_acc[r] = _mm512_fmadd_ps(even, _mm512_loadu_ps(xe + r * K / 2 + j), even_acc[r]);
                odd_acc[r] = _mm512_fmadd_ps(odd, _mm512_loadu_ps(xo + r * K / 2 + j), odd_acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) part[r] = _mm512_reduce_add_ps(_mm512_add_ps(even_acc[r], odd_acc[r]));
#elif ISA == 1
        __m256 even_acc[MAX_ROWS], odd_acc[MAX_ROWS];
        for (int r = 0; r < rows; r++) even_acc[r] = odd_acc[r] = _mm256_setzero_ps();
        for (int64_t j = g * G / 2; j < (g + 1) * G / 2; j += 8) {  /* 8 bytes: 16 weights */
            _mm_prefetch((const char *)(w + j) + PREFETCH_BYTES, _MM_HINT_T0);
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + j)));
            const __m256 even = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
            const __m256 odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
            for (int r = 0; r < rows; r++) {
                even_acc[r] = _mm256_fmadd_ps(even, _mm256_loadu_ps(xe + r * K / 2 + j), even_acc[r]);
                odd_acc[r] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(xo + r * K / 2 + j), odd_acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) part[r] = hsum256(_mm256_add_ps(even_acc[r], odd_acc[r]));
#else
        float acc[MAX_ROWS][8] = {{0}};  /* eight partial sums per row, as eight SIMD lanes */
        for (int64_t j = g * G / 2; j < (g + 1) * G / 2; j++)
            for (int r = 0; r < rows; r++) {
                acc[r][j % 8] += xe[r * K / 2 + j] * (float)(w[j] & 15);
                acc[r][j % 8] += xo[r * K / 2 + j] * (float)(w[j] >> 4);
            }
        for (int r = 0; r < rows; r++) {
            part[r] = 0.0f;
            for (int lane = 0; lane < 8; lane++) part[r] += acc[r][lane];
        }
#endif
        for (int r = 0; r < rows; r++) out[r] += scale[g] * part[r] + offset[g] * xs[r * groups + g];
    }
}

/* decoderlm.quant's own layouts: Int8Linear (bits 8: y = s_n Σ_k x_k q_nk, one scale per row) and
 * Int4Linear (bits 4: `int4_dot`). */
INLINE void int_rows(const int bits, const float *x, const float *xe, const float *xo, const float *xs, int64_t m0,
                     const int rows, const uint8_t *W, const float *scale, const float *offset, int64_t n, int64_t N,
                     int64_t K, int64_t G, float *y) {
    float out[MAX_ROWS];
    if (bits == 8) {
        widened_dot(I8, x + m0 * K, rows, W + n * K, K, out);
        for (int r = 0; r < rows; r++) out[r] *= scale[n];
    } else {
        const int64_t groups = K / G;
        int4_dot(xe + m0 * K / 2, xo + m0 * K / 2, xs + m0 * groups, rows, W + n * K / 2, scale + n * groups,
                 offset + n * groups, K, G, out);
    }
    for (int r = 0; r < rows; r++) y[(m0 + r) * N + n] = out[r];
}

/* y (M, N) float32 for one type: output rows split over threads; for each output row, x's rows four
 * at a time (the weights unpacked once for the four). */
#define FOR_OUTPUT_ROWS(ROWS_FN)                                                           \
    _Pragma("omp parallel for schedule(static)")                                           \
    for (int64_t n = 0; n < N; n++) {                                                      \
        int64_t m0 = 0;                                                                    \
        for (; m0 + MAX_ROWS <= M; m0 += MAX_ROWS) ROWS_FN(m0, MAX_ROWS);                  \
        switch (M - m0) {                                                                  \
            case 3: ROWS_FN(m0, 3); break;                                                 \
            case 2: ROWS_FN(m0, 2); break;                                                 \
            case 1: ROWS_FN(m0, 1); break;                                                 \
        }                                                                                  \
    }

#define QUANT_KERNEL(T)                                                                    \
    static void CAT(quant, T)(const Acts *acts, int64_t M, const uint8_t *W, int64_t N,    \
                              int64_t K, float *y) {                                       \
        FOR_OUTPUT_ROWS(CAT(T, ROWS))                                                      \
    }
#define Q4_0_ROWS(m0, rows) quant_rows(Q4_0, acts, m0, rows, W, n, N, K, y)
#define Q4_1_ROWS(m0, rows) quant_rows(Q4_1, acts, m0, rows, W, n, N, K, y)
#define Q5_0_ROWS(m0, rows) quant_rows(Q5_0, acts, m0, rows, W, n, N, K, y)
#define Q5_1_ROWS(m0, rows) quant_rows(Q5_1, acts, m0, rows, W, n, N, K, y)
QUANT_KERNEL(Q4_0)
QUANT_KERNEL(Q4_1)
QUANT_KERNEL(Q5_0)
QUANT_KERNEL(Q5_1)

static void q8_kernel(const Wide *acts, int64_t M, const uint8_t *W, int64_t N, int64_t K, float *y) {
#define Q8_0_ROWS(m0, rows) q8_rows(acts, m0, rows, W, n, N, K, y)
    FOR_OUTPUT_ROWS(Q8_0_ROWS)
}

static void float_kernel(const int type, const float *x, int64_t M, const uint16_t *W, int64_t N, int64_t K, float *y) {
#define FLOAT_ROWS(m0, rows) float_rows(type, x, m0, rows, W, n, N, K, y)
    FOR_OUTPUT_ROWS(FLOAT_ROWS)
}

/* The instruction set this build's kernels use: 2 AVX-512 VNNI, 1 AVX2, 0 portable C. */
int FN(block_linear_isa)(void) { return ISA; }

/* x (M, K) float32, or bfloat16 (x_bf16) widened into `wide` (M · K floats). */
static const float *widened(const void *x, int x_bf16, int64_t M, int64_t K, float *wide) {
    if (!x_bf16) return x;
    for (int64_t i = 0; i < M * K; i++) wide[i] = bf16_to_float(((const uint16_t *)x)[i]);
    return wide;
}

/* y (M, N) = x (M, K) Ŵᵀ, Ŵ (N, K) in blocks of `type`; x and y float32, or bfloat16 where x_bf16
 * (y rounded once). K a multiple of 32 for the quantized types. Returns −1 where the memory for the
 * quantized (or widened) activations and the float32 products cannot be had, else 0. */
int FN(block_linear)(int type, const void *x, int x_bf16, int64_t M, const uint8_t *W, int64_t N,
                     int64_t K, void *y) {
    const int floats = type == F16 || type == BF16;
    const size_t acts_bytes = floats ? (x_bf16 ? sizeof(float) * M * K : 0)
                              : type == Q8_0 ? WIDE_BYTES(M, K) : ACTS_BYTES(M, K) + (ISA == 1 ? JOINED_BYTES(M, K) : 0);
    const size_t out_bytes = x_bf16 ? sizeof(float) * M * N : 0;
    char *buffer = malloc(acts_bytes + out_bytes + 1);
    if (buffer == NULL) return -1;
    float *out = x_bf16 ? (float *)(buffer + acts_bytes) : y;
    if (floats) {
        float_kernel(type, widened(x, x_bf16, M, K, (float *)buffer), M, (const uint16_t *)W, N, K, out);
    } else if (type == Q8_0) {
        Wide acts;
        quantize_wide(x, x_bf16, M, K, buffer, &acts);
        q8_kernel(&acts, M, W, N, K, out);
    } else {
        Acts acts;
        quantize_acts(x, x_bf16, M, K, buffer, &acts);
        if (ISA == 1 && LAYOUTS[type].qh < 0) join_acts(&acts, M, K, buffer + ACTS_BYTES(M, K));
        switch (type) {
            case Q4_0: quant_Q4_0(&acts, M, W, N, K, out); break;
            case Q4_1: quant_Q4_1(&acts, M, W, N, K, out); break;
            case Q5_0: quant_Q5_0(&acts, M, W, N, K, out); break;
            case Q5_1: quant_Q5_1(&acts, M, W, N, K, out); break;
        }
    }
    store(out, x_bf16, M * N, y);
    free(buffer);
    return 0;
}

/* y (M, N) = x (M, K) Ŵᵀ for decoderlm.quant's Int8Linear (bits 8: W int8 (N, K), scale (N,),
 * offset NULL, G = K) and Int4Linear (bits 4: W (N, K/2), scale and offset (N, K/G)); x and y
 * float32, or bfloat16 where x_bf16. Returns −1 without the memory for the widened x, else 0. */
int FN(int_linear)(int bits, const void *x, int x_bf16, int64_t M, const uint8_t *W, const float *scale,
                   const float *offset, int64_t G, int64_t N, int64_t K, void *y) {
    const size_t split = bits == 4 ? sizeof(float) * (M * K + M * K / G) : 0;
    const size_t wide = x_bf16 ? sizeof(float) * M * K : 0, out_bytes = x_bf16 ? sizeof(float) * M * N : 0;
    char *buffer = malloc(split + wide + out_bytes + 1);
    if (buffer == NULL) return -1;
    const float *xf = widened(x, x_bf16, M, K, (float *)(buffer + split));
    float *out = x_bf16 ? (float *)(buffer + split + wide) : y;
    float *xe = (float *)buffer, *xo = xe + M * K / 2, *xs = xo + M * K / 2;
    if (bits == 4) {
        for (int64_t i = 0; i < M * K / 2; i++) xe[i] = xf[2 * i], xo[i] = xf[2 * i + 1];
        for (int64_t g = 0; g < M * K / G; g++) {
            float sum = 0.0f;
            for (int64_t k = g * G; k < (g + 1) * G; k++) sum += xf[k];
            xs[g] = sum;
        }
    }
#define INT_ROWS(m0, rows) int_rows(bits, xf, xe, xo, xs, m0, rows, W, scale, offset, n, N, K, G, out)
    FOR_OUTPUT_ROWS(INT_ROWS)
    store(out, x_bf16, M * N, y);
    free(buffer);
    return 0;
}

INLINE void dequantize_rows(const int type, const uint8_t *W, int64_t n0, int64_t rows, int64_t K, void *out,
                            int out_bf16) {
    const int64_t row_bytes = type == F16 || type == BF16 ? 2 * K : K / 32 * LAYOUTS[type].bytes;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < rows; n++) {
        if (!out_bf16) {
            dequantize_row(type, W + (n0 + n) * row_bytes, K, (float *)out + n * K);
            continue;
        }
        float wide[K];
        dequantize_row(type, W + (n0 + n) * row_bytes, K, wide);
        for (int64_t k = 0; k < K; k++) ((uint16_t *)out)[n * K + k] = float_to_bf16(wide[k]);
    }
}

/* Rows n0 .. n0 + rows − 1 of Ŵ (N, K) in blocks of `type` → out (rows, K), float32 or (out_bf16)
 * bfloat16 rounded to nearest even. */
void FN(block_dequantize)(int type, const uint8_t *W, int64_t n0, int64_t rows, int64_t K, void *out, int out_bf16) {
    switch (type) {
        case F16: dequantize_rows(F16, W, n0, rows, K, out, out_bf16); break;
        case BF16: dequantize_rows(BF16, W, n0, rows, K, out, out_bf16); break;
        case Q8_0: dequantize_rows(Q8_0, W, n0, rows, K, out, out_bf16); break;
        case Q4_0: dequantize_rows(Q4_0, W, n0, rows, K, out, out_bf16); break;
        case Q4_1: dequantize_rows(Q4_1, W, n0, rows, K, out, out_bf16); break;
        case Q5_0: dequantize_rows(Q5_0, W, n0, rows, K, out, out_bf16); break;
        case Q5_1: dequantize_rows(Q5_1, W, n0, rows, K, out, out_bf16); break;
    }
}
