"""What this CPU is: its model name, the flags /proc/cpuinfo lists, and whether it has native
bfloat16 matmuls."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


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


def cpu_flags() -> set[str]:
    """The instruction-set extensions /proc/cpuinfo lists (empty where it cannot be read)."""
    flags = [line for line in cpu_identity().splitlines() if line.startswith("flags")]
    return {flag for line in flags for flag in line.split(":", 1)[-1].split()}


def has_native_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions (AVX512-BF16 or AMX), used by oneDNN."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe is not None and probe())
