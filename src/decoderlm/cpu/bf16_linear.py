"""bfloat16 linear layers on the CPU's bfloat16 dot-product instructions, for the serving engine:
the products of its batched decode steps, read at memory bandwidth, and of its prefill chunks.

A decode step of B running sequences multiplies B rows by every weight: a few flops per weight
byte, so its speed is the rate at which the weights stream from memory. oneDNN's packed bfloat16
linear (`decoderlm.cpu.packed_linear`) reads them well below that rate at 4-16 rows. Here each
weight is laid out once in pairs of inputs for 16 outputs, (⌈N/16⌉, K/2, 16, 2), the order both
of the CPU's bfloat16 dot products read (float32 sums), and streamed block by block with a
software prefetch ahead. Two kernels take that layout, one per kind of CPU:

- `amx_linear.c` (Intel Sapphire Rapids and later, AMX-BF16): TDPBF16PS multiplies 16 rows × 32
  inputs by 32 inputs × 16 outputs per instruction; from 32 rows two tiles of rows share each
  load of the weights;
- `dpbf16_linear.c` (AVX512-BF16 without AMX: AMD Zen 4, Intel Cooper Lake): VDPBF16PS adds
  the products of one pair of inputs to 16 outputs per instruction, 6 rows × 4 blocks of 16
  outputs in registers at a time. On a Zen 4, SmolLM2-135M's 30 layers' products in 0.57× the
  time of oneDNN's packed linear at one row, 0.77× at 16, 0.85× at 64 and 0.95× at 512
  (benchmarks/README.md, "bfloat16 linears on the CPU's dot products").

Either sums each output pair by pair in the order of K whatever the rows beside it: a row's
outputs have the same bits alone or among others (`decoderlm.cpu.invariant` relies on it); the
two kernels' bits may differ from each other (each instruction rounds its own way).

`pack(weight)` lays a weight (N, K) out; `linear(x, packed, N)` is x Wᵀ in bfloat16.
`pack_swiglu(gate, up)` lays SwiGLU's two projections out block by block in turns, and
`swiglu(x, packed, N)` is silu(x W_gateᵀ) ⊙ x W_upᵀ (Shazeer, 2020) in one pass, the same bits as
the two linears and `decoderlm.cpu.fused.silu_mul`. `supports(weight)` says whether a kernel runs
for it: bfloat16, K a multiple of the kernel's step (32 on the tiles, 2 on AVX512-BF16), and
`kernel()` not None (a CPU with either kernel's instructions, a C compiler to build it
(`decoderlm.cpu.native`), and for the tiles Linux granting the process their state).

`float32_linear(x, W)` multiplies float32 activations by a weight a prefill has just made from
a GGUF file's rows (`decoderlm.quant.BlockLinear`: BF16 rows as they are, other types
dequantized) as torch's float32 matmul precision allows: at "medium"
(`torch.set_float32_matmul_precision`: bfloat16 inside a float32 product) x and W are rounded to
bfloat16 and the VDPBF16PS kernel keeps its float32 sums, llama.cpp's arithmetic for BF16 weights
(on a Zen 4 SmolLM2-135M's BF16 file then prefills 512 tokens at 1.07-1.20× llama.cpp's rate,
against 0.72-0.82× exactly: benchmarks/README.md); otherwise oneDNN's float32 linear multiplies
exactly.

Eagerly the kernel is called through ctypes; traced code (the engine's compiled decode pass of
several rows, `decoderlm.cpu.paged_step`) calls the same kernel as the op decoderlm::bf16_linear
(`bf16_linear_ops.cpp`, built with the kernel where `op_available` says), which a library
compiled ahead of time calls without Python, the packed weights among its inputs.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from decoderlm.cpu import bf16_kernels, native, onednn

HERE = Path(__file__).parent
SOURCES = {"amx": HERE / "amx_linear.c", "avx512_bf16": HERE / "dpbf16_linear.c"}
INPUTS_PER_STEP = {"amx": 32, "avx512_bf16": 2}  # K is consumed this many inputs at a time
OUTPUTS_PER_BLOCK = 16


@functools.cache
def _library(name: str) -> ctypes.CDLL | None:
    """Kernel `name`'s library, None where it does not run here."""
    library = bf16_kernels.load(name, SOURCES[name], "bfloat16 linears stay on oneDNN")
    if library is not None:
        library.packed_linear_bf16.restype = None
        library.packed_linear_bf16.argtypes = (
            [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        )
    if library is not None and name == "avx512_bf16":
        library.packed_linear_bf16_f32.restype = None
        library.packed_linear_bf16_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    return library


@functools.cache
def kernels() -> tuple[str, ...]:
    """The kernels that run here, the faster first: "amx" where the CPU has the tiles,
    "avx512_bf16" where it has VDPBF16PS."""
    return tuple(name for name in SOURCES if _library(name) is not None)


def kernel() -> str | None:
    """The kernel the packed linears run here (the first of `kernels()`), None if none does."""
    return next(iter(kernels()), None)


_OPS = torch.library.Library("decoderlm", "FRAGMENT")
_OPS.define("bf16_linear(Tensor x, Tensor packed, int out_features, bool swiglu) -> Tensor")
_OPS.define("float32_linear(Tensor x, Tensor weight) -> Tensor")


@torch.compiler.assume_constant_result  # asked while tracing; the answer never changes
@functools.cache
def op_available() -> bool:
    """Whether the op decoderlm::bf16_linear runs here (`kernel()`, and its op built with it)."""
    name = kernel()
    sources = [SOURCES[name], HERE / "bf16_linear_ops.cpp"] if name else []
    return bool(sources) and native.load_ops(sources, "no compiled pass of many rows")


def supports(weight: Tensor) -> bool:
    """Whether `linear` runs for this weight (N, K) here."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and kernel() is not None
        and weight.shape[1] % INPUTS_PER_STEP[kernel()] == 0
    )


def pack(weight: Tensor) -> Tensor:
    """weight (N, K) → (⌈N/16⌉, K/2, 16, 2): block j, row p holds outputs 16j .. 16j + 15, each with
    inputs 2p and 2p + 1 (outputs past N are zeros)."""
    n, k = weight.shape
    blocks = -(-n // OUTPUTS_PER_BLOCK)
    padded = weight.contiguous()
    if n % OUTPUTS_PER_BLOCK:
        padded = weight.new_zeros(blocks * OUTPUTS_PER_BLOCK, k)
        padded[:n] = weight
    pairs = padded.view(torch.int32).view(blocks, OUTPUTS_PER_BLOCK, k // 2)  # a pair as one int32
    return pairs.transpose(1, 2).contiguous().view(torch.bfloat16).view(blocks, k // 2, 16, 2)


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
        return torch.ops.decoderlm.bf16_linear(x, packed, out_features, swiglu)
    k = packed.shape[1] * 2
    if x.shape[-1] != k or x.dtype != torch.bfloat16:
        raise ValueError(f"bf16_linear: x {tuple(x.shape)} {x.dtype} for a weight of {k} inputs")
    rows = x.reshape(-1, k).contiguous()  # (M, K)
    y = x.new_empty(rows.shape[0], out_features)  # (M, N)
    if rows.shape[0]:
        _library(kernel()).packed_linear_bf16(
            rows.data_ptr(), packed.data_ptr(), y.data_ptr(), rows.shape[0], out_features, k,
            int(swiglu),
        )  # fmt: skip
    return y.view(*x.shape[:-1], out_features)


def float32_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x Wᵀ: x (..., K) float32, W (N, K) bfloat16 or float32 → (..., N) float32. At float32
    matmul precision "medium", where the VDPBF16PS kernel runs and K is even, x and W are rounded
    to bfloat16 (to nearest even; a bfloat16 W is taken as it is) and W packed for the kernel on
    each call (`pack`: nothing kept beside the weight), each output the float32 sum of its
    products in the order of K; otherwise oneDNN's float32 linear of x and W in float32 (as the
    model's own float32 prefills run: `decoderlm.cpu.decode`). The op decides as it runs,
    so a compiled graph follows the precision set after tracing."""
    return torch.ops.decoderlm.float32_linear(x, weight)


@torch.library.impl("decoderlm::float32_linear", "CPU", lib=_OPS)
def _(x: Tensor, weight: Tensor) -> Tensor:
    n, k = weight.shape
    rounding = torch.get_float32_matmul_precision() == "medium"
    if not (rounding and "avx512_bf16" in kernels() and k % 2 == 0):
        return onednn.linear(x, weight.float())
    rows = x.reshape(-1, k).bfloat16()  # (M, K), rounded to nearest even
    packed = pack(weight.bfloat16())  # (⌈N/16⌉, K/2, 16, 2)
    y = x.new_empty(rows.shape[0], n)  # (M, N) float32
    if rows.shape[0]:
        _library("avx512_bf16").packed_linear_bf16_f32(
            rows.data_ptr(), packed.data_ptr(), y.data_ptr(), rows.shape[0], n, k
        )
    return y.view(*x.shape[:-1], n)


@torch.library.register_fake("decoderlm::float32_linear", lib=_OPS)
def _(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


@torch.library.register_fake("decoderlm::bf16_linear", lib=_OPS)
def _(x: Tensor, packed: Tensor, out_features: int, swiglu: bool) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))
