"""The model inputs of one engine pass, built from the sequences' Python lists in numpy.

`torch.tensor` of nested Python lists checks every element's type; numpy fills the same int64
arrays row by row several times faster (a table of 64 rows: about 4×, measured while writing
this), and `torch.from_numpy` wraps them without a copy. At 64 decoding sequences that is a
noticeable share of a step outside the model (benchmarks/README.md, engine_profile.py).
"""

from __future__ import annotations

from collections.abc import Sequence as Rows

import numpy as np
import torch
from torch import Tensor

from decoderlm.engine.scheduler import Sequence


def pass_inputs(
    seqs: Rows[Sequence], n: int, width: int | None, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """(idx (B, n): tokens [n_computed, n_computed + n) of each sequence, start (B,): each one's
    n_computed, table (B, W): its blocks, padded to W = `width` (or to the longest table when
    None) by repeating its last block, which its key mask hides: every block a table names holds
    K/V), int64 on `device`."""
    rows = len(seqs)
    w = max(len(s.blocks) for s in seqs) if width is None else width
    idx, start = np.empty((rows, n), np.int64), np.empty(rows, np.int64)
    table = np.empty((rows, w), np.int64)
    for i, s in enumerate(seqs):
        idx[i] = s.tokens[s.n_computed : s.n_computed + n]
        start[i] = s.n_computed
        table[i, : len(s.blocks)] = s.blocks
        table[i, len(s.blocks) :] = s.blocks[-1]
    return (
        torch.from_numpy(idx).to(device),
        torch.from_numpy(start).to(device),
        torch.from_numpy(table).to(device),
    )
