/* Decode attention read in place from a KV cache (decoderlm.cpu.paged_attention).
 *
 * One query token per row: out[b, h] = softmax(q[b, h] · K_bᵀ · scale) V_b, where K_b / V_b are
 * row b's keys / values first[b] .. lengths[b] − 1, stored in the blocks table[b, 0],
 * table[b, 1], ... (block_size tokens each). Nothing is gathered: each key and value row is read
 * once, where it lies, and converted to float32 on the fly; scores, softmax and the weighted sum
 * are in float32.
 *
 * Layouts, by strides (in elements): key t of K/V head h in block j starts at
 * k + j · block_stride + h · head_stride + t · token_stride. The paged pool (num_blocks,
 * block_size, Hkv, D) has (block_size · Hkv · D, D, Hkv · D); the static cache (B, Hkv, S, D) is
 * one block of S tokens per row, (Hkv · S · D, S · D, D), with table NULL (row b's block is b).
 * first NULL: every row starts at key 0. q, out (B, H, D) and table (B, W), first, lengths (B,)
 * int64 are contiguous. Query head hq reads K/V head hq / (H / Hkv) (MHA, GQA and MQA).
 *
 * A work item is one row's K/V head and the G = H / Hkv query heads that read it (GQA), or some of
 * them: each key and value row is loaded and widened to float32 once for all of them. A score is
 * q · k_t summed across the lanes of a vector of partial sums; those of LANES keys are summed at
 * once (`vsum_each`), a fixed tree whatever the key's place among them, and every sum of a query
 * head runs in the same order whichever heads share its item, so a row's output does not depend
 * on the batch around it (`Engine(batch_invariant=True)`). Parallel over the items with OpenMP
 * (the runtime torch itself loaded, so its threads); with fewer items than 4 per thread, one per
 * query head.
 *
 * A row of more than CHUNK keys is split into chunks of CHUNK keys, an item each (Dao et al.,
 * 2023, "Flash-Decoding for long-context inference"): each chunk c leaves its unnormalised
 * o_c = Σ_t exp(s_t − m_c) v_t, its max score m_c and l_c = Σ_t exp(s_t − m_c), and the chunks
 * are merged in order: m = max_c m_c, out = Σ_c exp(m_c − m) o_c / Σ_c exp(m_c − m) l_c. The
 * chunks depend on the row's own length only, so a row's arithmetic is still that of the row
 * alone. Unsplit, a lone row's few items each read a whole head's keys, and those of one K/V
 * head once per query head (SmolLM2's shapes, float32, one row of 2,048 keys, 30 layers' caches
 * from memory: 4.0-4.6 ms against 5.0-5.7 unsplit on two cores of a Zen 4).
 *
 * append_attention_*: a decode step's store and attention in one call. Each row's new key and
 * value go to its last position first, by the item that then reads them: the writes' cache misses
 * (a slot anywhere in a pool of hundreds of MB) overlap the reading of the row's other keys,
 * where a store before the call waits for each.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define MAX_D 512    /* the largest head_dim */
#define GROUP_MAX 8  /* query heads an item computes at once */
#define CHUNK 256    /* keys an item reads at most (a multiple of LANES) */
#define CHUNKS_MAX (MAX_D / LANES)

struct pools { /* the arguments every item shares */
    const void *q;
    void *k, *v; /* written only where new keys and values are appended */
    const int64_t *table, *first, *lengths;
    void *out;
    int64_t H, G, D, block_size, W, block_stride, head_stride, token_stride;
    float scale;
    const void *k_new, *v_new; /* NULL, or each row's new key and value (row b, head h at b·*_b + h·*_h) */
    int64_t k_new_b, k_new_h, v_new_b, v_new_h;
};

/* The pool's blocks lie anywhere, so the hardware prefetcher cannot follow a row's keys from one
 * block to the next, and within a block of the paged layout one head reads only D of every
 * Hkv · D values: each token's row of this head is prefetched one block ahead, from the row's next
 * block (none in the static layout, whose rows are one block each). */
static inline void prefetch(const char *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

/* Element i of x (float32 or bfloat16, `bf16`), LANES of them from i on (n < LANES: zeros after). */
static inline vec load_at(const void *x, int64_t i, int64_t n, int bf16) {
    return bf16 ? load_bf16((const uint16_t *)x + i, n) : load_f32((const float *)x + i, n);
}

/* Row b's key/value rows of K/V head h, from key t_first to n − 1, block by block: for each,
 * VISIT(t, row) with row the element offset of key t in the pool; the next block's rows
 * prefetched. */
#define FOR_EACH_KEY(a, pool, b, h, t_first, n, es, VISIT)                                          \
    for (int64_t j = (t_first) / (a)->block_size; j * (a)->block_size < (n); j++) {               \
        const int64_t t0 = j * (a)->block_size;                                                    \
        const int64_t base = ((a)->table ? (a)->table[(b) * (a)->W + j] : (b)) * (a)->block_stride \
                             + (h) * (a)->head_stride;                                             \
        const int64_t next = (a)->table && t0 + (a)->block_size < (n)                              \
            ? (a)->table[(b) * (a)->W + j + 1] * (a)->block_stride + (h) * (a)->head_stride : -1;  \
        const int64_t lo = t0 > (t_first) ? t0 : (t_first);                                        \
        const int64_t end = t0 + (a)->block_size < (n) ? t0 + (a)->block_size : (n);               \
        for (int64_t t = lo; t < end; t++) {                                                       \
            if (next >= 0)                                                                         \
                prefetch((const char *)(pool) + (next + (t - t0) * (a)->token_stride) * (es),      \
                         (a)->D * (es));                                                           \
            VISIT(t, base + (t - t0) * (a)->token_stride);                                         \
        }                                                                                          \
    }

/* Row b's new key and value of K/V head h to its last position, lengths[b] − 1 (es: bytes per
 * element). */
static inline void append(const struct pools *a, int64_t b, int64_t h, int64_t es) {
    const int64_t t = a->lengths[b] - 1, j = t / a->block_size;
    const int64_t at = (a->table ? a->table[b * a->W + j] : b) * a->block_stride + h * a->head_stride
                       + (t - j * a->block_size) * a->token_stride;
    memcpy((char *)a->k + at * es, (const char *)a->k_new + (b * a->k_new_b + h * a->k_new_h) * es, a->D * es);
    memcpy((char *)a->v + at * es, (const char *)a->v_new + (b * a->v_new_b + h * a->v_new_h) * es, a->D * es);
}

/* Row b, K/V head h, query heads hq .. hq + gh − 1, keys t_first .. n − 1: out = softmax(q Kᵀ ·
 * scale) V for each; or, given `partial`, a chunk's o, m and l (file comment) at partial + i (D + 2)
 * for query head hq + i. `scores`: gh rows of `stride` floats. D is a constant where the caller
 * dispatches on it, so that a key's vectors stay in registers. */
static inline __attribute__((always_inline)) void attend_item(const struct pools *a, int64_t b,
        int64_t h, int64_t hq, int64_t gh, int64_t t_first, int64_t n, float *partial, float *scores,
        int64_t stride, const int64_t D, const int bf16) {
    const int64_t chunks = (D + LANES - 1) / LANES, es = bf16 ? 2 : 4;
    vec qs[GROUP_MAX * CHUNKS_MAX], acc[GROUP_MAX * CHUNKS_MAX], part[GROUP_MAX * LANES];
    float top[GROUP_MAX], total[GROUP_MAX];
    for (int64_t i = 0; i < gh; i++) {
        top[i] = -3.0e38f;
        for (int64_t c = 0; c < chunks; c++) /* q · scale, zeros past D */
            qs[i * chunks + c] = vmul(load_at(a->q, (b * a->H + hq + i) * D + c * LANES, D - c * LANES, bf16), vset(a->scale));
    }
    /* s_t = q·k_t · scale: each key's partial sums per lane, then LANES keys' lanes summed at once */
#define SCORE(t, row)                                                                              \
    {                                                                                              \
        vec kv[CHUNKS_MAX];                                                                        \
        for (int64_t c = 0; c < chunks; c++) kv[c] = load_at(a->k, (row) + c * LANES, D - c * LANES, bf16); \
        const int64_t slot = ((t) - t_first) % LANES;                                              \
        for (int64_t i = 0; i < gh; i++) {                                                         \
            vec s = vzero();                                                                       \
            for (int64_t c = 0; c < chunks; c++) s = vfma(qs[i * chunks + c], kv[c], s);          \
            part[i * LANES + slot] = s;                                                            \
        }                                                                                          \
        if (slot == LANES - 1 || (t) == n - 1) {                                                   \
            const int64_t t0 = (t) - slot;                                                         \
            for (int64_t i = 0; i < gh; i++) {                                                     \
                for (int64_t l = slot + 1; l < LANES; l++) part[i * LANES + l] = vzero();          \
                float *s = scores + i * stride + (t0 - t_first);                                   \
                store_f32(s, vsum_each(part + i * LANES), slot + 1);                               \
                for (int64_t l = 0; l <= slot; l++) top[i] = s[l] > top[i] ? s[l] : top[i];        \
            }                                                                                      \
        }                                                                                          \
    }
    FOR_EACH_KEY(a, a->k, b, h, t_first, n, es, SCORE)
#undef SCORE
    for (int64_t i = 0; i < gh; i++) { /* p_t = exp(s_t − max s) / Σ_t exp(s_t − max s) */
        float *s = scores + i * stride, sum = 0.f;
        const float m = top[i];
        _Pragma("omp simd reduction(+ : sum)") for (int64_t t = 0; t < n - t_first; t++) {
            s[t] = expf(s[t] - m);
            sum += s[t];
        }
        total[i] = sum;
        for (int64_t c = 0; c < chunks; c++) acc[i * chunks + c] = vzero();
    }
    /* o = Σ_t p_t v_t */
#define ACCUMULATE(t, row)                                                                         \
    {                                                                                              \
        vec vv[CHUNKS_MAX];                                                                        \
        for (int64_t c = 0; c < chunks; c++) vv[c] = load_at(a->v, (row) + c * LANES, D - c * LANES, bf16); \
        for (int64_t i = 0; i < gh; i++) {                                                         \
            const vec p = vset(scores[i * stride + (t) - t_first]);                                \
            for (int64_t c = 0; c < chunks; c++) acc[i * chunks + c] = vfma(p, vv[c], acc[i * chunks + c]); \
        }                                                                                          \
    }
    FOR_EACH_KEY(a, a->v, b, h, t_first, n, es, ACCUMULATE)
#undef ACCUMULATE
    for (int64_t i = 0; i < gh; i++) {
        if (partial != NULL) {
            float *o = partial + i * (D + 2);
            for (int64_t c = 0; c < chunks; c++) store_f32(o + c * LANES, acc[i * chunks + c], D - c * LANES);
            o[D] = top[i];
            o[D + 1] = total[i];
            continue;
        }
        const vec inverse = vset(1.f / total[i]);
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t at = (b * a->H + hq + i) * D + c * LANES;
            const vec o = vmul(acc[i * chunks + c], inverse);
            if (bf16) store_bf16((uint16_t *)a->out + at, o, D - c * LANES);
            else store_f32((float *)a->out + at, o, D - c * LANES);
        }
    }
}

/* Query head hq of row b from the partials of its `count` chunks (chunk c's at part + c · H ·
 * (D + 2)), merged in the chunks' order: out = Σ_c exp(m_c − m) o_c / Σ_c exp(m_c − m) l_c. Each
 * chunk's m_c is replaced by its weight exp(m_c − m), computed once. */
static void merge(const struct pools *a, int64_t b, int64_t hq, float *part, int64_t count, int bf16) {
    const int64_t D = a->D, step = a->H * (D + 2), at = (b * a->H + hq) * D;
    float m = -3.0e38f, l = 0.f;
    for (int64_t c = 0; c < count; c++) m = part[c * step + D] > m ? part[c * step + D] : m;
    for (int64_t c = 0; c < count; c++) {
        part[c * step + D] = expf(part[c * step + D] - m);
        l += part[c * step + D] * part[c * step + D + 1];
    }
    const vec inverse = vset(1.f / l);
    for (int64_t lane = 0; lane < D; lane += LANES) {
        vec acc = vzero();
        for (int64_t c = 0; c < count; c++)
            acc = vfma(vset(part[c * step + D]), load_f32(part + c * step + lane, D - lane), acc);
        if (bf16) store_bf16((uint16_t *)a->out + at + lane, vmul(acc, inverse), D - lane);
        else store_f32((float *)a->out + at + lane, vmul(acc, inverse), D - lane);
    }
}

/* The row whose chunks include item `item`: start[b] ≤ item < start[b + 1]. */
static int64_t row_of(const int64_t *start, int64_t B, int64_t item) {
    int64_t lo = 0, hi = B - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (start[mid] <= item) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Every item of the batch, in `pools`' dtype: each row's chunks × Hkv K/V heads × `splits` groups
 * of query heads, then the chunked rows' merges. 0, −1 when there was no memory for the scores or
 * the partials, −2 for D > MAX_D. */
static int attend_all(const struct pools *a, int64_t B, int64_t Hkv, int bf16) {
    if (a->D > MAX_D) return -2;
    int64_t *start = malloc(sizeof(int64_t) * (size_t)(B + 1)), longest = 0;
    if (start == NULL) return -1;
    start[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t keys = a->lengths[b] - (a->first ? a->first[b] : 0);
        longest = keys > longest ? keys : longest;
        start[b + 1] = start[b] + (keys > CHUNK ? (keys + CHUNK - 1) / CHUNK : 1);
    }
    const int64_t chunks = start[B];
    int64_t splits = (a->G + GROUP_MAX - 1) / GROUP_MAX;
    if (chunks * Hkv * splits < 4 * omp_get_max_threads()) splits = a->G;
    longest = longest < CHUNK ? longest : CHUNK;
    const int64_t per = (a->G + splits - 1) / splits, stride = (longest + LANES - 1) / LANES * LANES;
    const int64_t es = bf16 ? 2 : 4;
    float *partials = NULL;
    if (chunks > B && (partials = malloc(sizeof(float) * (size_t)(chunks * a->H * (a->D + 2)))) == NULL) {
        free(start);
        return -1;
    }
    /* An item that is its row's K/V head's only one appends their new key and value itself, so
     * that the store's cache misses overlap the reading of the other keys; else all are appended
     * first. */
    const int own = a->k_new != NULL && splits == 1 && chunks == B;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = aligned_alloc(64, sizeof(float) * (size_t)(GROUP_MAX * stride));
        if (scores == NULL) failed = 1;
        if (a->k_new != NULL && !own) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < B * Hkv; p++) append(a, p / Hkv, p % Hkv, es);
        } /* (the loop's barrier: every new key is in place before any item reads it) */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < chunks * Hkv * splits; p++) {
            const int64_t item = p / (Hkv * splits), h = p / splits % Hkv, first = p % splits * per;
            const int64_t b = row_of(start, B, item), c = item - start[b];
            if (own) append(a, b, h, es);
            if (scores == NULL) continue;
            const int64_t gh = a->G - first < per ? a->G - first : per, hq = h * a->G + first;
            if (gh <= 0) continue;
            const int64_t lo = (a->first ? a->first[b] : 0) + c * CHUNK;
            const int64_t hi = a->lengths[b] < lo + CHUNK ? a->lengths[b] : lo + CHUNK;
            float *part = start[b + 1] - start[b] > 1 ? partials + (item * a->H + hq) * (a->D + 2) : NULL;
            if (a->D == 64) attend_item(a, b, h, hq, gh, lo, hi, part, scores, stride, 64, bf16);
            else if (a->D == 128) attend_item(a, b, h, hq, gh, lo, hi, part, scores, stride, 128, bf16);
            else attend_item(a, b, h, hq, gh, lo, hi, part, scores, stride, a->D, bf16);
        }
        if (partials != NULL) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < B * a->H; p++) {
                const int64_t b = p / a->H, count = start[b + 1] - start[b];
                if (count > 1) merge(a, b, p % a->H, partials + (start[b] * a->H + p % a->H) * (a->D + 2), count, bf16);
            }
        }
        free(scores);
    }
    free(partials);
    free(start);
    return failed ? -1 : 0;
}

#define DECODE_ATTENTION(NAME, T, BF16)                                                            \
    int NAME(const T *q, const T *k, const T *v, const int64_t *table, const int64_t *first,       \
             const int64_t *lengths, T *out, int64_t B, int64_t H, int64_t Hkv, int64_t D,         \
             int64_t block_size, int64_t W, int64_t block_stride, int64_t head_stride,             \
             int64_t token_stride, float scale) {                                                  \
        const struct pools a = {q, (T *)k, (T *)v, table, first, lengths, out, H, H / Hkv, D,      \
                                block_size, W, block_stride, head_stride, token_stride, scale,     \
                                NULL, NULL, 0, 0, 0, 0};                                           \
        return attend_all(&a, B, Hkv, BF16);                                                       \
    }

/* The same after appending each row's new key and value, k_new / v_new (row b, K/V head h at
 * element b · *_b + h · *_h), at its last position, lengths[b] − 1, of the paged pools. */
#define APPEND_ATTENTION(NAME, T, BF16)                                                            \
    int NAME(const T *q, T *k, T *v, const int64_t *table, const int64_t *lengths, T *out,         \
             int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, int64_t W,          \
             int64_t block_stride, int64_t head_stride, int64_t token_stride, float scale,         \
             const T *k_new, const T *v_new, int64_t k_new_b, int64_t k_new_h, int64_t v_new_b,    \
             int64_t v_new_h) {                                                                    \
        const struct pools a = {q, k, v, table, NULL, lengths, out, H, H / Hkv, D, block_size, W,  \
                                block_stride, head_stride, token_stride, scale, k_new, v_new,      \
                                k_new_b, k_new_h, v_new_b, v_new_h};                               \
        return attend_all(&a, B, Hkv, BF16);                                                       \
    }

DECODE_ATTENTION(decode_attention_f32, float, 0)
DECODE_ATTENTION(decode_attention_bf16, uint16_t, 1)
APPEND_ATTENTION(append_attention_f32, float, 0)
APPEND_ATTENTION(append_attention_bf16, uint16_t, 1)
