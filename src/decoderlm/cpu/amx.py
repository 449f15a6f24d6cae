"""Loading a kernel that runs on Intel AMX (Advanced Matrix Extensions) tiles: its library is
built like any of `decoderlm.cpu.native`'s, and the process is granted the tile state, which
Linux hands out on request (arch_prctl ARCH_REQ_XCOMP_PERM: `amx_request` of `amx.h`)."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

from decoderlm.cpu import features, native

log = logging.getLogger(__name__)
CPU_FLAGS = {"amx_tile", "amx_bf16", "avx512_bf16"}  # AVX512-BF16 for the kernels' rounding


def available() -> bool:
    """Whether this CPU has the AMX-BF16 tiles (and AVX512-BF16) the kernels need."""
    return CPU_FLAGS.issubset(features.cpu_flags())


def load_tile_library(source: Path, fallback: str) -> ctypes.CDLL | None:
    """An AMX kernel's library (its source includes `amx.h`), built if need be, the process
    granted the tile state; None (warned, the caller doing `fallback` instead) where the CPU
    lacks CPU_FLAGS, the library does not build, or Linux refuses the tiles."""
    if not available():
        return None
    library = native.load([source], fallback, ctypes.CDLL)
    if library is None:
        return None
    library.amx_request.restype = ctypes.c_int
    if library.amx_request() != 0:
        log.warning("decoderlm: the kernel refused AMX tiles; %s", fallback)
        return None
    return library
