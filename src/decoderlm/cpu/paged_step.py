"""The serving engine's decode pass compiled ahead of time: one token for each of B sequences over
the paged KV pool, as `decoderlm.cpu.decode.CompiledStep` is for `generate`'s static cache.

An eager decode pass pays Python and the dispatcher for every op of every layer; for a small model
that is most of the pass (benchmarks/README.md, engine_profile.py). Here the pass is exported with
`torch.export` and compiled by AOTInductor into a shared library (`decode.step_library`: the
weights and the pools are inputs, not constants; kept on disk under a hash of the graph), its
attention read in place from the pools by the op decoderlm::paged_decode_attention
(`decoderlm.cpu.paged_attention`) and each new token's K/V written to its slot
slot = table[b, p // block_size] · block_size + p mod block_size. A recurrent layer's conv and
matrix states (linear attention, Gated DeltaNet, Mamba-2) are inputs too: the engine keeps the
decoding rows' states in contiguous buffers from one pass to the next
(`decoderlm.engine.state_pool`: gathered from their pages when a row joins, written back when it
leaves), and the pass folds the token into them in place. (Gathered inside the pass, as raw
bytes of the bfloat16 pools viewed as float32 states, Inductor's code took 118-178 ms at 64 rows
of a 55M hybrid against the engine's 16-18 ms.)

vLLM captures CUDA graphs for a few padded batch sizes because a graph has fixed shapes. An
AOTInductor library can leave the batch dimension symbolic instead, so two libraries cover every
batch size with no padding rows: one row (traced with the one-row linear kernels of
`decoderlm.cpu.gemv`) and 2..`max_batch` rows. The engine takes the second where its linears are
packed for `decoderlm.cpu.bf16_linear`'s kernel (bfloat16 on AMX tiles or AVX512-BF16): traced
with the packed modules in place (`engine.runner`), the packs are inputs of the library like the
weights, and its linears the op decoderlm::bf16_linear; elsewhere only the first
(COMPILED_ROWS): a traced F.linear reads the plain weights through oneDNN's GEMM, slower for a
few rows than the eager pass's packed linears. They are made with `CompiledPagedStep` (the
engine's start): the first start on a machine compiles them (minutes on 2 cores), later ones
load them from the disk cache.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.export import Dim

from decoderlm.cpu import paged_attention
from decoderlm.cpu.decode import CPULinearKernels, Forward, step_library
from decoderlm.errors import DecoderLMError
from decoderlm.model.cache import BaseLayerCache, RecurrentLayerCache, StatePart
from decoderlm.model.lm import DecoderLM

MAX_BATCH = 1024  # rows the batched library takes; more run eagerly


def compiles(model: DecoderLM, pool_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `CompiledPagedStep` runs for `model` over plain pools of `pool_dtype`: on the CPU,
    no layer with a sliding window (those read a window of slots, not whole blocks), and the op
    built for the pools' dtype."""
    return (
        device.type == "cpu"
        and model.config.sliding_window is None
        and paged_attention.static_available(pool_dtype)
    )


class _PagedLayer(BaseLayerCache):
    """One layer's pools k, v (num_blocks, block_size, Hkv, hd) inside the traced pass: stores the
    new K/V at (block, offset) and attends each row's first `lengths` keys in place."""

    def __init__(
        self, k: Tensor, v: Tensor, where: tuple[Tensor, Tensor], table: Tensor, lengths: Tensor
    ) -> None:
        super().__init__(k, v)
        self.where, self.table, self.lengths = where, table, lengths

    def attend_in_place(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """q (B, H, 1, hd); k, v (B, Hkv, 1, hd) → softmax(q Kᵀ · scale) V (B, H, 1, hd)."""
        self.k.index_put_(self.where, k[:, :, 0])  # (B, Hkv, hd) to pool[block_b, offset_b]
        self.v.index_put_(self.where, v[:, :, 0])
        return paged_attention.paged_decode_op(q, self.k, self.v, self.table, self.lengths, scale)


class _PagedDecodeStep(nn.Module):
    """The decode pass as a function of tensors only, for torch.export.

    forward(*state, *keys, *values, token, position, table, *states): the model's parameters and
    buffers (in the order of `names`), each attention layer's K and V pools, the new tokens
    (B, 1), their positions (B, 1), the rows' block tables (B, W) and, with recurrent layers,
    their states (`parts`' order) → logits (B, V) in float32: `forward` of the model, under
    `CPULinearKernels` if `linear_kernels`. The recurrent layers' states after the token are
    copied into their inputs (S_t over S_{t−1}), as the attention layers store their K/V in the
    pools.
    """

    def __init__(
        self,
        model: DecoderLM,
        names: list[str],
        forward: Forward,
        linear_kernels: bool,
        parts: list[StatePart],
        batch_invariant: bool,
    ) -> None:
        super().__init__()
        self.model, self.names, self.logits, self.parts = model, names, forward, parts
        self.paths = (linear_kernels, batch_invariant)  # what is traced into the pass

    def forward(self, *tensors: Tensor) -> Tensor:
        config, n = self.model.config, len(self.names)
        n_attention = config.n_layers - len({part.layer for part in self.parts})
        state = dict(zip(self.names, tensors[:n], strict=True))
        keys = tensors[n : n + n_attention]
        values = tensors[n + n_attention : n + 2 * n_attention]
        token, position, table = tensors[n + 2 * n_attention : n + 2 * n_attention + 3]
        inputs = tensors[n + 2 * n_attention + 3 :]  # each part's state (B, ...)
        recurrent: dict[int, RecurrentLayerCache] = {}
        for part, value in zip(self.parts, inputs, strict=True):  # a matrix state before its conv
            if part.name == "state":
                recurrent[part.layer] = RecurrentLayerCache(None, value)
            else:
                recurrent[part.layer].conv = value
        attention = iter(self._attention_layers(keys, values, position, table))
        cache = [
            recurrent[i] if i in recurrent else next(attention) for i in range(config.n_layers)
        ]
        with CPULinearKernels(compiling=True) if self.paths[0] else nullcontext():
            logits = self.logits(self.model, cache, token, position, None, state)
        for part, value in zip(self.parts, inputs, strict=True):  # the states after the token
            value.copy_(getattr(recurrent[part.layer], part.name))
        return logits

    @staticmethod
    def _attention_layers(
        keys: tuple[Tensor, ...], values: tuple[Tensor, ...], position: Tensor, table: Tensor
    ) -> list[_PagedLayer]:
        if not keys:
            return []
        block_size = keys[0].shape[1]
        block = table.gather(1, position // block_size)[:, 0]  # (B,) the block of each new token
        where = (block, position[:, 0] % block_size)  # slot = block · block_size + p mod bs
        lengths = position[:, 0] + 1  # (B,) keys of each row, the new one included
        return [_PagedLayer(k, v, where, table, lengths) for k, v in zip(keys, values, strict=True)]


class CompiledPagedStep:
    """The engine's decode pass of `model` over the pools `keys`, `values` (one per attention
    layer, (num_blocks ≥ 2, block_size, Hkv, hd) each), compiled ahead of time by AOTInductor.

    `step(token, position, table, states)` writes the K/V of token (B, 1) at position (B, 1) of
    each row to its slot, folds it into the recurrent layers' `states` (the B rows' state of each
    of `parts`, contiguous), updated in place, and returns the logits (B, V) in float32 of the
    token after it; table (B, W) holds each row's blocks (W = `width`, unused entries any block in
    the pool). B is 1 to `max_batch`; the libraries take pools of any number of blocks. `forward`
    is the forward pass compiled (`decoderlm.inference.generate.next_logits`), under
    `CPULinearKernels` with `linear_kernels`. batch_invariant: the caller has swapped in the
    modules of `decoderlm.cpu.invariant` (`traceable`), traced as ops (`fused.as_ops`), and
    Inductor rounds each intermediate where eager code does (`emulate_precision_casts`), so that
    a row's logits are bit for bit those of an eager pass of the same modules, whatever the rows
    beside it. `compile_s`: the seconds making both libraries took (compiling, or loading them
    from disk).
    """

    def __init__(
        self,
        model: DecoderLM,
        keys: list[Tensor],
        values: list[Tensor],
        forward: Forward,
        *,
        width: int,
        max_batch: int = MAX_BATCH,
        linear_kernels: bool = True,
        parts: list[StatePart] | None = None,
        batch_invariant: bool = False,
    ) -> None:
        start = time.perf_counter()
        floats = next(model.parameters())
        if not compiles(model, floats.dtype, floats.device):  # (and loads the op's library)
            raise DecoderLMError(
                "the compiled decode pass needs CPU pools in float32 or bfloat16, no sliding "
                "window, and a C/C++ compiler for its attention op"
            )
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        self.inputs = [*state.values(), *keys, *values]
        self.width, self.max_batch, self.parts = width, max_batch, parts or []
        step = _PagedDecodeStep(
            model, list(state), forward, linear_kernels, self.parts, batch_invariant
        )
        options = {"emulate_precision_casts": True} if batch_invariant else None
        blocks = Dim("blocks", min=2)  # one library for every pool size
        pools: tuple[Any, ...] = tuple({0: blocks} for _ in [*keys, *values])
        weights = tuple(None for _ in state)
        one = (*weights, *pools, *(None for _ in self._examples(1)))
        self.runs = {1: step_library(step, self.inputs, self._examples(1), (one,), options)}
        if max_batch >= 2:
            rows = Dim("batch", min=2, max=max_batch)
            examples = self._examples(2)
            batch = (*weights, *pools, *({0: rows} for _ in examples))
            self.runs[2] = step_library(step, self.inputs, examples, (batch,), options)
        self.compile_s = time.perf_counter() - start

    def __call__(
        self, token: Tensor, position: Tensor, table: Tensor, states: Sequence[Tensor] = ()
    ) -> Tensor:
        # The library reads each state as contiguous (as traced): another layout would be misread.
        if not all(t.is_contiguous() for t in states):
            raise RuntimeError("the compiled decode pass takes contiguous recurrent states")
        run = self.runs[min(token.shape[0], 2)]
        return run([*self.inputs, token, position, table, *states])[0]

    def _examples(self, batch: int) -> list[Tensor]:
        """Example per-call inputs: token (B, 1), position (B, 1), table (B, W), the states."""
        device = self.inputs[0].device
        shapes = [(batch, 1), (batch, 1), (batch, self.width)]
        ids = [torch.zeros(shape, dtype=torch.long, device=device) for shape in shapes]
        states = [
            torch.zeros(batch, *part.shape[1:], dtype=part.dtype, device=device)
            for part in self.parts
        ]
        return ids + states
