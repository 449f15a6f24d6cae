"""Decode attention read in place from a paged KV pool: PagedAttention's kernel (Kwon et al., 2023,
"Efficient Memory Management for LLM Serving with PagedAttention") for the CPU; and the same kernel
over the static cache of the compiled one-token step.

A decode step has one query per row, out = softmax(q Kᵀ · scale) V over the row's own keys, which
lie in blocks scattered over the pool. Without a kernel for that, each layer first gathers every
row's blocks into a padded (B, Hkv, Tk, hd) tensor (`engine.kv_pool.PagedLayerCache.update`) and
then runs SDPA over it: the K/V bytes are read twice and written once. `paged_decode_attention`
reads each key and value once, where it lies (`paged_attention.c`; the measurements in
benchmarks/README.md). It runs on torch's OpenMP threads, in float32 for bfloat16 pools as SDPA
does, and is used by `engine.Engine(cpu_kernels=True)` for the decode rows of its layers without
a window.

The compiled one-token step (`decoderlm.cpu.decode.CompiledStep`) attends its static cache
(B, Hkv, S, hd) with the op decoderlm::static_decode_attention, the same C kernel registered in
C++ (`decode_attention_ops.cpp`, as `decoderlm.cpu.gemv` does) so that the AOTInductor library
calls it without Python: it reads each row's filled slots only, where SDPA over the whole buffer
reads all S and masks the unfilled ones. The engine's compiled decode pass
(`decoderlm.cpu.paged_step`) attends the paged pools with decoderlm::paged_decode_attention,
registered there too: `paged_decode_attention` as an op that checks its indices in C++.

`static_attention` runs the same kernel over a prompt's queries, each a row of its own over its
row's keys up to itself: a batch-invariant `generate` (`decoderlm.cpu.decode.InPlaceKVCache`)
computes every query as it would be computed alone, whatever the padding beside it.

The C source is built on first use and cached (`decoderlm.cpu.native`); where it cannot be,
`available` / `static_available` are False and the callers keep the gather path / SDPA.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from decoderlm.cpu import native

SOURCE = Path(__file__).with_name("paged_attention.c")
OPS_SOURCES = [SOURCE, Path(__file__).with_name("decode_attention_ops.cpp")]
FUNCTIONS = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}
APPENDING = {torch.float32: "append_attention_f32", torch.bfloat16: "append_attention_bf16"}

_OPS = torch.library.Library("decoderlm", "FRAGMENT")
_OPS.define(
    "static_decode_attention(Tensor q, Tensor k, Tensor v, Tensor first, Tensor last, float scale)"
    " -> Tensor"
)
_OPS.define(
    "paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor table, Tensor lengths, float scale)"
    " -> Tensor"
)


def library_path() -> Path:
    """Where this CPU's build of the kernel lives in the cache."""
    return native.library_path([SOURCE])


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = native.load([SOURCE], "paged attention gathers the blocks instead", ctypes.CDLL)
    if library is None:
        return None
    attend = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 9 + [ctypes.c_float]
    append = attend[1:] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 4  # no `first`; k_new, v_new
    for names, argtypes in ((FUNCTIONS, attend), (APPENDING, append)):
        for name in names.values():
            function = getattr(library, name)
            function.restype, function.argtypes = ctypes.c_int, argtypes
    return library


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `paged_decode_attention` runs for pools of this dtype on this device."""
    return device.type == "cpu" and dtype in FUNCTIONS and _library() is not None


def check_block_tables(table: Tensor, lengths: Tensor, num_blocks: int, block_size: int) -> None:
    """ValueError unless every block of table (B, W) lies in a pool of num_blocks and every row's
    length (B,) is at least 1 and fits its W blocks: the C code trusts its indices, and out of
    range it would read outside the pools."""
    if int(table.min()) < 0 or int(table.max()) >= num_blocks:
        raise ValueError(f"paged_decode_attention: a block outside the pool's {num_blocks}")
    if int(lengths.min()) < 1 or int(lengths.max()) > table.shape[1] * block_size:
        raise ValueError(f"paged_decode_attention: lengths beyond the {table.shape[1]} blocks")


def paged_decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    table: Tensor,
    lengths: Tensor,
    scale: float,
    checked: bool = False,
    new: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """softmax(q Kᵀ · scale) V for one query per row, the keys read from the pools in place.

    q (B, H, 1, hd); k, v: pools (num_blocks, block_size, Hkv, hd) of q's dtype; table (B, W)
    int64 block tables; lengths (B,) int64: row b attends its first lengths[b] ≥ 1 positions,
    in blocks table[b, 0], table[b, 1], .... Returns (B, H, 1, hd). checked: the caller ran
    `check_block_tables` on these table and lengths (once per step for all layers). new: each
    row's new key and value (B, Hkv, 1, hd), written first to its last position, lengths[b] − 1
    (a decode step's store, by the same threads: its cache misses hide behind the reading).
    """
    b, h, t, d = q.shape
    num_blocks, block_size, h_kv, _ = k.shape
    if t != 1 or h % h_kv or not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError(f"paged_decode_attention: q {tuple(q.shape)}, pools {tuple(k.shape)}")
    if not checked:
        check_block_tables(table, lengths, num_blocks, block_size)
    q = q.contiguous()  # (B, H, 1, hd)
    table, lengths = table.contiguous(), lengths.contiguous()
    out = torch.empty_like(q)
    strides = (block_size * h_kv * d, d, h_kv * d)  # a block's, a head's, a token's
    if new is None:
        status = getattr(_library(), FUNCTIONS[q.dtype])(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), None, lengths.data_ptr(),
            out.data_ptr(), b, h, h_kv, d, block_size, table.shape[1], *strides, scale,
        )  # fmt: skip
    else:
        k_new, v_new = (_rows(x, (b, h_kv, 1, d), q.dtype) for x in new)
        status = getattr(_library(), APPENDING[q.dtype])(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), lengths.data_ptr(),
            out.data_ptr(), b, h, h_kv, d, block_size, table.shape[1], *strides, scale,
            k_new.data_ptr(), v_new.data_ptr(), *k_new.stride()[:2], *v_new.stride()[:2],
        )  # fmt: skip
    _check(status, "paged_decode_attention", d)
    return out


def _check(status: int, name: str, head_dim: int) -> None:
    """The kernel's status as an error: −2 a head_dim past its largest, another non-zero no
    memory for its scores."""
    if status == -2:
        raise ValueError(f"{name}: head_dim {head_dim} > 512, the kernel's largest")
    if status != 0:
        raise MemoryError(f"{name}: no memory for the scores")


def _rows(x: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """x of `shape` and `dtype`, its last dim contiguous (the kernel reads rows at any stride)."""
    if tuple(x.shape) != shape or x.dtype != dtype:
        raise ValueError(
            f"paged_decode_attention: new rows {tuple(x.shape)} {x.dtype}, not {shape}"
        )
    return x if x.stride(-1) == 1 else x.contiguous()


@functools.cache
def _ops_built() -> bool:
    """Whether decoderlm::static_decode_attention's CPU kernel is loaded (built first if need be)."""
    fallback = "the compiled step attends its cache with SDPA"
    return native.load_ops(OPS_SOURCES, fallback)


@torch.compiler.assume_constant_result  # asked while tracing the step; the answer never changes
def static_available(dtype: torch.dtype) -> bool:
    """Whether the ops `static_decode_attention` and `paged_decode_op` run for caches of this
    dtype on the CPU."""
    return dtype in FUNCTIONS and _ops_built()


def static_decode_attention(
    q: Tensor, k: Tensor, v: Tensor, first: Tensor, last: Tensor, scale: float
) -> Tensor:
    """softmax(q Kᵀ · scale) V for one query per row over the static cache, read in place.

    q (B, H, 1, hd); k, v (B, Hkv, S, hd) contiguous, q's dtype; first (B,) int64: row b attends
    slots first[b] .. last[0] (last (1,) int64, first[b] ≤ last < S; checked). Returns
    (B, H, 1, hd).
    """
    return torch.ops.decoderlm.static_decode_attention(q, k, v, first, last, scale)


def static_attention(
    q: Tensor, k: Tensor, v: Tensor, first: Tensor, slots: Tensor, scale: float
) -> Tensor:
    """softmax(q Kᵀ · scale) V for T queries per row over the static cache, read in place, each
    query a row of the kernel's own: its arithmetic is that of the same query alone, whatever the
    rows, queries and padding beside it (a prefill in `decoderlm.cpu.decode.InPlaceKVCache`).

    q (B, H, T, hd) the queries of cache slots `slots` (T,) int64, ascending; k, v (B, Hkv, S, hd)
    contiguous, q's dtype, the queries' own keys stored; first (B,) int64: row b's first real
    slot. The query at slot s of row b attends slots first[b] .. s (causal); one inside the row's
    left padding (s < first[b]) attends itself only. Returns (B, H, T, hd).
    """
    b, h, t, d = q.shape
    _, h_kv, s, _ = k.shape
    if k.shape[0] != b or h % h_kv or not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError(f"static_attention: q {tuple(q.shape)}, cache {tuple(k.shape)}")
    if int(first.min()) < 0 or int(slots.min()) < 0 or int(slots.max()) >= s:
        raise ValueError(f"static_attention: slots or first slots outside the cache's {s}")
    at = slots.repeat(b)  # (B·T,) each query's slot
    rows = torch.arange(b, device=q.device).repeat_interleave(t)[:, None]  # (B·T, 1): its block
    start = torch.minimum(first.repeat_interleave(t), at)  # (B·T,)
    lengths = at + 1
    queries = q.transpose(1, 2).reshape(b * t, h, d).contiguous()  # (B·T, H, hd)
    out = torch.empty_like(queries)
    status = getattr(_library(), FUNCTIONS[q.dtype])(
        queries.data_ptr(), k.data_ptr(), v.data_ptr(), rows.data_ptr(), start.data_ptr(),
        lengths.data_ptr(), out.data_ptr(), b * t, h, h_kv, d, s, 1, h_kv * s * d, s * d, d, scale,
    )  # fmt: skip
    _check(status, "static_attention", d)
    return out.view(b, t, h, d).transpose(1, 2)


def paged_decode_op(
    q: Tensor, k: Tensor, v: Tensor, table: Tensor, lengths: Tensor, scale: float
) -> Tensor:
    """`paged_decode_attention` as the op decoderlm::paged_decode_attention, which a compiled
    library calls without Python; it checks table and lengths itself. Same arguments and result."""
    return torch.ops.decoderlm.paged_decode_attention(q, k, v, table, lengths, scale)


@torch.library.register_fake("decoderlm::paged_decode_attention", lib=_OPS)
def _(q: Tensor, k: Tensor, v: Tensor, table: Tensor, lengths: Tensor, scale: float) -> Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("decoderlm::static_decode_attention", lib=_OPS)
def _(q: Tensor, k: Tensor, v: Tensor, first: Tensor, last: Tensor, scale: float) -> Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)
