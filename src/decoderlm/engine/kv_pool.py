"""KV memory as a pool of fixed-size blocks: PagedAttention (Kwon et al., 2023, "Efficient Memory
Management for LLM Serving with PagedAttention"), after vLLM's block manager.

A sequence's keys and values live in `block_size`-token blocks anywhere in one preallocated pool;
its block table maps token position p to slot `blocks[p // block_size] · block_size + p %
block_size`. Blocks are refcounted so that sequences sharing a full-block prompt prefix share its
blocks (prefix caching): a full, computed block is registered under a hash of every token up to its
end, and a freed block keeps that registration until the pool hands it out again (least recently
freed first), so a later request with the same prefix can still find it.

`PagedKVCache` is the model's side: its layers keep the `LayerCache` contract
(`decoderlm.model.cache`) by writing each new
token's K/V to its slot and gathering each row's blocks into one (B, Hkv, Tk, hd) tensor; with
`in_place`, a decode step of a layer without a window skips the gather and attends the keys where
they lie (`attend_in_place`, `decoderlm.cpu.paged_attention`). With
kv_cache_dtype "int8" its pools are `decoderlm.model.cache.Int8Buffer`s: int8 K/V and one
scale per (slot, head), quantized as they are written and dequantized as they are gathered.
Its step is `seek(table, start, n_new)`: block tables and a start per row, as the engine batches
sequences of different lengths; or several sequences' tokens in one row, `seek_packed` (each
token a query of the in-place kernel: a speculative verification) or `seek_segments` (each
sequence's tokens attending its own keys by SDPA: prefill chunks of different lengths); a rollback
is the engine's (the next step's `start`), so its layers refuse `rollback`.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from decoderlm.cpu.attention import PAD_MULTIPLE
from decoderlm.cpu.paged_attention import check_block_tables, paged_decode_attention
from decoderlm.errors import DecoderLMError
from decoderlm.model.attention import attend
from decoderlm.model.cache import BaseLayerCache, Int8Buffer, LayerCaches, kv_buffer
from decoderlm.model.config import ModelConfig

# what `decoderlm.model.attention.attend` is: q, k, v and its keywords → (out, weights)
Attend = Callable[..., tuple[Tensor, Tensor | None]]

# `attend_in_place` handles passes of up to this many tokens per row (a decode step, a speculative
# verification); longer ones (prefill chunks) go to SDPA, faster for many queries.
IN_PLACE_MAX_TOKENS = 16

_UNITS = {
    "": 1,
    "B": 1,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
}


def parse_bytes(value: int | str) -> int:
    """A byte count from an int or a string such as "512MiB", "1GiB", "64KB" or "4096"."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = (
        re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", value)
        if isinstance(value, str)
        else None
    )
    if match is None or float(match[1]) <= 0:
        raise DecoderLMError(
            f"kv_cache_memory={value!r} must be a positive number of bytes or a size such as "
            "'512MiB' or '1GiB' (units B, KiB, MiB, GiB, KB, MB, GB)"
        )
    return int(float(match[1]) * _UNITS[match[2] or ""])


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks holding n_tokens tokens: ⌈n_tokens / block_size⌉."""
    return -(-n_tokens // block_size)


def prefix_keys(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """One key per full block of `tokens`: key_i = SHA-256(key_{i−1} ‖ the block's token ids).

    Chained, so key_i names the whole prefix tokens[: (i + 1) · block_size], not just block i.
    """
    keys, key = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        key = hashlib.sha256(key + b"".join(t.to_bytes(4, "little") for t in block)).digest()
        keys.append(key)
    return keys


class BlockPool:
    """Block ids 0..num_blocks−1: allocation, refcounts, and the prefix cache over full blocks."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self.refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self._cached: dict[bytes, int] = {}  # prefix key → block holding that prefix's last block
        self._key_of: dict[int, bytes] = {}  # block → its key, while registered

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (cached blocks no sequence holds count as free)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, keys: Sequence[bytes], n_blocks: int) -> tuple[list[int], int] | None:
        """Blocks for a sequence of `n_blocks` blocks whose full blocks have `keys`, or None if short.

        The leading blocks found in the prefix cache are shared (their refcount goes up); the
        rest are fresh. Returns (block table, number of blocks reused from the cache).
        """
        hits = []
        for key in keys[:n_blocks] if self.prefix_caching else ():
            block = self._cached.get(key)
            if block is None:
                break
            hits.append(block)
        revived = sum(1 for b in hits if self.refs[b] == 0)  # cached but free: leaves the free list
        if n_blocks - len(hits) + revived > len(self._free):
            return None
        for block in hits:
            self._free.pop(block, None)
            self.refs[block] += 1
        return hits + [self._take() for _ in range(n_blocks - len(hits))], len(hits)

    def grow(self) -> int | None:
        """One fresh block, or None when the pool is full."""
        return self._take() if self._free else None

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; a block nobody holds returns to the free list.

        Last blocks first, so that a prefix's tail is handed out (and forgotten) before its head.
        """
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self._free[block] = None

    def register(self, block: int, key: bytes) -> None:
        """Record that `block` holds the computed K/V of the full-block prefix named `key`."""
        if self.prefix_caching and key not in self._cached and block not in self._key_of:
            self._cached[key], self._key_of[block] = block, key

    def _take(self) -> int:
        block, _ = self._free.popitem(last=False)
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._cached[key]  # its contents are about to be overwritten
        self.refs[block] = 1
        return block


class PagedLayerCache(BaseLayerCache):
    """One layer's K and V pools, (num_blocks, block_size, Hkv, hd) each: a `LayerCache`.

    A layer without a window reads each row's blocks whole, right-padded; a layer with window W
    reads only the slots a row's new tokens can see (its last W − 1 + T positions), left-padded,
    so that each row's last key is the last column, where attention aligns its causal window.
    Either way `key_padding_mask` marks the real keys, or is None when every row has them all.
    """

    def __init__(
        self,
        k: Tensor | Int8Buffer,
        v: Tensor | Int8Buffer,
        window: int | None,
        in_place: bool = False,
        attend_with: Attend = attend,
    ) -> None:
        """in_place: attend decode steps in place (`attend_in_place`); the caller checked that
        `decoderlm.cpu.paged_attention` is available for these pools. attend_with: what a pass of
        segments attends each sequence's queries with (the model's layers' `attend`)."""
        super().__init__(k, v)
        self.window, self.attend_with = window, attend_with
        self.in_place = in_place and window is None and isinstance(k, Tensor)
        num_blocks, block_size, n_kv_heads, head_dim = k.shape
        slots = (num_blocks * block_size, n_kv_heads, head_dim)
        self.k_slots, self.v_slots = k.view(*slots), v.view(*slots)  # the same storage, per slot
        self.write: Tensor | None = None  # (B·T,) slots of the new tokens
        self.read: Tensor | None = None  # (B, n_blocks) block tables, or (B, Tk) slots
        self.by_slot = window is not None  # `read` holds slots (left-padded), not block tables
        self.n_keys = 0  # keys each row attends (full layers: the longest row's length)
        self.lengths: Tensor | None = None  # (B,) keys of each row, this step's included
        # per query: (B·T, n_blocks), (B·T,); in a pass of segments, (Ns,) places first
        self.queries: tuple[Tensor, ...] | None = None
        # per sequence SDPA attends in a pass of segments: (offset, n_b, (Tk_b,) slots)
        self.segments: list[tuple[int, int, Tensor]] | None = None
        self.runs: list[tuple[int, int, int]] = []  # the segments' `_runs`, found once a pass
        self.key_padding_mask: Tensor | None = None  # (B, Tk) True at real keys; None: all real
        # every row of the pass starts at position 0 (prompts' first chunks) over a plain pool:
        # its keys are the new K/V, the bits the pool holds, so `update` returns them as they are
        self.own_keys = False

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v (B, Hkv, T, hd) go to their slots; returns the rows' keys/values (B, Hkv, Tk, hd):
        k, v themselves where every row starts at position 0 over a plain pool (`own_keys`; a
        128-token prompt's first token 0.95× the time of reading them back, SmolLM2 in bfloat16)."""
        self._store(k, v)
        if self.own_keys:  # no copy of what was just stored
            return k, v
        if self.by_slot:
            return self._slots(self.k_slots), self._slots(self.v_slots)
        return self._blocks(self.k), self._blocks(self.v)

    def attend_in_place(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor | None:
        """A pass of T ≤ `IN_PLACE_MAX_TOKENS` tokens per row (a decode step, T = 1, or a
        speculative verification), or a packed pass (`PagedKVCache.seek_packed`), of a layer
        without a window: store k, v (B, Hkv, T, hd) and return the attention of q (B, H, T, hd)
        over each row's keys, read from the pools where they lie
        (`decoderlm.cpu.paged_attention`): (B, H, T, hd). Query t of row b is one row of the
        kernel, attending the row's first start_b + t + 1 keys: causal, whatever the rows'
        lengths. None otherwise (or without `in_place`): then the caller calls `update` and
        attends the keys it returns."""
        if self.segments is not None:
            return self._attend_segments(q, k, v, scale)
        b, h, t, hd = q.shape
        if not self.in_place or (t > 1 and self.queries is None):
            return None
        if self.queries is None:  # a decode step: one query per row, its K/V stored by the kernel
            return paged_decode_attention(  # `PagedKVCache.seek` checked this step's tables
                q, self.k, self.v, self.read, self.lengths, scale, checked=True, new=(k, v)
            )
        self._store(k, v)  # one kernel row per query (several per row, or packed rows of one each)
        table, lengths = self.queries
        q = q.transpose(1, 2).reshape(b * t, h, 1, hd)  # (B·T, H, 1, hd)
        out = paged_decode_attention(q, self.k, self.v, table, lengths, scale, checked=True)
        return out.view(b, t, h, hd).transpose(1, 2)  # (B, H, T, hd)

    def _attend_segments(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """A pass over several sequences' tokens in one row (`PagedKVCache.seek_segments`): store
        k, v (1, Hkv, N, hd), then each sequence's queries attend its own keys, read from the
        pool (its first start + n_b positions, or those within the window; a chunk that sees only
        its own new keys, a prompt's first, takes them from k, v, the bits a plain pool holds),
        by SDPA, or, where `queries` holds (places, tables, lengths), those places by the
        in-place kernel; q (1, H, N, hd) → (1, H, N, hd). Sequences side by side that attend
        only their own new keys, of one length that is a multiple of PAD_MULTIPLE, attend as one
        batch (`runs`: prompts' first chunks of 128 tokens beside decode rows, say)."""
        self._store(k, v)
        out = torch.empty_like(q)  # (1, H, N, hd): every place is written below
        if self.queries is not None:
            places, table, lengths = self.queries
            rows = q[0].index_select(1, places).transpose(0, 1)[:, :, None]  # (Ns, H, 1, hd)
            attended = paged_decode_attention(rows, self.k, self.v, table, lengths, scale, checked=True)  # fmt: skip
            out[0].index_copy_(1, places, attended[:, :, 0].transpose(0, 1))  # (H, Ns, hd)
        for offset, n, count in self.runs:  # (count, H, n, hd) from count · n places
            qs, ks, vs = (
                t[0, :, offset : offset + count * n].unflatten(1, (count, n)).transpose(0, 1)
                for t in (q, k, v)
            )
            attended = self.attend_with(qs, ks, vs, scale=scale, window=self.window)[0]
            out[0, :, offset : offset + count * n] = attended.transpose(0, 1).flatten(1, 2)
        for offset, n, slots in self.segments:
            if self._batched(n, slots):
                continue
            m = n  # queries: the sequence's n, or more (below)
            if len(slots) == n and isinstance(self.k, Tensor):  # it attends its own new keys
                # as many as the fused kernel runs fastest where the pass holds them: the next
                # sequences' tokens, after each of these queries, which the causal mask hides
                m = min(n + -n % PAD_MULTIPLE, q.shape[2] - offset)
                keys, values = k[:, :, offset : offset + m], v[:, :, offset : offset + m]
            else:  # gathered from the pool: (1, Hkv, Tk_b, hd) each
                keys = self.k_slots.index_select(0, slots).transpose(0, 1)[None]
                values = self.v_slots.index_select(0, slots).transpose(0, 1)[None]
            part = q[:, :, offset : offset + m]  # (1, H, m, hd)
            attended = self.attend_with(part, keys, values, scale=scale, window=self.window)[0]
            out[:, :, offset : offset + n] = attended[:, :, :n]
        return out

    def _batched(self, n: int, slots: Tensor) -> bool:
        """Whether a segment of n queries over `slots` attends in one of `runs`: its own new
        keys only, a multiple of PAD_MULTIPLE of them, in a plain pool."""
        return len(slots) == n and n % PAD_MULTIPLE == 0 and isinstance(self.k, Tensor)

    def _runs(self, segments: list[tuple[int, int, Tensor]]) -> list[tuple[int, int, int]]:
        """(offset, n, count): the segments' runs of `_batched` sequences of one length n, each
        starting where the one before it ends (a lone one: a run of 1)."""
        runs: list[tuple[int, int, int]] = []
        for offset, n, slots in segments:
            if not self._batched(n, slots):
                continue
            if runs:
                first, length, count = runs[-1]
                if length == n and first + n * count == offset:  # the run goes on
                    runs[-1] = (first, n, count + 1)
                    continue
            runs.append((offset, n, 1))
        return runs

    def _store(self, k: Tensor, v: Tensor) -> None:
        self.k_slots.index_copy_(0, self.write, k.transpose(1, 2).flatten(0, 1))  # (B·T, Hkv, hd)
        self.v_slots.index_copy_(0, self.write, v.transpose(1, 2).flatten(0, 1))

    def _blocks(self, pool: Tensor | Int8Buffer) -> Tensor:
        """Each row's blocks, copied whole (one index per block, not per token): (B, Hkv, Tk, hd)."""
        rows, width = self.read.shape
        blocks = pool.index_select(0, self.read.flatten())  # (B·n_blocks, block_size, Hkv, hd)
        keys = blocks.view(rows, width * blocks.shape[1], *blocks.shape[2:])  # (B, Tk', Hkv, hd)
        return keys[:, : self.n_keys].transpose(1, 2)

    def _slots(self, pool: Tensor | Int8Buffer) -> Tensor:
        """The slots in `read`, one index per token: (B, Hkv, Tk, hd)."""
        rows, n_keys = self.read.shape
        keys = pool.index_select(0, self.read.flatten())  # (B·Tk, Hkv, hd)
        return keys.view(rows, n_keys, *keys.shape[1:]).transpose(1, 2)


class PagedKVCache(LayerCaches):
    """The pools of the attention layers, indexed as `kv_caches[i]` by `DecoderLM.forward` (a
    model with recurrent layers reaches them through `decoderlm.engine.state_pool.StatePool`).

    dtype: the model's; kv_cache_dtype: None (pools in `dtype`) or "int8" (`Int8Buffer` pools,
    handing attention their K/V in `dtype`); in_place: `PagedLayerCache.attend_in_place` for the
    layers that can (the caller checked `decoderlm.cpu.paged_attention.available`); attend_with:
    the function a pass of segments attends with, as the layers' `attend`.
    `nbytes` = num_blocks · block_size · `kv_cache_bytes_per_token(config, kv_cache_dtype or dtype)`.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str | None = None,
        in_place: bool = False,
        attend_with: Attend = attend,
    ) -> None:
        self.block_size = block_size
        shape = (num_blocks, block_size, config.n_kv_heads, config.head_dim)
        attention = [i for i in range(config.n_layers) if config.layer_type(i) == "attention"]
        super().__init__(
            [
                PagedLayerCache(
                    *(kv_buffer(shape, dtype, device, kv_cache_dtype) for _ in "kv"),
                    config.layer_window(i),
                    in_place,
                    attend_with,
                )
                for i in attention
            ]
        )

    @property
    def packable(self) -> bool:
        """Whether `seek_packed` serves every layer: all attend in place."""
        return all(layer.in_place for layer in self.layers)

    def seek_packed(self, tables: Tensor, positions: Tensor) -> None:
        """Before a forward pass over one row of N tokens from several sequences (vLLM's packed
        batch: no padding): token i, at `positions[i]` of the sequence whose block table is
        tables[i] (N, n_blocks), attends that sequence's keys up to itself. `packable` only."""
        lengths = positions + 1  # (N,) keys of each token's query, its own included
        check_block_tables(tables, lengths, self.layers[0].k.shape[0], self.block_size)
        write = self.slots(tables, positions[:, None]).flatten()  # (N,)
        for layer in self.layers:
            layer.write, layer.queries, layer.segments = write, (tables, lengths), None
            layer.own_keys = False

    def seek_segments(self, tables: list[Tensor], starts: list[int], lengths: list[int]) -> None:
        """Before a forward pass over one row of Σ n_b tokens from several sequences, each its own
        segment (prefill chunks of different lengths in one pass: the weights read once): sequence
        b's n_b = lengths[b] tokens at positions starts[b] .. of block table tables[b] (n_blocks,)
        attend its keys up to themselves (within the layer's window), gathered per sequence. In a
        layer that attends in place, the queries of sequences of at most `IN_PLACE_MAX_TOKENS`
        (the decode rows beside the prefill chunks) are rows of one call of the in-place kernel."""
        device = tables[0].device
        new = [  # (n_b,) the positions of each sequence's new tokens
            torch.arange(start, start + n, device=device)
            for start, n in zip(starts, lengths, strict=True)
        ]
        write = torch.cat(  # (Σ n_b,) their slots
            [self.slots(t[None], p[None])[0] for t, p in zip(tables, new, strict=True)]
        )
        offsets = [0, *itertools.accumulate(lengths)][:-1]  # each sequence's first token
        short = [b for b, n in enumerate(lengths) if n <= IN_PLACE_MAX_TOKENS]
        in_kernel = self._short_queries(tables, new, offsets, short) if short else None
        keys: dict[tuple[int | None, bool], list[tuple[int, int, Tensor]]] = {}
        runs: dict[tuple[int | None, bool], list[tuple[int, int, int]]] = {}
        for layer in self.layers:
            kernel = in_kernel if layer.in_place else None
            key = (layer.window, kernel is not None)
            if key not in keys:  # per window: (offset, n_b, slots) of each sequence SDPA attends
                w, skip = layer.window, set(short) if kernel is not None else set()
                keys[key] = []
                for b, (table, start, n) in enumerate(zip(tables, starts, lengths, strict=True)):
                    if b not in skip:
                        first = 0 if w is None else max(0, start - w + 1)  # of its first query
                        seen = torch.arange(first, start + n, device=device)  # keys it attends
                        keys[key].append((offsets[b], n, self.slots(table[None], seen[None])[0]))
                runs[key] = layer._runs(keys[key])  # (the same for every layer of this key)
            layer.write, layer.segments, layer.queries = write, keys[key], kernel
            layer.own_keys = False
            layer.runs = runs[key]

    def _short_queries(
        self, tables: list[Tensor], new: list[Tensor], offsets: list[int], short: list[int]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The in-place kernel's rows for the tokens of sequences `short`: their places in the
        pass's row (Ns,), their sequences' block tables (Ns, n_blocks) and keys (Ns,)."""
        width = max(len(tables[b]) for b in short)
        index, rows, keys = [], [], []
        for b in short:
            n = len(new[b])
            index.append(torch.arange(offsets[b], offsets[b] + n))
            padded = torch.zeros(width, dtype=tables[b].dtype, device=tables[b].device)
            padded[: len(tables[b])] = tables[b]
            rows.append(padded.expand(n, width))
            keys.append(new[b] + 1)  # query t attends keys 0 .. its own position
        table, lengths = torch.cat(rows), torch.cat(keys)  # (Ns, width), (Ns,)
        check_block_tables(table, lengths, self.layers[0].k.shape[0], self.block_size)
        return torch.cat(index).to(table.device), table, lengths

    def slots(self, table: Tensor, positions: Tensor) -> Tensor:
        """Pool slots of token `positions` (B, T) given block tables (B, n_blocks): same shape."""
        block = torch.gather(table, 1, positions // self.block_size)  # (B, T)
        return (
            block * self.block_size + positions % self.block_size
        )  # slot = b·block_size + p mod bs

    def seek(self, table: Tensor, start: Tensor, n_new: int) -> None:
        """Before a forward pass over tokens [start_b, start_b + n_new) of each row b: table (B,
        n_blocks) the rows' block tables, start (B,) on the same device. The new tokens' K/V go to
        their slots; row b attends its keys up to start_b + n_new (within its window).

        Attention aligns its causal mask bottom-right, so when rows of different lengths run
        several tokens each (a batched speculative verification), every layer reads its keys
        left-padded, slot by slot, each row's last key in the last column; otherwise a layer
        without a window reads its rows' blocks whole, right-padded."""
        device = table.device
        new = torch.arange(n_new, device=device)
        write = self.slots(table, start[:, None] + new).flatten()  # (B·T,)
        lengths = start + n_new  # (B,) keys of each row
        longest = int(lengths.max())
        keys = torch.arange(longest, device=device)[None, :]  # (1, Tk)
        full_mask = keys < lengths[:, None]  # (B, Tk): right padding
        ragged = n_new > 1 and not bool(full_mask.all())
        queries = None
        if any(layer.in_place for layer in self.layers):
            check_block_tables(table, lengths, self.layers[0].k.shape[0], self.block_size)
            if 1 < n_new <= IN_PLACE_MAX_TOKENS:  # `attend_in_place`: one kernel row per query
                queries = (
                    table.repeat_interleave(n_new, dim=0),  # (B·T, n_blocks)
                    (start[:, None] + new + 1).flatten(),  # (B·T,) keys of query t: start + t + 1
                )
        own_keys = not ragged and not bool(start.any())  # every row's keys are its new ones
        reads: dict[int | None, tuple[Tensor, int, Tensor | None]] = {}
        if not ragged:
            reads[None] = (table, longest, None if bool(full_mask.all()) else full_mask)
        for layer in self.layers:
            w = layer.window
            if w not in reads:  # the last w − 1 keys before each row's first new one (all
                # without a window), and its own
                first = torch.zeros_like(start) if w is None else (start - w + 1).clamp(min=0)
                n_keys = int((lengths - first).max())
                positions = lengths[:, None] - n_keys + torch.arange(n_keys, device=device)
                mask = positions >= first[:, None]  # (B, Tk): left padding
                slots = self.slots(table, positions.clamp(min=0))  # (B, Tk)
                reads[w] = (slots, n_keys, None if bool(mask.all()) else mask)
            layer.write, layer.lengths, layer.by_slot = write, lengths, w is not None or ragged
            layer.queries, layer.segments = queries, None
            layer.own_keys = own_keys and isinstance(layer.k, Tensor)
            layer.read, layer.n_keys, layer.key_padding_mask = reads[w]
