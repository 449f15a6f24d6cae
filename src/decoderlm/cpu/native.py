"""C kernels compiled on first use and kept in a cache (`paged_attention.c`, `gemv.c`).

Each C source is compiled with the system's C compiler (`$CC`, else `cc`), each C++ source with
`$CXX` (else `c++`) against torch's stable C ABI, for this CPU (`-march=native`), into
`$DECODERLM_CACHE/kernels` (default `~/.cache/decoderlm/kernels`), under a name hashed from the
sources, the flags, torch's version and the CPU's model and flags, so a different machine compiles
its own. Where no compiler is found, the compile fails or the cache is not writable,
`load` returns None (logged once per source) and the caller keeps its PyTorch path; a damaged
file in the cache is rebuilt once. The kernels run on torch's OpenMP runtime (`-fopenmp` binds
them to the libgomp that torch has loaded).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
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


def _torch_dirs() -> tuple[str, str]:
    """torch's header and library directories, for C++ sources against its stable C ABI."""
    root = Path(torch.__file__).parent
    return str(root / "include"), str(root / "lib")


def _compiler(cpp: bool) -> str:
    return os.environ.get("CXX", "c++") if cpp else os.environ.get("CC", "cc")


def _compile_command(source: Path) -> list[str]:
    if source.suffix == ".cpp":
        return [_compiler(cpp=True), *CXX_COMPILE, "-I", _torch_dirs()[0]]
    return [_compiler(cpp=False), *COMPILE]


def library_path(sources: Sequence[Path]) -> Path:
    """Where the build of `sources` (named after the first), with these flags, for this CPU and
    this torch, lives in the cache."""
    parts = [s.read_bytes() for s in sources]
    parts += [" ".join(COMPILE + CXX_COMPILE + LINK).encode(), features.cpu_identity().encode()]
    parts += [torch.__version__.encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    root = Path(os.environ.get("DECODERLM_CACHE", Path.home() / ".cache" / "decoderlm"))
    return root / "kernels" / f"{sources[0].stem}-{key}.so"


def _run(command: list[str]) -> None:
    """Run a compiler; OSError with its last line if it is missing or fails."""
    if shutil.which(command[0]) is None:
        raise OSError(f"no compiler {command[0]!r}")
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no message"])[-1]
        raise OSError(f"{Path(command[0]).name} failed: {last}")


def _build(sources: Sequence[Path], target: Path) -> None:
    """Compile `sources` (C, and C++ against torch's stable ABI) and link them into `target`,
    atomically (a concurrent process sees the whole file or none)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{source.name}.o" for source in sources]
        for source, obj in zip(sources, objects, strict=True):
            _run([*_compile_command(source), str(source), "-o", str(obj)])
        cpp = any(source.suffix == ".cpp" for source in sources)
        linker = _compiler(cpp)
        libs = ["-L", _torch_dirs()[1], f"-Wl,-rpath,{_torch_dirs()[1]}", "-ltorch_cpu", "-lc10"]
        built = Path(tmp) / target.name
        _run([linker, *LINK, *map(str, objects), "-o", str(built), "-lm", *(libs if cpp else [])])
        built.replace(target)


def load(sources: Sequence[Path], fallback: str, opener: Callable[[str], T]) -> T | None:
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


def load_ops(sources: Sequence[Path], fallback: str) -> bool:
    """Build (if need be) and load `sources` as a library of torch ops, whose kernels register
    themselves with the dispatcher (`torch.ops.load_library`); False (warned) where it cannot be."""
    return load(sources, fallback, _load_ops_library) is not None


def _load_ops_library(path: str) -> str:
    torch.ops.load_library(path)
    return path
