"""Recurrent state in the serving engine: each running sequence keeps its state in pages of the
same byte budget as the KV blocks, after vLLM's hybrid KV-cache manager (one pool, two kinds of
pages: the KV blocks of attention layers and the fixed-size state of Mamba / linear-attention
layers, the same bytes viewed as either; vllm/v1/core/single_type_kv_cache_manager.py).

A recurrent layer (linear attention, Gated DeltaNet, Mamba-2; `decoderlm.model.cache.recurrent`)
keeps per sequence a conv state (C, K − 1) and a matrix state (H, d_k, d_v), s bytes over all its
recurrent layers (`recurrent_state_bytes`) whatever the sequence's length. The budget rule
(`split_budget`), with b the bytes of one KV block (block_size · the attention layers' KV bytes per
token) and B the budget:

- a hybrid (attention and recurrent layers): the pool is ⌊B / b⌋ blocks, and a sequence's state
  takes p = ⌈s / b⌉ of them besides its K/V blocks: its bytes live in those blocks' rows of the
  K/V tensors, read as raw bytes. A sequence of n tokens holds ⌈n / block_size⌉ + p blocks, so
  the pool admits as many sequences as their bytes allow (at most b − 1 bytes lost to rounding per
  sequence), short and long ones alike, and preempts when it runs out, as for attention;
- a pure recurrent model (b = 0): ⌊B / s⌋ state slots of s bytes (rounded up to 8), one per
  sequence, so it admits a number of sequences independent of the context (its blocks are
  bookkeeping without storage);
- no recurrent layers (s = 0): ⌊B / b⌋ blocks, as before.

A prefill pass gathers its rows' states from their pages, each recurrent layer's conv and matrix
state into one contiguous tensor for the mixer's `RecurrentLayerCache` (a row starting at
position 0, new or recomputed, starts from zeros; `decoderlm.model.cache.state_parts` says where
each lies in a sequence's bytes), and after the forward pass writes the new states back into the
same pages, each run of a state's bytes straight between the page rows that hold it and its
tensor (`seek`, `store`; a memcpy per run, `decoderlm.cpu.state_pages`). A decode pass keeps its
rows' states instead (`seek(keep=True)`): they stay in the pool's buffers, row b of the pass in
row b of each buffer, and the next decode pass, mostly over the same sequences in the same order,
copies only the rows that joined (gathered from their pages) or moved (within the buffers); a
sequence that left the decode rows is written back to its pages, unless it left the running batch
(its pages are freed and its state dropped), and a prefill pass writes back a kept row it runs.
So a steady decode step copies no state at all, where gathering and writing back every row took
half of a compiled step at 64 rows (benchmarks/README.md, engine_states.py), as vLLM's persistent
batch keeps its rows in place between steps (vllm/v1/worker/gpu_input_batch.py). The buffers
hold at most twice the rows of the widest decode pass so far and lie outside the budget, as a
prefill pass's gathered states do. The compiled decode pass (`decoderlm.cpu.paged_step`) takes
the buffers' rows as inputs and updates them in place (`layer_states`). Every row of an engine
pass runs the same number of real tokens: no padding reaches a state. A page leaving a state is
zeroed (`StatePages.release`), so that the K/V read from a block never reinterprets a state's
bytes (which, seen as bfloat16 or an int8 scale, could be a NaN that a masked key would still
multiply into attention's output).

What recurrent layers rule out in the engine (`check_engine_options`):
- prefix caching is off: a block of a shared prefix holds its K/V, but the recurrent state after
  that prefix is stored nowhere (vLLM's "align" mode would snapshot it at block boundaries), so a
  sequence that reused the blocks could not restore its state;
- speculative decoding (`draft=`) is refused: its rejected draft tokens would already be folded into
  the state, which cannot roll back (`LayerCache.rollback`).
A preempted sequence frees its pages, and its state is recomputed from its first token on resume.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from decoderlm.cpu.state_pages import StateCopies
from decoderlm.engine.kv_pool import BlockPool, PagedKVCache, blocks_for, parse_bytes
from decoderlm.errors import DecoderLMError
from decoderlm.model.cache import (
    BaseLayerCache,
    Int8Buffer,
    LayerCaches,
    RecurrentLayerCache,
    kv_cache_bytes_per_token,
    recurrent_state_bytes,
    state_parts,
)
from decoderlm.model.config import ModelConfig


@dataclass(frozen=True)
class Budget:
    """How `kv_cache_memory` is spent (`split_budget`)."""

    num_blocks: int  # KV blocks (a hybrid's states among them)
    block_bytes: int  # b: one KV block of every attention layer (0: no attention layer)
    state_bytes: int  # s: one sequence's state in every recurrent layer (0: no recurrent layer)
    state_pages: int  # pages of one sequence's state: ⌈s / b⌉ blocks, 1 slot, or 0
    num_slots: int | None = None  # a pure recurrent model's slots of s bytes; else None

    @property
    def sequence_blocks(self) -> int:
        """The most KV blocks one sequence can hold: the pool, less its state's pages when they
        come from the same pool (a hybrid)."""
        return self.num_blocks - (self.state_pages if self.num_slots is None else 0)

    def sequences_at(self, n_tokens: int, block_size: int) -> int:
        """Sequences of n_tokens tokens each that the budget holds at once."""
        blocks = blocks_for(n_tokens, block_size)
        if self.num_slots is not None:
            return min(self.num_slots, self.num_blocks // blocks)
        return self.num_blocks // (blocks + self.state_pages)


def split_budget(
    config: ModelConfig,
    kv_cache_memory: int | str,
    block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str | None = None,
) -> Budget:
    """`kv_cache_memory` as KV blocks and state pages by the module's rule; DecoderLMError when it
    cannot hold one sequence."""
    budget = parse_bytes(kv_cache_memory)
    block = block_size * kv_cache_bytes_per_token(config, kv_cache_dtype or dtype)
    state = recurrent_state_bytes(config, dtype) if config.has_recurrent_layers else 0
    if block == 0:  # no attention layer: slots of s bytes, rounded up to 8 (float64 views)
        slot = -(-state // 8) * 8
        if budget < slot:
            raise DecoderLMError(
                f"kv_cache_memory={kv_cache_memory!r} holds no sequence: one sequence's "
                f"recurrent state takes {slot} bytes"
            )
        slots = budget // slot
        return Budget(slots * blocks_for(config.context_length, block_size), 0, state, 1, slots)
    pages = -(-state // block)  # p = ⌈s / b⌉
    if budget < block * (1 + pages):
        raise DecoderLMError(
            f"kv_cache_memory={kv_cache_memory!r} holds no KV block: one block of "
            f"{block_size} tokens takes {block} bytes"
            + (f", and one sequence's recurrent state {pages} more" if pages else "")
        )
    return Budget(budget // block, block, state, pages)


def check_engine_options(config: ModelConfig, draft: object) -> None:
    """DecoderLMError for speculative decoding over recurrent layers (see the module docstring)."""
    if draft is not None and config.has_recurrent_layers:
        name = repr(draft) if isinstance(draft, str) else "a draft model"
        raise DecoderLMError(
            f"draft={name}: speculative decoding is not supported for models with recurrent "
            f"layers (layer_types {config.layer_types}): a rejected draft token cannot be taken "
            "back out of a recurrent state; serve without draft="
        )


@dataclass(frozen=True)
class StatePages:
    """Where the scheduler takes a sequence's `per_sequence` state pages: `pool` (a hybrid's KV
    block pool, or a pure recurrent model's pool of slots); `release` frees them, zeroed."""

    pool: BlockPool
    per_sequence: int
    drop: Callable[[list[int]], None]  # the state that `pages` hold forgotten, its pages zeroed

    def release(self, pages: list[int]) -> None:
        self.drop(pages)
        self.pool.free(pages)


class StatePool:
    """The recurrent layers' states of the running sequences, stored in pages: the rows of the K/V
    tensors of `kv` (a hybrid) or slots of their own (a pure recurrent model), `budget`'s."""

    def __init__(
        self,
        config: ModelConfig,
        budget: Budget,
        dtype: torch.dtype,
        device: torch.device,
        kv: PagedKVCache,
    ) -> None:
        self.parts = state_parts(config, dtype)  # where each state lies in a sequence's bytes
        self.budget = budget
        if budget.num_slots is None:  # every K/V tensor's row j is a part of page j
            raw = [t for layer in kv.layers for buf in (layer.k, layer.v) for t in _raw(buf)]
            self.tensors = [t.view(t.shape[0], -1) for t in raw]  # (num_blocks, row elements)
        else:
            shape = (budget.num_slots, -(-budget.state_bytes // 8) * 8)  # as `split_budget`
            self.tensors = [torch.zeros(shape, dtype=torch.uint8, device=device)]
        # copies each part's bytes between the pages and its tensor
        self.copies = StateCopies(self.tensors, [(part.offset, part.nbytes) for part in self.parts])
        self.caches = {part.layer: RecurrentLayerCache(None, torch.zeros(0)) for part in self.parts}
        self.rows = torch.zeros(0, dtype=torch.long, device=device)  # (B·p,) a copied pass's pages
        self.device = device
        # The kept states (`seek(keep=True)`): row r of each part's buffer holds the state of the
        # sequence whose pages are kept[r] (None: a row that holds none), newer than its pages.
        self.buffers = [
            torch.empty(0, *part.shape[1:], dtype=part.dtype, device=device) for part in self.parts
        ]
        self.kept: list[tuple[int, ...] | None] = []
        self.keeping = False  # whether this pass's states are the buffers' rows

    def pages(self, kv_pool: BlockPool) -> StatePages:
        """The scheduler's side: a hybrid's pages come from `kv_pool`, slots from a pool of their own."""
        budget = self.budget
        pool = kv_pool if budget.num_slots is None else BlockPool(budget.num_slots, 1, False)
        return StatePages(pool, budget.state_pages, self._drop)

    def with_kv(self, kv: LayerCaches) -> LayerCaches:
        """Every layer's cache in model order: this pool's `RecurrentLayerCache`s for the recurrent
        layers, the layers of `kv` (built for the attention layers only, in order) for the others."""
        attention = iter(kv.layers)
        layers: list[BaseLayerCache] = []
        for i in range(len(kv) + len(self.caches)):
            layers.append(self.caches[i] if i in self.caches else next(attention))
        return LayerCaches(layers)

    def seek(self, pages: Sequence[list[int]], start: Tensor, keep: bool = False) -> None:
        """Before a pass over rows whose states lie in `pages` (B lists of p), row b from position
        start_b (B,): each recurrent layer's cache gets the rows' states, contiguous, zeros where
        start_b = 0. keep (a decode pass): the states are the first B rows of the pool's buffers
        and stay there after the pass (see the module docstring); else gathered from the pages
        into tensors of their own, and `store` writes them back."""
        self.keeping = keep
        owners = [tuple(row) for row in pages]
        fresh = start == 0  # (B,): a new or recomputed sequence starts from the zero state
        if keep:
            states = self._arrange(owners, fresh)
        else:  # the pages of a row kept from a decode pass are behind its kept state
            self.rows = _pages(owners, self.device)
            running = set(owners)
            self.write_back([r for r, owner in enumerate(self.kept) if owner in running])
            states = []
            for i, part in enumerate(self.parts):
                shape = (len(pages), *part.shape[1:])
                state = torch.empty(shape, dtype=part.dtype, device=start.device)
                self.copies.gather(i, self.rows, state, fresh)
                states.append(state)
        for part, state in zip(self.parts, states, strict=True):
            setattr(self.caches[part.layer], part.name, state)

    def order(self, owners: list[tuple[int, ...]]) -> list[int]:
        """An order of the rows whose states lie in pages `owners` for the next kept pass that
        moves the fewest kept states (as vLLM's persistent batch condenses its rows): a row kept
        at r < B runs at r, the others fill the remaining places in their given order (a
        sequence that left leaves its place to the last row). Indices into `owners`."""
        b, at = len(owners), {owner: r for r, owner in enumerate(self.kept) if owner is not None}
        placed: list[int | None] = [None] * b
        others = []
        for i, owner in enumerate(owners):
            r = at.get(owner)
            if r is not None and r < b:
                placed[r] = i
            else:
                others.append(i)
        rest = iter(others)
        return [next(rest) if i is None else i for i in placed]

    def _arrange(self, owners: list[tuple[int, ...]], fresh: Tensor) -> list[Tensor]:
        """The buffers' first B rows made the states of the sequences whose pages are `owners`,
        in order: a row kept at its place is not copied, a kept one elsewhere moves there, one
        not kept is gathered from its pages (zeros where fresh); the kept rows of sequences
        not among them are written back first. Returns each part's rows (B, ...)."""
        b, at = len(owners), {owner: r for r, owner in enumerate(self.kept) if owner is not None}
        running = set(owners)
        self.write_back([r for owner, r in at.items() if owner not in running])
        source = [
            None if new else at.get(owner)
            for owner, new in zip(owners, fresh.tolist(), strict=True)
        ]
        if b > len(self.buffers[0]):  # more rows than the buffers hold: twice as many (or b)
            rows = max(b, 2 * len(self.buffers[0]))
            grow = [x.new_empty(rows - len(x), *x.shape[1:]) for x in self.buffers]
            self.buffers = [torch.cat(pair) for pair in zip(self.buffers, grow, strict=True)]
        moves = [(row, r) for row, r in enumerate(source) if r is not None and r != row]
        if moves:  # every source read before any row is written
            to, source_rows = (
                torch.tensor(x, device=self.device) for x in zip(*moves, strict=True)
            )
            for x in self.buffers:
                x.index_copy_(0, to, x.index_select(0, source_rows))
        for first, n in _spans([row for row, r in enumerate(source) if r is None]):
            joined, new = _pages(owners[first : first + n], self.device), fresh[first : first + n]
            for i, x in enumerate(self.buffers):
                self.copies.gather(i, joined, x[first : first + n], new)
        self.kept = list(owners)
        return [x[:b] for x in self.buffers]

    def write_back(self, rows: list[int] | None = None) -> None:
        """The kept states of buffer rows `rows` (default: every kept row) written to their pages,
        and no longer kept."""
        rows = (
            [r for r, owner in enumerate(self.kept) if owner is not None] if rows is None else rows
        )
        for first, n in _spans(sorted(rows)):
            pages = _pages(self.kept[first : first + n], self.device)
            for i, x in enumerate(self.buffers):
                self.copies.scatter(i, pages, x[first : first + n])
        for r in rows:
            self.kept[r] = None

    def layer_states(self) -> list[Tensor]:
        """The states `seek` gave the recurrent layers' caches, in `parts`' order: what the
        compiled pass (`decoderlm.cpu.paged_step`) reads and updates in place."""
        return [getattr(self.caches[part.layer], part.name) for part in self.parts]

    def store(self) -> None:
        """After the pass: the recurrent layers' new states back to the rows' pages, each run of
        a state's bytes straight to the page rows that hold it; a kept pass's stay in the
        buffers (an eager pass's new tensors copied into their rows)."""
        for i, part in enumerate(self.parts):
            state = getattr(self.caches[part.layer], part.name)
            if self.keeping:
                rows = self.buffers[i][: state.shape[0]]
                if state.data_ptr() != rows.data_ptr():
                    rows.copy_(state)
            else:
                self.copies.scatter(i, self.rows, state.to(part.dtype).contiguous())

    def _drop(self, pages: list[int]) -> None:
        """A sequence's state leaves: its kept row forgotten (not written back), its pages zeroed."""
        owner = tuple(pages)
        self.kept = [None if kept == owner else kept for kept in self.kept]
        index = torch.tensor(pages, device=self.device)
        for t in self.tensors:
            t.index_fill_(0, index, 0)


def _pages(owners: Sequence[tuple[int, ...] | None], device: torch.device) -> Tensor:
    """The pages of these rows' states, one row's after another's (a row that holds none: no
    pages): (B·p,) int64."""
    return torch.tensor([page for owner in owners for page in owner or ()], device=device)


def _spans(rows: list[int]) -> list[tuple[int, int]]:
    """Ascending rows as (first, count) runs of consecutive ones: [0, 1, 2, 5, 6] → [(0, 3), (5, 2)]."""
    spans: list[tuple[int, int]] = []
    for row in rows:
        if spans and spans[-1][0] + spans[-1][1] == row:
            spans[-1] = (spans[-1][0], spans[-1][1] + 1)
        else:
            spans.append((row, 1))
    return spans


def _raw(buf: Tensor | Int8Buffer) -> list[Tensor]:
    """The tensors that hold a K or V buffer: itself, or an int8 buffer's values and scales."""
    return [buf.values, buf.scales] if isinstance(buf, Int8Buffer) else [buf]
