"""keep_freed_memory: buffers freed and allocated again reuse the heap's pages instead of new ones;
freeze_startup_objects: the objects a process holds when it is ready are left out of later
collections."""

import ctypes.util
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from decoderlm.cpu import heap

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)


def _with_heap_in_fresh_process(body: str, env: dict[str, str] | None = None) -> str:
    """stdout of `body` run by a fresh interpreter, with `heap` loaded from its file (no torch)."""
    load = textwrap.dedent(
        f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("heap", {heap.__file__!r})
        heap = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(heap)
        """
    )
    code = load + textwrap.dedent(body)
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return run.stdout.strip()


def _page_faults_of_growing_buffers(keep: bool) -> tuple[int, int]:
    """Minor page faults, in a fresh process, of writing buffers of 1, 2, ..., 16 MiB in turn:
    (the first pass, a second pass over the same sizes)."""
    body = f"""
        import resource
        if {keep}:
            assert heap.keep_freed_memory()
        for _ in range(2):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for mib in range(1, 17):
                buffer = b"x" * (mib * 2**20)  # allocated, every page written, freed
                del buffer
            print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        """
    first, second = _with_heap_in_fresh_process(body).split()
    return int(first), int(second)


@glibc_only
def test_freed_buffers_are_reused_without_page_faults():
    pages_of_largest = 16 * 2**20 // 4096
    kept_first, kept_again = _page_faults_of_growing_buffers(keep=True)
    default_first, _ = _page_faults_of_growing_buffers(keep=False)
    # Kept: once the heap has grown to hold the largest buffer, the same buffers again fault (next
    # to) never: every page is reused. How much the first pass faults depends on where the
    # interpreter's own start-up allocations left holes in the heap (4,094 to 6,387 pages seen,
    # with and without PYTHONPATH set), so that pass is only compared with glibc's default, which
    # maps each buffer larger than any freed before afresh: 1 + 2 + ... + 16 MiB, 34,816 pages.
    assert kept_again <= 0.01 * pages_of_largest
    assert default_first > 4 * kept_first


@glibc_only
def test_malloc_in_use_names_glibc_or_the_preloaded_tcmalloc() -> None:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    in_use = "print(heap.malloc_in_use())"
    assert _with_heap_in_fresh_process(in_use, env) == "glibc"
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal")
    if tcmalloc is None:
        pytest.skip("no tcmalloc here (Debian: libtcmalloc-minimal4)")
    assert _with_heap_in_fresh_process(in_use, {**env, "LD_PRELOAD": tcmalloc}) == "tcmalloc"


def test_startup_objects_are_frozen_and_later_collections_walk_only_newer_ones():
    body = """
        import gc
        startup = [[i] for i in range(50_000)]  # tracked objects a server holds from its start
        heap.freeze_startup_objects()
        frozen, walked = gc.get_freeze_count(), len(gc.get_objects())
        later = [[i] for i in range(1_000)]
        gc.collect()
        print(frozen, walked, len(gc.get_objects()) - walked)
        """
    frozen, walked, added = map(int, _with_heap_in_fresh_process(body).split())
    assert frozen >= 50_000  # the startup objects, and the interpreter's own
    assert walked < 1_000  # what a collection still walks: next to nothing
    assert 1_000 <= added < 1_100  # the later objects (and their list)
