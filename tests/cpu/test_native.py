"""Compiled code's caches: a C kernel library's name changes with every file its build reads; a
process whose PyTorch kernels are capped compiles into an Inductor cache of its own."""

import os
import subprocess
import sys
from pathlib import Path

from decoderlm.cpu import native


def test_a_build_is_renamed_when_a_header_reached_through_another_header_changes(
    tmp_path: Path,
) -> None:
    source = tmp_path / "kernel.c"
    source.write_text('#include "outer.h"\nint f(void) { return A; }\n')
    # outer.h and inner.h include each other (guarded): the walk must still end.
    (tmp_path / "outer.h").write_text('#pragma once\n#include "inner.h"\n')
    (tmp_path / "inner.h").write_text('#pragma once\n#include "outer.h"\n#define A 1\n')
    before = native.library_path([source])
    assert native.library_path([source]) == before
    (tmp_path / "inner.h").write_text('#pragma once\n#include "outer.h"\n#define A 2\n')
    assert native.library_path([source]) != before


def test_a_process_with_capped_pytorch_kernels_compiles_into_an_inductor_cache_of_its_own() -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    show = "import os, decoderlm; print(os.environ.get('TORCHINDUCTOR_CACHE_DIR'))"
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR")
    }

    def cache_dir(**env: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", show], env={**base, **env}, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert cache_dir() in ("None", default_cache_dir())  # uncapped: Inductor's default
    assert cache_dir(ATEN_CPU_CAPABILITY="avx2") == f"{default_cache_dir()}-avx2"
    assert cache_dir(ATEN_CPU_CAPABILITY="avx2", TORCHINDUCTOR_CACHE_DIR="/tmp/mine") == "/tmp/mine"
