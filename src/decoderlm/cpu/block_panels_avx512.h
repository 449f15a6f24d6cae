/* block_panels.c's AVX-512 VNNI build (ISA == 2): the integer panels and their tiles
 * (`block_tiles`) and the strips (`block_strips`). Not a header of its own: block_panels.c includes
 * it in that build, after the helpers it uses (`prefetch_strip`). */

/* Many rows with AVX-512 VNNI: panels of the blocks' integers. Each thread unpacks the weights of
 * PANEL outputs at a time into its cache, laid out for the integer dot products of 16 outputs at
 * once (one int32 lane an output), with each block's scale d and minimum m per output (K/32,
 * PANEL), and multiplies tiles of IR rows of the activations by it, the activations quantized as
 * for block_linear.c's kernels (the same rounding at every number of rows):
 *   - 4- and 5-bit types: unsigned bytes u, (K/4, PANEL, 4), the four inputs that one lane of
 *     vpdpbusd sums; x_j ≈ e (256 a_j + b_j), four of a row's a (then b) broadcast at a time;
 *     per block, exactly in int32 and then once in float32 (z the zero point):
 *         y += d e (Σ_j u_j (256 a_j + b_j) − z Σ_j (256 a_j + b_j)) + m Σ_j x_j
 *   - Q8_0: its int8 q widened to int16, (K/2, PANEL, 2), the two inputs of a lane of vpdpwssd;
 *     x_j ≈ e c_j with c int16, two of a row's c broadcast at a time:
 *         y += d e Σ_j q_j c_j
 * Per block and row the 32 outputs take 32 vpdpbusd or vpdpwssd and 4 to 8 float operations,
 * where the dequantized panels take 64 FMAs. 16 outputs' blocks are transposed into the panel in
 * registers (`transpose16`). */
#define IR 6 /* rows per tile: 2 IR int32 and 2 IR float32 accumulators in AVX-512's 32 registers */

typedef struct {
    uint8_t *u;   /* (K/4, PANEL, 4) bytes, Q8_0: (K/2, PANEL, 2) int16 */
    float *d, *m; /* (K/32, PANEL) */
} IntPanel;

/* The 16 × 16 int32 matrix of rows r[0..15] → its transpose, r[j] lane i = r[i] lane j before:
 * 4 × 4 transposes within each 128-bit chunk (unpack 32, then 64 bits), then the chunks moved. */
INLINE void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 4) {
        for (int j = 0; j < 4; j += 2) {
            t[i + j] = _mm512_unpacklo_epi32(r[i + j], r[i + j + 1]);
            t[i + j + 1] = _mm512_unpackhi_epi32(r[i + j], r[i + j + 1]);
        }
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);     /* chunk L: column 4L of rows i .. i + 3 */
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]); /* 4L + 1 */
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i p0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), q0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xee);
        const __m512i p1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        const __m512i q1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xee);
        t[c] = _mm512_shuffle_i32x4(p0, p1, 0x88), t[4 + c] = _mm512_shuffle_i32x4(p0, p1, 0xdd);
        t[8 + c] = _mm512_shuffle_i32x4(q0, q1, 0x88), t[12 + c] = _mm512_shuffle_i32x4(q0, q1, 0xdd);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* 64 bytes of a row from block blk on, as the panel holds them: Q8_0's block widened to int16;
 * a 4- or 5-bit type's blocks blk and blk + 1 (blk alone where `last`) as unsigned bytes. */
INLINE __m512i panel_line(const int type, const uint8_t *b, const int last) {
    if (type == Q8_0) return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(b + LAYOUTS[Q8_0].qs)));
    return unpack_pair(type, b, last ? b : b + LAYOUTS[type].bytes);
}

/* Outputs n0 .. n0 + rn − 1 of Ŵ into the panel p (zeros past rn): 16 outputs' 64 bytes (16
 * words) at a time, transposed in registers into the panel's lines. */
static void int_panel(const int type, const uint8_t *W, int64_t n0, int64_t rn, int64_t K, IntPanel *p) {
    const Layout L = LAYOUTS[type];
    const int64_t nb = K / 32, step = type == Q8_0 ? 1 : 2, per_word = type == Q8_0 ? 2 : 4; /* blocks a line, inputs a word */
    for (int64_t i0 = 0; i0 < PANEL; i0 += 16)
        for (int64_t blk = 0; blk < nb; blk += step) {
            const int last = blk + step > nb; /* a 4-bit row's odd last block */
            __m512i r[16];
            for (int64_t i = 0; i < 16; i++) {
                const int64_t n = i0 + i;
                r[i] = _mm512_setzero_si512();
                for (int64_t j = 0; j < step - last; j++) p->d[(blk + j) * PANEL + n] = p->m[(blk + j) * PANEL + n] = 0.0f;
                if (n >= rn) continue;
                const uint8_t *b = W + ((n0 + n) * nb + blk) * L.bytes;
                r[i] = panel_line(type, b, last);
                for (int64_t j = 0; j < step - last; j++) {
                    p->d[(blk + j) * PANEL + n] = half_to_float(load16(b + j * L.bytes));
                    if (L.min) p->m[(blk + j) * PANEL + n] = half_to_float(load16(b + j * L.bytes + 2));
                }
            }
            transpose16(r);
            for (int w = 0; w < (last ? 8 : 16); w++) /* word w of the line: per_word inputs */
                _mm512_store_si512(p->u + ((blk * 32 / per_word + w) * PANEL + i0) * 4, r[w]);
        }
}

/* y += d e Σ for both vectors of outputs: the block's int32 sums `dot` of one row. */
INLINE void scale_add(const __m512i dot[2], const float *d, const float e, __m512 acc[2]) {
    const __m512 ev = _mm512_set1_ps(e);
    acc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[0]), _mm512_mul_ps(_mm512_load_ps(d), ev), acc[0]);
    acc[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[1]), _mm512_mul_ps(_mm512_load_ps(d + 16), ev), acc[1]);
}

/* Rows m0 .. m0 + rows − 1 of the activations (`acts`: Acts, or Wide for Q8_0) against panel p →
 * out (IR, PANEL). */
INLINE void int_tile(const int type, const IntPanel *p, const void *acts, int64_t m0, const int rows, int64_t K,
                     float *out) {
    const Acts *ab = acts;
    const Wide *wide = acts;
    const int has_min = LAYOUTS[type].min;
    const int32_t zero = LAYOUTS[type].zero_shift ? 1 << LAYOUTS[type].zero_shift : 0;
    __m512 acc[IR][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < K / 32; blk++) {
        const uint8_t *u = p->u + blk * 32 * PANEL * (type == Q8_0 ? 2 : 1);
        const float *d = p->d + blk * PANEL;
        __m512i dot[IR][2];
        for (int r = 0; r < rows; r++) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
        if (type == Q8_0) {
            const uint8_t *c = (const uint8_t *)(wide->c + m0 * K + blk * 32);
            for (int g = 0; g < 16; g++) { /* inputs 2g, 2g + 1 */
                const __m512i w0 = _mm512_load_si512(u + g * 4 * PANEL), w1 = _mm512_load_si512(u + g * 4 * PANEL + 64);
                for (int r = 0; r < rows; r++) {
                    const __m512i a = _mm512_set1_epi32((int)load32(c + 2 * (r * K + 2 * g)));
                    dot[r][0] = _mm512_dpwssd_epi32(dot[r][0], w0, a);
                    dot[r][1] = _mm512_dpwssd_epi32(dot[r][1], w1, a);
                }
            }
            for (int r = 0; r < rows; r++) scale_add(dot[r], d, wide->e[(m0 + r) * (K / 32) + blk], acc[r]);
            continue;
        }
        for (int part = 0; part < 2; part++) { /* Σ u a, shifted by 8 bits, then + Σ u b */
            const uint8_t *act = (const uint8_t *)(part ? ab->b : ab->a) + m0 * K + blk * 32;
            for (int g = 0; g < 8; g++) { /* inputs 4g .. 4g + 3 */
                const __m512i w0 = _mm512_load_si512(u + g * 4 * PANEL), w1 = _mm512_load_si512(u + g * 4 * PANEL + 64);
                for (int r = 0; r < rows; r++) {
                    const __m512i a = _mm512_set1_epi32((int)load32(act + r * K + 4 * g));
                    dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], w0, a);
                    dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], w1, a);
                }
            }
            for (int r = 0; part == 0 && r < rows; r++)
                dot[r][0] = _mm512_slli_epi32(dot[r][0], 8), dot[r][1] = _mm512_slli_epi32(dot[r][1], 8);
        }
        for (int r = 0; r < rows; r++) {
            const int64_t at = (m0 + r) * (K / 32) + blk;
            const __m512i zs = _mm512_set1_epi32(zero * ab->block_ab[at]);
            dot[r][0] = _mm512_sub_epi32(dot[r][0], zs), dot[r][1] = _mm512_sub_epi32(dot[r][1], zs);
            scale_add(dot[r], d, ab->block_e[at], acc[r]);
            if (has_min) {
                const __m512 sum = _mm512_set1_ps(ab->block_sums[2 * at + 1]);
                acc[r][0] = _mm512_fmadd_ps(_mm512_load_ps(p->m + blk * PANEL), sum, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(_mm512_load_ps(p->m + blk * PANEL + 16), sum, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(out + r * PANEL, acc[r][0]);
        _mm512_storeu_ps(out + r * PANEL + 16, acc[r][1]);
    }
}

/* A few rows in the tiles' arithmetic (`block_strips`, for a batch-invariant engine): the outputs
 * of STRIP output rows at a time, one float32 lane each, read from the blocks as they lie, with
 * int_tile's operations in its order, so that a row's products have the same bits here as on the
 * tiles. An output's dot products come out of vpdpbusd or vpdpwssd in 16 int32 lanes of 4 or 2
 * inputs; `block_sums16` adds 16 outputs' lanes into one vector of their blocks' sums, a lane an
 * output (exact: integers). The strip's rows lie one after the other; the next strip's are
 * prefetched into L2 a slice per block (without it they ran at 0.42-0.48× the kernels' speed).
 * Against block_linear.c's kernels, which sum each output in lanes of its inputs (SmolLM2's Q4_1
 * and Q8_0 files, their 30 layers and Q8_0 heads, weights in memory, 2 threads of a Zen 4): one
 * row 0.83-1.03× their speed, four rows 0.96-0.99×; a 1536 × 576 product in cache 1.09-1.25×
 * (one row and four, Q4_1 and Q8_0, one thread or two). From memory the kernels' one stream of
 * weights a thread is read faster than a strip's 16; the kernels keep the default's few rows. */
#define STRIP 16      /* outputs a strip: one lane each */
#define STRIP_ROWS 4  /* rows of x a call: their accumulators in registers */

/* v[i] (i < 16): output i's int32 partial sums, lanes 0-7 of one block and 8-15 of the next → s[0]
 * lane i = Σ v[i] lanes 0-7, s[1] lane i = Σ v[i] lanes 8-15. */
INLINE void block_sums16(const __m512i v[STRIP], __m512i s[2]) {
    __m512i w[8], x[4], y[2];
    for (int j = 0; j < 8; j++) /* each 128-bit chunk: outputs 2j, 2j + 1, two partial sums each */
        w[j] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * j], v[2 * j + 1]),
                                _mm512_unpackhi_epi32(v[2 * j], v[2 * j + 1]));
    for (int k = 0; k < 4; k++) /* chunk c: outputs 4k .. 4k + 3, each the sum of its lanes 4c .. 4c + 3 */
        x[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(w[2 * k], w[2 * k + 1]),
                                _mm512_unpackhi_epi64(w[2 * k], w[2 * k + 1]));
    for (int h = 0; h < 2; h++) /* chunks: the first block of outputs 8h .. 8h + 3, the second, then of 8h + 4 .. */
        y[h] = _mm512_add_epi32(_mm512_shuffle_i32x4(x[2 * h], x[2 * h + 1], 0x88),
                                _mm512_shuffle_i32x4(x[2 * h], x[2 * h + 1], 0xdd));
    s[0] = _mm512_shuffle_i32x4(y[0], y[1], 0x88);
    s[1] = _mm512_shuffle_i32x4(y[0], y[1], 0xdd);
}

/* The first four bytes of block blk of each valid row of the strip ([d | m] as two float16), and
 * the float16 in their low or high half as float32. */
INLINE __m512i block_heads(const uint8_t *strip, int64_t row_bytes, __mmask16 valid, int64_t blk, int bytes) {
    const __m512i row_at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32((int)row_bytes));
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, row_at, strip + blk * bytes, 1);
}
INLINE __m512 low_halves(__m512i heads) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(heads)); }
INLINE __m512 high_halves(__m512i heads) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(heads, 16))); }

/* Outputs n0 .. n0 + rn − 1 (rn ≤ STRIP) of x rows m0 .. m0 + rows − 1 → y (M, N), a quantized
 * `type`; `acts`: Acts, or Wide for Q8_0. Per block and row, as int_tile:
 *     y = fma(float(S − z Σ_j (256 a_j + b_j)), d · e, y), then y = fma(m, Σ_j x_j, y) (the _1 types)
 *     y = fma(float(S), d · e, y) (Q8_0) */
INLINE void strip(const int type, const void *acts, int64_t m0, const int rows, const uint8_t *W, int64_t n0,
                  int64_t rn, int64_t N, int64_t K, float *y) {
    const Layout L = LAYOUTS[type];
    const Acts *ab = acts;
    const Wide *wide = acts;
    const int64_t nb = K / 32, row_bytes = nb * L.bytes, step = type == Q8_0 ? 1 : 2; /* blocks a line */
    const int32_t zero = L.zero_shift ? 1 << L.zero_shift : 0;
    const __mmask16 valid = (__mmask16)((1u << rn) - 1);
    const uint8_t *rows_at = W + n0 * row_bytes, *next = rows_at + STRIP * row_bytes, *end = W + N * row_bytes;
    __m512 acc[STRIP_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < nb; blk += step) {
        const int last = blk + step > nb; /* a 4-bit row's odd last block, alone */
        prefetch_strip(next, end, blk, step, L.bytes, STRIP);
        __m512i u[STRIP];
        for (int i = 0; i < STRIP; i++)
            u[i] = i < rn ? panel_line(type, rows_at + i * row_bytes + blk * L.bytes, last) : _mm512_setzero_si512();
        __m512i heads[2];
        heads[0] = block_heads(rows_at, row_bytes, valid, blk, L.bytes);
        heads[1] = step == 2 && !last ? block_heads(rows_at, row_bytes, valid, blk + 1, L.bytes) : heads[0];
        for (int r = 0; r < rows; r++) {
            const int64_t q = (m0 + r) * K + blk * 32;
            __m512i v[STRIP], s[2];
            if (type == Q8_0) {
                const __m512i c = _mm512_loadu_si512(wide->c + q);
                for (int i = 0; i < STRIP; i++) v[i] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), u[i], c);
                block_sums16(v, s);
                const __m512 de = _mm512_mul_ps(low_halves(heads[0]), _mm512_set1_ps(wide->e[q / 32]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s[0], s[1])), de, acc[r]);
                continue;
            }
            const __mmask64 mq = last ? 0xffffffffull : ~0ull;
            const __m512i a = _mm512_maskz_loadu_epi8(mq, ab->a + q), b = _mm512_maskz_loadu_epi8(mq, ab->b + q);
            for (int i = 0; i < STRIP; i++) {
                const __m512i high = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[i], a);
                v[i] = _mm512_dpbusd_epi32(_mm512_slli_epi32(high, 8), u[i], b);
            }
            block_sums16(v, s);
            for (int j = 0; j < 2 - last; j++) {
                const int64_t at = q / 32 + j;
                const __m512i sum = _mm512_sub_epi32(s[j], _mm512_set1_epi32(zero * ab->block_ab[at]));
                const __m512 de = _mm512_mul_ps(low_halves(heads[j]), _mm512_set1_ps(ab->block_e[at]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), de, acc[r]);
                if (L.min) acc[r] = _mm512_fmadd_ps(high_halves(heads[j]), _mm512_set1_ps(ab->block_sums[2 * at + 1]), acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(y + (m0 + r) * N + n0, valid, acc[r]);
}

/* The activations the tiles and strips read, in `buffer` (QUANTIZED_BYTES): Acts, or Wide for Q8_0. */
typedef union {
    Acts ab;
    Wide wide;
} QuantizedActs;
#define QUANTIZED_BYTES(type, M, K) ((type) == Q8_0 ? WIDE_BYTES(M, K) : ACTS_BYTES(M, K))

INLINE const void *quantize(const int type, const void *x, int x_bf16, int64_t M, int64_t K, char *buffer,
                            const int strips, QuantizedActs *q) {
    (void)strips; /* both read the same activations */
    if (type == Q8_0) {
        quantize_wide(x, x_bf16, M, K, buffer, &q->wide);
        return &q->wide;
    }
    quantize_acts(x, x_bf16, M, K, buffer, &q->ab);
    return &q->ab;
}
