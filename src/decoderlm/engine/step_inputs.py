"""The model inputs of one uniform engine pass (every row runs the same n tokens), built from the
rows' Python lists in numpy.

`torch.tensor` of nested Python lists checks every element's type; numpy fills the same int64
arrays row by row several times faster (a table of 64 rows: about 4×), and `torch.from_numpy`
wraps them without a copy. At 64 decoding sequences that is a noticeable share of a step outside
the model (benchmarks/README.md, engine_profile.py).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from decoderlm.engine.passes import Row


def pass_inputs(
    rows: list[Row], width: int | None, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """(idx (B, n): each row's tokens, start (B,): where they start, table (B, W): its blocks,
    padded to W = `width` (or to the longest table when None) by repeating its last block, which
    its key mask hides: every block a table names holds K/V), int64 on `device`."""
    n = len(rows[0].tokens)
    w = max(len(r.blocks) for r in rows) if width is None else width
    idx, start = np.empty((len(rows), n), np.int64), np.empty(len(rows), np.int64)
    table = np.empty((len(rows), w), np.int64)
    for i, r in enumerate(rows):
        idx[i] = r.tokens
        start[i] = r.start
        table[i, : len(r.blocks)] = r.blocks
        table[i, len(r.blocks) :] = r.blocks[-1]
    return (
        torch.from_numpy(idx).to(device),
        torch.from_numpy(start).to(device),
        torch.from_numpy(table).to(device),
    )
