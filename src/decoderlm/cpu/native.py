"""C kernels compiled on first use and kept in a cache (`paged_attention.c`, `gemv.c`).

Each C source is compiled with the system's C compiler (`$CC`, else `cc`), each C++ source with
`$CXX` (else `c++`) against torch's stable C ABI, for this CPU (`-march=native`, less what
`features.isa_cap` leaves out), into
`$DECODERLM_CACHE/kernels` (default `~/.cache/decoderlm/kernels`), under a name hashed from the
sources, the flags, torch's version and the CPU's model and flags, so a different machine compiles
its own. Where no compiler is found, the compile fails or the cache is not writable,
`load` returns None (logged once per source) and the caller keeps its PyTorch path; a damaged
file in the cache is rebuilt once. A `Build` compiles a source with flags of its own (one C file
built once per instruction set: `block_linear.c`, `block_panels.c`). The kernels run on torch's OpenMP runtime (`-fopenmp` binds
them to the libgomp that torch has loaded).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from decoderlm.cpu import features

log = logging.getLogger(__name__)
T = TypeVar("T")
# Compiled with -ffast-math (vectorised expf and reductions) but linked without it: gcc < 13 links
# crtfastmath.o into a -ffast-math shared library, whose loading switches the whole process to
# flush subnormals to zero.
COMPILE = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c"]
CXX_COMPILE = ["-O2", "-march=native", "-std=c++17", "-fPIC", "-c"]
LINK = ["-shared", "-fopenmp"]


@dataclass(frozen=True)
class Build:
    """`source` compiled with `flags` after the usual ones (-D…, -mno-…)."""

    source: Path
    flags: tuple[str, ...] = ()


Source = Path | Build


def _build_of(source: Source) -> Build:
    return source if isinstance(source, Build) else Build(source)


def _torch_dirs() -> tuple[str, str]:
    """torch's header and library directories, for C++ sources against its stable C ABI."""
    root = Path(torch.__file__).parent
    return str(root / "include"), str(root / "lib")


def _compiler(cpp: bool) -> str:
    return os.environ.get("CXX", "c++") if cpp else os.environ.get("CC", "cc")


def _compile_command(build: Build) -> list[str]:
    """The compiler and its flags: -march=native, less what `features.isa_cap` leaves out."""
    if build.source.suffix == ".cpp":
        cpp = [_compiler(cpp=True), *CXX_COMPILE, *features.cap_compile_flags(), *build.flags]
        return [*cpp, "-I", _torch_dirs()[0]]
    return [_compiler(cpp=False), *COMPILE, *features.cap_compile_flags(), *build.flags]


def _local_headers(source: Path) -> list[Path]:
    """The headers beside `source` that it includes (`#include "vec.h"`), and those they include."""
    found: list[Path] = []
    pending = [source]
    while pending:
        text = pending.pop().read_bytes()
        for name in re.findall(rb'^#include "([^"]+)"', text, flags=re.MULTILINE):
            header = source.with_name(name.decode())
            if header not in found:
                found.append(header)
                pending.append(header)
    return found


def library_path(sources: Sequence[Source]) -> Path:
    """Where the build of `sources` (named after the first), with these flags, for this CPU and
    this torch, lives in the cache; the headers they include count as their text."""
    builds = [_build_of(s) for s in sources]
    parts = [b.source.read_bytes() + " ".join(b.flags).encode() for b in builds]
    parts += [h.read_bytes() for b in builds for h in _local_headers(b.source)]
    flags = [*COMPILE, *CXX_COMPILE, *LINK, *features.cap_compile_flags()]
    parts += [" ".join(flags).encode(), features.cpu_identity().encode()]
    parts += [torch.__version__.encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    root = Path(os.environ.get("DECODERLM_CACHE", Path.home() / ".cache" / "decoderlm"))
    return root / "kernels" / f"{builds[0].source.stem}-{key}.so"


def _run(command: list[str]) -> None:
    """Run a compiler; OSError with its last line if it is missing or fails."""
    if shutil.which(command[0]) is None:
        raise OSError(f"no compiler {command[0]!r}")
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no message"])[-1]
        raise OSError(f"{Path(command[0]).name} failed: {last}")


def _build(sources: Sequence[Source], target: Path) -> None:
    """Compile `sources` (C, and C++ against torch's stable ABI) and link them into `target`,
    atomically (a concurrent process sees the whole file or none)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    builds = [_build_of(s) for s in sources]
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{i}-{b.source.name}.o" for i, b in enumerate(builds)]
        for build, obj in zip(builds, objects, strict=True):
            _run([*_compile_command(build), str(build.source), "-o", str(obj)])
        cpp = any(b.source.suffix == ".cpp" for b in builds)
        linker = _compiler(cpp)
        libs = ["-L", _torch_dirs()[1], f"-Wl,-rpath,{_torch_dirs()[1]}", "-ltorch_cpu", "-lc10"]
        built = Path(tmp) / target.name
        _run([linker, *LINK, *map(str, objects), "-o", str(built), "-lm", *(libs if cpp else [])])
        built.replace(target)


def load(sources: Sequence[Source], fallback: str, opener: Callable[[str], T]) -> T | None:
    """opener(path) of the compiled `sources` (ctypes.CDLL, or torch.ops.load_library for a
    library of torch ops), built first if the cache lacks it; None (with a warning that ends in
    `fallback`, what the caller does instead) where it cannot be built."""
    target = library_path(sources)
    try:
        if not target.exists():
            _build(sources, target)
        try:
            return opener(str(target))
        except OSError:  # a damaged file in the cache: build it again, once
            _build(sources, target)
            return opener(str(target))
    except OSError as exc:
        log.warning("decoderlm: building %s: %s; %s", target.name, exc, fallback)
        return None


def load_ops(sources: Sequence[Source], fallback: str) -> bool:
    """Build (if need be) and load `sources` as a library of torch ops, whose kernels register
    themselves with the dispatcher (`torch.ops.load_library`); False (warned) where it cannot be."""
    return load(sources, fallback, load_ops_library) is not None


def load_ops_library(path: str) -> ctypes.CDLL:
    """The library of torch ops at `path`, loaded: its kernels registered with the dispatcher
    (`torch.ops.load_library`) and its symbols global, where the libraries AOTInductor compiles
    find its direct-call functions (`aoti_shim.h`, `decoderlm.cpu.shims`)."""
    library = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    torch.ops.load_library(path)  # the same library: only recorded as loaded
    return library
