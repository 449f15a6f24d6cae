"""`decoderlm.cpu.state_pages.StateCopies`: the memcpy copies of recurrent states between their
pages and contiguous buffers move exactly the bytes the PyTorch ops move — gathered (zeros for a
fresh row) and written back, over runs that cross pages and the K/V tensors of a page — and
touch no other byte of the pool."""

from __future__ import annotations

import pytest
import torch

from decoderlm import DecoderLM, ModelConfig
from decoderlm.cpu import state_pages
from decoderlm.engine.kv_pool import PagedKVCache
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
