/* The softmax of a prefill attention's row of scores for decoderlm.cpu's attention kernels
 * (amx_attention.c, dpbf16_attention.c): e_j = exp(s_j · scale − max) in float32, l = Σ e_j, and
 * P = bf16(e), the rounding points of torch's CPU flash-attention kernel for bfloat16. */
#ifndef DECODERLM_SOFTMAX_ROW_H
#define DECODERLM_SOFTMAX_ROW_H

#include <math.h>
#include <stdint.h>

#include "vec.h"

/* 2^t for t ≤ 0 (a score less its row's maximum, in units of log2 e): 2^n · 2^f with n = round(t)
 * and |f| ≤ 1/2, 2^f by its Taylor polynomial of degree 7 (relative error below 1e−8, under an ulp
 * of float32), 2^n applied by VSCALEFPS (a t below −126 gives a subnormal or 0). */
static inline vec exp2_nonpositive(vec t) {
    const vec n = vround(t), f = vsub(t, n);
    vec p = vset(1.5252733804059840e-5f); /* ln2^k / k!, k = 7 .. 1 */
    p = vfma(p, f, vset(1.5403530393381606e-4f));
    p = vfma(p, f, vset(1.3333558146428443e-3f));
    p = vfma(p, f, vset(9.6181291076284772e-3f));
    p = vfma(p, f, vset(5.5504108664821580e-2f));
    p = vfma(p, f, vset(2.4022650695910071e-1f));
    p = vfma(p, f, vset(6.9314718055994531e-1f));
    return _mm512_scalef_ps(vfma(p, f, vset(1.0f)), n);
}

/* A row of scores s (n visible keys, float32) → P (bf16, zeros from n to width); returns l. Whole
 * vectors first, then the last n mod 16 keys under a mask. */
static float softmax_row(const float *s, uint16_t *p, int64_t n, int64_t width, float scale) {
    const int64_t whole = n / LANES * LANES;
    const __mmask16 last = (__mmask16)((1u << (n - whole)) - 1);
    vec top = _mm512_mask_loadu_ps(vset(-INFINITY), last, s + whole);
    for (int64_t j = 0; j < whole; j += LANES) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
    const float c = scale * LOG2E; /* e^(scale·(s − max)) = 2^(c·s − c·max) */
    const vec cs = vset(c), high = vset(-_mm512_reduce_max_ps(top) * c);
    vec sum = vzero();
    for (int64_t j = 0; j < whole; j += LANES) {
        const vec e = exp2_nonpositive(vfma(_mm512_loadu_ps(s + j), cs, high));
        sum = vadd(sum, e);
        _mm256_storeu_si256((__m256i *)(p + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    if (whole < width) { /* the last keys (none where n = width), zeros after them */
        const vec e = _mm512_maskz_mov_ps(last, exp2_nonpositive(vfma(_mm512_maskz_loadu_ps(last, s + whole), cs, high)));
        sum = vadd(sum, e); /* the masked lanes add zeros */
        _mm256_storeu_si256((__m256i *)(p + whole), (__m256i)_mm512_cvtneps_pbh(e));
    }
    for (int64_t j = whole + LANES; j < width; j += LANES) _mm256_storeu_si256((__m256i *)(p + j), _mm256_setzero_si256());
    return vsum(sum);
}

#endif
