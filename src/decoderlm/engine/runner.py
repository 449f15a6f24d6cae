"""Rows → model inputs → logits, after vLLM's ModelRunner (vllm/v1/worker/gpu_model_runner.py):
the only part of the serving engine that runs the model and holds the paged KV cache.

One forward over a pass's rows (`passes.Row`: each row's tokens, where they start, its blocks):

- uniform rows (every row runs the same n tokens: a decode pass, a prefill chunk) are the fast
  path: one (B, n) batch over the rows' block tables. Decode rows attend their own blocks, read in
  place by `decoderlm.cpu.paged_attention` on the CPU, else gathered and padded under a key mask;
  a layer with a sliding window gathers only the keys inside it. A model with recurrent layers
  keeps their states in pages of the same budget (`state_pool`): a prefill pass gathers its rows'
  and writes them back after it, a decode pass keeps its rows' in the pool's buffers from one step
  to the next (copying only the rows that join, leave or move);
- with `compile`, a pass whose rows run at most IN_PLACE_MAX_TOKENS tokens each (a decode pass, a
  speculative verification, a draft model's catch-up; not a short prompt's chunk, which wants its
  last token's logits only, where the library computes every token's) runs the library compiled
  ahead of time (`decoderlm.cpu.paged_step`, the recurrent layers' kept states among its inputs,
  updated in place), made when the runner is, each token a row of its own (its sequence's
  blocks, its position): any number of tokens up to `paged_step.MAX_BATCH` where every linear
  is packed (`decoderlm.cpu.packed_linear`) or a GGUF file's block linear (each kernel an op of
  the pass: `AppliedPaths.kernel_products`), else one (COMPILED_ROWS: `decoderlm.quant`'s int8
  and int4 linears). The pass stores all its tokens' K/V before any attends, so a draft attends
  the tokens before it as in the packed pass below, and a verified token gets the bits a plain
  decode pass would give it. Wider passes, prefill chunks and models it does not take run eagerly;
- rows of different lengths of which one runs more than `IN_PLACE_MAX_TOKENS` (prefill chunks of
  prompts of different lengths, decode rows beside them), or that neither of the next two ways
  takes, run as segments of one row of Σ n_b tokens, so that the linear weights are read once for
  all of them, each chunk's queries attending its own keys by SDPA, the short rows' by one call of
  the in-place kernel (`PagedKVCache.seek_segments`), the logits taken at each row's last token
  only;
- other ragged rows (a speculative verification: some rows run their last token and k_b drafts, the
  others one token; a draft model's catch-up) run packed, vLLM's layout, where every layer
  attends in place (`PagedKVCache.packable`): all rows' tokens in one row of Σ n_b tokens, each
  query attending its own sequence's keys up to itself (`PagedKVCache.seek_packed`), no padding;
  else padded on the right to n = max n_b, in two passes (the one-token rows, the others):
  queries after a row's real ones see the real keys, never the reverse (causal), so the padding
  changes no real row's logits. The padding's K/V is written after the row's real tokens, into
  its own blocks past what it has computed (written over before it is ever read), or, past its
  blocks, into the runner's scratch block, which the engine's `BlockPool` never hands out
  (`ragged=True` keeps it). `PagedKVCache.seek` reads such rows' keys left-padded, where
  attention's bottom-right causal mask expects them. Recurrent states never run ragged: the
  engine does not speculate over them (`state_pool.check_engine_options`).

Batch-invariant (`batch_invariant`): every pass runs packed, through the modules of
`decoderlm.cpu.invariant`, the head over each row's last token only; with `compile`, the passes
above run the library traced with those modules as ops, the same kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from contextlib import nullcontext

import torch
from torch import Tensor

from decoderlm.cpu import fused, invariant, paged_attention, paged_step
from decoderlm.cpu.attention import cpu_attend
from decoderlm.cpu.paths import SpeedPaths
from decoderlm.cpu.swap import swapped
from decoderlm.engine.kv_pool import IN_PLACE_MAX_TOKENS, PagedKVCache, blocks_for
from decoderlm.engine.passes import Row
from decoderlm.engine.state_pool import StatePool, split_budget
from decoderlm.engine.step_inputs import pass_inputs
from decoderlm.inference.generate import evaluating, next_logits
from decoderlm.inference.options import float_probe
from decoderlm.model.attention import attend
from decoderlm.model.cache import kv_cache_bytes_per_token
from decoderlm.model.lm import DecoderLM

log = logging.getLogger(__name__)
# The compiled pass's rows where some linear is neither packed nor a block linear
# (`decoderlm.quant`'s int8 and int4 ones): the start compiles the one-row library only. (Plain
# linears traced into a pass of many rows read their weights through oneDNN's GEMM, slower for a
# few rows than packed ones: the linears of a 64-row SmolLM2 step ~30 ms against ~17 on AMX
# tiles.) With every linear an op (decoderlm::bf16_linear and ::invariant_linear over the packs,
# ::block_linear over a GGUF file's blocks) it takes up to paged_step.MAX_BATCH rows.
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
        ragged: bool = False,
        batch_invariant: bool = False,
    ) -> None:
        """kv_cache_memory: the byte budget of the KV pool, which holds
        ⌊budget / (block_size · bytes per token)⌋ blocks (with recurrent layers, the blocks and
        state pages of `state_pool.split_budget`); kv_cache_dtype: None (K/V in the model's
        dtype) or "int8" (`decoderlm.model.cache.storage`, whose scales the bytes per token count);
        cpu_kernels: the CPU speed paths, True for `SpeedPaths.for_engine()` (False none, or a
        `SpeedPaths`): the linear weights packed for `bf16_linear`'s kernel in bfloat16 where
        the CPU has AMX or AVX512-BF16, else for the fixed-order kernel
        (`decoderlm.cpu.packed_linear`: faster for a batch of rows, at twice the linear
        weights' memory; packed now, so a model changed later needs a new engine); freed
        memory kept in the process (`decoderlm.cpu.heap`), so that each step's gathered K/V
        reuse the last step's pages instead of faulting in new ones; and, for float32 and
        bfloat16 pools, the decode rows of layers without a window attended in place, without
        gathering their blocks (`decoderlm.cpu.paged_attention`, where a C compiler builds it).
        compile: decode passes (of up to COMPILED_ROWS rows, or `paged_step.MAX_BATCH` where
        every linear is packed or a block linear: `AppliedPaths.kernel_products`) by
        `decoderlm.cpu.paged_step.CompiledPagedStep` where it runs (the CPU, float32 or bfloat16
        pools, no sliding window), its library made now (compiled the
        first time on a machine, then loaded from the disk cache; `compile_s` says how long),
        through the one-row linear kernels if the speed paths pack linears. ragged: passes of
        rows of different lengths will run (speculative decoding): the last block is kept out of
        `pool_blocks` as the padding's scratch block. batch_invariant: every pass packed (each
        token a query of the in-place attention kernel, whatever the pass) and the linears of
        `decoderlm.cpu.invariant`, so that a row's logits do not depend on the rows beside
        it (`invariant.batch_invariant_swap` says which models and pools can); with compile, its
        decode passes of up to `paged_step.MAX_BATCH` rows by a library traced with those
        modules as ops, which computes each row as the eager passes do
        (`invariant.traceable`; else they run eagerly)."""
        self.model, self.modules = model, list(model.modules())
        floats = float_probe(model)
        self.device = floats.device
        paths = SpeedPaths.resolve(cpu_kernels, SpeedPaths.for_engine())
        if batch_invariant:  # the invariant linears instead of the packed ones
            paths = dataclasses.replace(paths, packed_linears=False, in_place_attention=True)
        self.paths = paths.applied(model)
        self.bytes_per_token = kv_cache_bytes_per_token(
            model.config, kv_cache_dtype or floats.dtype
        )
        self.budget = split_budget(
            model.config, kv_cache_memory, block_size, floats.dtype, kv_cache_dtype
        )
        self.num_blocks = self.budget.num_blocks
        self.scratch = self.num_blocks - 1 if ragged else None  # the padding's block, if any
        in_place = self.paths.paths.in_place_attention and paged_attention.available(
            floats.dtype, self.device
        )
        self.cache = PagedKVCache(
            model.config,
            self.num_blocks,
            block_size,
            floats.dtype,
            self.device,
            kv_cache_dtype,
            in_place,
            cpu_attend if self.paths.paths.attention else attend,  # as the layers attend
        )
        self.states = None
        if self.budget.state_pages:
            self.states = StatePool(
                model.config, self.budget, floats.dtype, self.device, self.cache
            )
        self.layer_caches = self.cache if self.states is None else self.states.with_kv(self.cache)
        self.width = blocks_for(model.config.context_length, block_size)  # a table's most blocks
        self.invariant = None
        if batch_invariant:
            self.invariant = invariant.batch_invariant_swap(
                model, kv_cache_dtype, self.cache.packable
            )
        compiles = compile and kv_cache_dtype is None
        if batch_invariant:
            compiles = compiles and invariant.traceable(new for *_, new in self.invariant)
        self.step = self._compiled_step() if compiles else None
        self.compile_s = 0.0 if self.step is None else self.step.compile_s

    def _compiled_step(self) -> paged_step.CompiledPagedStep | None:
        """The compiled decode pass over this runner's pools, where it runs (else None)."""
        model, floats = self.model, float_probe(self.model)
        if not (self.num_blocks >= 2 and paged_step.compiles(model, floats.dtype, self.device)):
            return None
        many_rows = self.paths.kernel_products
        invariant_ops = nullcontext()
        if self.invariant is not None:  # the invariant modules as ops, at every row count
            invariant_ops, many_rows = fused.as_ops(), True
        # traced as the eager passes run: packed (or invariant) linears, their packs inputs
        with self.paths, swapped(self.invariant or []), invariant_ops:
            step = paged_step.CompiledPagedStep(
                model,
                [layer.k for layer in self.cache.layers],
                [layer.v for layer in self.cache.layers],
                next_logits,
                width=self.width,
                max_batch=paged_step.MAX_BATCH if many_rows else COMPILED_ROWS,
                linear_kernels=self.paths.paths.packed_linears,
                parts=None if self.states is None else self.states.parts,
                batch_invariant=self.invariant is not None,
            )
        log.info("decoderlm engine: the compiled decode pass took %.1f s", step.compile_s)
        return step

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The model in eval mode without gradients, its speed paths applied: one engine step."""
        invariant = nullcontext() if self.invariant is None else swapped(self.invariant)
        with evaluating(self.model, self.modules), self.paths, invariant:
            yield

    @property
    def pool_blocks(self) -> int:
        """The blocks a `BlockPool` may hand out: all but the scratch block."""
        return self.num_blocks - (self.scratch is not None)

    def forward(self, rows: list[Row]) -> Tensor:
        """Run each row's tokens; logits (B, V) float32 of each row's last token."""
        return self._run(rows, last_only=True)

    def forward_tokens(self, rows: list[Row]) -> list[Tensor]:
        """Run each row's tokens; logits (n_b, V) float32 of each of row b's n_b tokens."""
        return self._run(rows, last_only=False)

    def _run(self, rows: list[Row], last_only: bool) -> Tensor | list[Tensor]:
        if self._compiled(rows, last_only):
            return self._compiled_pass(rows, last_only)
        if self.invariant is not None:
            return self._packed(rows, last_only)  # as the compiled pass: each token a query
        n = len(rows[0].tokens)
        if all(len(row.tokens) == n for row in rows):
            logits = self._uniform(rows, n, last_only)  # (B, V) or (B, n, V)
            return logits if last_only else list(logits)
        if self.states is not None:
            raise RuntimeError("rows of different lengths cannot run over recurrent states")
        short = max(len(row.tokens) for row in rows) <= IN_PLACE_MAX_TOKENS  # not prefill chunks
        if short and self.cache.packable:
            return self._packed(rows, last_only)
        if not short or self.scratch is None:
            return self._segments(rows, last_only)
        per_row = self._padded(rows)  # (n_b, V) each
        return torch.stack([logits[-1] for logits in per_row]) if last_only else per_row

    def _uniform(self, rows: list[Row], n: int, last_only: bool) -> Tensor:
        """Eagerly, logits (B, V) of each row's last token, or (B, n, V) of every one."""
        idx, start, table = pass_inputs(rows, None, self.device)  # (B, n), (B,), (B, W)
        if self.states is not None:
            # a decode pass (a token a row) keeps its states: its rows mostly decode again next
            self.states.seek([row.state_pages for row in rows], start, keep=n == 1)
        self.cache.seek(table, start, n)  # each layer cache supplies its own key mask
        positions = start[:, None] + torch.arange(n, device=self.device)  # (B, n)
        # (B, n|1, V)
        logits = self.model(idx, positions, None, self.layer_caches, last_only=last_only)
        if self.states is not None:
            self.states.store()
        return logits[:, -1].float() if last_only else logits.float()

    def _compiled(self, rows: list[Row], last_only: bool) -> bool:
        """Whether the compiled decode pass runs these rows, each token a row of it: up to its
        rows in all, of a token each over recurrent states, else of up to IN_PLACE_MAX_TOKENS (a
        speculative verification, a draft model's catch-up). The library computes the head over
        every token: a pass that wants each row's last logits only takes it with at most two
        tokens a row on average (a catch-up of one or two; not a short prompt's chunk)."""
        tokens = sum(len(row.tokens) for row in rows)
        if self.step is None or tokens > self.step.max_batch:
            return False
        if last_only and tokens > 2 * len(rows):
            return False
        most = 1 if self.states is not None else IN_PLACE_MAX_TOKENS
        return all(len(row.tokens) <= most for row in rows)

    def _compiled_pass(self, rows: list[Row], last_only: bool) -> Tensor | list[Tensor]:
        """The compiled decode pass over every token of the rows, as a row of its own: token t of
        row b at position start_b + t over row b's blocks. The pass stores all its rows' K/V
        before any attends (`paged_step`), so a token attends the row's tokens before it as a
        packed pass does: logits (B, V) of each row's last token, or (n_b, V) of each of its."""
        tokens = [  # one token each
            Row(row.blocks, row.start + t, [token], row.state_pages)
            for row in rows
            for t, token in enumerate(row.tokens)
        ]
        # (N, 1), (N,), (N, W): the tables as wide as the pass was traced with
        idx, start, table = pass_inputs(tokens, self.width, self.device)
        states = []
        if self.states is not None:  # one token a row: the rows' states kept for the next pass
            self.states.seek([row.state_pages for row in rows], start, keep=True)
            states = self.states.layer_states()
        logits = self.step(idx, start[:, None], table, states).float()  # (N, V)
        if self.states is not None:
            self.states.store()
        lengths = [len(row.tokens) for row in rows]
        if last_only:
            return logits[torch.tensor(lengths, device=self.device).cumsum(0) - 1]  # (B, V)
        return list(logits.split(lengths))  # (n_b, V) each

    def _one_row(self, rows: list[Row]) -> tuple[Tensor, Tensor, list[int]]:
        """All rows' tokens in one row: ids (1, N), positions (N,), and each row's length n_b."""
        dev = self.device
        idx = torch.tensor([[token for row in rows for token in row.tokens]], device=dev)  # (1, N)
        positions = torch.tensor(  # (N,)
            [row.start + t for row in rows for t in range(len(row.tokens))], device=dev
        )
        return idx, positions, [len(row.tokens) for row in rows]

    def _segments(self, rows: list[Row], last_only: bool) -> Tensor | list[Tensor]:
        """Rows of different lengths, all their tokens in one row of Σ n_b (the weights read once
        for all), each row's queries attending its own keys (`PagedKVCache.seek_segments`):
        logits (B, V) of each row's last token, or (n_b, V) of each of its tokens."""
        idx, positions, lengths = self._one_row(rows)
        tables = [torch.tensor(row.blocks, device=self.device) for row in rows]
        self.cache.seek_segments(tables, [row.start for row in rows], lengths)
        keep = torch.tensor(lengths, device=self.device).cumsum(0) - 1 if last_only else None
        logits = self.model(idx, positions[None], None, self.cache, keep=keep)[0].float()
        return logits if last_only else list(logits.split(lengths))  # (B, V) or (n_b, V) each

    def _packed(self, rows: list[Row], last_only: bool) -> Tensor | list[Tensor]:
        """All rows' tokens in one row of N = Σ n_b, each a query of the in-place attention
        kernel: logits (B, V) of each row's last token (the head over those alone), or (n_b, V)
        of each of its tokens."""
        idx, positions, lengths = self._one_row(rows)
        n = torch.tensor(lengths, device=self.device)  # (B,)
        width = max(len(row.blocks) for row in rows)
        tables = torch.tensor(  # (N, width): each token's sequence's blocks
            [row.blocks + [0] * (width - len(row.blocks)) for row in rows], device=self.device
        ).repeat_interleave(n, dim=0)
        self.cache.seek_packed(tables, positions)
        keep = n.cumsum(0) - 1 if last_only else None
        logits = self.model(idx, positions[None], None, self.cache, keep=keep)[0].float()
        return logits if last_only else list(logits.split(lengths))  # (B, V) or (n_b, V) each

    def _padded(self, rows: list[Row]) -> list[Tensor]:
        """Logits (n_b, V) of each row's tokens: the one-token rows in one pass, the others in
        one padded to the longest."""
        logits: list[Tensor | None] = [None] * len(rows)
        for one in (True, False):
            group = [i for i, row in enumerate(rows) if (len(row.tokens) == 1) == one]
            if group:
                out = self._padded_pass([rows[i] for i in group])  # (B', n, V)
                for j, i in enumerate(group):
                    logits[i] = out[j, : len(rows[i].tokens)]
        return logits

    def _padded_pass(self, rows: list[Row]) -> Tensor:
        """Logits (B, n, V), n = the longest row; row b's first len(rows[b].tokens) positions
        are its tokens', the rest padding, whose K/V past a row's blocks goes to the scratch block."""
        if self.scratch is None:
            raise RuntimeError("a padded pass needs the scratch block: build the runner ragged")
        dev, size = self.device, self.cache.block_size
        n = max(len(row.tokens) for row in rows)
        width = max(max(len(row.blocks), blocks_for(row.start + n, size)) for row in rows)
        table = torch.tensor(  # (B, width): each row's blocks, then the scratch block
            [row.blocks + [self.scratch] * (width - len(row.blocks)) for row in rows], device=dev
        )
        start = torch.tensor([row.start for row in rows], device=dev)  # (B,)
        idx = torch.tensor([row.tokens + [0] * (n - len(row.tokens)) for row in rows], device=dev)
        self.cache.seek(table, start, n)
        # (B, n); the padding's positions may pass the context: they are clamped, their logits unused.
        positions = (start[:, None] + torch.arange(n, device=dev)).clamp(
            max=self.model.config.context_length - 1
        )
        return self.model(idx, positions, None, self.cache).float()  # (B, n, V)

    def prompt_logprobs(self, ids: list[int]) -> Tensor:
        """Log-probabilities (T − 1, V) of prompt `ids`, in at least float32: row t is
        log p(· | tokens ≤ t). One forward pass outside the batch and the KV cache."""
        logits = self.model(torch.tensor([ids], device=self.device))[0, :-1]  # (T − 1, V)
        return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
