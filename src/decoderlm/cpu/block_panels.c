/* Products y = x Ŵᵀ of many rows with Ŵ in ggml's block formats (a decode step of many
 * sequences, a prompt's prefill): each thread unpacks the weights of PANEL outputs at a time into
 * a panel in its cache, never written to memory, and multiplies every row by it there, in tiles
 * of rows as a BLAS micro-kernel does (Goto and van de Geijn, 2008). Two kinds of panel:
 *   - integer panels (`block_tiles`, AVX-512 VNNI and AVX2, the quantized types): the blocks'
 *     integers, summed with the activations quantized as for block_linear.c's kernels by
 *     vpdpbusd (64 products an instruction, two per product: the activations' two int8) or
 *     vpdpwssd (Q8_0: 32, one per product); with AVX2 by vpmaddwd + vpaddd on both as int16
 *     (16 products in two instructions), the same integer sums;
 *   - dequantized panels (`block_panels`, every build and type): the weights' float32 values,
 *     summed by outer.h's FMA tile, 16 products an instruction (8 with AVX2).
 * And strips (`block_strips`, AVX-512 VNNI and AVX2): a few rows with the integer tiles'
 * arithmetic, read from the blocks as they lie, for a batch-invariant engine (a row's bits the
 * same at any number of rows; block_linear.py). Both builds' tiles and strips give a row the
 * same bits.
 * SmolLM2-135M's 30 Q4_1 layers, their weights read from memory, 2 threads of a Zen 4: at 24 /
 * 32 / 64 rows 24.9 / 31.2 / 55.6 ms on integer panels, 61.5 / 69.5 / 107.5 on dequantized ones;
 * the AVX2 build's (the same CPU, 2026-12-07, medians of 15 interleaved rounds' ratios) at 9 / 16
 * / 32 / 64 rows 0.99× / 0.89× / 0.89× / 1.12× the time of its default products (the block
 * kernel up to 16 rows, then dequantized panels), its strips at 1 / 4 / 8 rows 1.05× / 1.03× /
 * 1.06×; on the Q8_0 head (int16 weights, twice its blocks' bytes in the panels) the strips
 * 1.18-1.26×, the tiles 1.25× at 9 and 16 rows and 0.80× / 0.95× at 32 / 64. */
#include "vec.h"
#include "outer.h"
#include "blocks.h"

#if ISA > 0
/* The 8 × 8 int32 matrix of rows r[0..7] → its transpose: 2 × 2 then 4 × 4 blocks within each
 * 128-bit half (unpack 32, then 64 bits), then the halves exchanged. */
INLINE void transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);     /* columns 0 and 4 of rows i .. i + 3 */
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]); /* 1 and 5 */
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
        r[4 + c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
    }
}

/* rows (PANEL, K) float32 → panel (K, PANEL): 8 × 8 blocks transposed in registers, the last K % 8
 * inputs one at a time. (SmolLM2's 30 Q4_1 layers at 64 rows on the AVX2 build: with a plain
 * loop of scalar copies the transposition took ~15% of the products' time.) */
static void transpose_panel(const float *rows, int64_t K, float *panel) {
    const int64_t whole = K - K % 8;
    for (int64_t k0 = 0; k0 < whole; k0 += 8)
        for (int64_t i0 = 0; i0 < PANEL; i0 += 8) {
            __m256i r[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_castps_si256(_mm256_loadu_ps(rows + (i0 + i) * K + k0));
            transpose8(r);
            for (int c = 0; c < 8; c++) _mm256_storeu_ps(panel + (k0 + c) * PANEL + i0, _mm256_castsi256_ps(r[c]));
        }
    for (int64_t k = whole; k < K; k++)
        for (int64_t i = 0; i < PANEL; i++) panel[k * PANEL + i] = rows[i * K + k];
}
/* Asks for the bytes of the rows n0 .. n0 + PANEL − 1 of Ŵ (N rows of row_bytes, one after the
 * other), into L2, while the tiles multiply the panel before them: the unpacking of a panel reads
 * 16 rows (AVX2: 8) at a time, a pattern the hardware prefetcher does not follow (SmolLM2's products, its
 * weights in memory, 2 threads of a Zen 4: its 30 layers at 8 / 16 rows 17.0 / 24.3 ms against
 * 19.9 / 26.2 without, its Q8_0 head 4.5 / 6.5 against 5.8 / 7.4). */
static void prefetch_panel(const uint8_t *W, int64_t n0, int64_t N, int64_t row_bytes) {
    const int64_t end = (n0 + PANEL < N ? n0 + PANEL : N) * row_bytes;
    for (int64_t at = n0 * row_bytes; at < end; at += 64) _mm_prefetch((const char *)W + at, _MM_HINT_T1);
}

/* Asks for a slice of the strip at `ahead` (`outputs` rows of blocks of `bytes`, one row after the
 * other; nothing from `end` on) into L2: the share of it that blocks blk .. blk + count − 1 are of
 * a row, so that the whole strip arrives over one pass of a strip's blocks. */
INLINE void prefetch_strip(const uint8_t *ahead, const uint8_t *end, int64_t blk, int64_t count, int bytes,
                           int outputs) {
    for (const uint8_t *p = ahead + blk * outputs * bytes; p < ahead + (blk + count) * outputs * bytes && p < end;
         p += 64)
        _mm_prefetch((const char *)p, _MM_HINT_T1);
}

#endif

#if ISA == 2
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
#elif ISA == 1
/* Many rows with AVX2 (`block_tiles`), and a batch-invariant engine's few (`block_strips`): the
 * AVX-512 tiles' arithmetic above, to the bit, on int16 integers. AVX2 has no vpdpbusd: 32
 * products against the activations' two int8 take vpmaddubsw, vpmaddwd and vpaddd for each part,
 * six instructions, where vpmaddwd + vpaddd take four for 32 products of int16. So every type's
 * integers are widened to int16 in the panel, (K/2, PANEL, 2), the two inputs of a lane of
 * vpmaddwd, and the 4- and 5-bit types' activations are joined into one int16,
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

/* A block's 32 integers as int16: inputs 0-15 in w[0], 16-31 in w[1] (Q8_0's signed q; the 4-
 * and 5-bit types' unsigned u, their zero point left to the activations' Σ_j c_j). */
INLINE void block_words(const int type, const uint8_t *b, __m256i w[2]) {
    if (type == Q8_0) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + LAYOUTS[Q8_0].qs));
        w[0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
        w[1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
        return;
    }
    const __m256i u = unpack_block(type, b);
    w[0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(u));
    w[1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(u, 1));
}

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
#define QUANTIZED_BYTES(type, M, K) \
    ((type) == Q8_0 ? WIDE_BYTES(M, K) : ACTS_BYTES(M, K) + sizeof(int16_t) * (size_t)((M) * (K)))

INLINE const void *quantize(const int type, const void *x, int x_bf16, int64_t M, int64_t K, char *buffer,
                            const int strips, QuantizedActs *q) {
    if (type == Q8_0) {
        quantize_wide(x, x_bf16, M, K, buffer, &q->wide);
        q->c = (Int16Acts){q->wide.c, NULL, NULL, q->wide.e, NULL, NULL};
        return &q->c;
    }
    quantize_acts(x, x_bf16, M, K, buffer, &q->ab);
    int16_t *c = strips ? NULL : (int16_t *)(buffer + ACTS_BYTES(M, K));
    for (int64_t i = 0; c != NULL && i < M * K; i++) c[i] = (int16_t)(256 * q->ab.a[i] + q->ab.b[i]);
    q->c = (Int16Acts){c, q->ab.a, q->ab.b, q->ab.block_e, q->ab.block_ab, q->ab.block_sums};
    return &q->c;
}
#endif

#if ISA > 0
/* All M rows against panel p (outputs n0 .. n0 + rn − 1) into y (M, N), IR rows a tile; the
 * tile's number of rows a constant in each call, so that its accumulators stay in registers. */
#define INT_TILES(T)                                                                                  \
    static void CAT(int_tiles, T)(const IntPanel *p, const void *acts, int64_t M, int64_t K, float *out, \
                                  int64_t n0, int64_t rn, int64_t N, float *y) {                      \
        for (int64_t m = 0; m < M; m += IR) {                                                         \
            switch (M - m < IR ? M - m : IR) {                                                        \
                case 1: int_tile(T, p, acts, m, 1, K, out); break;                                    \
                case 2: int_tile(T, p, acts, m, 2, K, out); break;                                    \
                case 3: int_tile(T, p, acts, m, 3, K, out); break;                                    \
                case 4: int_tile(T, p, acts, m, 4, K, out); break;                                    \
                case 5: int_tile(T, p, acts, m, 5, K, out); break;                                    \
                default: int_tile(T, p, acts, m, IR, K, out); break;                                  \
            }                                                                                         \
            for (int64_t r = 0; r < IR && m + r < M; r++)                                             \
                memcpy(y + (m + r) * N + n0, out + r * PANEL, sizeof(float) * (size_t)rn);            \
        }                                                                                             \
    }
INT_TILES(Q8_0)
INT_TILES(Q4_0)
INT_TILES(Q4_1)
INT_TILES(Q5_0)
INT_TILES(Q5_1)

/* All M rows against every strip of Ŵ into y (M, N); threads split the strips. */
#define STRIPS(T)                                                                                     \
    static void CAT(strips, T)(const void *acts, int64_t M, const uint8_t *W, int64_t N, int64_t K, float *y) { \
        _Pragma("omp parallel for schedule(static)")                                                  \
        for (int64_t n0 = 0; n0 < N; n0 += STRIP) {                                                   \
            const int64_t rn = N - n0 < STRIP ? N - n0 : STRIP;                                       \
            for (int64_t m0 = 0; m0 < M; m0 += STRIP_ROWS) {                                          \
                switch (M - m0 < STRIP_ROWS ? M - m0 : STRIP_ROWS) {                                  \
                    case 1: strip(T, acts, m0, 1, W, n0, rn, N, K, y); break;                         \
                    case 2: strip(T, acts, m0, 2, W, n0, rn, N, K, y); break;                         \
                    case 3: strip(T, acts, m0, 3, W, n0, rn, N, K, y); break;                         \
                    default: strip(T, acts, m0, STRIP_ROWS, W, n0, rn, N, K, y); break;               \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    }
STRIPS(Q8_0)
STRIPS(Q4_0)
STRIPS(Q4_1)
STRIPS(Q5_0)
STRIPS(Q5_1)

/* All M rows on the integer panels into y (M, N); threads split the panels. Returns −1 where a
 * buffer could not be allocated, else 0. */
static int tiles(const int type, const void *acts, int64_t M, const uint8_t *W, int64_t N, int64_t K, float *y) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const size_t scales = sizeof(float) * (size_t)(K / 32 * PANEL);
        IntPanel p = {aligned_alloc(64, (size_t)(2 * K * PANEL)), aligned_alloc(64, scales), aligned_alloc(64, scales)};
        float *out = aligned_alloc(64, sizeof(float) * IR * PANEL);
        failed = !p.u || !p.d || !p.m || !out;
        for (int64_t j = panels * t / threads; !failed && j < panels * (t + 1) / threads; j++) {
            const int64_t n0 = j * PANEL, rn = N - n0 < PANEL ? N - n0 : PANEL;
            int_panel(type, W, n0, rn, K, &p);
            prefetch_panel(W, j + 1 < panels * (t + 1) / threads ? n0 + PANEL : N, N, K * LAYOUTS[type].bytes / 32);
            switch (type) {
                case Q8_0: int_tiles_Q8_0(&p, acts, M, K, out, n0, rn, N, y); break;
                case Q4_0: int_tiles_Q4_0(&p, acts, M, K, out, n0, rn, N, y); break;
                case Q4_1: int_tiles_Q4_1(&p, acts, M, K, out, n0, rn, N, y); break;
                case Q5_0: int_tiles_Q5_0(&p, acts, M, K, out, n0, rn, N, y); break;
                case Q5_1: int_tiles_Q5_1(&p, acts, M, K, out, n0, rn, N, y); break;
            }
        }
        free(p.u), free(p.d), free(p.m), free(out);
    }
    return failed ? -1 : 0;
}

/* y (M, N) = x (M, K) Ŵᵀ, Ŵ (N, K) in blocks of a quantized `type`, in the integer tiles'
 * arithmetic: on the panels, or (`strips`) on STRIP output rows at a time read from the blocks;
 * x and y float32, or bfloat16 where x_bf16 (y rounded once). Returns −1 where a buffer could
 * not be allocated, else 0. */
static int quantized_products(int strips, int type, const void *x, int x_bf16, int64_t M, const uint8_t *W,
                              int64_t N, int64_t K, void *y) {
    const size_t acts_bytes = QUANTIZED_BYTES(type, M, K);
    char *buffer = malloc(acts_bytes + (x_bf16 ? sizeof(float) * (size_t)(M * N) : 0));
    if (buffer == NULL) return -1;
    QuantizedActs q;
    const void *acts = quantize(type, x, x_bf16, M, K, buffer, strips, &q);
    float *out_y = x_bf16 ? (float *)(buffer + acts_bytes) : y;
    int failed = 0;
    if (!strips) failed = tiles(type, acts, M, W, N, K, out_y);
    else switch (type) {
        case Q8_0: strips_Q8_0(acts, M, W, N, K, out_y); break;
        case Q4_0: strips_Q4_0(acts, M, W, N, K, out_y); break;
        case Q4_1: strips_Q4_1(acts, M, W, N, K, out_y); break;
        case Q5_0: strips_Q5_0(acts, M, W, N, K, out_y); break;
        case Q5_1: strips_Q5_1(acts, M, W, N, K, out_y); break;
    }
    if (!failed) store(out_y, x_bf16, M * N, y);
    free(buffer);
    return failed;
}

int FN(block_tiles)(int type, const void *x, int x_bf16, int64_t M, const uint8_t *W, int64_t N, int64_t K,
                    void *y) {
    return quantized_products(0, type, x, x_bf16, M, W, N, K, y);
}

int FN(block_strips)(int type, const void *x, int x_bf16, int64_t M, const uint8_t *W, int64_t N, int64_t K,
                     void *y) {
    return quantized_products(1, type, x, x_bf16, M, W, N, K, y);
}
#else
int FN(block_tiles)(int type, const void *x, int x_bf16, int64_t M, const uint8_t *W, int64_t N, int64_t K,
                    void *y) {
    (void)type, (void)x, (void)x_bf16, (void)M, (void)W, (void)N, (void)K, (void)y;
    return -1; /* the integer panels are AVX-512 VNNI and AVX2 code: block_linear.py asks block_linear_isa first */
}

int FN(block_strips)(int type, const void *x, int x_bf16, int64_t M, const uint8_t *W, int64_t N, int64_t K,
                     void *y) {
    return FN(block_tiles)(type, x, x_bf16, M, W, N, K, y); /* −1: AVX-512 VNNI and AVX2 code, as the panels */
}
#endif

/* y (M, N) = x (M, K) Ŵᵀ, x and y float32, for more rows than the block kernels take: each thread
 * dequantizes a panel of PANEL outputs at a time into its buffer, laid out (K, PANEL) as outer.h's
 * tiles read it (4 · K · PANEL bytes: 192 KiB at K = 1,536 with AVX-512, in L2), and multiplies all
 * M rows by it there, so that every weight is dequantized once per call and never written to memory
 * (on SmolLM2's layers 1.15-1.32× the speed of the weights dequantized whole and a GEMM from 17
 * to 256 rows of Q4_1, benchmarks/README.md). Threads split the panels. Returns −1 where a
 * buffer could not be allocated. */
int FN(block_panels)(int type, const float *x, int64_t M, const uint8_t *W, int64_t N, int64_t K, float *y) {
    const int64_t row_bytes = type == F16 || type == BF16 ? 2 * K : K / 32 * LAYOUTS[type].bytes;
    const int64_t panels = (N + PANEL - 1) / PANEL;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        float *panel = malloc(sizeof(float) * (size_t)(K * PANEL)), *rows = malloc(sizeof(float) * (size_t)(K * PANEL));
        failed = !panel || !rows;
        for (int64_t j = panels * t / threads; !failed && j < panels * (t + 1) / threads; j++) {
            const int64_t n0 = j * PANEL, rn = N - n0 < PANEL ? N - n0 : PANEL;
            for (int64_t i = 0; i < PANEL; i++) {
                if (i < rn) dequantize_row(type, W + (n0 + i) * row_bytes, K, rows + i * K);
                else memset(rows + i * K, 0, sizeof(float) * (size_t)K);
            }
#if ISA > 0
            transpose_panel(rows, K, panel);
#else
            for (int64_t k0 = 0; k0 < K; k0 += 16) /* rows (PANEL, K) → panel (K, PANEL), 16 lines in L1 */
                for (int64_t i = 0; i < PANEL; i++)
                    for (int64_t k = k0; k < k0 + 16 && k < K; k++) panel[k * PANEL + i] = rows[i * K + k];
#endif
            float out[R * PANEL];
            for (int64_t m = 0; m < M; m += R) {
                const int64_t rm = M - m < R ? M - m : R;
                (rm == R ? full_f32 : rm == 1 ? one_f32 : part_f32)(x + m * K, panel, out, rm, K);
                for (int64_t r = 0; r < rm; r++)
                    memcpy(y + (m + r) * N + n0, out + r * PANEL, sizeof(float) * (size_t)rn);
            }
        }
        free(panel);
        free(rows);
    }
    return failed ? -1 : 0;
}
