"""One forward pass over rows of different lengths in the paged KV pool: the engine's batched
speculative verification (every speculating sequence's last token and its k_b drafts, k_b + 1
tokens, in one target pass; vLLM's batched rejection sampler does the same) and the draft model's
catch-up on the tokens each sequence took since its last proposal.

`ModelRunner.forward` runs the same n tokens of every row. Here row b runs its own n_b ≤ n tokens,
padded on the right to n: queries after a row's real ones see the real keys, never the reverse
(causal), so the padding changes no real row's logits. The padding's K/V is written after the
row's real tokens, into its own blocks past what it has computed (written over before it is ever
read), or, past its blocks, into a scratch block that no sequence is given (`SCRATCH_BLOCKS`: the
engine's `BlockPool` leaves it out). `PagedKVCache.seek` reads such ragged rows' keys left-padded,
where attention's bottom-right causal mask expects them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from decoderlm.serving.kv_pool import blocks_for
from decoderlm.serving.runner import ModelRunner

SCRATCH_BLOCKS = 1  # the pool's last block: the padding's K/V, never given to a sequence


@dataclass(frozen=True)
class Row:
    """One row of a ragged pass: tokens written at positions start, start + 1, … of the sequence
    whose block table is `blocks`."""

    blocks: list[int]
    start: int
    tokens: list[int]


def forward_rows(runner: ModelRunner, rows: list[Row]) -> Tensor:
    """Logits (B, n, V) float32 of each row's tokens, n = the longest row; row b's first
    len(rows[b].tokens) positions are its tokens', the rest padding. The pool's last block
    (`SCRATCH_BLOCKS`) takes the padding past a row's blocks."""
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
