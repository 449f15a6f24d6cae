"""Decode attention read in place from a paged KV pool: PagedAttention's kernel (Kwon et al., 2023,
"Efficient Memory Management for LLM Serving with PagedAttention") for the CPU.

A decode step has one query per row, out = softmax(q Kᵀ · scale) V over the row's own keys, which
lie in blocks scattered over the pool. Without a kernel for that, each layer first gathers every
row's blocks into a padded (B, Hkv, Tk, hd) tensor (`serving.kv_pool.PagedLayerCache.update`) and
then runs SDPA over it: the K/V bytes are read twice and written once. `paged_decode_attention`
reads each key and value once, where it lies (`paged_attention.c`; the measurements in
benchmarks/README.md). It runs on torch's OpenMP threads, in float32 for bfloat16 pools as SDPA
does, and is used by `serving.Engine(cpu_kernels=True)` for the decode rows of its layers without
a window.

The C source is built on first use and cached (`decoderlm.cpu.native`); where it cannot be,
`available` is False and the engine keeps the gather path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from decoderlm.cpu import native

SOURCE = Path(__file__).with_name("paged_attention.c")
FUNCTIONS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}


def library_path() -> Path:
    """Where this CPU's build of the kernel lives in the cache."""
    return native.library_path([SOURCE])


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = native.load([SOURCE], "paged attention gathers the blocks instead", ctypes.CDLL)
    if library is None:
        return None
    for name in FUNCTIONS.values():
        function = getattr(library, name)
        function.restype = ctypes.c_int
        function.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float]
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
) -> Tensor:
    """softmax(q Kᵀ · scale) V for one query per row, the keys read from the pools in place.

    q (B, H, 1, hd); k, v: pools (num_blocks, block_size, Hkv, hd) of q's dtype; table (B, W)
    int64 block tables; lengths (B,) int64: row b attends its first lengths[b] ≥ 1 positions,
    in blocks table[b, 0], table[b, 1], .... Returns (B, H, 1, hd). checked: the caller ran
    `check_block_tables` on these table and lengths (once per step for all layers).
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
    status = getattr(_library(), FUNCTIONS[q.dtype])(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), lengths.data_ptr(),
        out.data_ptr(), b, h, h_kv, d, block_size, table.shape[1], scale,
    )  # fmt: skip
    if status == -2:
        raise ValueError(f"paged_decode_attention: head_dim {d} > 512, the kernel's largest")
    if status != 0:
        raise MemoryError("paged_decode_attention: no memory for the scores")
    return out
