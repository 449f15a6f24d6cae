"""A batch's recurrent states gathered from their pages and written back, for the serving engine's
`decoderlm.engine.state_pool`: on the CPU by memcpy, each run of a state's bytes straight between
its page rows and the state's contiguous buffer, one pass over memory each way (`state_pages.c`);
elsewhere, or without a C compiler, by PyTorch ops over the same runs.

The PyTorch ops gather a run's rows by `index_select`, then copy them into place, and write a
run back by `index_put_`, a TensorIterator over every element: copying every row's states both
ways around a compiled decode step of 64 rows of a 3:1 Gated DeltaNet hybrid (d_model 512) took
14 ms of a 21 ms step by PyTorch ops, 7.5-8.0 of 13.1-13.5 by memcpy (benchmarks/README.md,
engine_states.py, "copied"). The engine's decode passes keep their states between steps and
copy only the rows that join or leave (`decoderlm.engine.state_pool`).
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import itertools
from pathlib import Path

import torch
from torch import Tensor

from decoderlm.cpu import native

SOURCE = Path(__file__).with_name("state_pages.c")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
Run = tuple[int, int, int, int, int, int]  # (t, k, m, at, x, n): see `StateCopies`


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = native.load([SOURCE], "recurrent states are copied by PyTorch ops", ctypes.CDLL)
    if library is not None:
        library.copy_state_runs.restype = None
        library.copy_state_runs.argtypes = [_PTR] * 3 + [_I64] * 2 + [_PTR, _I64, _PTR] + [_I64] * 2 + [_PTR, ctypes.c_int]  # fmt: skip
    return library


class StateCopies:
    """Pages that are rows of `tensors` ((num_pages, row elements) each, contiguous: page j is row
    j of every one, in turn), and state parts that lie at `spans` (byte offset, length) of a
    sequence's pages, each part as runs (`runs`): a run (t, k, m, at, x, n) says that its pages
    k .. k + m − 1 hold, at byte `at` of their row of tensor t, the part's bytes
    x + j·page .. x + j·page + n − 1 (j < m)."""

    def __init__(self, tensors: list[Tensor], spans: list[tuple[int, int]]) -> None:
        self.tensors = tensors
        self.row_bytes = [t.shape[1] * t.element_size() for t in tensors]
        self.page = sum(self.row_bytes)
        self.runs = [self._runs(offset, n) for offset, n in spans]
        self.memcpy = tensors[0].device.type == "cpu" and _library() is not None
        if self.memcpy:  # the addresses and runs as the C function reads them
            self.pointers = (_PTR * len(tensors))(*(t.data_ptr() for t in tensors))
            self.row_bytes_c = torch.tensor(self.row_bytes)
            self.runs_c = [torch.tensor(r, dtype=torch.int64).view(-1, 6) for r in self.runs]

    def _runs(self, offset: int, n: int) -> list[Run]:
        """Where bytes offset .. offset + n of a sequence's pages lie, in runs: (tensor t, first
        page k, pages m, byte in each page's row of t, byte x of the part at page k, length);
        page k + j of a run holds the part's bytes j · page further on."""
        page, starts = self.page, [0, *itertools.accumulate(self.row_bytes)]
        runs: list[Run] = []
        latest: dict[tuple[int, int, int], int] = {}  # (t, at, length) → its latest run
        x = 0
        while x < n:  # one piece per page row of one tensor, joined to the run before if it goes on
            k, within = divmod(offset + x, page)
            t = bisect.bisect_right(starts, within) - 1
            at = within - starts[t]
            length = min(n - x, self.row_bytes[t] - at)
            j = latest.get((t, at, length))
            if (
                j is not None
                and runs[j][1] + runs[j][2] == k
                and runs[j][4] + runs[j][2] * page == x
            ):
                runs[j] = (t, runs[j][1], runs[j][2] + 1, at, runs[j][4], length)
            else:
                latest[(t, at, length)] = len(runs)
                runs.append((t, k, 1, at, x, length))
            x += length
        return runs

    def gather(self, part: int, rows: Tensor, state: Tensor, fresh: Tensor) -> None:
        """Part `part` of each row's state into state (B, ...), contiguous, from the page rows
        rows (B·p,) int64; zeros where fresh (B,) bool."""
        if self.memcpy:
            self._memcpy(part, rows, state, fresh.view(torch.uint8), to_pages=False)
            return
        b, raw = state.shape[0], _bytes(state)  # (B, n bytes)
        for t, k, m, at, x, n in self.runs[part]:
            source = _bytes(self.tensors[t])[:, at : at + n]  # (num_pages, n)
            pages = rows.view(b, -1)[:, k : k + m].flatten()  # (B·m,)
            at_x = raw.storage_offset() + x
            target = raw.as_strided((b, m, n), (raw.shape[1], self.page, 1), at_x)
            target.copy_(source.index_select(0, pages).view(b, m, n))
        raw.masked_fill_(fresh[:, None], 0)

    def scatter(self, part: int, rows: Tensor, state: Tensor) -> None:
        """state (B, ...), contiguous, back into the page rows rows (B·p,) of its rows."""
        if self.memcpy:
            self._memcpy(part, rows, state, None, to_pages=True)
            return
        b, raw = state.shape[0], _bytes(state)
        for t, k, m, at, x, n in self.runs[part]:
            target, source, e = _bytes(self.tensors[t]), raw, 1  # e: bytes an element
            at_x = raw.storage_offset() + x
            sizes = (at, at_x, n, self.page, target.shape[1], raw.shape[1])
            if all(v % 4 == 0 for v in sizes):
                target, source, e = target.view(torch.int32), raw.view(torch.int32), 4
            run = source.as_strided(  # (B, m, n): the run's bytes of each of its m pages
                (b, m, n // e), (raw.shape[1] // e, self.page // e, 1), at_x // e
            )
            target[:, at // e : (at + n) // e].index_put_((rows.view(b, -1)[:, k : k + m],), run)

    def _memcpy(
        self, part: int, rows: Tensor, state: Tensor, fresh: Tensor | None, to_pages: bool
    ) -> None:
        b, runs = state.shape[0], self.runs_c[part]
        _library().copy_state_runs(
            self.pointers, self.row_bytes_c.data_ptr(), rows.data_ptr(), b, rows.shape[0] // b,
            runs.data_ptr(), runs.shape[0], state.data_ptr(), state[0].nbytes, self.page,
            None if fresh is None else fresh.data_ptr(), int(to_pages),
        )  # fmt: skip


def _bytes(x: Tensor) -> Tensor:
    """x (N, ...), contiguous, as its raw bytes (N, nbytes / N), uint8."""
    return x.view(x.shape[0], -1).view(torch.uint8)
