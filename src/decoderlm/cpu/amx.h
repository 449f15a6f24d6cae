/* What every AMX kernel of decoderlm.cpu needs (amx_linear.c, amx_attention.c): the process's
 * permission to use the tile data state, which Linux grants on request (arch_prctl
 * ARCH_REQ_XCOMP_PERM; `amx_request`, called once when the library loads), and the tile
 * configuration LDTILECFG reads (palette 1: up to 8 tiles of up to 16 rows of 64 bytes). */
#ifndef DECODERLM_AMX_H
#define DECODERLM_AMX_H

#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: let this process use the AMX tile data state */
#define XFEATURE_XTILEDATA 18

int amx_request(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

struct tile_config { /* palette 1, the layout LDTILECFG reads */
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

#endif
