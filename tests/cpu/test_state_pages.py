"""`decoderlm.cpu.state_pages.StateCopies`: the memcpy copies of recurrent states between their
pages and contiguous buffers move exactly the bytes the PyTorch ops move — gathered (zeros for a
fresh row) and written back, over runs that cross pages and the K/V tensors of a page — and
touch no other byte of the pool. `StatePool`'s kept decode states: the same bytes as passes that
copy every row both ways, with copies only for the rows that change."""

from __future__ import annotations

import random

import pytest
import torch

from decoderlm import DecoderLM, ModelConfig
from decoderlm.cpu import state_pages
from decoderlm.engine.kv_pool import BlockPool, PagedKVCache
from decoderlm.engine.state_pool import StatePool, split_budget

pytestmark = pytest.mark.skipif(
    state_pages._library() is None, reason="no C compiler for the memcpy copies"
)


@pytest.fixture(params=["hybrid-tiny", "recurrent-tiny"])
def pool(request) -> StatePool:
    """A bfloat16 pool of 16-token blocks (a hybrid's state spans several pages of four K/V rows
    each), its pages filled with random bytes."""
    config = ModelConfig.from_preset(request.param, vocab_size=32, d_model=32, n_heads=4, d_ff=64)
    model = DecoderLM(config).bfloat16()
    budget = split_budget(config, "1MiB", 16, torch.bfloat16)
    cache = PagedKVCache(config, budget.num_blocks, 16, torch.bfloat16, torch.device("cpu"))
    states = StatePool(model.config, budget, torch.bfloat16, torch.device("cpu"), cache)
    g = torch.Generator().manual_seed(0)
    for t in states.tensors:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g))
    return states


def test_memcpy_gathers_and_writes_back_the_bytes_pytorch_does(pool):
    copies = pool.copies
    assert copies.memcpy  # the CPU path under test
    p = pool.budget.state_pages
    rows = torch.tensor([3, 0, 7]).repeat_interleave(p) * p + torch.arange(p).repeat(3)  # (B·p,)
    fresh = torch.tensor([False, True, False])
    g = torch.Generator().manual_seed(1)
    for i, part in enumerate(pool.parts):
        got, want = (torch.empty(3, *part.shape[1:], dtype=part.dtype) for _ in range(2))
        copies.gather(i, rows, got, fresh)
        copies.memcpy = False
        copies.gather(i, rows, want, fresh)
        copies.memcpy = True
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), part
        assert not got[1].view(torch.uint8).any()  # the fresh row: the zero state

        new = torch.randint(0, 256, got.view(torch.uint8).shape, generator=g, dtype=torch.uint8)
        before = [t.clone() for t in pool.tensors]
        copies.scatter(i, rows, new.view(part.dtype))
        after_memcpy = [t.clone() for t in pool.tensors]
        for t, old in zip(pool.tensors, before, strict=True):
            t.copy_(old)
        copies.memcpy = False
        copies.scatter(i, rows, new.view(part.dtype))
        copies.memcpy = True
        for t, memcpy_t, old in zip(pool.tensors, after_memcpy, before, strict=True):
            assert torch.equal(t.view(torch.uint8), memcpy_t.view(torch.uint8)), part
            untouched = torch.ones(len(t), dtype=torch.bool)
            untouched[rows] = False
            assert torch.equal(t[untouched].view(torch.uint8), old[untouched].view(torch.uint8))
        back = torch.empty_like(got)
        copies.gather(i, rows, back, torch.zeros(3, dtype=torch.bool))
        assert torch.equal(back.view(torch.uint8), new)  # read back as written


def _pass(pool: StatePool, owners: list[list[int]], fresh: list[bool], keep: bool) -> None:
    """One pass over these sequences' states: each row's bytes + (its first page + 1), mod 256."""
    start = torch.tensor([0 if new else 1 for new in fresh])
    pool.seek(owners, start, keep=keep)
    for state in pool.layer_states():
        for row, pages in zip(state, owners, strict=True):
            row.view(torch.uint8).add_(pages[0] + 1)
    pool.store()


def test_kept_decode_states_equal_gathering_and_writing_back_every_row(pool):
    """Random passes over six sequences — kept (decode) or not (prefill), rows joining, leaving
    and changing places, some starting fresh, some dropped — leave each sequence's pages, once
    the kept rows are written back, the bytes of passes that gather and write back every row."""
    p = pool.budget.state_pages
    owners = [list(range(k * p, (k + 1) * p)) for k in range(6)]
    want = {}  # the state each sequence's passes make, bytes per part
    for k, pages in enumerate(owners):
        pool.seek([pages], torch.tensor([1]))
        want[k] = [state[0].view(torch.uint8).clone() for state in pool.layer_states()]
    drop = pool.pages(BlockPool(pool.budget.num_blocks, 16, False)).drop  # a sequence leaves
    rng, dropped = random.Random(0), set()
    for _ in range(80):
        rows = rng.sample(range(6), rng.randint(1, 6))
        if rng.random() < 0.6:  # mostly a decode pass over the last one's rows, in their order
            rows = sorted(rows)
        fresh = [k in dropped or rng.random() < 0.1 for k in rows]
        _pass(pool, [owners[k] for k in rows], fresh, keep=rng.random() < 0.7)
        for k, new in zip(rows, fresh, strict=True):
            dropped.discard(k)
            want[k] = [(0 * s if new else s) + (owners[k][0] + 1) for s in want[k]]  # uint8
        if rng.random() < 0.15:  # a sequence leaves the running batch: its state is gone
            k = rng.randrange(6)
            drop(owners[k])
            want[k], dropped = [0 * s for s in want[k]], dropped | {k}
    pool.write_back()
    assert not any(pool.kept)
    for k, pages in enumerate(owners):
        pool.seek([pages], torch.tensor([1]))
        for got, expected in zip(pool.layer_states(), want[k], strict=True):
            assert torch.equal(got[0].view(torch.uint8), expected), k


def test_a_steady_decode_pass_copies_no_state_and_a_changed_one_only_its_changed_rows(pool):
    """Copies between pages and buffers (calls of `StateCopies.gather` / `scatter`, rows each)."""
    p = pool.budget.state_pages
    a, b, c, d = ([k * p + i for i in range(p)] for k in range(4))
    copied = []
    for name in ("gather", "scatter"):
        method = getattr(pool.copies, name)

        def counted(part, rows, *args, method=method, name=name):
            copied.append((name, len(rows) // p))
            return method(part, rows, *args)

        setattr(pool.copies, name, counted)
    parts = len(pool.parts)
    _pass(pool, [a, b, c], [False] * 3, keep=True)
    assert copied == [("gather", 3)] * parts  # the first decode pass: every row from its pages
    copied.clear()
    _pass(pool, [a, b, c], [False] * 3, keep=True)
    assert copied == []  # the same rows again: nothing copied
    _pass(pool, [a, c, d], [False] * 3, keep=True)  # b left (written back), c moved, d joined
    assert copied == [("scatter", 1)] * parts + [("gather", 1)] * parts
    copied.clear()
    _pass(pool, [c], [False], keep=False)  # a prefill pass over a kept row: written back first
    assert copied == [("scatter", 1)] * parts + [("gather", 1)] * parts + [("scatter", 1)] * parts


def test_a_dropped_kept_state_is_never_written_over_its_freed_pages(pool):
    """A sequence that leaves the running batch frees its pages (zeroed, then another sequence's
    state or K/V): its kept row must not reach them when the kept rows are written back."""
    p = pool.budget.state_pages
    a, b = ([k * p + i for i in range(p)] for k in range(2))
    _pass(pool, [a, b], [False, False], keep=True)
    pool.pages(BlockPool(pool.budget.num_blocks, 16, False)).drop(a)
    pool.write_back()
    for t in pool.tensors:
        assert not t[a].any() and t[b].any()


def test_the_decode_order_keeps_kept_rows_in_place_and_the_last_row_fills_a_left_place(pool):
    p = pool.budget.state_pages
    a, b, c, d, e = (tuple(k * p + i for i in range(p)) for k in range(5))
    _pass(pool, [list(x) for x in (a, b, c, d)], [False] * 4, keep=True)
    assert pool.order([a, c, d]) == [0, 2, 1]  # b left: a and c stay, d takes b's place
    _pass(pool, [list(x) for x in (a, d, c)], [False] * 3, keep=True)
    assert pool.kept == [a, d, c]
    assert pool.order([e, c, a, d]) == [2, 3, 1, 0]  # the kept in place, e joins at the end
    assert pool.order([e, b]) == [0, 1]  # none kept: as given
