/* bfloat16 linear layers on Intel AMX tiles (decoderlm.cpu.bf16_linear): y = x Wᵀ for a few rows.
 *
 * W (N, K) is stored blocked once, (⌈N/16⌉, K/2, 16, 2): for each 16 outputs, K/2 rows of
 * 16 (output, pair of inputs) in the VNNI order a tile multiply reads, so that each block of 16
 * outputs is 32·K contiguous bytes streamed once per call (software-prefetched 6 KiB ahead; the
 * hardware prefetcher ramps up too slowly on blocks of a few KB). For every 16 outputs and every 16
 * rows of x: C (16 × 16, float32) = Σ over K/32 of A (16 rows × 32 inputs of x) · B (32 inputs × 16
 * outputs of W), one TDPBF16PS each; rows beyond the last full 16 use a second pair of tiles
 * configured for the rest. The block of W is read from memory by the first 16 rows and from the
 * cache by the others. Sums in float32, rounded to bfloat16 once, as oneDNN's bf16 GEMM does.
 * Needs K % 32 == 0 (the caller checks). Parallel over blocks of outputs with OpenMP.
 *
 * From WIDE rows on (a prefill chunk), where the products, not the weights' bytes, bound the time,
 * each step of K multiplies two tiles of rows by two blocks of outputs: four products for four
 * tile loads, where one tile of rows by one block takes two loads per product (the 2 × 2 register
 * blocking of a GEMM), 256 rows at a time, which stay in the cache while the weights stream past
 * them. The rows past the last multiple of 16 are copied into a tile of zeros. A step's C tiles
 * are rounded and written to y (SwiGLU's silu and product among them) a row per step of K of the
 * next step, by the vector units while the tiles multiply, instead of between the two: a 128-row
 * SwiGLU product of SmolLM2 (576 → 2 × 1536) in 0.75× the time (benchmarks/README.md).
 * Either way each output is summed by the same TDPBF16PS steps in the same order, so the two give
 * the same bits, whatever the rows (`decoderlm.cpu.invariant` relies on it).
 *
 * SwiGLU's gate and up projections (`swiglu`): W holds their blocks in turns (gate block j, up
 * block j, ...), and each pair's outputs g, u are stored as y = bf16(silu(bf16(g))) ⊙ bf16(u): the
 * bits of the two linears' bfloat16 outputs through `fused.c`'s silu_mul (the same vec.h lanes,
 * compiled without fast-math), without writing g and u out and reading them back.
 */
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "vec.h"

#define PREFETCH_BYTES 6144 /* not a multiple of 4 KiB: see gemv.c */
#define WIDE 32 /* rows from which two tiles of rows share each load of W */
#define CHUNK_GROUPS 16 /* the wide path takes 256 rows of x at a time, which stay in the cache */

/* Tiles: 0 = C and 1 = A for groups of 16 rows, 3 = C and 4 = A for the last `rest` rows, 2 = B. */
static void configure(int64_t rest) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 5; t++) cfg.bytes_per_row[t] = 64;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = 16;
    cfg.rows[3] = cfg.rows[4] = (uint8_t)(rest ? rest : 16);
    _tile_loadconfig(&cfg);
}

/* Round row m of C (16 float32) to bfloat16 and store its `valid` outputs. */
static inline void store_rows(const float *c, int64_t rows, uint16_t *y, int64_t N, int64_t valid) {
    for (int64_t m = 0; m < rows; m++) store_bf16(y + m * N, _mm512_loadu_ps(c + m * 16), valid);
}

/* The same for SwiGLU's pair: C of the gate (g) and of the up projection (u). */
static inline void store_swiglu(const float *g, const float *u, int64_t rows, uint16_t *y, int64_t N, int64_t valid) {
    for (int64_t m = 0; m < rows; m++) {
        const vec gate = vround_bf16(_mm512_loadu_ps(g + m * 16)), up = vround_bf16(_mm512_loadu_ps(u + m * 16));
        store_bf16(y + m * N, vmul(vround_bf16(vsilu(gate)), up), valid);
    }
}

/* The wide path's C tiles of one 2 × 2 step, stored, to be rounded and written to y a row at a
 * time while the next step's tile products run (the vector units idle while the tiles multiply):
 * tile 2r + s holds rows row[r] .. row[r] + rows[r] − 1 of y (rows[r] = 0: none) against output
 * block j + s; with `swiglu`, tiles 2r and 2r + 1 are the gate and up projections of block jj. */
struct pending {
    float c[4][16 * 16];
    int64_t row[2], rows[2], j, jj, N;
    uint16_t *y;
    int swiglu, done; /* rows of the tiles written so far (16: all) */
};

/* Row m = p->done of the pending tiles to y. */
static void write_row(struct pending *p) {
    const int64_t m = p->done++, N = p->N;
    for (int r = 0; r < 2; r++) {
        if (m >= p->rows[r]) continue;
        uint16_t *y = p->y + (p->row[r] + m) * N;
        if (p->swiglu) {
            store_swiglu(p->c[2 * r] + m * 16, p->c[2 * r + 1] + m * 16, 1, y + p->jj * 16, N, N - p->jj * 16);
            continue;
        }
        for (int s = 0; s < 2; s++) {
            const int64_t out = (p->j + s) * 16;
            if (out < N) store_rows(p->c[2 * r + s] + m * 16, 1, y + out, N, N - out);
        }
    }
}

/* C (tiles 0-3) of rows 16·g .. and 16·(g + 1) .. (`x0`, `x1`: 16 rows each, K apart) against
 * output blocks j and j + 1 (`w0`, `w1`); with one of the pair missing (x1 or w1 NULL), the
 * products it would take are skipped. A in tiles 4, 5; B in 6, 7. Each step of K writes a row of
 * the previous step's tiles (`p`), the rest after the last. */
static void tiles_2x2(const uint16_t *x0, const uint16_t *x1, const uint16_t *w0, const uint16_t *w1, int64_t K,
                      struct pending *p) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        if (p->done < 16) write_row(p);
        _tile_loadd(4, x0 + k0, K * 2);
        _tile_loadd(6, w0 + k0 * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (w1) {
            _tile_loadd(7, w1 + k0 * 16, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (x1) {
            _tile_loadd(5, x1 + k0, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (w1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    while (p->done < 16) write_row(p);
}

/* C tile t (0-3) to c (16 × 16 float32): the tile number must be a constant. */
static inline void tile_to(int t, float *c) {
    switch (t) {
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64);
    }
}

/* The wide path: x (M, K) with M ≥ WIDE; its last M mod 16 rows read from `tail` (16 × K, zeros
 * after them); `blocks` blocks of W, in pairs (gate, up) with `swiglu`. */
static void wide(const uint16_t *x, const uint16_t *tail, const uint16_t *w, uint16_t *y, int64_t M,
                 int64_t N, int64_t K, int64_t blocks, int swiglu) {
    const int64_t groups = (M + 15) / 16;
#pragma omp parallel
    {
        struct tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) cfg.bytes_per_row[t] = 64, cfg.rows[t] = 16;
        _tile_loadconfig(&cfg);
        struct pending p = {.N = N, .y = y, .swiglu = swiglu, .done = 16};
        for (int64_t g0 = 0; g0 < groups; g0 += CHUNK_GROUPS) {
#pragma omp for schedule(static)
            for (int64_t jj = 0; jj < (blocks + 1) / 2; jj++) {
                const int64_t j = 2 * jj, pair = j + 1 < blocks;
                const int64_t g_end = g0 + CHUNK_GROUPS < groups ? g0 + CHUNK_GROUPS : groups;
                for (int64_t g = g0; g < g_end; g += 2) {
                    const uint16_t *x0 = 16 * (g + 1) <= M ? x + g * 16 * K : tail, *x1 = NULL;
                    if (g + 1 < groups) x1 = 16 * (g + 2) <= M ? x + (g + 1) * 16 * K : tail;
                    tiles_2x2(x0, x1, w + j * 16 * K, pair ? w + (j + 1) * 16 * K : NULL, K, &p);
                    for (int t = 0; t < 4; t++) tile_to(t, p.c[t]); /* tiles 2r, 2r + 1: rows 16·(g + r) .. */
                    for (int r = 0; r < 2; r++) { /* rows[r]: M − row[r] within 0 .. 16 */
                        const int64_t left = M - (g + r) * 16;
                        p.row[r] = (g + r) * 16, p.rows[r] = left < 0 ? 0 : left < 16 ? left : 16;
                    }
                    p.j = j, p.jj = jj, p.done = 0;
                }
            }
            while (p.done < 16) write_row(&p); /* this thread's last tiles */
        }
        _tile_release();
    }
}

/* The few-rows path's C of `rows` rows of x from xg (16: tiles 0, 1; fewer: tiles 3, 4) against
 * the block wb, to c; `fetch`: the first rows to read the block, which prefetch it ahead. */
static void narrow_tile(const uint16_t *xg, int64_t rows, const uint16_t *wb, int64_t K, int fetch, float *c) {
    if (rows == 16) _tile_zero(0); else _tile_zero(3);
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        const uint16_t *bt = wb + k0 * 16; /* inputs k0 .. k0 + 31: 1 KiB */
        if (fetch)
            for (int i = 0; i < 1024; i += 64) _mm_prefetch((const char *)bt + PREFETCH_BYTES + i, _MM_HINT_T0);
        _tile_loadd(2, bt, 64);
        if (rows == 16) {
            _tile_loadd(1, xg + k0, K * 2);
            _tile_dpbf16ps(0, 1, 2);
        } else {
            _tile_loadd(4, xg + k0, K * 2);
            _tile_dpbf16ps(3, 4, 2);
        }
    }
    if (rows == 16) _tile_stored(0, c, 64); else _tile_stored(3, c, 64);
}

/* What the op's first call needs (bf16_linear_ops.cpp): the process's tile state. */
int packed_linear_prepare(void) { return amx_request(); }

/* x (M, K), w blocked as above, y (M, N); all contiguous bfloat16. With `swiglu`, w holds the
 * gate's and the up projection's blocks in turns (2·⌈N/16⌉ blocks) and y = silu(g) ⊙ u. */
void packed_linear_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N, int64_t K,
                     int swiglu) {
    const int64_t blocks = (N + 15) / 16 * (swiglu ? 2 : 1);
    if (M >= WIDE) {
        const int64_t rest = M % 16;
        uint16_t *tail = rest ? calloc((size_t)(16 * K), sizeof(uint16_t)) : NULL;
        if (!rest || tail) {
            if (tail) memcpy(tail, x + (M - rest) * K, (size_t)(rest * K) * sizeof(uint16_t));
            wide(x, tail, w, y, M, N, K, blocks, swiglu);
            free(tail);
            return;
        }
    }
    const int64_t full = M / 16, rest = M % 16, width = swiglu ? 2 : 1; /* blocks per output block */
#pragma omp parallel
    {
        configure(rest);
        float c[16 * 16], c2[16 * 16];
#pragma omp for schedule(static)
        for (int64_t j = 0; j < blocks / width; j++) {
            const uint16_t *wb = w + j * width * 16 * K; /* this block: K/2 × 16 × 2 */
            for (int64_t g = 0; g <= full; g++) {
                const int64_t rows = g < full ? 16 : rest;
                if (rows == 0) break;
                uint16_t *yg = y + g * 16 * N + j * 16;
                narrow_tile(x + g * 16 * K, rows, wb, K, g == 0, c);
                if (swiglu) {
                    narrow_tile(x + g * 16 * K, rows, wb + 16 * K, K, g == 0, c2);
                    store_swiglu(c, c2, rows, yg, N, N - j * 16);
                } else
                    store_rows(c, rows, yg, N, N - j * 16);
            }
        }
        _tile_release();
    }
}
