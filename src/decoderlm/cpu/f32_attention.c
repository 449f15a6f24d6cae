/* Causal attention of a prefill pass in float32 (decoderlm.cpu.f32_attention): out = softmax(Q Kᵀ ·
 * scale + M) V, M causal, aligned bottom-right (query i of Tq sees keys 0 .. Tk − Tq + i), GQA's
 * query head h reading K/V head h / (H / Hkv); every product, sum and exponential in float32, on
 * vec.h's lanes (AVX-512, AVX2 + FMA or plain C, whichever the build targets).
 *
 * The blocked products of FlashAttention (Dao et al., 2022), each block of queries scored only
 * against the keys its last query sees; the softmax over a block's whole row of scores (a prompt's
 * row fits in cache: 4 bytes a key), so no online rescaling. Two phases, parallel with OpenMP:
 * 1. Each (batch, K/V head)'s keys are laid out once, shared by its GQA group's query heads: Tk_L /
 *    LANES blocks of LANES keys × D dims (block kb, dim d: dim d of keys LANES·kb ..), Tk_L = Tk
 *    rounded up to LANES, zeros past Tk. Values are read in place (a key's D dims are contiguous).
 * 2. Each group of ROWS queries of one head: S = Q Kᵀ over the keys its last query sees, each
 *    query's e_j = exp(scale · (s_j − max_k s_k)) over the keys it sees (zeros after them), l = Σ
 *    e_j, then O = E V and out = O · (1 / l). `tile` is the register-blocked product of both:
 *    ROWS rows of a against COLS vectors of b, one broadcast of a's element per row and step.
 *    A group's rows past Tq are rows of zeros whose output is not stored.
 */
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define ROWS 6 /* ROWS × COLS accumulators, COLS vectors of b and a broadcast: 29 of AVX-512's 32 registers */
#if LANES == 16
#define COLS 4
#else
#define COLS 2 /* 15 of AVX2's 16 registers */
#endif

/* acc[m][c] = Σ_{r < depth} a[m · a_stride + r] · b[r · b_row + c · b_col .. + LANES] for ROWS rows of a
 * and `count` ≤ COLS vectors of b; `count` is a constant after inlining, so the loops unroll into
 * registers. Each sum runs over r in order, whatever the rows beside it; the sums build in local
 * registers and are written to acc at the end (a vector type may alias anything: sums kept in acc
 * would be stored back after every step). */
static inline __attribute__((always_inline)) void tile(const float *a, int64_t a_stride, int64_t depth, const float *b,
                                                       int64_t b_row, int64_t b_col, int count, vec acc[ROWS][COLS]) {
    vec sum[ROWS][COLS];
#pragma GCC unroll 8
    for (int m = 0; m < ROWS; m++)
#pragma GCC unroll 8
        for (int c = 0; c < COLS; c++) sum[m][c] = vzero();
    for (int64_t r = 0; r < depth; r++) {
        vec w[COLS];
#pragma GCC unroll 8
        for (int c = 0; c < COLS; c++)
            if (c < count) w[c] = load_f32(b + r * b_row + c * b_col, LANES);
#pragma GCC unroll 8
        for (int m = 0; m < ROWS; m++) {
            const vec x = vset(a[m * a_stride + r]);
#pragma GCC unroll 8
            for (int c = 0; c < COLS; c++)
                if (c < count) sum[m][c] = vfma(x, w[c], sum[m][c]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < ROWS; m++)
#pragma GCC unroll 8
        for (int c = 0; c < COLS; c++) acc[m][c] = sum[m][c];
}

/* `tile` with `count` made a constant */
static void tile_of(const float *a, int64_t a_stride, int64_t depth, const float *b, int64_t b_row, int64_t b_col,
                    int count, vec acc[ROWS][COLS]) {
    if (count >= COLS) tile(a, a_stride, depth, b, b_row, b_col, COLS, acc);
#if COLS > 2
    else if (count == 3) tile(a, a_stride, depth, b, b_row, b_col, 3, acc);
    else if (count == 2) tile(a, a_stride, depth, b, b_row, b_col, 2, acc);
#endif
    else tile(a, a_stride, depth, b, b_row, b_col, 1, acc);
}

/* One (batch, K/V head)'s keys k (Tk rows at stride ks, D contiguous) → kp (Tk_L · D) as above. */
static void lay_out(const float *k, int64_t ks, int64_t Tk, int64_t Tk_L, int64_t D, float *kp) {
    for (int64_t kb = 0; kb < Tk_L / LANES; kb++)
        for (int64_t d = 0; d < D; d++)
            for (int64_t l = 0; l < LANES; l++) {
                const int64_t key = kb * LANES + l;
                kp[(kb * D + d) * LANES + l] = key < Tk ? k[key * ks + d] : 0.0f;
            }
}

/* A row of scores s (n visible keys, `seen` ≥ n of them computed) → e in place (zeros from n to
 * seen); returns l = Σ e. */
static float exp_row(float *s, int64_t n, int64_t seen, float scale) {
    float top = s[0];
    vec tops = vset(s[0]);
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) tops = vmax(tops, load_f32(s + j, LANES));
    for (; j < n; j++) top = s[j] > top ? s[j] : top;
    float lanes[LANES];
    store_f32(lanes, tops, LANES);
    for (int l = 0; l < LANES; l++) top = lanes[l] > top ? lanes[l] : top;
    const vec high = vset(top), scales = vset(scale);
    vec sum = vzero();
    for (j = 0; j + LANES <= n; j += LANES) {
        const vec e = vexp(vmul(vsub(load_f32(s + j, LANES), high), scales));
        sum = vadd(sum, e);
        store_f32(s + j, e, LANES);
    }
    if (j < n) { /* the last n mod LANES keys, the lanes after them zeros */
        float e[LANES] = {0};
        for (int64_t l = 0; j + l < n; l++) e[l] = s[j + l];
        store_f32(e, vexp(vmul(vsub(load_f32(e, LANES), high), scales)), n - j);
        sum = vadd(sum, load_f32(e, LANES));
        memcpy(s + j, e, (size_t)(n - j) * sizeof(float));
    }
    memset(s + n, 0, (size_t)(seen - n) * sizeof(float));
    return vsum(sum);
}

/* q (B, H, Tq, D), k, v (B, Hkv, Tk, D), out (B, H, Tq, D), float32, at the element strides
 * *_s[0..2] (batch, head, position); each row of D contiguous. D a multiple of LANES, Tq ≤ Tk.
 * Returns 0, or 1 where memory for the layout or a thread's rows could not be had (out unset). */
int prefill_attention_f32(const float *q, const float *k, const float *v, float *out, int64_t B, int64_t H,
                          int64_t Hkv, int64_t Tq, int64_t Tk, int64_t D, float scale, const int64_t *q_s,
                          const int64_t *k_s, const int64_t *v_s, const int64_t *o_s) {
    const int64_t Tk_L = (Tk + LANES - 1) / LANES * LANES, per_head = Tk_L * D, groups = (Tq + ROWS - 1) / ROWS;
    float *kp = malloc((size_t)(B * Hkv * per_head) * sizeof(float));
    int failed = kp == NULL;
    if (failed) return 1;
#pragma omp parallel
    {
        float *s = malloc((size_t)(ROWS * Tk_L) * sizeof(float)), *tail = calloc((size_t)(ROWS * D), sizeof(float));
        if (s == NULL || tail == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t bg = 0; bg < B * Hkv; bg++)
            lay_out(k + bg / Hkv * k_s[0] + bg % Hkv * k_s[1], k_s[2], Tk, Tk_L, D, kp + bg * per_head);
        if (!failed) {
            vec acc[ROWS][COLS];
#pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < B * H * groups; w++) {
                const int64_t t = groups - 1 - w / (B * H), bh = w % (B * H); /* the longest groups first */
                const int64_t b = bh / H, h = bh % H, g = h / (H / Hkv);
                const int64_t i0 = t * ROWS, rows = Tq - i0 < ROWS ? Tq - i0 : ROWS;
                const int64_t seen = Tk - Tq + i0 + rows, width = (seen + LANES - 1) / LANES * LANES;
                const float *qt = q + b * q_s[0] + h * q_s[1] + i0 * q_s[2], *kh = kp + (b * Hkv + g) * per_head;
                const float *vh = v + b * v_s[0] + g * v_s[1];
                int64_t q_stride = q_s[2];
                if (rows < ROWS) { /* the last rows, then zeros */
                    for (int64_t m = 0; m < rows; m++) memcpy(tail + m * D, qt + m * q_s[2], (size_t)D * sizeof(float));
                    qt = tail, q_stride = D;
                }
                for (int64_t kb = 0; kb < width / LANES; kb += COLS) { /* S = Q Kᵀ, COLS · LANES keys a step */
                    const int count = width / LANES - kb < COLS ? (int)(width / LANES - kb) : COLS;
                    tile_of(qt, q_stride, D, kh + kb * D * LANES, LANES, D * LANES, count, acc);
                    for (int64_t m = 0; m < ROWS; m++)
                        for (int c = 0; c < count; c++) store_f32(s + m * width + (kb + c) * LANES, acc[m][c], LANES);
                }
                float l[ROWS];
                for (int64_t m = 0; m < ROWS; m++)
                    if (m < rows) l[m] = exp_row(s + m * width, Tk - Tq + i0 + m + 1, seen, scale);
                    else memset(s + m * width, 0, (size_t)seen * sizeof(float));
                for (int64_t db = 0; db < D / LANES; db += COLS) { /* O = E V, COLS · LANES dims a step */
                    const int count = D / LANES - db < COLS ? (int)(D / LANES - db) : COLS;
                    tile_of(s, width, seen, vh + db * LANES, v_s[2], LANES, count, acc);
                    for (int64_t m = 0; m < rows; m++) {
                        float *row = out + b * o_s[0] + h * o_s[1] + (i0 + m) * o_s[2] + db * LANES;
                        const vec inverse = vset(1.0f / l[m]);
                        for (int c = 0; c < count; c++) store_f32(row + c * LANES, vmul(acc[m][c], inverse), LANES);
                    }
                }
            }
        }
        free(s);
        free(tail);
    }
    free(kp);
    return failed;
}
