"""Recurrent state in the serving engine: one state slot per running sequence, counted in the same
byte budget as the KV blocks, after vLLM's hybrid KV-cache manager (one budget, two kinds of
pages: the KV blocks of attention layers, the fixed-size state of Mamba / linear-attention layers;
vllm/v1/core/single_type_kv_cache_manager.py, `MambaManager`).

A recurrent layer (linear attention, Gated DeltaNet, Mamba-2; `decoderlm.model.cache.recurrent`)
keeps per sequence a conv state (C, K − 1) and a matrix state (H, d_k, d_v), s bytes over all its
recurrent layers (`recurrent_state_bytes`), whatever the sequence's length. The pool holds them for
`num_slots` sequences: per recurrent layer one conv tensor (N, C, K − 1) and one state tensor
(N, H, d_k, d_v). A step's rows read their slots' rows (a gather), the mixer folds the new tokens
in, and the states after are written back to the same rows (a scatter): `SlotLayerCache`.

The budget rule (`split_budget`), exact and fixed when the pool is built. With s the state bytes of
one sequence, b the bytes of one KV block (block_size · the attention layers' KV bytes per token),
m = ⌈context_length / block_size⌉ the blocks of one sequence at its full context and B the budget:

    a sequence slot costs s + m·b bytes;   num_slots = ⌊B / (s + m·b)⌋;   num_blocks = num_slots · m

so every admitted sequence can reach its full context without waiting for a block or preempting
another. A pure recurrent model (b = 0) holds ⌊B / s⌋ sequences, whatever the context (its blocks
are bookkeeping without storage); a hybrid as many as its bytes allow at full context. A model
without recurrent layers (s = 0) keeps the attention engine's rule: num_blocks = ⌊B / b⌋, no slots,
and sequences admitted while blocks last (preempted when they run out). vLLM instead shares one
page pool between both kinds as sequences come and go; a fixed split is simpler to reason about,
at the price of idle blocks when a hybrid's requests are short.

What recurrent layers rule out in the engine (`check_engine_options`):
- prefix caching is off: a block of a shared prefix holds its K/V, but the recurrent state after
  that prefix is not stored anywhere (vLLM's "align" mode would snapshot it at block boundaries),
  so a sequence that reused the blocks could not restore its state;
- speculative decoding (`draft=`) is refused: its rejected draft tokens would already be folded into
  the state, which cannot roll back (`LayerCache.rollback`).
A sequence that is preempted frees its slot; its state is recomputed from its first token on
resume (a step that starts a row at position 0 zeroes that row's slot first), as its K/V is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from decoderlm.errors import DecoderLMError
from decoderlm.model.cache import (
    BaseLayerCache,
    LayerCaches,
    kv_cache_bytes_per_token,
    recurrent_state_bytes,
    recurrent_state_shapes,
)
from decoderlm.model.config import ModelConfig
from decoderlm.serving.kv_pool import blocks_for, parse_bytes


@dataclass(frozen=True)
class Budget:
    """How `kv_cache_memory` is spent (`split_budget`)."""

    num_blocks: int
    num_slots: int | None  # state slots; None without recurrent layers (no slot limit)
    block_bytes: int  # b: one KV block of every attention layer
    state_bytes: int  # s: one sequence's state in every recurrent layer

    def sequences_at(self, n_tokens: int, block_size: int) -> int:
        """Sequences of n_tokens tokens each that the pools hold at once: the admission limit."""
        by_blocks = self.num_blocks // blocks_for(n_tokens, block_size)
        return by_blocks if self.num_slots is None else min(by_blocks, self.num_slots)


def split_budget(
    config: ModelConfig,
    kv_cache_memory: int | str,
    block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str | None = None,
) -> Budget:
    """`kv_cache_memory` as KV blocks and state slots by the module's rule; DecoderLMError when it
    holds no block (no recurrent layers) or no slot (recurrent layers)."""
    budget = parse_bytes(kv_cache_memory)
    block = block_size * kv_cache_bytes_per_token(config, kv_cache_dtype or dtype)
    state = recurrent_state_bytes(config, dtype) if config.has_recurrent_layers else 0
    if state == 0:
        if budget < block:
            raise DecoderLMError(
                f"kv_cache_memory={kv_cache_memory!r} holds no KV block: one block of "
                f"{block_size} tokens takes {block} bytes"
            )
        return Budget(budget // block, None, block, 0)
    per_seq = blocks_for(config.context_length, block_size)  # m
    slot = state + per_seq * block  # s + m·b
    if budget < slot:
        raise DecoderLMError(
            f"kv_cache_memory={kv_cache_memory!r} holds no sequence slot: one sequence takes "
            f"{state} bytes of recurrent state + {per_seq} KV blocks of {block} bytes "
            f"(context_length={config.context_length}) = {slot} bytes"
        )
    slots = budget // slot
    return Budget(slots * per_seq, slots, block, state)


def check_engine_options(config: ModelConfig, draft: object) -> None:
    """DecoderLMError for speculative decoding over recurrent layers (see the module docstring)."""
    if draft is not None and config.has_recurrent_layers:
        raise DecoderLMError(
            f"draft={draft!r}: speculative decoding is not supported for models with recurrent "
            f"layers (layer_types {config.layer_types}): a rejected draft token cannot be taken "
            "back out of a recurrent state; serve without draft="
        )


class SlotLayerCache(BaseLayerCache):
    """One recurrent layer's states of every slot, as the `RecurrentLayerCache` its mixer reads:
    `conv` and `state` are the rows of this step's slots (gathered), and assigning them writes
    the new states back to those slots (scattered). No padding reaches them: every row of an
    engine pass runs the same number of real tokens (`valid` stays None)."""

    valid: Tensor | None = None

    def __init__(self, conv: Tensor | None, state: Tensor) -> None:
        """conv (N, C, K − 1) or None (linear attention), state (N, H, d_k, d_v): the pools."""
        self.conv_pool, self.state_pool = conv, state
        self.rows = torch.zeros(0, dtype=torch.long, device=state.device)  # (B,) this step's slots

    @property
    def nbytes(self) -> int:
        return self.state_pool.nbytes + (0 if self.conv_pool is None else self.conv_pool.nbytes)

    @property
    def conv(self) -> Tensor | None:
        """(B, C, K − 1): the conv states of this step's slots."""
        return None if self.conv_pool is None else self.conv_pool.index_select(0, self.rows)

    @conv.setter
    def conv(self, value: Tensor | None) -> None:
        if self.conv_pool is not None:
            self.conv_pool.index_copy_(0, self.rows, value.to(self.conv_pool.dtype))

    @property
    def state(self) -> Tensor:
        """(B, H, d_k, d_v): the matrix states of this step's slots."""
        return self.state_pool.index_select(0, self.rows)

    @state.setter
    def state(self, value: Tensor) -> None:
        self.state_pool.index_copy_(0, self.rows, value.to(self.state_pool.dtype))


class StatePool:
    """`num_slots` state slots of every recurrent layer of `config`: the storage (conv states in
    `dtype`, matrix states in float32 at least, as `HybridCache`) and which slots are free."""

    def __init__(
        self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        state_dtype = torch.promote_types(dtype, torch.float32)
        self.layers: dict[int, SlotLayerCache] = {}  # model layer index → its slots
        for i in range(config.n_layers):
            kind = config.layer_type(i)
            if kind == "attention":
                continue
            conv, state = recurrent_state_shapes(config, kind, num_slots)
            self.layers[i] = SlotLayerCache(
                None if conv is None else torch.zeros(conv, dtype=dtype, device=device),
                torch.zeros(state, dtype=state_dtype, device=device),
            )
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: the lowest slot first

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers.values())

    def take(self) -> int | None:
        """A free slot, or None when every slot is held."""
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def seek(self, slots: Sequence[int], start: Tensor) -> None:
        """Before a pass over rows holding `slots`, row b from position start_b (B,): a row that
        starts at 0 (a new or a recomputed sequence) starts from the zero state."""
        rows = torch.tensor(slots, device=start.device)  # (B,)
        fresh = rows[start == 0]
        for layer in self.layers.values():
            layer.rows = rows
            if len(fresh):
                layer.state_pool.index_fill_(0, fresh, 0)
                if layer.conv_pool is not None:
                    layer.conv_pool.index_fill_(0, fresh, 0)

    def with_kv(self, kv: LayerCaches) -> LayerCaches:
        """Every layer's cache in model order: the slot views of the recurrent layers, the layers
        of `kv` (built for the attention layers only, in order) for the others."""
        attention = iter(kv.layers)
        layers: list[BaseLayerCache] = []
        for i in range(len(kv) + len(self.layers)):
            layers.append(self.layers[i] if i in self.layers else next(attention))
        return LayerCaches(layers)
