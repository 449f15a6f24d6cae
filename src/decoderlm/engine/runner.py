"""Sequences → model inputs → logits, after vLLM's ModelRunner (vllm/v1/worker/gpu_model_runner.py):
the only part of the serving engine that runs the model and holds the paged KV cache.

Each forward pass runs the same number of tokens of every sequence in it: the decode rows (one
each; rows of different lengths attend their own blocks, read in place by
`decoderlm.cpu.paged_attention` on the CPU, else gathered and padded under a key mask; a layer
with a sliding window gathers only the keys inside it) or one prefill chunk. A model with
recurrent layers keeps their states in pages of the same budget (`state_pool`), gathered for
each pass and written back after it. With `compile`, a decode pass of up to COMPILED_ROWS rows
runs the library compiled ahead of time (`decoderlm.cpu.paged_step`), made when the runner is;
wider decode passes, prefill chunks, speculative verifications and models it does not take
(recurrent layers among them) run eagerly.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import Tensor

from decoderlm.cpu import paged_attention, paged_step
from decoderlm.cpu.paths import SpeedPaths
from decoderlm.engine.kv_pool import PagedKVCache, blocks_for
from decoderlm.engine.scheduler import Sequence
from decoderlm.engine.state_pool import StatePool, split_budget
from decoderlm.engine.step_inputs import pass_inputs
from decoderlm.inference.generate import evaluating, next_logits
from decoderlm.model.cache import kv_cache_bytes_per_token
from decoderlm.model.lm import DecoderLM

log = logging.getLogger(__name__)
# The compiled pass's rows: a wider compiled pass measured no faster than the eager one over
# packed linears (benchmarks/README.md, engine_profile.py), so wider passes stay eager and the
# start compiles one library, not two.
COMPILED_ROWS = 1


class ModelRunner:
    """`model` over a paged KV cache of `num_blocks` blocks of `block_size` tokens, and a
    `StatePool` for the recurrent layers' states, when it has some."""

    def __init__(
        self,
        model: DecoderLM,
        *,
        kv_cache_memory: int | str,
        block_size: int,
        kv_cache_dtype: str | None,
        cpu_kernels: bool | SpeedPaths,
        compile: bool = False,
    ) -> None:
        """kv_cache_memory: the byte budget of the KV pool, which holds
        ⌊budget / (block_size · bytes per token)⌋ blocks (with recurrent layers, the blocks and
        state pages of `state_pool.split_budget`); kv_cache_dtype: None (K/V in the model's
        dtype) or "int8" (`decoderlm.model.cache.storage`, whose scales the bytes per token count);
        cpu_kernels: the CPU speed paths, True for `SpeedPaths.for_engine()` (False none, or a
        `SpeedPaths`): the linear weights packed for oneDNN, or for AMX tiles in bfloat16 where
        the CPU has them (`decoderlm.cpu.packed_linear`: faster for a batch of rows, at twice the
        linear weights' memory; packed now, so a model changed later needs a new engine); freed
        memory kept in the process (`decoderlm.cpu.heap`), so that each step's gathered K/V
        reuse the last step's pages instead of faulting in new ones; and, for float32 and
        bfloat16 pools, the decode rows of layers without a window attended in place, without
        gathering their blocks (`decoderlm.cpu.paged_attention`, where a C compiler builds it).
        compile: decode passes of up to COMPILED_ROWS rows by
        `decoderlm.cpu.paged_step.CompiledPagedStep` where it runs (the CPU, float32 or bfloat16
        pools, no sliding window, no recurrent layers), its library made now (compiled the
        first time on a machine, then loaded from the disk cache; `compile_s` says how long),
        through the one-row linear kernels if the speed paths pack linears."""
        self.model = model
        weight = model.tok_emb.weight
        self.device = weight.device
        self.paths = SpeedPaths.resolve(cpu_kernels, SpeedPaths.for_engine()).applied(model)
        self.bytes_per_token = kv_cache_bytes_per_token(
            model.config, kv_cache_dtype or weight.dtype
        )
        self.budget = split_budget(
            model.config, kv_cache_memory, block_size, weight.dtype, kv_cache_dtype
        )
        self.num_blocks = self.budget.num_blocks
        in_place = self.paths.paths.in_place_attention and paged_attention.available(
            weight.dtype, self.device
        )
        self.cache = PagedKVCache(
            model.config,
            self.num_blocks,
            block_size,
            weight.dtype,
            self.device,
            kv_cache_dtype,
            in_place,
        )
        self.states = None
        if self.budget.state_pages:
            self.states = StatePool(
                model.config, self.budget, weight.dtype, self.device, self.cache
            )
        self.layer_caches = self.cache if self.states is None else self.states.with_kv(self.cache)
        self.width = blocks_for(model.config.context_length, block_size)  # a table's most blocks
        self.step: paged_step.CompiledPagedStep | None = None
        self.compile_s = 0.0
        if (
            compile
            and self.states is None
            and kv_cache_dtype is None
            and self.num_blocks >= 2
            and paged_step.compiles(model, weight.dtype, self.device)
        ):
            self.step = paged_step.CompiledPagedStep(
                model,
                [layer.k for layer in self.cache.layers],
                [layer.v for layer in self.cache.layers],
                next_logits,
                width=self.width,
                max_batch=COMPILED_ROWS,
                linear_kernels=self.paths.paths.packed_linears,
            )
            self.compile_s = self.step.compile_s
            log.info("decoderlm engine: the compiled decode pass took %.1f s", self.compile_s)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The model in eval mode without gradients, its speed paths applied: one engine step."""
        with evaluating(self.model), self.paths:
            yield

    def forward(self, seqs: list[Sequence], n: int, last_only: bool = True) -> Tensor:
        """Run tokens [n_computed, n_computed + n) of each sequence; logits (B, V) of the last, or
        (B, n, V) of every one (a speculative verification's)."""
        if self.step is not None and n == 1 and last_only and len(seqs) <= self.step.max_batch:
            return self._compiled(seqs)
        dev = self.device
        idx, start, table = pass_inputs(seqs, n, None, dev)  # (B, n), (B,), (B, n_blocks)
        if self.states is not None:
            self.states.seek([s.state_pages for s in seqs], start)
        self.cache.seek(table, start, n)  # each layer cache supplies its own key mask
        if self.states is not None:
            self.states.seek([s.state_pages for s in seqs], start)
        positions = start[:, None] + torch.arange(n, device=dev)  # (B, n)
        # (B, n|1, V)
        logits = self.model(idx, positions, None, self.layer_caches, last_only=last_only)
        if self.states is not None:
            self.states.store()
        return logits[:, -1].float() if last_only else logits.float()

    def _compiled(self, seqs: list[Sequence]) -> Tensor:
        """`forward` of one decode token per sequence by the compiled pass: logits (B, V)."""
        token, start, table = pass_inputs(seqs, 1, self.width, self.device)  # (B, 1), (B,), (B, W)
        return self.step(token, start[:, None], table)  # (B, V)

    def prompt_logprobs(self, ids: list[int]) -> Tensor:
        """Log-probabilities (T − 1, V) of prompt `ids`, in at least float32: row t is
        log p(· | tokens ≤ t). One forward pass outside the batch and the KV cache."""
        logits = self.model(torch.tensor([ids], device=self.device))[0, :-1]  # (T − 1, V)
        return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
