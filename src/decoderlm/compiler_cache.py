"""An Inductor cache of its own for a process whose PyTorch kernels are capped.

`ATEN_CPU_CAPABILITY=avx2` (what benchmarks/gguf_decode.py's `--avx2` sets, with decoderlm's own
`DECODERLM_CPU_ISA`, to run an AVX2-only CPU's paths on an AVX-512 one) makes Inductor generate
code for AVX2's vector width, but file it under the keys the CPU's own code has. A capped and an
uncapped process sharing one cache then load each other's compiled kernels (torch 2.13: after
capped runs a compiled attention gave values of 1e38 in a capped process and crashed an uncapped
one). `decoderlm/__init__.py` calls `separate_compiler_cache` first, before any import can ask
Inductor for its cache directory (importing Triton does).
"""

from __future__ import annotations

import os


def separate_compiler_cache() -> None:
    """Under ATEN_CPU_CAPABILITY, unless TORCHINDUCTOR_CACHE_DIR names a cache: Inductor's
    default cache directory + "-" + the capability (e.g. /tmp/torchinductor_root-avx2)."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}-{capability}"
