"""keep_freed_memory: buffers freed and allocated again reuse the heap's pages instead of new ones."""

import ctypes.util
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from decoderlm.cpu import heap

pytestmark = pytest.mark.skipif(
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


def _page_faults_of_growing_buffers(keep: bool) -> int:
    """Minor page faults, in a fresh process, of writing buffers of 1, 2, ..., 16 MiB in turn."""
    body = f"""
        import resource
        if {keep}:
            assert heap.keep_freed_memory()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for mib in range(1, 17):
            buffer = b"x" * (mib * 2**20)  # allocated, every page written, freed
            del buffer
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        """
    return int(_with_heap_in_fresh_process(body))


def test_freed_buffers_are_reused_without_page_faults():
    pages_of_largest = 16 * 2**20 // 4096
    kept = _page_faults_of_growing_buffers(keep=True)
    default = _page_faults_of_growing_buffers(keep=False)
    # Kept: only the heap's growth to the largest buffer faults (4,096 pages). glibc's default maps
    # each buffer larger than any freed before afresh: 1 + 2 + ... + 16 MiB, 34,816 pages.
    assert kept <= 1.25 * pages_of_largest
    assert default > 4 * kept


def test_malloc_in_use_names_glibc_or_the_preloaded_tcmalloc() -> None:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    in_use = "print(heap.malloc_in_use())"
    assert _with_heap_in_fresh_process(in_use, env) == "glibc"
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal")
    if tcmalloc is None:
        pytest.skip("no tcmalloc here (Debian: libtcmalloc-minimal4)")
    assert _with_heap_in_fresh_process(in_use, {**env, "LD_PRELOAD": tcmalloc}) == "tcmalloc"
