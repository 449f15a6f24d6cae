/* A batch's recurrent states between the pages that hold them and one contiguous buffer per state
 * (decoderlm.cpu.state_pages, for decoderlm.engine.state_pool): each sequence's bytes copied run
 * by run with memcpy, one pass over memory each way.
 *
 * A state of s bytes lies in a sequence's p pages; a page is row `rows[b·p + i]` of every tensor
 * (the K/V pools of a hybrid, in turn, or a pure recurrent model's slots), row_bytes[t] bytes of
 * tensor t each, `page` bytes in all. A run (t, k, m, at, x, n) says that pages k .. k + m − 1
 * hold, at byte `at` of their row of tensor t, the state's bytes x + j·page .. x + j·page + n − 1
 * (j < m). `fresh[b]` (gather only, may be NULL): row b starts from the zero state instead.
 * Parallel over the batch's rows (OpenMP) where the bytes pay for the threads.
 */
#include <stdint.h>
#include <string.h>

#define PARALLEL_MIN (1 << 20) /* bytes below which one thread copies them all */

void copy_state_runs(uint8_t *const *tensors, const int64_t *row_bytes, const int64_t *rows,
                     int64_t B, int64_t p, const int64_t *runs, int64_t n_runs, uint8_t *state,
                     int64_t state_bytes, int64_t page, const uint8_t *fresh, int to_pages) {
#pragma omp parallel for schedule(static) if (B * state_bytes >= PARALLEL_MIN)
    for (int64_t b = 0; b < B; b++) {
        uint8_t *s = state + b * state_bytes;
        if (!to_pages && fresh != NULL && fresh[b]) {
            memset(s, 0, (size_t)state_bytes);
            continue;
        }
        for (int64_t r = 0; r < n_runs; r++) {
            const int64_t *u = runs + 6 * r; /* t, k, m, at, x, n */
            for (int64_t j = 0; j < u[2]; j++) {
                uint8_t *row = tensors[u[0]] + rows[b * p + u[1] + j] * row_bytes[u[0]] + u[3];
                uint8_t *part = s + u[4] + j * page;
                if (to_pages)
                    memcpy(row, part, (size_t)u[5]);
                else
                    memcpy(part, row, (size_t)u[5]);
            }
        }
    }
}
