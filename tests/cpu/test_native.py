"""The C kernels' build cache: a library's name changes with every file its build reads."""

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
