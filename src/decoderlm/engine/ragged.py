"""One forward pass over rows of different lengths in the paged KV pool: the engine's step when
sequences speculate (each speculating sequence's last token and its k_b drafts, k_b + 1 tokens,
and every other decoding sequence's one token, in one target pass, as vLLM batches them) and the
draft model's catch-up on the tokens each sequence took since its last proposal.

`ModelRunner.forward` runs the same n tokens of every row. Here row b runs its own n_b tokens:

- packed (vLLM's layout), where every layer attends in place (`PagedKVCache.packable`): all rows'
  tokens in one row of Σ n_b tokens, each query attending its own sequence's keys up to itself
  (`PagedKVCache.seek_packed`), no padding;
- else padded on the right to n = max n_b: queries after a row's real ones see the real keys,
  never the reverse (causal), so the padding changes no real row's logits. The padding's K/V is
  written after the row's real tokens, into its own blocks past what it has computed (written
  over before it is ever read), or, past its blocks, into a scratch block that no sequence is
  given (`SCRATCH_BLOCKS`: the engine's `BlockPool` leaves it out). `PagedKVCache.seek` reads such
  ragged rows' keys left-padded, where attention's bottom-right causal mask expects them. The
  one-token rows run in a pass of their own, not padded to n.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from decoderlm.engine.kv_pool import blocks_for
from decoderlm.engine.runner import ModelRunner

SCRATCH_BLOCKS = 1  # the pool's last block: the padding's K/V, never given to a sequence


@dataclass(frozen=True)
class Row:
    """One row of a ragged pass: tokens written at positions start, start + 1, … of the sequence
    whose block table is `blocks`."""

    blocks: list[int]
    start: int
    tokens: list[int]


def forward_rows(runner: ModelRunner, rows: list[Row]) -> list[Tensor]:
    """The logits (n_b, V) float32 of each row's n_b tokens, in one pass (packed) or two (padded:
    the one-token rows, the others)."""
    if runner.cache.packable:
        return _packed(runner, rows)
    logits: list[Tensor | None] = [None] * len(rows)
    for one in (True, False):
        group = [i for i, row in enumerate(rows) if (len(row.tokens) == 1) == one]
        if group:
            out = _padded(runner, [rows[i] for i in group])  # (B', n, V)
            for j, i in enumerate(group):
                logits[i] = out[j, : len(rows[i].tokens)]
    return logits


def _packed(runner: ModelRunner, rows: list[Row]) -> list[Tensor]:
    dev = runner.device
    width = max(len(row.blocks) for row in rows)
    lengths = [len(row.tokens) for row in rows]
    tables = torch.tensor(  # (N, width): each token's sequence's blocks
        [row.blocks + [0] * (width - len(row.blocks)) for row in rows], device=dev
    ).repeat_interleave(torch.tensor(lengths, device=dev), dim=0)
    positions = torch.tensor(  # (N,)
        [row.start + t for row in rows for t in range(len(row.tokens))], device=dev
    )
    idx = torch.tensor([[token for row in rows for token in row.tokens]], device=dev)  # (1, N)
    runner.cache.seek_packed(tables, positions)
    logits = runner.model(idx, positions[None], None, runner.cache)[0].float()  # (N, V)
    return list(logits.split(lengths))


def _padded(runner: ModelRunner, rows: list[Row]) -> Tensor:
    """Logits (B, n, V) float32, n = the longest row; row b's first len(rows[b].tokens) positions
    are its tokens', the rest padding. The pool's last block (`SCRATCH_BLOCKS`) takes the
    padding past a row's blocks."""
    dev, size = runner.device, runner.cache.block_size
    scratch = runner.num_blocks - SCRATCH_BLOCKS
    n = max(len(row.tokens) for row in rows)
    width = max(max(len(row.blocks), blocks_for(row.start + n, size)) for row in rows)
    table = torch.tensor(  # (B, width): each row's blocks, then the scratch block
        [row.blocks + [scratch] * (width - len(row.blocks)) for row in rows], device=dev
    )
    start = torch.tensor([row.start for row in rows], device=dev)  # (B,)
    idx = torch.tensor([row.tokens + [0] * (n - len(row.tokens)) for row in rows], device=dev)
    runner.cache.seek(table, start, n)
    # (B, n); the padding's positions may pass the context: they are clamped, their logits unused.
    positions = (start[:, None] + torch.arange(n, device=dev)).clamp(
        max=runner.model.config.context_length - 1
    )
    return runner.model(idx, positions, None, runner.cache).float()  # (B, n, V)
