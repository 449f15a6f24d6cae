"""What this CPU is: its model name, the flags /proc/cpuinfo lists, and whether it has native
bfloat16 matmuls.

`DECODERLM_CPU_ISA=avx2` (or `portable`) makes decoderlm's kernels act as on a CPU without the
instructions above that level: `cpu_flags` leaves out AVX-512, AMX and AVX-VNNI (for portable:
every AVX, FMA and F16C flag too), `has_native_bf16` says False and C kernels are compiled without
them (`cap_compile_flags`). The paths of an AVX2-only CPU are so run and measured on an AVX-512 one;
PyTorch's own kernels follow `ATEN_CPU_CAPABILITY=avx2`, oneDNN's `ONEDNN_MAX_CPU_ISA=AVX2`.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from decoderlm.errors import DecoderLMError

ISA_ENV = "DECODERLM_CPU_ISA"
# The level named in ISA_ENV → (the flags' prefixes it drops, the compiler flags that drop them).
ISA_CAPS = {
    "avx2": (("avx512", "amx", "avx_vnni"), ("-mno-avx512f", "-mno-avxvnni", "-mno-amx-tile")),
    "portable": (("avx", "amx", "fma", "f16c"), ("-mno-avx",)),
}


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what `platform` knows: printed beside
    every speed figure, since the machine's CPU changes from one session to the next."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_identity() -> str:
    """The CPU's model name and flags lines (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


def isa_cap() -> str | None:
    """The level `DECODERLM_CPU_ISA` caps the kernels at ("avx2", "portable"), None if unset."""
    cap = os.environ.get(ISA_ENV) or None
    if cap is not None and cap not in ISA_CAPS:
        raise DecoderLMError(f"{ISA_ENV}={cap!r} must be one of {', '.join(ISA_CAPS)} or unset")
    return cap


def cap_compile_flags() -> tuple[str, ...]:
    """Compiler flags (x86) that leave out the instructions above `isa_cap`."""
    cap = isa_cap()
    if cap is None or platform.machine() not in ("x86_64", "AMD64", "i686"):
        return ()
    return ISA_CAPS[cap][1]


def cpu_flags() -> set[str]:
    """The instruction-set extensions /proc/cpuinfo lists (empty where it cannot be read), less
    those above `isa_cap`."""
    flags = [line for line in cpu_identity().splitlines() if line.startswith("flags")]
    listed = {flag for line in flags for flag in line.split(":", 1)[-1].split()}
    cap = isa_cap()
    return listed if cap is None else {f for f in listed if not f.startswith(ISA_CAPS[cap][0])}


def has_native_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions (AVX512-BF16 or AMX), used by oneDNN; False
    under an `isa_cap`."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe is not None and probe()) and isa_cap() is None


@torch.compiler.assume_constant_result  # traced code asks too; the answer never changes
def bf16_emulated() -> bool:
    """Whether PyTorch's bfloat16 matmuls run without bfloat16 instructions here (so slower than
    float32 ones: products of many bfloat16 rows are better done in float32)."""
    return not has_native_bf16()
