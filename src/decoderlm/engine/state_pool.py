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

A step gathers its rows' states from their pages, each recurrent layer's conv and matrix state
into one contiguous tensor for the mixer's `RecurrentLayerCache` (a row starting at position 0,
new or recomputed, starts from zeros; `decoderlm.model.cache.state_parts` says where each lies in
a sequence's bytes), and after the forward pass writes the new states back into the same pages,
each run of a state's bytes straight between the page rows that hold it and its tensor (`seek`,
`store`; a memcpy per run, `decoderlm.cpu.state_pages`). The compiled decode pass
(`decoderlm.cpu.paged_step`) takes the gathered states as inputs and updates them in place
(`layer_states`). Every row of an engine pass runs the same number of real tokens: no padding
reaches a state. A page leaving a state is zeroed (`StatePages.release`), so that the K/V read
from a block never reinterprets a state's bytes (which, seen as bfloat16 or an int8 scale, could
be a NaN that a masked key would still multiply into attention's output).

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
    zero: Callable[[list[int]], None]

    def release(self, pages: list[int]) -> None:
        self.zero(pages)
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
        self.rows = torch.zeros(0, dtype=torch.long, device=device)  # (B·p,) this step's pages

    def pages(self, kv_pool: BlockPool) -> StatePages:
        """The scheduler's side: a hybrid's pages come from `kv_pool`, slots from a pool of their own."""
        budget = self.budget
        pool = kv_pool if budget.num_slots is None else BlockPool(budget.num_slots, 1, False)
        return StatePages(pool, budget.state_pages, self._zero)

    def with_kv(self, kv: LayerCaches) -> LayerCaches:
        """Every layer's cache in model order: this pool's `RecurrentLayerCache`s for the recurrent
        layers, the layers of `kv` (built for the attention layers only, in order) for the others."""
        attention = iter(kv.layers)
        layers: list[BaseLayerCache] = []
        for i in range(len(kv) + len(self.caches)):
            layers.append(self.caches[i] if i in self.caches else next(attention))
        return LayerCaches(layers)

    def seek(self, pages: Sequence[list[int]], start: Tensor) -> None:
        """Before a pass over rows whose states lie in `pages` (B lists of p), row b from position
        start_b (B,): each recurrent layer's cache gets the rows' states, contiguous, zeros where
        start_b = 0."""
        self.rows = torch.tensor([p for row in pages for p in row], device=start.device)
        fresh = start == 0  # (B,): a new or recomputed sequence starts from the zero state
        for i, part in enumerate(self.parts):
            state = torch.empty(len(pages), *part.shape[1:], dtype=part.dtype, device=start.device)
            self.copies.gather(i, self.rows, state, fresh)
            setattr(self.caches[part.layer], part.name, state)

    def layer_states(self) -> list[Tensor]:
        """The states `seek` gave the recurrent layers' caches, in `parts`' order: what the
        compiled pass (`decoderlm.cpu.paged_step`) reads and updates in place."""
        return [getattr(self.caches[part.layer], part.name) for part in self.parts]

    def store(self) -> None:
        """After the pass: the recurrent layers' new states back to the rows' pages, each run of
        a state's bytes straight to the page rows that hold it."""
        for i, part in enumerate(self.parts):
            state = getattr(self.caches[part.layer], part.name).to(part.dtype).contiguous()
            self.copies.scatter(i, self.rows, state)

    def _zero(self, pages: list[int]) -> None:
        index = torch.tensor(pages, device=self.tensors[0].device)
        for t in self.tensors:
            t.index_fill_(0, index, 0)


def _raw(buf: Tensor | Int8Buffer) -> list[Tensor]:
    """The tensors that hold a K or V buffer: itself, or an int8 buffer's values and scales."""
    return [buf.values, buf.scales] if isinstance(buf, Int8Buffer) else [buf]
