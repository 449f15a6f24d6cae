"""Causal attention of a prefill pass in bfloat16 on the CPU's bfloat16 dot products:
softmax(QKᵀ/√d_k + M)V with both products on AMX tiles (TDPBF16PS) or, on a CPU without them,
AVX512-BF16's VDPBF16PS (float32 sums either way).

torch's CPU flash-attention kernel runs a prompt's causal self-attention well below the rate of
its matrix products: in a serving engine's prefill pass over SmolLM2-135M (16 prompts of 100-130
tokens, 9 query and 3 K/V heads of 64 dims) ~100-130 µs a prompt and layer on a Sapphire Rapids, a
sixth of the pass, ~390 µs on a Zen 4. `amx_attention.c` takes 0.49-0.63× its time from 93 to 2,048
tokens on the tiles, `dpbf16_attention.c` the same computation with register-blocked VDPBF16PS
products (`dpbf16.h`) 0.22-0.34× from 93 to 2,048 tokens on a Zen 4 (benchmarks/README.md,
prefill_attention.py). Both compute the
attention as the blocked matrix products of FlashAttention (Dao et al., 2022): each block of
queries is scored against the keys its last query sees (Q Kᵀ), softmaxed in float32 and
multiplied by V, the keys and values of each K/V head laid out once for the products and shared by
the GQA group's query heads. They round where torch's kernel does (the float32 scores'
exponentials rounded to bfloat16 for the product with V; their sum l and 1 / l in float32:
`softmax_row.h`), so they differ from it only by the order of float32 sums.

`takes(q, k, v, ...)` says whether `attention(q, k, v, scale)` runs for a call of
`decoderlm.model.attention.attend` (`decoderlm.cpu.attention.cpu_attend` routes it): bfloat16
on the CPU, no gradient, outside torch.compile, causal over Tq > 1 queries aligned to the last of
Tk ≥ Tq keys, no key padding mask, no window, head dims a multiple of 32, `kernel()` not None (a
CPU with AMX-BF16 or AVX512-BF16, a C compiler (`decoderlm.cpu.native`), and for the tiles
Linux granting their state).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from decoderlm.cpu import bf16_kernels, prompt_calls

HERE = Path(__file__).parent
SOURCES = {"amx": HERE / "amx_attention.c", "avx512_bf16": HERE / "dpbf16_attention.c"}
DIMS_PER_TILE = 32  # a tile row holds 32 bfloat16 of a query or key


@functools.cache
def _library(name: str) -> ctypes.CDLL | None:
    """Kernel `name`'s library, None where it does not run here."""
    library = bf16_kernels.load(name, SOURCES[name], "prefill attention stays torch's SDPA")
    if library is not None:
        library.prefill_attention_bf16.restype = ctypes.c_int
        library.prefill_attention_bf16.argtypes = (
            [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6 + [ctypes.c_float] + [ctypes.c_void_p] * 4
        )
    return library


@functools.cache
def kernels() -> tuple[str, ...]:
    """The kernels that run here, the faster first ("amx", "avx512_bf16")."""
    return tuple(name for name in SOURCES if _library(name) is not None)


def kernel() -> str | None:
    """The kernel `attention` runs here (the first of `kernels()`), None if none does."""
    return next(iter(kernels()), None)


def takes(q: Tensor, k: Tensor, v: Tensor, **options: Any) -> bool:
    """Whether `attention` computes this call of `attend`: q (B, H, Tq, D), k/v (B, Hkv, Tk, D),
    options `attend`'s causal, key_padding_mask, window and dropout_p (`prompt_calls`)."""
    return (
        prompt_calls.is_prompt_call(
            q, k, v, dtype=torch.bfloat16, dims_multiple=DIMS_PER_TILE, **options
        )
        and not torch.compiler.is_compiling()
        and kernel() is not None
    )


def attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, kernel_name: str | None = None
) -> Tensor:
    """softmax(Q Kᵀ · scale + M) V, M causal aligned bottom-right (query i sees keys up to
    Tk − Tq + i), GQA's query head h reading K/V head h // (H / Hkv); `takes` must hold.
    q (B, H, Tq, D), k/v (B, Hkv, Tk, D) → (B, H, Tq, D), lying as (B, Tq, H, D) (a transposed
    view: the layout the output projection reads). kernel_name: one of `kernels()` (default
    `kernel()`)."""
    b, h, t_q, d = q.shape
    q, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, v))
    if k.stride(-1) != 1 or k.stride(2) % 2:  # keys are gathered a 32-bit pair of dims at a time
        k = k.contiguous()
    out = q.new_empty(b, t_q, h, d).transpose(1, 2)  # (B, H, Tq, D)
    strides = [(ctypes.c_int64 * 3)(*x.stride()[:3]) for x in (q, k, v, out)]
    failed = _library(kernel_name or kernel()).prefill_attention_bf16(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), b, h, k.shape[1], t_q,
        k.shape[2], d, d**-0.5 if scale is None else scale, *strides,
    )  # fmt: skip
    if failed:
        raise MemoryError(f"bf16_attention: no memory for the keys' layout of {tuple(k.shape)}")
    return out
