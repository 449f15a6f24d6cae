/* block_panels.c's AVX2 build (ISA == 1): the integer panels and their tiles (`block_tiles`) and
 * the strips (`block_strips`). Not a header of its own: block_panels.c includes it in that build,
 * after the helpers it uses (`transpose8`, `prefetch_strip`). */

/* Many rows with AVX2 (`block_tiles`), and a batch-invariant engine's few (`block_strips`): the
 * AVX-512 tiles' arithmetic (block_panels_avx512.h), to the bit, on int16 integers. AVX2 has no
 * vpdpbusd: 32 products against the activations' two int8 take vpmaddubsw, vpmaddwd and vpaddd
 * for each part, six instructions, where vpmaddwd + vpaddd take four for 32 products of int16.
 * So every type's integers are widened to int16 in the panel, (K/2, PANEL, 2), the two inputs of
 * a lane of vpmaddwd, and the 4- and 5-bit types' activations are joined into one int16,
 * c_j = 256 a_j + b_j (|c_j| ≤ 32,639): a block's
 *     S = Σ_j u_j c_j = 256 Σ_j u_j a_j + Σ_j u_j b_j
 * is the integer the AVX-512 tiles sum (|S| < 2³¹: 32 · 31 · 32,639), and from it, per block and
 * row, the same float32 operations in the same order: y = fma(float(S − z Σ_j c_j), d · e, y),
 * then y = fma(m, Σ_j x_j, y) for the _1 types (Q8_0: its int8 q against its int16 c). So a row's
 * invariant products have the same bits on either build. 8 outputs' blocks are transposed into
 * the panel in registers (`transpose8`). */

/* Rows per tile: 2 IR int32 accumulators, two weight vectors, a broadcast and a product in the 16
 * registers (with 6 the compiler kept accumulators on the stack: SmolLM2's 30 layers at 64 rows in
 * 1.07× the default products' time, against 0.88× with 5 in a run of the same script). */
#define IR 5

typedef struct {
    int32_t *u;   /* (K/2, PANEL) words, each an output's inputs 2g, 2g + 1 as two int16 */
    float *d, *m; /* (K/32, PANEL) */
} IntPanel;

/* The activations as the tiles and strips read them, for every quantized type. */
typedef struct {
    const int16_t *c;   /* (M, K): Q8_0's c; the other types' 256 a + b (tiles only) */
    const int8_t *a, *b; /* (M, K): the 4- and 5-bit types' a and b, as the strips read them (NULL for Q8_0) */
    const float *e;     /* (M, K/32): each block's e */
    const int32_t *ab;  /* (M, K/32): Σ_j c_j, the zero point's term (NULL for Q8_0) */
    const float *sums;  /* (M, K/32, 2): (e Σ_j c_j, Σ_j x_j), the minimum's term (NULL for Q8_0) */
} Int16Acts;

/* Eight float16 in the low halves of int32 lanes → float32. */
INLINE __m256 halves_of(__m256i v) {
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

/* The scales d and minimums m (zeros where the type has none) of block blk of 8 rows of blocks
 * from `rows_at` (a row every row_bytes; zeros past rn), a lane a row. */
INLINE void heads8(const uint8_t *rows_at, int64_t row_bytes, int64_t rn, int64_t blk, const int type, __m256 *d,
                   __m256 *m) {
    const Layout L = LAYOUTS[type];
    const uint8_t *at = rows_at + blk * L.bytes;
#define HEAD(i) ((i) < rn ? (int)load32(at + (i) * row_bytes) : 0)
    const __m256i heads = _mm256_setr_epi32(HEAD(0), HEAD(1), HEAD(2), HEAD(3), HEAD(4), HEAD(5), HEAD(6), HEAD(7));
#undef HEAD
    *d = halves_of(_mm256_and_si256(heads, _mm256_set1_epi32(0xffff)));
    *m = L.min ? halves_of(_mm256_srli_epi32(heads, 16)) : _mm256_setzero_ps();
}

/* Outputs n0 .. n0 + rn − 1 of Ŵ into the panel p (zeros past rn): 8 outputs' blocks at a time,
 * transposed in registers into the panel's words. */
static void int_panel(const int type, const uint8_t *W, int64_t n0, int64_t rn, int64_t K, IntPanel *p) {
    const Layout L = LAYOUTS[type];
    const int64_t nb = K / 32;
    for (int64_t i0 = 0; i0 < PANEL; i0 += 8)
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *rows_at = W + (n0 + i0) * nb * L.bytes;
            __m256i low[8], high[8];
            for (int64_t i = 0; i < 8; i++) {
                low[i] = high[i] = _mm256_setzero_si256();
                if (i0 + i < rn) {
                    __m256i w[2];
                    block_words(type, rows_at + (i * nb + blk) * L.bytes, w);
                    low[i] = w[0], high[i] = w[1];
                }
            }
            __m256 d, m;
            heads8(rows_at, nb * L.bytes, rn - i0, blk, type, &d, &m);
            _mm256_store_ps(p->d + blk * PANEL + i0, d), _mm256_store_ps(p->m + blk * PANEL + i0, m);
            transpose8(low), transpose8(high);
            for (int g = 0; g < 8; g++) { /* word g: inputs 2g, 2g + 1 of the block (high: + 16) */
                _mm256_store_si256((__m256i *)(p->u + (blk * 16 + g) * PANEL + i0), low[g]);
                _mm256_store_si256((__m256i *)(p->u + (blk * 16 + 8 + g) * PANEL + i0), high[g]);
            }
        }
}

/* The float32 steps of one block of one row for 8 outputs (the tiles' and the strips'): y =
 * fma(float(S − z Σ_j c_j), d · e, y), then y = fma(m, Σ_j x_j, y) where the type has a minimum. */
INLINE __m256 block_step(const int type, __m256i S, __m256 d, __m256 m, const Int16Acts *acts, int64_t at,
                         __m256 y) {
    const Layout L = LAYOUTS[type];
    if (L.zero_shift) S = _mm256_sub_epi32(S, _mm256_set1_epi32((1 << L.zero_shift) * acts->ab[at]));
    y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(d, _mm256_set1_ps(acts->e[at])), y);
    if (L.min) y = _mm256_fmadd_ps(m, _mm256_set1_ps(acts->sums[2 * at + 1]), y);
    return y;
}

/* Rows m0 .. m0 + rows − 1 of the activations (`acts`: Int16Acts) against panel p → out (IR,
 * PANEL): per block, the rows' int32 sums S in registers, then `block_step` on out. */
INLINE void int_tile(const int type, const IntPanel *p, const void *acts, int64_t m0, const int rows, int64_t K,
                     float *out) {
    const Int16Acts *a16 = acts;
    for (int r = 0; r < rows; r++) memset(out + r * PANEL, 0, sizeof(float) * PANEL);
    for (int64_t blk = 0; blk < K / 32; blk++) {
        const int32_t *u = p->u + blk * 16 * PANEL;
        const int16_t *c = a16->c + m0 * K + blk * 32;
        __m256i S[IR][2];
        for (int r = 0; r < rows; r++) S[r][0] = S[r][1] = _mm256_setzero_si256();
        for (int g = 0; g < 16; g++) { /* inputs 2g, 2g + 1 */
            const __m256i w0 = _mm256_load_si256((const __m256i *)(u + g * PANEL));
            const __m256i w1 = _mm256_load_si256((const __m256i *)(u + g * PANEL + 8));
            for (int r = 0; r < rows; r++) {
                const __m256i pair = _mm256_set1_epi32((int)load32((const uint8_t *)(c + r * K + 2 * g)));
                S[r][0] = _mm256_add_epi32(S[r][0], _mm256_madd_epi16(w0, pair));
                S[r][1] = _mm256_add_epi32(S[r][1], _mm256_madd_epi16(w1, pair));
            }
        }
        for (int r = 0; r < rows; r++) {
            const int64_t at = (m0 + r) * (K / 32) + blk;
            for (int h = 0; h < 2; h++) {
                const __m256 d = _mm256_load_ps(p->d + blk * PANEL + 8 * h);
                const __m256 m = _mm256_load_ps(p->m + blk * PANEL + 8 * h);
                float *y = out + r * PANEL + 8 * h;
                _mm256_store_ps(y, block_step(type, S[r][h], d, m, a16, at, _mm256_load_ps(y)));
            }
        }
    }
}

/* A few rows in the tiles' arithmetic (`block_strips`, for a batch-invariant engine): the outputs
 * of STRIP output rows at a time, one float32 lane each, read from the blocks as they lie, with
 * int_tile's operations in its order. An output's block comes out of vpmaddubsw + vpmaddwd (Q8_0:
 * two vpmaddwd) in 8 int32 lanes of 4 inputs; `block_sums8` adds 8 outputs' lanes into one vector
 * of their sums S, a lane an output (exact: integers). The bytes of the strip after the next are
 * prefetched into L2 a slice per block (SmolLM2's 30 Q4_1 layers, one row, a Zen 4 running this
 * build: 0.95-0.96× the block kernel's speed, against 0.83-0.89× prefetching the next strip's and
 * 0.92-0.96× three or four ahead). */
#define STRIP 8       /* outputs a strip: one lane each */
#define STRIP_ROWS 4  /* rows of x a call */

/* v[i] (i < 8): output i's int32 partial sums of one block in 8 lanes → lane i: their sum. */
INLINE __m256i block_sums8(const __m256i v[STRIP]) {
    /* within each 128-bit half: lanes 0-3 of the result the sums of v[0..3]'s half, then v[4..7]'s */
    const __m256i q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
}

/* Block blk's sums S of one row (its activations from q on) for the strip's outputs, their blocks
 * at `blocks` (a zero block past rn): Q8_0's q widened to int16 against the row's c, as each row
 * asks (16 vectors kept for the rows would not fit the registers); the 4- and 5-bit types' u as
 * unsigned bytes in u[i] (`unpack_block`) against its a and b: pairs of u_j a_j in int16 (|·| ≤
 * 2 · 31 · 127), pairs of those in int32, 256 Σ u a + Σ u b. */
INLINE __m256i strip_sums(const int type, const uint8_t *const blocks[STRIP], const __m256i u[STRIP],
                          const Int16Acts *acts, int64_t q) {
    __m256i v[STRIP];
    if (type == Q8_0) {
        const __m256i c0 = _mm256_loadu_si256((const __m256i *)(acts->c + q));
        const __m256i c1 = _mm256_loadu_si256((const __m256i *)(acts->c + q + 16));
        for (int i = 0; i < STRIP; i++) {
            __m256i w[2];
            block_words(Q8_0, blocks[i], w);
            v[i] = _mm256_add_epi32(_mm256_madd_epi16(w[0], c0), _mm256_madd_epi16(w[1], c1));
        }
        return block_sums8(v);
    }
    const __m256i a = _mm256_loadu_si256((const __m256i *)(acts->a + q));
    const __m256i b = _mm256_loadu_si256((const __m256i *)(acts->b + q));
    for (int i = 0; i < STRIP; i++)
        v[i] = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u[i], a), _mm256_set1_epi16(256)),
                                _mm256_madd_epi16(_mm256_maddubs_epi16(u[i], b), _mm256_set1_epi16(1)));
    return block_sums8(v);
}

/* Outputs n0 .. n0 + rn − 1 (rn ≤ STRIP) of x rows m0 .. m0 + rows − 1 → y (M, N), per block
 * and row the sums S of int_tile and its `block_step`. */
INLINE void strip(const int type, const void *acts, int64_t m0, const int rows, const uint8_t *W, int64_t n0,
                  int64_t rn, int64_t N, int64_t K, float *y) {
    const Layout L = LAYOUTS[type];
    const Int16Acts *a16 = acts;
    const int64_t nb = K / 32, row_bytes = nb * L.bytes;
    const uint8_t *rows_at = W + n0 * row_bytes, *ahead = rows_at + 2 * STRIP * row_bytes, *end = W + N * row_bytes;
    __m256 acc[STRIP_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < nb; blk++) {
        prefetch_strip(ahead, end, blk, 1, L.bytes, STRIP);
        static const uint8_t zeros[64] = {0}; /* a block of zeros, any type's */
        const uint8_t *blocks[STRIP];
        __m256i u[STRIP];
        for (int i = 0; i < STRIP; i++) {
            blocks[i] = i < rn ? rows_at + i * row_bytes + blk * L.bytes : zeros;
            if (type != Q8_0) u[i] = unpack_block(type, blocks[i]);
        }
        __m256 d, m;
        heads8(rows_at, row_bytes, rn, blk, type, &d, &m);
        for (int r = 0; r < rows; r++) {
            const int64_t q = (m0 + r) * K + blk * 32;
            acc[r] = block_step(type, strip_sums(type, blocks, u, a16, q), d, m, a16, q / 32, acc[r]);
        }
    }
    const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)rn), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int r = 0; r < rows; r++) _mm256_maskstore_ps(y + (m0 + r) * N + n0, valid, acc[r]);
}

/* The activations as Int16Acts in `buffer` (QUANTIZED_BYTES): Q8_0's, or the 4- and 5-bit types'
 * a and b, joined into c = 256 a + b for the tiles (the strips read a and b: no c). */
typedef struct {
    Acts ab;
    Wide wide;
    Int16Acts c;
} QuantizedActs;
#define QUANTIZED_BYTES(type, M, K) ((type) == Q8_0 ? WIDE_BYTES(M, K) : ACTS_BYTES(M, K) + JOINED_BYTES(M, K))

INLINE const void *quantize(const int type, const void *x, int x_bf16, int64_t M, int64_t K, char *buffer,
                            const int strips, QuantizedActs *q) {
    if (type == Q8_0) {
        quantize_wide(x, x_bf16, M, K, buffer, &q->wide);
        q->c = (Int16Acts){q->wide.c, NULL, NULL, q->wide.e, NULL, NULL};
        return &q->c;
    }
    quantize_acts(x, x_bf16, M, K, buffer, &q->ab);
    if (!strips) join_acts(&q->ab, M, K, buffer + ACTS_BYTES(M, K));
    q->c = (Int16Acts){q->ab.c, q->ab.a, q->ab.b, q->ab.block_e, q->ab.block_ab, q->ab.block_sums};
    return &q->c;
}
