/* float32 vectors of LANES lanes for decoderlm.cpu's C kernels: AVX-512 (16 lanes), AVX2 + FMA
 * (8), or plain C (1), whichever the build's target has. Loads and stores of the last n < LANES
 * elements of a row are masked, so that every element goes through the same instructions wherever
 * it lies (the kernels' batch invariance). bfloat16 widens exactly (it is the top half of a
 * float32) and narrows to the nearest value, ties to even, a NaN staying a NaN: torch's
 * conversions, to the bit. vexp is Cephes' expf (range reduction by ln 2 in two parts, a degree-6
 * polynomial, 2^n put in the exponent): within 2 ulp of e^x on [−87.3, 88.7], the input clamped
 * to it; vrcp is 1/a within 2 ulp. vsum_each(v) sums LANES vectors at once, lane l the sum of v[l]
 * by one fixed tree whatever l. */
#ifndef DECODERLM_VEC_H
#define DECODERLM_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float from_bf16(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#define EXP_HI 88.7228391f
#define EXP_LO -87.3365447f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
/* e^r ≈ 1 + r + r²·P(r) on |r| ≤ ln2 / 2, P's coefficients from the highest power */
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

#if defined(__AVX2__) || defined(__AVX512F__)
/* Lane l of the result: the sum of h[l]'s 8 lanes, ((e0 + e1) + (e2 + e3)) + ((e4 + e5) + (e6 +
 * e7)) for every l: the horizontal sums of 8 vectors in 7 instructions, where one at a time takes
 * 6 each. hadd(a, b) = (a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7). */
static inline __m256 sum8_each(const __m256 *h) {
    const __m256 a = _mm256_hadd_ps(h[0], h[1]), b = _mm256_hadd_ps(h[2], h[3]);
    const __m256 c = _mm256_hadd_ps(h[4], h[5]), d = _mm256_hadd_ps(h[6], h[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d); /* h0..3 low sums | high */
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}
#endif

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vset(float a) { return _mm512_set1_ps(a); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vrcp0(vec a) { return _mm512_rcp14_ps(a); } /* 1/a within 2^−14 */
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vclamp(vec a, float lo, float hi) {
    return _mm512_min_ps(_mm512_max_ps(a, _mm512_set1_ps(lo)), _mm512_set1_ps(hi));
}
static inline vec vround(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT); }
static inline vec vexp2i(vec n) { /* 2^n for integral n in the normal range */
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_castsi512_ps(e);
}
static inline float vsum(vec v) { /* fixed tree: halves, then halves */
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
    return _mm_cvtss_f32(q);
}
static inline vec vsum_each(const vec *v) { /* lane l: the sum of v[l]'s lanes, halves first */
    __m256 h[16];
    for (int l = 0; l < 16; l++) h[l] = _mm256_add_ps(_mm512_castps512_ps256(v[l]), _mm512_extractf32x8_ps(v[l], 1));
    return _mm512_insertf32x8(_mm512_castps256_ps512(sum8_each(h)), sum8_each(h + 8), 1);
}
static inline __mmask16 first(int64_t n) { return n >= LANES ? 0xffff : (__mmask16)((1u << n) - 1); }
static inline vec load_f32(const float *p, int64_t n) { /* n ≤ LANES values, zeros after */
    return n >= LANES ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(first(n), p);
}
static inline vec load_bf16(const uint16_t *p, int64_t n) {
    __m256i h = n >= LANES ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(first(n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline void store_f32(float *p, vec v, int64_t n) { _mm512_mask_storeu_ps(p, first(n), v); }
#if defined(__AVX512BF16__)
/* one instruction (VCVTNEPS2BF16: to nearest even, a NaN made quiet, as to_bf16; a subnormal
 * float32, below 1.2e−38, becomes zero, which torch's conversion keeps) */
static inline __m512i bf16_bits(vec v) { return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)); }
static inline vec vround_bf16(vec v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
static inline void store_bf16(uint16_t *p, vec v, int64_t n) {
    _mm256_mask_storeu_epi16(p, first(n), (__m256i)_mm512_cvtneps_pbh(v));
}
#else
static inline __m512i bf16_bits(vec v) { /* each lane's bfloat16 (to_bf16), in its low half */
    const __m512i bits = _mm512_castps_si512(v), top = _mm512_srli_epi32(bits, 16);
    const __m512i odd = _mm512_and_si512(top, _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(top, _mm512_set1_epi32(0x40)));
}
static inline vec vround_bf16(vec v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
static inline void store_bf16(uint16_t *p, vec v, int64_t n) {
    _mm256_mask_storeu_epi16(p, first(n), _mm512_cvtepi32_epi16(bf16_bits(v)));
}
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vset(float a) { return _mm256_set1_ps(a); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vrcp0(vec a) { return _mm256_rcp_ps(a); } /* 1/a within 1.5·2^−12 */
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec vclamp(vec a, float lo, float hi) {
    return _mm256_min_ps(_mm256_max_ps(a, _mm256_set1_ps(lo)), _mm256_set1_ps(hi));
}
static inline vec vround(vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vexp2i(vec n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_castsi256_ps(e);
}
static inline float vsum(vec v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
    return _mm_cvtss_f32(q);
}
static inline vec vsum_each(const vec *v) { return sum8_each(v); } /* lane l: the sum of v[l] */
static inline vec load_f32(const float *p, int64_t n) {
    if (n >= LANES) return _mm256_loadu_ps(p);
    float t[LANES] = {0};
    memcpy(t, p, (size_t)n * sizeof(float));
    return _mm256_loadu_ps(t);
}
static inline vec load_bf16(const uint16_t *p, int64_t n) {
    uint16_t t[LANES] = {0};
    if (n < LANES) memcpy(t, p, (size_t)n * sizeof(uint16_t));
    const __m128i h = _mm_loadu_si128((const __m128i *)(n < LANES ? t : p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline void store_f32(float *p, vec v, int64_t n) {
    if (n >= LANES) return _mm256_storeu_ps(p, v);
    float t[LANES];
    _mm256_storeu_ps(t, v);
    memcpy(p, t, (size_t)n * sizeof(float));
}
static inline __m256i bf16_bits(vec v) { /* each lane's bfloat16 (to_bf16), in its low half */
    const __m256i bits = _mm256_castps_si256(v), top = _mm256_srli_epi32(bits, 16);
    const __m256i odd = _mm256_and_si256(top, _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
}
static inline vec vround_bf16(vec v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }
static inline void store_bf16(uint16_t *p, vec v, int64_t n) {
    const __m256i r = bf16_bits(v); /* 32 → 16 bits: packus within each 128-bit half, then in order */
    const __m128i h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
    if (n >= LANES) return _mm_storeu_si128((__m128i *)p, h);
    uint16_t t[LANES];
    _mm_storeu_si128((__m128i *)t, h);
    memcpy(p, t, (size_t)n * sizeof(uint16_t));
}
#else
#define LANES 1
typedef float vec;
static inline vec vzero(void) { return 0.0f; }
static inline vec vset(float a) { return a; }
static inline vec vadd(vec a, vec b) { return a + b; }
static inline vec vsub(vec a, vec b) { return a - b; }
static inline vec vmul(vec a, vec b) { return a * b; }
static inline vec vrcp0(vec a) { return 1.0f / a; }
static inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
static inline vec vmax(vec a, vec b) { return a > b ? a : b; }
static inline vec vclamp(vec a, float lo, float hi) { return a < lo ? lo : a > hi ? hi : a; }
static inline vec vround(vec a) { return nearbyintf(a); }
static inline vec vexp2i(vec n) { return ldexpf(1.0f, (int)n); }
static inline float vsum(vec v) { return v; }
static inline vec vsum_each(const vec *v) { return v[0]; }
static inline vec load_f32(const float *p, int64_t n) { (void)n; return *p; }
static inline vec load_bf16(const uint16_t *p, int64_t n) { (void)n; return from_bf16(*p); }
static inline void store_f32(float *p, vec v, int64_t n) { (void)n; *p = v; }
static inline void store_bf16(uint16_t *p, vec v, int64_t n) { (void)n; *p = to_bf16(v); }
static inline vec vround_bf16(vec v) { return from_bf16(to_bf16(v)); }
#endif

/* 1/a: the estimate refined by one Newton step, r ← r·(2 − a·r), which squares its relative
 * error (within 2 ulp; a division's throughput is a sixteenth of a multiply's) */
static inline vec vrcp(vec a) {
    const vec r = vrcp0(a);
    return vmul(r, vfma(vsub(vzero(), a), r, vset(2.0f)));
}

/* e^x, lane by lane (Cephes' expf); below, silu(x) = x · 1/(1 + e^−x) */
static inline vec vexp(vec x) {
    x = vclamp(x, EXP_LO, EXP_HI);
    const vec n = vround(vmul(x, vset(LOG2E)));
    const vec r = vfma(n, vset(-LN2_LO), vfma(n, vset(-LN2_HI), x)); /* x − n·ln2, in two parts */
    vec p = vset(EXP_P0);
    p = vfma(p, r, vset(EXP_P1));
    p = vfma(p, r, vset(EXP_P2));
    p = vfma(p, r, vset(EXP_P3));
    p = vfma(p, r, vset(EXP_P4));
    p = vfma(p, r, vset(EXP_P5));
    p = vfma(vmul(p, r), r, vadd(r, vset(1.0f))); /* 1 + r + r²·P(r) */
    return vmul(p, vexp2i(n));
}

static inline vec vsilu(vec x) { return vmul(x, vrcp(vadd(vset(1.0f), vexp(vsub(vzero(), x))))); }

#endif
