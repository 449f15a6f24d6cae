"""Modules swapped into a model from outside for the duration of a `with` block.

The CPU speed paths replace some of a model's modules while a step runs (the packed linears of
`decoderlm.cpu.packed_linear`, the fused elementwise kernels of `decoderlm.cpu.fused`, the
batch-invariant modules of `decoderlm.cpu.invariant`) and put the plain ones back afterwards, so
that the model itself and its state_dict stay as they were. A `Swap` lists them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn

Swap = list[tuple[nn.Module, str, nn.Module, nn.Module]]  # (parent, name, plain, replacement)


@contextmanager
def swapped(swap: Sequence[tuple[nn.Module, str, nn.Module, nn.Module]]) -> Iterator[None]:
    """Each (parent, name, plain, replacement) of `swap` in place for the duration; the plain
    ones back on exit. (It writes the parents' `_modules` directly: nn.Module.__setattr__'s checks
    cost more than a step's worth of them is worth, and a child module is all it would set.)"""
    for parent, name, _, replacement in swap:
        parent._modules[name] = replacement
    try:
        yield
    finally:
        for parent, name, plain, _ in swap:
            parent._modules[name] = plain
