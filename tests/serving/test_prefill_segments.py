"""Prefill chunks of different lengths run in one pass (`ModelRunner`'s segments: the sequences'
tokens in one row, each attending its own keys): each sequence's logits are those of running it
alone, with and without a sliding window, over float and int8 KV pools, from the start of a prompt
and from the middle of one, the decode rows among them attended in place, prompts of one length
side by side as one batch; an engine step schedules them as one pass, and where every layer attends
in place the decode rows with them. A prompt's first pass of uniform rows attends the K/V it stores
without reading them back from a plain pool."""

from __future__ import annotations

import pytest
import torch

from decoderlm import DecoderLM, ModelConfig
from decoderlm.cpu import paged_attention
from decoderlm.engine.engine import Engine
from decoderlm.engine.kv_pool import PagedLayerCache
from decoderlm.engine.passes import PrefillPass, Row
from decoderlm.engine.runner import ModelRunner
from decoderlm.engine.types import RequestParams
from decoderlm.inference.sampling import SamplingParams
from decoderlm.tokenizer import Tokenizer

VOCAB = 31


def model(**overrides) -> DecoderLM:
    torch.manual_seed(0)
    config = ModelConfig.from_preset("llama-tiny", vocab_size=VOCAB, context_length=128, d_model=32,
                                     n_layers=2, n_heads=4, n_kv_heads=2, **overrides)  # fmt: skip
    return DecoderLM(config).double().eval()


def runner(lm: DecoderLM, kv_cache_dtype: str | None = None) -> ModelRunner:
    return ModelRunner(lm, kv_cache_memory="4MiB", block_size=4, kv_cache_dtype=kv_cache_dtype,
                       cpu_kernels=False)  # fmt: skip


def sequences(lengths: list[int], cached: int) -> list[Row]:
    """One row per length n: `cached` tokens already in the pool, then n to run; blocks of its own."""
    g = torch.Generator().manual_seed(1)
    out, block = [], 0
    for n in lengths:
        need = -(-(cached + n) // 4)
        tokens = torch.randint(0, VOCAB, (cached + n,), generator=g).tolist()
        out.append(Row(list(range(block, block + need)), cached, tokens[cached:]))
        block += need
    return out


@pytest.mark.parametrize(
    ("overrides", "kv_cache_dtype"),
    [({}, None), ({"sliding_window": 6}, None), ({}, "int8")],
)
@pytest.mark.parametrize("cached", [0, 9])  # a prompt's first chunk, or a later one
def test_segments_give_each_sequence_its_logits_alone(overrides, kv_cache_dtype, cached):
    lm = model(**overrides)
    batch = sequences([23, 5, 17, 1], cached)
    together, alone = runner(lm, kv_cache_dtype), runner(lm, kv_cache_dtype)
    with together.running(), alone.running():
        if cached:  # the cached tokens' K/V, row by row (random tokens: only their keys matter)
            for r in batch:
                for each in (together, alone):
                    each.forward([Row(r.blocks, 0, list(range(cached)))])
        last = together.forward(batch)  # (B, V): one pass of segments
        every = together.forward_tokens(batch)  # each row's (n_b, V)
        for b, row in enumerate(batch):
            solo = alone.forward_tokens([row])[0]  # (n_b, V): a uniform pass of one row
            torch.testing.assert_close(last[b], solo[-1], rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(every[b], solo, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("window", [None, 6])
def test_prompts_of_one_length_side_by_side_attend_as_one_batch_with_their_logits_alone(window):
    lm = model() if window is None else model(sliding_window=window)
    batch = sequences([16, 16, 16, 1, 32, 16], cached=0)  # at offsets 0, 16, 32, 48, 49, 81
    together, alone = runner(lm), runner(lm)
    with together.running(), alone.running():
        every = together.forward_tokens(batch)
        assert together.cache.layers[0].runs == [(0, 16, 3), (49, 32, 1), (81, 16, 1)]
        for b, row in enumerate(batch):
            solo = alone.forward_tokens([row])[0]  # (n_b, V)
            torch.testing.assert_close(every[b], solo, rtol=1e-9, atol=1e-9)


@pytest.mark.skipif(
    not paged_attention.available(torch.float32, torch.device("cpu")), reason="no C compiler"
)
def test_decode_rows_beside_prefill_chunks_attend_in_place_and_keep_their_logits_alone():
    lm = model().float()
    batch = sequences([23, 1, 17, 1, 5], cached=9)  # chunks of 23 and 17; two decodes; a draft
    together, alone = (ModelRunner(lm, kv_cache_memory="4MiB", block_size=4, kv_cache_dtype=None,
                                   cpu_kernels=True) for _ in range(2))  # fmt: skip
    with together.running(), alone.running():
        for r in batch:  # the cached tokens' K/V, row by row
            for each in (together, alone):
                each.forward([Row(r.blocks, 0, list(range(9)))])
        every = together.forward_tokens(batch)  # one pass of segments
        places = together.cache.layers[0].queries[0]  # the in-place kernel's queries
        assert places.tolist() == [23, 41, 42, 43, 44, 45, 46]  # the 1-, 1- and 5-token rows
        for b, row in enumerate(batch):
            solo = alone.forward_tokens([row])[0]  # (n_b, V)
            torch.testing.assert_close(every[b], solo, rtol=1e-5, atol=1e-5)


def test_prompts_of_different_lengths_prefill_in_one_pass():
    tok = Tokenizer.train_char(["abcdefghijklmnopqrstuvwxyz .,\n"])
    engine = Engine(model(), tok, block_size=4, prefill_chunk=32, max_batched_tokens=256)
    params = RequestParams(4, SamplingParams(temperature=0), ignore_eos=True)
    for n in (7, 19, 30):
        engine.submit(list(range(1, n + 1)), params, on_event=lambda event: None)
    (prefill,) = engine.core.schedule()
    assert isinstance(prefill, PrefillPass) and prefill.sizes == [7, 19, 30]


@pytest.mark.skipif(
    not paged_attention.available(torch.float32, torch.device("cpu")), reason="no C compiler"
)
def test_where_every_layer_attends_in_place_the_decode_rows_join_the_prompts_pass():
    tok = Tokenizer.train_char(["abcdefghijklmnopqrstuvwxyz .,\n"])
    engine = Engine(model().float(), tok, block_size=4, prefill_chunk=32, max_batched_tokens=256)
    assert engine.runner.cache.packable
    params = RequestParams(4, SamplingParams(temperature=0), ignore_eos=True)
    engine.submit([1, 2, 3], params, on_event=lambda event: None)
    engine.step()  # its prompt and first token: it decodes from now on
    engine.submit(list(range(1, 20)), params, on_event=lambda event: None)
    (one,) = engine.core.schedule()  # one pass: the weights read once for both
    assert isinstance(one, PrefillPass) and one.sizes == [1, 19]


@pytest.mark.parametrize(
    ("overrides", "kv_cache_dtype", "reads_back"),
    [({}, None, False), ({"sliding_window": 6}, None, False), ({}, "int8", True)],
)
def test_a_prompts_first_uniform_pass_attends_its_new_keys_without_reading_them_back(
    overrides, kv_cache_dtype, reads_back, monkeypatch
):
    """Rows all starting at position 0 over a plain pool attend the K/V they store as they are
    (the bits the pool holds); an int8 pool's are read back, as its later chunks read them, and
    a later chunk reads the pool. Logits as the model's own forward without a cache."""
    lm = model(**overrides)
    reads = []
    for name in ("_blocks", "_slots"):
        read = getattr(PagedLayerCache, name)
        monkeypatch.setattr(PagedLayerCache, name, lambda s, pool, r=read: reads.append(1) or r(s, pool))  # fmt: skip
    whole = sequences([37, 37], cached=0)  # blocks for 37 tokens each
    batch = [Row(row.blocks, 0, row.tokens[:20]) for row in whole]  # past the in-place kernel's 16
    later = [Row(row.blocks, 20, row.tokens[20:]) for row in whole]  # a second chunk of each
    pool = runner(lm, kv_cache_dtype)
    with pool.running():
        first = pool.forward_tokens(batch)
        assert bool(reads) == reads_back
        reads.clear()
        second = pool.forward_tokens(later)
        assert reads
    with torch.no_grad():
        ids = torch.tensor([row.tokens for row in whole])
        want = lm(ids).float()  # (2, 37, V): no cache; the runner's logits are float32
    tolerance = 0.05 if kv_cache_dtype else 1e-6  # int8 keys: the rounding of their scales
    for b in range(2):
        torch.testing.assert_close(first[b], want[b, :20], rtol=0, atol=tolerance)
        torch.testing.assert_close(second[b], want[b, 20:], rtol=0, atol=tolerance)
