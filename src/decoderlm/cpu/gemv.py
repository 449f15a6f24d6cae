"""One-row linear layers for decoding one sequence on the CPU: y = x Wᵀ read at memory bandwidth.

Decoding batch 1 reads every weight once per token and does two flops per weight read, so its
speed is the rate at which the weights stream from memory. The kernels in `gemv.c` compute one
output row after another, each thread a contiguous run of rows (one sequential stream of weights
each), with AVX-512 (vdpbf16ps for bfloat16, bfloat16 weights widened to float32 for float32
activations, int8 widened to float32 for per-row-scaled int8), summing in float32 as F.linear
does (only the order of the sums differs), and prefetch each row's weights 6 KiB ahead: the
hardware prefetcher alone ramps up too slowly on matrices of a few hundred KB,
where F.linear's GEMV and the product-and-row-sum that inductor
fuses (`decode.CPULinearKernels`) stay well below the memory bandwidth. Measured against
llama.cpp and without the prefetch: benchmarks/README.md, llama_cpp.py.

`linear(x, weight)` and `int8_linear(x, weight_q, scale)` call the ops decoderlm::gemv and
decoderlm::gemv_int8, defined here with fake kernels (so torch.compile and torch.export treat
them as opaque and the compiled decode step calls them as they are) and implemented in
`gemv_ops.cpp` against torch's stable C ABI: a library compiled ahead of time calls them without
Python (a Python kernel's call costs as much as a 512 × 512 product: benchmarks/README.md). `available` says
whether the kernel for a pair of dtypes was built here: AVX-512 (and AVX512-BF16 for bfloat16
weights) and C and C++ compilers (`decoderlm.cpu.native`). The call sites
(`decode.CPULinearKernels`, `quant.linear.Int8Linear` and `Bf16Linear`) fall back to PyTorch
where it is not.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_or_false

from decoderlm.cpu import features, native

SOURCES = [Path(__file__).with_name("gemv.c"), Path(__file__).with_name("gemv_ops.cpp")]
# (activation dtype, weight dtype) pairs with a kernel, and the CPU flags each needs.
KERNELS = {
    (torch.float32, torch.float32): {"avx512f"},
    (torch.bfloat16, torch.bfloat16): {"avx512f", "avx512_bf16"},
    (torch.float32, torch.bfloat16): {"avx512f"},  # bfloat16 weights widened to float32
    (torch.float32, torch.int8): {"avx512f"},
    (torch.bfloat16, torch.int8): {"avx512f"},
}

_OPS = torch.library.Library("decoderlm", "FRAGMENT")
_OPS.define("gemv(Tensor x, Tensor weight) -> Tensor")
_OPS.define("gemv_int8(Tensor x, Tensor weight_q, Tensor scale) -> Tensor")


@functools.cache
def _built() -> bool:
    """Whether the ops' CPU kernels are loaded (built first where the cache lacks them)."""
    if "avx512f" not in features.cpu_flags():
        return False
    fallback = "one-row linear layers run on PyTorch's kernels"
    return native.load_ops(SOURCES, fallback)


@torch.compiler.assume_constant_result  # traced code asks too; the answer never changes
def available(x_dtype: torch.dtype, weight_dtype: torch.dtype) -> bool:
    """Whether a kernel for activations of x_dtype and weights of weight_dtype runs on this CPU."""
    needs = KERNELS.get((x_dtype, weight_dtype))
    return needs is not None and needs <= features.cpu_flags() and _built()


def one_row_of(x: Tensor) -> bool:
    """Whether x (..., K) holds one row; False, and no guard, where that rests on a symbolic
    batch size (a library traced for any number of rows)."""
    return guard_or_false(math.prod(x.shape[:-1]) == 1)  # (torch.Size.numel specializes)


def handles(x: Tensor, weight: Tensor) -> bool:
    """Whether x Wᵀ goes to a kernel here: one row on the CPU, no gradient to x or W, and a kernel
    for their dtypes (what both call sites ask before `linear` / `int8_linear`)."""
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    one_row = one_row_of(x) and x.device.type == "cpu"
    return one_row and not needs_grad and available(x.dtype, weight.dtype)


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """x Wᵀ for one row: x (..., K) with one row in all, weight (N, K) of x's dtype (or bfloat16
    for float32 x, widened exactly) → (..., N) in x's dtype."""
    return torch.ops.decoderlm.gemv(x, weight)


def int8_linear(x: Tensor, weight_q: Tensor, scale: Tensor) -> Tensor:
    """(x qᵀ)_n · s_n for one row: x (..., K) float32 or bfloat16 with one row in all, weight_q
    (N, K) int8, scale (N,) → (..., N) in x's dtype."""
    return torch.ops.decoderlm.gemv_int8(x, weight_q, scale.float())


@torch.library.register_fake("decoderlm::gemv", lib=_OPS)
def _(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("decoderlm::gemv_int8", lib=_OPS)
def _(x: Tensor, weight_q: Tensor, scale: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight_q.shape[0]))
