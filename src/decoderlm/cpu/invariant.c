/* Batch-invariant kernels (decoderlm.cpu.invariant): a row's results do not depend on the rows
 * computed with it.
 *
 * invariant_linear: y = x Wᵀ where every output y[m, n] is summed in one fixed order, whatever the
 * number of rows M and the row's place m.
 *
 * y[m, n] = Σ_k x[m, k] · W[n, k] is accumulated in float32 vector lanes L wide (16 with AVX-512,
 * 8 with AVX2, 1 without): lane l sums the products of k ≡ l (mod L) in increasing k, the last
 * K mod L inputs masked in (AVX-512) or added lane by lane (AVX2); then the lanes are added by
 * one fixed tree. A BLAS picks its blocking of K and its kernels by the shape, so a row's sums
 * change with the batch around it (Thinking Machines, 2025, "Defeating Nondeterminism in LLM
 * Inference"); here only the tiling of rows and outputs changes with the shape, never an output's
 * arithmetic: a full tile of 4 rows × 4 outputs (16 accumulators, each row of x and of W loaded
 * once per step of k) and the partial tiles at the edges perform, per output, the same operations
 * in the same order (and the file is compiled without -ffast-math's reassociation). bfloat16 operands are widened exactly to float32 (a 16-bit shift); the sums round to
 * bfloat16 once, to nearest even. Parallel over blocks of outputs with OpenMP; each output is
 * computed by one thread, whole.
 */
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ROWS 4 /* rows of x per tile */
#define OUTS 4 /* outputs (rows of W) per tile */
#define BLOCK 64 /* outputs per unit of parallel work */

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec v) { /* fixed tree: halves, then halves */
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
    return _mm_cvtss_f32(q);
}
static inline vec load_f32(const float *p, int64_t n) { /* n ≤ LANES values, zeros after */
    return n >= LANES ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
static inline vec load_bf16(const uint16_t *p, int64_t n) {
    __m256i h = n >= LANES ? _mm256_loadu_si256((const __m256i *)p)
                           : _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
    return _mm_cvtss_f32(q);
}
static inline vec load_f32(const float *p, int64_t n) {
    if (n >= LANES) return _mm256_loadu_ps(p);
    float t[LANES] = {0};
    memcpy(t, p, (size_t)n * sizeof(float));
    return _mm256_loadu_ps(t);
}
static inline vec load_bf16(const uint16_t *p, int64_t n) {
    uint16_t t[LANES] = {0};
    memcpy(t, p, (size_t)(n >= LANES ? LANES : n) * sizeof(uint16_t));
    __m128i h = _mm_loadu_si128((const __m128i *)t);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#else
#define LANES 1
typedef float vec;
static inline vec vzero(void) { return 0.0f; }
static inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
static inline float vsum(vec v) { return v; }
static inline vec load_f32(const float *p, int64_t n) { (void)n; return *p; }
static inline vec load_bf16(const uint16_t *p, int64_t n) {
    (void)n;
    uint32_t bits = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif

static inline uint16_t round_bf16(float f) { /* to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* One tile: rows 0 .. rm − 1 of x against outputs (rows of w) 0 .. rn − 1 (rm ≤ ROWS, rn ≤ OUTS),
 * the sums into out (ROWS × OUTS). FULL is the same code with rm = ROWS and rn = OUTS known to the
 * compiler, so that its 16 accumulators stay in registers; per output both run the same
 * operations. */
#define TILE(NAME, T, LOAD, RM, RN)                                                                \
    static void NAME(const T *x, const T *w, float *out, int64_t rm, int64_t rn, int64_t K) {     \
        vec acc[ROWS][OUTS];                                                                       \
        (void)rm, (void)rn;                                                                        \
        for (int r = 0; r < RM; r++)                                                               \
            for (int c = 0; c < RN; c++) acc[r][c] = vzero();                                      \
        for (int64_t k = 0; k < K; k += LANES) {                                                   \
            const int64_t n = K - k;                                                               \
            vec wv[OUTS], xv;                                                                      \
            for (int c = 0; c < RN; c++) wv[c] = LOAD(w + c * K + k, n);                           \
            for (int r = 0; r < RM; r++) {                                                         \
                xv = LOAD(x + r * K + k, n);                                                       \
                for (int c = 0; c < RN; c++) acc[r][c] = vfma(xv, wv[c], acc[r][c]);              \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < RM; r++)                                                               \
            for (int c = 0; c < RN; c++) out[r * OUTS + c] = vsum(acc[r][c]);                      \
    }
TILE(full_f32, float, load_f32, ROWS, OUTS)
TILE(part_f32, float, load_f32, rm, rn)
TILE(full_bf16, uint16_t, load_bf16, ROWS, OUTS)
TILE(part_bf16, uint16_t, load_bf16, rm, rn)

/* x (M, K), w (N, K), y (M, N), contiguous; float32 or bfloat16 (`bf16`). */
void invariant_linear(const void *x, const void *w, void *y, int64_t M, int64_t N, int64_t K,
                      int bf16) {
    const int64_t blocks = (N + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        float out[ROWS * OUTS];
        const int64_t n_end = (b + 1) * BLOCK < N ? (b + 1) * BLOCK : N;
        for (int64_t m = 0; m < M; m += ROWS) {
            const int64_t rm = M - m < ROWS ? M - m : ROWS;
            for (int64_t n = b * BLOCK; n < n_end; n += OUTS) {
                const int64_t rn = n_end - n < OUTS ? n_end - n : OUTS;
                const int full = rm == ROWS && rn == OUTS;
                const uint16_t *xh = (const uint16_t *)x + m * K, *wh = (const uint16_t *)w + n * K;
                const float *xf = (const float *)x + m * K, *wf = (const float *)w + n * K;
                if (bf16) (full ? full_bf16 : part_bf16)(xh, wh, out, rm, rn, K);
                else (full ? full_f32 : part_f32)(xf, wf, out, rm, rn, K);
                for (int64_t r = 0; r < rm; r++)
                    for (int64_t c = 0; c < rn; c++) {
                        const float v = out[r * OUTS + c];
                        if (bf16) ((uint16_t *)y)[(m + r) * N + n + c] = round_bf16(v);
                        else ((float *)y)[(m + r) * N + n + c] = v;
                    }
            }
        }
    }
}

/* invariant_silu_mul: y = silu(g) ⊙ u = g / (1 + e^−g) ⊙ u, element by element with the C
 * library's expf. A vectorised elementwise loop computes its last few elements by a scalar path
 * whose exp rounds differently from the vector one, so which elements those are (where a row
 * falls in the batch) would change their bits; here every element takes the same scalar path
 * (not vectorised), in float32, the bfloat16 result rounded once. Parallel over elements. */
__attribute__((optimize("no-tree-vectorize"))) void invariant_silu_mul(
    const void *g, const void *u, void *y, int64_t n, int bf16) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float gi, ui;
        if (bf16) {
            uint32_t gb = (uint32_t)((const uint16_t *)g)[i] << 16, ub = (uint32_t)((const uint16_t *)u)[i] << 16;
            memcpy(&gi, &gb, sizeof gi);
            memcpy(&ui, &ub, sizeof ui);
        } else {
            gi = ((const float *)g)[i];
            ui = ((const float *)u)[i];
        }
        const float v = gi / (1.0f + expf(-gi)) * ui;
        if (bf16) ((uint16_t *)y)[i] = round_bf16(v);
        else ((float *)y)[i] = v;
    }
}
