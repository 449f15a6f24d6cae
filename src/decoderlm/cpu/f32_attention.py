"""Causal attention of a prefill pass in float32 on the CPU: softmax(QKᵀ/√d_k + M)V as the blocked
products of FlashAttention (Dao et al., 2022), every operation in float32 (`f32_attention.c`).

torch's CPU flash-attention kernel runs a float32 prompt's causal self-attention well below the
rate of its matrix products: SmolLM2-135M's 512-token prefill (9 query and 3 K/V heads of 64 dims)
spends ~4 ms a layer in it on two Zen 4 cores, a sixth of the pass while the layer's products
take ~17 ms. `f32_attention.c` scores each block of six queries against the keys its last query
sees with register-blocked FMA products (AVX-512, AVX2 + FMA, or plain C, whichever the build
targets: `decoderlm.cpu.native`), the keys of each K/V head laid out once for its GQA group; the
times are in benchmarks/README.md (prefill_attention.py). It differs from SDPA only in the order of
float32 sums and in its exponential (vec.h's, within 2 ulp).

The kernel is the op decoderlm::prefill_attention_f32, so that a compiled prefill pass calls it
too. `takes(q, k, v, ...)` says whether `attention(q, k, v, scale)` runs for a call of
`decoderlm.model.attention.attend` (`decoderlm.cpu.attention.cpu_attend` routes it): float32 on
the CPU, no gradient, causal over Tq > 1 queries aligned to the last of Tk ≥ Tq keys, no key
padding mask, no window, head dims a multiple of 16, and the library built.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from decoderlm.cpu import native, prompt_calls

SOURCE = Path(__file__).with_name("f32_attention.c")
DIMS_MULTIPLE = 16  # a head's dims fill whole vectors of AVX-512's 16 lanes (AVX2's 8)


@functools.cache
def library(flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernel's library (built with `flags` after the usual ones: the tests build the AVX2 and
    plain-C variants too), None where it does not build here."""
    source = native.Build(SOURCE, flags)
    built = native.load([source], "float32 prefill attention stays torch's SDPA", ctypes.CDLL)
    if built is not None:
        built.prefill_attention_f32.restype = ctypes.c_int
        built.prefill_attention_f32.argtypes = (
            [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6 + [ctypes.c_float] + [ctypes.c_void_p] * 4
        )
    return built


@torch.compiler.assume_constant_result  # traced code asks too; the answer never changes
def available() -> bool:
    """Whether the kernel runs here."""
    return library() is not None


def takes(q: Tensor, k: Tensor, v: Tensor, **options: Any) -> bool:
    """Whether `attention` computes this call of `attend`: q (B, H, Tq, D), k/v (B, Hkv, Tk, D),
    options `attend`'s causal, key_padding_mask, window and dropout_p (`prompt_calls`)."""
    return (
        prompt_calls.is_prompt_call(
            q, k, v, dtype=torch.float32, dims_multiple=DIMS_MULTIPLE, **options
        )
        and available()
    )


@torch.library.custom_op("decoderlm::prefill_attention_f32", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """softmax(Q Kᵀ · scale + M) V, M causal aligned bottom-right (query i sees keys up to
    Tk − Tq + i), GQA's query head h reading K/V head h // (H / Hkv); `takes` must hold.
    q (B, H, Tq, D), k/v (B, Hkv, Tk, D) → (B, H, Tq, D), lying as (B, Tq, H, D) (a transposed
    view: the layout the output projection reads)."""
    return run(library(), q, k, v, scale)


def run(built: ctypes.CDLL, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """`attention` on the kernel of the library `built`."""
    b, h, t_q, d = q.shape
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = q.new_empty(b, t_q, h, d).transpose(1, 2)  # (B, H, Tq, D)
    strides = [(ctypes.c_int64 * 3)(*x.stride()[:3]) for x in (q, k, v, out)]
    failed = built.prefill_attention_f32(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), b, h, k.shape[1], t_q,
        k.shape[2], d, scale, *strides,
    )  # fmt: skip
    if failed:
        raise MemoryError(f"f32_attention: no memory for the keys' layout of {tuple(k.shape)}")
    return out


@attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    b, h, t_q, d = q.shape
    return q.new_empty(b, t_q, h, d).transpose(1, 2)
