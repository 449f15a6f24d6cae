"""Loading a kernel on the CPU's bfloat16 dot products, of one of two kinds: "amx" (Intel AMX
tiles, TDPBF16PS; its source includes `amx.h`) or "avx512_bf16" (VDPBF16PS, on CPUs without the
tiles: AMD Zen 4, Intel Cooper Lake). Its library is built like any of `decoderlm.cpu.native`'s;
for the tiles the process is granted their state too, which Linux hands out on request (arch_prctl
ARCH_REQ_XCOMP_PERM: `amx_request` of `amx.h`)."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

from decoderlm.cpu import features, native

log = logging.getLogger(__name__)
CPU_FLAGS = {  # AVX512-BF16 for the AMX kernels' rounding too
    "amx": {"amx_tile", "amx_bf16", "avx512_bf16"},
    "avx512_bf16": {"avx512_bf16"},
}


def load(kind: str, source: Path, fallback: str) -> ctypes.CDLL | None:
    """The library of `source`, a kernel of `kind`, built if need be; None (warned, the caller
    doing `fallback` instead) where the CPU lacks the kind's flags, the library does not build,
    or Linux refuses the tiles."""
    if not CPU_FLAGS[kind].issubset(features.cpu_flags()):
        return None
    library = native.load([source], fallback, ctypes.CDLL)
    if library is None or kind != "amx":
        return library
    library.amx_request.restype = ctypes.c_int
    if library.amx_request() != 0:
        log.warning("decoderlm: the kernel refused AMX tiles; %s", fallback)
        return None
    return library
