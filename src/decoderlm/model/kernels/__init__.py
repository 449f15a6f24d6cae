"""Optional GPU kernels written in Triton (`pip install 'decoderlm[triton]'`).

Importing this package never imports triton; import `decoderlm.model.kernels.flash_triton` only where
`triton_available()` is true (with CUDA tensors, or on a CPU under `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

from functools import cache


@cache
def triton_available() -> bool:
    """Whether `triton` can be imported (the `triton` extra is installed)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
