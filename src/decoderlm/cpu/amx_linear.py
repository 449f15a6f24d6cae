"""bfloat16 linear layers of a few rows on Intel AMX (Advanced Matrix Extensions) tiles: the
products of the serving engine's batched decode steps, read at memory bandwidth.

A decode step of B running sequences multiplies B rows by every weight: a few flops per weight
byte, so its speed is the rate at which the weights stream from memory. oneDNN's packed bfloat16
linear (`decoderlm.cpu.packed_linear`) reads them well below that rate at 4-16 rows; the kernel in
`amx_linear.c` keeps each weight blocked for the tile multiply (TDPBF16PS: 16 rows × 32 inputs
times 32 inputs × 16 outputs per instruction, float32 sums) and prefetches each block ahead, so
the products are bound by the memory (measured in benchmarks/README.md, serve.py). Rows beyond 16
re-read the block from the cache, not from memory.

`pack(weight)` lays a weight (N, K) out as (⌈N/16⌉, K/2, 16, 2) once; `linear(x, packed, N)` is
x Wᵀ in bfloat16. `pack_swiglu(gate, up)` lays SwiGLU's two projections out block by block in
turns, and `swiglu(x, packed, N)` is silu(x W_gateᵀ) ⊙ x W_upᵀ (Shazeer, 2020) in one pass, the
same bits as the two linears and `decoderlm.cpu.fused.silu_mul`. `supports(weight)` says whether the kernel runs for it: bfloat16, K a multiple
of 32, a CPU with AMX-BF16 (and AVX512-BF16, for the rounding), a C compiler to build the kernel
(`decoderlm.cpu.native`), and Linux granting the process the tile state (arch_prctl
ARCH_REQ_XCOMP_PERM).

Eagerly the kernel is called through ctypes; traced code (the engine's compiled decode pass of
several rows, `decoderlm.cpu.paged_step`) calls the same kernel as the op decoderlm::amx_linear
(`amx_linear_ops.cpp`, built where `op_available` says), which a library compiled ahead of time
calls without Python, the packed weights among its inputs.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
from torch import Tensor

from decoderlm.cpu import features, native

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("amx_linear.c")
OPS_SOURCES = [SOURCE, Path(__file__).with_name("amx_linear_ops.cpp")]
CPU_FLAGS = {"amx_tile", "amx_bf16", "avx512_bf16"}
INPUTS_PER_TILE = 32  # K is consumed 32 inputs (one tile row of 64 bytes) at a time
OUTPUTS_PER_BLOCK = 16


def load_tile_library(source: Path, fallback: str) -> ctypes.CDLL | None:
    """An AMX kernel's library (its source includes `amx.h`), built if need be, the process
    granted the tile state; None (warned, the caller doing `fallback` instead) where the CPU
    lacks CPU_FLAGS, the library does not build, or Linux refuses the tiles."""
    if not CPU_FLAGS.issubset(features.cpu_flags()):
        return None
    library = native.load([source], fallback, ctypes.CDLL)
    if library is None:
        return None
    library.amx_request.restype = ctypes.c_int
    if library.amx_request() != 0:
        log.warning("decoderlm: the kernel refused AMX tiles; %s", fallback)
        return None
    return library


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = load_tile_library(SOURCE, "bfloat16 linears stay on oneDNN")
    if library is None:
        return None
    library.amx_linear_bf16.restype = None
    library.amx_linear_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    return library


_OPS = torch.library.Library("decoderlm", "FRAGMENT")
_OPS.define("amx_linear(Tensor x, Tensor packed, int out_features, bool swiglu) -> Tensor")


@torch.compiler.assume_constant_result  # asked while tracing; the answer never changes
@functools.cache
def op_available() -> bool:
    """Whether the op decoderlm::amx_linear runs here (the kernel, and its op built)."""
    return _library() is not None and native.load_ops(OPS_SOURCES, "no compiled pass of many rows")


def supports(weight: Tensor) -> bool:
    """Whether `linear` runs for this weight (N, K) here."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[1] % INPUTS_PER_TILE == 0
        and _library() is not None
    )


def pack(weight: Tensor) -> Tensor:
    """weight (N, K) → (⌈N/16⌉, K/2, 16, 2): block j, row p holds outputs 16j .. 16j + 15, each with
    inputs 2p and 2p + 1 (outputs past N are zeros)."""
    n, k = weight.shape
    blocks = -(-n // OUTPUTS_PER_BLOCK)
    padded = weight.new_zeros(blocks * OUTPUTS_PER_BLOCK, k)
    padded[:n] = weight
    return padded.view(blocks, OUTPUTS_PER_BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """gate, up (N, K) → (2·⌈N/16⌉, K/2, 16, 2): pack(gate)'s block j, then pack(up)'s, for each j."""
    both = torch.stack([pack(gate), pack(up)], dim=1)  # (⌈N/16⌉, 2, K/2, 16, 2)
    return both.flatten(0, 1)


def linear(x: Tensor, packed: Tensor, out_features: int) -> Tensor:
    """x Wᵀ: x (..., K) bfloat16, packed = pack(W) of W (out_features, K) → (..., out_features)."""
    return _run(x, packed, out_features, swiglu=False)


def swiglu(x: Tensor, packed: Tensor, out_features: int) -> Tensor:
    """silu(x W_gateᵀ) ⊙ x W_upᵀ, each product rounded to bfloat16 first: x (..., K) bfloat16,
    packed = pack_swiglu(W_gate, W_up) of two (out_features, K) weights → (..., out_features)."""
    return _run(x, packed, out_features, swiglu=True)


def _run(x: Tensor, packed: Tensor, out_features: int, swiglu: bool) -> Tensor:
    if torch.compiler.is_compiling():
        return torch.ops.decoderlm.amx_linear(x, packed, out_features, swiglu)
    k = packed.shape[1] * 2
    if x.shape[-1] != k or x.dtype != torch.bfloat16:
        raise ValueError(f"amx_linear: x {tuple(x.shape)} {x.dtype} for a weight of {k} inputs")
    rows = x.reshape(-1, k).contiguous()  # (M, K)
    y = x.new_empty(rows.shape[0], out_features)  # (M, N)
    if rows.shape[0]:
        _library().amx_linear_bf16(
            rows.data_ptr(), packed.data_ptr(), y.data_ptr(), rows.shape[0], out_features, k,
            int(swiglu),
        )  # fmt: skip
    return y.view(*x.shape[:-1], out_features)


@torch.library.register_fake("decoderlm::amx_linear", lib=_OPS)
def _(x: Tensor, packed: Tensor, out_features: int, swiglu: bool) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))
