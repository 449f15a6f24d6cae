/* What the C kernels of ggml's blocks (block_linear.c: a few rows; block_panels.c: many) share:
 * the instruction set of the build, the blocks' layouts and their unpacking to integers or floats,
 * and the activations quantized to two int8 per input (block_linear.c's comment gives the
 * arithmetic, quant/blocks.py the formats). */
#ifndef DECODERLM_BLOCKS_H
#define DECODERLM_BLOCKS_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif


#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__F16C__) && defined(__FMA__)
#define ISA 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ISA 1
#else
#define ISA 0
#endif

#define CAT2(a, b) a##_##b
#define CAT(a, b) CAT2(a, b)
#define FN(name) CAT(name, VARIANT)
#define INLINE static inline __attribute__((always_inline))

/* The types, in the order of quant/blocks.py's BLOCK_TYPES. */
enum { F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 };

/* A quantized block's layout: its bytes, where its 16 (32 for Q8_0) bytes of integers start,
 * where the four bytes of fifth bits start (−1: none), whether it has a minimum m (at byte 2),
 * and the zero point z as a shift (z = 1 << shift; 0: none, Q8_0's signed integers) of the
 * unsigned values the 4- and 5-bit types store. Every block starts with its scale d (float16). */
typedef struct {
    int bytes, qs, qh, min, zero_shift;
} Layout;
static const Layout LAYOUTS[] = {
    [Q8_0] = {34, 2, -1, 0, 0}, [Q4_0] = {18, 2, -1, 0, 3}, [Q4_1] = {20, 4, -1, 1, 0},
    [Q5_0] = {22, 6, 2, 0, 4},  [Q5_1] = {24, 8, 4, 1, 0},
};

/* Prefetch distance along the weights (rows lie one after the other): the hardware prefetcher ramps
 * up too slowly on matrices of a few hundred KB (as in gemv.c). Between 1 and 6 KiB the model's
 * products ran alike (within a loaded machine's noise); 256 bytes was slower. */
#define PREFETCH_BYTES 3072

INLINE float half_to_float(uint16_t h) {
#if ISA > 0
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (exp == 0x1f) {
        v.u = sign | 0x7f800000u | (man << 13);  /* inf, nan */
    } else if (exp == 0) {
        v.f = ldexpf((float)man, -24);           /* zero, subnormal: man · 2⁻²⁴, exact */
        v.u |= sign;
    } else {
        v.u = sign | ((exp + 112) << 23) | (man << 13);
    }
    return v.f;
#endif
}

INLINE float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

/* float32 → bfloat16, rounding to nearest even (finite inputs). */
INLINE uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    return (uint16_t)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);
}

INLINE uint16_t load16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
INLINE uint32_t load32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* Block blk of x (float32 or bfloat16: its 32 values from blk · 32) into v as float32; returns
 * max|v| over the values that are not NaN, and in *nan whether one is. A NaN input makes its
 * block's scale QUIET_NAN, so that it reaches y as it would in floats. */
INLINE float load_block(const void *x, int x_bf16, int64_t blk, float v[32], int *nan) {
    float amax = 0.0f;
    *nan = 0;
    for (int j = 0; j < 32; j++) {
        const int64_t i = blk * 32 + j;
        v[j] = x_bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
        amax = fmaxf(amax, fabsf(v[j]));
        union { float f; uint32_t u; } bits = {v[j]};
        *nan |= (bits.u & 0x7fffffffu) > 0x7f800000u;  /* (-ffast-math drops v != v) */
    }
    return amax;
}

static const union { uint32_t u; float f; } QUIET_NAN_BITS = {0x7fc00000u};
#define QUIET_NAN (QUIET_NAN_BITS.f)

/* The quantized activations of M rows (x_j ≈ e (256 a_j + b_j), file comment), K a multiple of 32.
 * Per row: a, b (K,) int8; per "lane" of four consecutive inputs (K/4 of them, eight per block,
 * the int32 lanes of AVX-512's dot products): e of the lane's block; per block (K/32): e, and
 * the pair (e Σ_j (256 a_j + b_j), Σ_j x_j) that the zero point's and the minimum's terms take. */
typedef struct {
    int8_t *a, *b;
    float *e;
    float *block_e, *block_sums;
    int32_t *block_ab; /* per block Σ_j (256 a_j + b_j), for the zero point's term in int32 */
    int16_t *c;        /* (M, K): 256 a + b as one int16 where `join_acts` filled it, else NULL */
} Acts;

/* Bytes of the buffer `quantize_acts` fills for M rows of K inputs. */
#define ACTS_BYTES(M, K) ((size_t)((M) * (K)) * 3 + sizeof(float) * (size_t)((M) * (K) / 32) * 4)

/* x (M, K) float32 or bfloat16 → the quantized activations, in `buffer` (ACTS_BYTES). */
INLINE void quantize_acts(const void *x, int x_bf16, int64_t M, int64_t K, void *buffer, Acts *acts) {
    const int64_t lanes = M * K / 4, blocks = M * K / 32;
    acts->e = buffer;
    acts->block_e = acts->e + lanes;
    acts->block_sums = acts->block_e + blocks;
    acts->block_ab = (int32_t *)(acts->block_sums + 2 * blocks);
    acts->a = (int8_t *)(acts->block_ab + blocks);
    acts->b = acts->a + M * K;
    acts->c = NULL;
#pragma omp parallel for schedule(static) if (blocks >= 4096)
    for (int64_t blk = 0; blk < blocks; blk++) {
        float v[32];
        int nan;
        const float amax = load_block(x, x_bf16, blk, v, &nan);
        const float e = nan ? QUIET_NAN : amax / (127.0f * 256.0f), inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int8_t *a = acts->a + blk * 32, *b = acts->b + blk * 32;
        for (int j = 0; j < 32; j++) {
            const float scaled = v[j] * inv;  /* x / 256e ∈ [−127, 127] */
            const float high = nearbyintf(scaled);
            const float low = nearbyintf((scaled - high) * 256.0f);
            a[j] = (int8_t)high;
            b[j] = (int8_t)fminf(fmaxf(low, -127.0f), 127.0f);
        }
        float lane[8] = {0.0f}; /* Σ_j x_j in eight lanes, then a fixed tree: vectorised in this order */
        int32_t block_ab = 0;
        for (int j = 0; j < 32; j++) {
            lane[j % 8] += v[j];
            block_ab += 256 * a[j] + b[j];
        }
        const float block_sum = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
        for (int lane = 0; lane < 8; lane++) acts->e[blk * 8 + lane] = e;
        acts->block_e[blk] = e;
        acts->block_sums[2 * blk] = e * (float)block_ab;
        acts->block_sums[2 * blk + 1] = block_sum;
        acts->block_ab[blk] = block_ab;
    }
}

/* Bytes of the buffer `join_acts` fills for M rows of K inputs. */
#define JOINED_BYTES(M, K) (sizeof(int16_t) * (size_t)((M) * (K)))

/* The activations' two int8 joined into one int16 each, c_j = 256 a_j + b_j (|c_j| ≤ 32,639), in
 * `buffer` (JOINED_BYTES): AVX2's products take a block's Σ_j u_j c_j, the same integer as 256
 * Σ_j u_j a_j + Σ_j u_j b_j, in two vpmaddwd of the weights widened to int16, where a and b apart
 * take two vpmaddubsw and two vpmaddwd. */
INLINE void join_acts(Acts *acts, int64_t M, int64_t K, void *buffer) {
    acts->c = buffer;
    for (int64_t i = 0; i < M * K; i++) acts->c[i] = (int16_t)(256 * acts->a[i] + acts->b[i]);
}

/* The int16 activations of M rows for Q8_0's products (x_j ≈ e c_j, file comment): c (M, K), and
 * e per block (M, K/32). */
typedef struct {
    int16_t *c;
    float *e;
} Wide;

/* Bytes of the buffer `quantize_wide` fills for M rows of K inputs. */
#define WIDE_BYTES(M, K) ((size_t)((M) * (K)) * 2 + sizeof(float) * (size_t)((M) * (K) / 32))

/* x (M, K) float32 or bfloat16 → the int16 activations, in `buffer` (WIDE_BYTES). A block whose
 * max|x| is below 1e-30 (where 32767 / max|x| would overflow), or not finite, is rounded to zeros;
 * a non-finite one keeps its NaN or ∞ scale, which makes its row's products non-finite. */
INLINE void quantize_wide(const void *x, int x_bf16, int64_t M, int64_t K, void *buffer, Wide *acts) {
    acts->e = buffer;
    acts->c = (int16_t *)(acts->e + M * K / 32);
#pragma omp parallel for schedule(static) if (M * K / 32 >= 4096)
    for (int64_t blk = 0; blk < M * K / 32; blk++) {
        float v[32];
        int nan;
        const float amax = load_block(x, x_bf16, blk, v, &nan);
        acts->e[blk] = nan ? QUIET_NAN : amax / 32767.0f;
        const union { float f; uint32_t u; } top = {amax};
        int16_t *c = acts->c + blk * 32;
        if (nan || top.u >= 0x7f800000u || amax < 1e-30f) {
            memset(c, 0, 32 * sizeof(int16_t));
            continue;
        }
        const float inv = 32767.0f / amax;
        for (int j = 0; j < 32; j++) c[j] = (int16_t)nearbyintf(v[j] * inv);  /* |v · inv| ≤ 32767 */
    }
}

#if ISA == 2
/* The 4- or 5-bit blocks b0 and b1 as 64 unsigned bytes, b0's 32 first. (Gathering both blocks
 * from one load with vpermw was slower on Sapphire Rapids: 42.5 µs against 34.1 for a 1536 × 576
 * Q4_1 product, one thread.) */
INLINE __m512i unpack_pair(const int type, const uint8_t *b0, const uint8_t *b1) {
    const Layout L = LAYOUTS[type];
    /* 16 bytes per block: value j in the low nibble of byte j, value j + 16 in its high nibble */
    const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + L.qs))),
                                              _mm_loadu_si128((const __m128i *)(b1 + L.qs)), 1);
    const __m512i twice = _mm512_shuffle_i64x2(_mm512_castsi256_si512(q), _mm512_castsi256_si512(q), 0x50);
    const __m512i shifts = _mm512_set_epi64(0x0004000400040004LL, 0x0004000400040004LL, 0, 0,
                                            0x0004000400040004LL, 0x0004000400040004LL, 0, 0);
    __m512i v = _mm512_and_si512(_mm512_srlv_epi16(twice, shifts), _mm512_set1_epi8(15));
    if (L.qh >= 0) {  /* bit j of a block's qh is its value j's fifth bit */
        const __mmask64 bits = (uint64_t)load32(b0 + L.qh) | (uint64_t)load32(b1 + L.qh) << 32;
        v = _mm512_mask_add_epi8(v, bits, v, _mm512_set1_epi8(16));  /* bit 4 is clear: + = | */
    }
    return v;
}

#elif ISA == 1
/* A block's 32 bits → 32 bytes, byte j 0xff where bit j is set. */
INLINE __m256i bytes_of_bits(uint32_t bits) {
    const __m256i byte_of = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                              0x0101010101010101LL, 0x0000000000000000LL);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), byte_of);  /* byte j: byte j/8 */
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);         /* byte j: 1 << j%8 */
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

/* A 4- or 5-bit block's 32 values as unsigned bytes. */
INLINE __m256i unpack_block(const int type, const uint8_t *blk) {
    const Layout L = LAYOUTS[type];
    const __m128i q = _mm_loadu_si128((const __m128i *)(blk + L.qs));
    __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15));
    if (L.qh >= 0) v = _mm256_or_si256(v, _mm256_and_si256(bytes_of_bits(load32(blk + L.qh)), _mm256_set1_epi8(16)));
    return v;
}

/* A block's 32 integers as int16: inputs 0-15 in w[0], 16-31 in w[1] (Q8_0's signed q; the 4-
 * and 5-bit types' unsigned u, their zero point left to the activations' Σ_j c_j). A 4-bit block's
 * 16 bytes widen to int16 words at once: value j is the low nibble of word j, value j + 16 its
 * high one. */
INLINE void block_words(const int type, const uint8_t *b, __m256i w[2]) {
    const Layout L = LAYOUTS[type];
    if (type == Q8_0) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + L.qs));
        w[0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
        w[1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
    } else if (L.qh < 0) {
        const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + L.qs)));
        w[0] = _mm256_and_si256(bytes, _mm256_set1_epi16(15));
        w[1] = _mm256_srli_epi16(bytes, 4);
    } else {
        const __m256i u = unpack_block(type, b);
        w[0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(u));
        w[1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(u, 1));
    }
}
#endif

#if ISA > 0
/* A 4- or 5-bit block's 32 unsigned values u (as `unpack_pair` or `unpack_block` give them) → o
 * (32,) float32: w = d·u + m where the type has a minimum, else d·(u − z), each product and sum
 * rounded apart, as quant/blocks.py's dequantize_rows computes them. */
INLINE void block_floats(const Layout L, __m256i u, float d, float m, float *o) {
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    const __m256i zero = _mm256_set1_epi32(L.zero_shift ? 1 << L.zero_shift : 0);
    const __m128i halves[2] = {_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)};
    for (int i = 0; i < 4; i++) {
        const __m128i bytes = i % 2 ? _mm_unpackhi_epi64(halves[i / 2], halves[i / 2]) : halves[i / 2];
        const __m256i q = _mm256_cvtepu8_epi32(bytes);  /* values 8i .. 8i + 7 */
        const __m256 w = L.min ? _mm256_add_ps(_mm256_mul_ps(dv, _mm256_cvtepi32_ps(q)), mv)
                               : _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_sub_epi32(q, zero)));
        _mm256_storeu_ps(o + 8 * i, w);
    }
}
#endif

/* Row `row` of Ŵ (K weights in blocks of `type`) → out (K,) float32: the values of quant/blocks.py's
 * dequantize_rows, to the bit. */
INLINE void dequantize_row(const int type, const uint8_t *row, int64_t K, float *out) {
    if (type == F16 || type == BF16) {
        const uint16_t *w = (const uint16_t *)row;
        for (int64_t k = 0; k < K; k++) out[k] = type == F16 ? half_to_float(w[k]) : bf16_to_float(w[k]);
        return;
    }
    const Layout L = LAYOUTS[type];
    const int zero = L.zero_shift ? 1 << L.zero_shift : 0;
#if ISA > 0
    for (int64_t blk = 0; type != Q8_0 && blk < K / 32; blk++) {
        const uint8_t *b = row + blk * L.bytes;
        const float d = half_to_float(load16(b)), m = L.min ? half_to_float(load16(b + 2)) : 0.0f;
#if ISA == 2
        const __m256i u = _mm512_castsi512_si256(unpack_pair(type, b, b));
#else
        const __m256i u = unpack_block(type, b);
#endif
        block_floats(L, u, d, m, out + blk * 32);
    }
    if (type != Q8_0) return;
#endif
    for (int64_t blk = 0; blk < K / 32; blk++) {
        const uint8_t *b = row + blk * L.bytes, *qs = b + L.qs;
        const float d = half_to_float(load16(b)), m = L.min ? half_to_float(load16(b + 2)) : 0.0f;
        const uint32_t qh = L.qh >= 0 ? load32(b + L.qh) : 0;
        float *o = out + blk * 32;
        if (type == Q8_0) {
            for (int j = 0; j < 32; j++) o[j] = d * (float)(int8_t)qs[j];
            continue;
        }
        for (int j = 0; j < 16; j++) {
            const int low = (qs[j] & 15) | (int)((qh >> j) & 1) << 4;
            const int high = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
            o[j] = L.min ? d * (float)low + m : d * (float)(low - zero);
            o[j + 16] = L.min ? d * (float)high + m : d * (float)(high - zero);
        }
    }
}

/* y (M, N) in x's dtype from the float32 products `out`: rounded once to bfloat16 where y_bf16. */
INLINE void store(const float *out, int y_bf16, int64_t count, void *y) {
    if (y_bf16)
        for (int64_t i = 0; i < count; i++) ((uint16_t *)y)[i] = float_to_bf16(out[i]);
}

#endif
