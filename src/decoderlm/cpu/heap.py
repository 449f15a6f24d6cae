"""The process's heap: freed memory kept for reuse, so that a loop's buffers stop page-faulting;
a server's startup objects exempt from Python's collector (`freeze_startup_objects`).

A training step allocates its activations and frees them again, at the same sizes, every step.
glibc's malloc gives allocations above a threshold their own pages from the kernel (mmap) and
returns them when freed; it also gives back the top of its heap once enough of it is free. The
threshold starts at 128 KiB and rises to the size of the largest such buffer freed so far, so
whether a step's buffers are fresh pages depends on what the process did before. When they are,
the first write to each 4 KiB page is a page fault, with the kernel zeroing the page. In a bare
training loop of the nanoGPT CPU recipe (`benchmarks/shakespeare_char.py`) this came and went from
one process to the next: from none to a thousand faults per step, and slower steps when they
occurred. With both thresholds raised: < 1 fault per step (the figures: benchmarks/README.md).

`keep_freed_memory` raises them with `mallopt`: allocations up to 32 MiB (the largest threshold
glibc accepts) come from the heap, and the heap keeps up to 1 GiB of free memory. This is what the
allocators PyTorch's CPU tuning guide suggests preloading (jemalloc, tcmalloc) do, without a
preload. The cost is memory kept by the process after a peak instead of returned to the system.

Preloading tcmalloc can still help: glibc's malloc and free run on the main thread while the
other cores wait (`LD_PRELOAD=libtcmalloc_minimal.so.4`, Debian: libtcmalloc-minimal4; measured in
benchmarks/README.md). `malloc_in_use` says which allocator a process has.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import platform
from pathlib import Path

# mallopt parameters, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # bytes: larger allocations still get pages of their own
TRIM_THRESHOLD = 2**30  # bytes of free memory the heap keeps before returning any


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where there is no glibc.

    Both are needed: setting either one also turns off glibc's dynamic mmap threshold, so the trim
    threshold alone sent every large buffer to mmap (2,500 faults per step of the recipe above).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    applied = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    return bool(applied and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)


def freeze_startup_objects() -> None:
    """Collect, then exempt every object that exists now from later collections (`gc.freeze`).

    A serving process holds hundreds of thousands of objects from startup (torch's and the
    tokenizer's modules, the model, the compiled pass) that live as long as it does. Python's
    collector walks all of them in each collection of its oldest generation: 120-200 ms pauses a
    few times a minute, in the engine between two steps and in the HTTP server between two
    requests, each a stall of every stream. Frozen, they are no longer walked. vLLM freezes its
    engine core's and API server's startup heaps for the same reason. Called once a process is
    ready to serve; cycles among the frozen objects are never collected, so only there.
    """
    gc.collect()
    gc.freeze()


PRELOADABLE = ("tcmalloc", "jemalloc", "mimalloc")


def malloc_in_use() -> str:
    """The allocator of this process: a preloaded one by name, else "glibc" or "system"."""
    maps = Path("/proc/self/maps")
    mapped = maps.read_text() if maps.exists() else ""
    found = [name for name in PRELOADABLE if f"lib{name}" in mapped]
    if found:
        return found[0]
    return "glibc" if platform.libc_ver()[0] == "glibc" else "system"
