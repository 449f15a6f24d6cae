"""The cache contract: every layer cache is a `LayerCache`, one `CacheStep` seeks them all, and a
rollback (speculative decoding's rejected drafts) leaves the cache as if the tokens were never
written — or is refused, in one line, with the cache untouched."""

import pytest
import torch

from decoderlm import DecoderLM, DecoderLMError, ModelConfig
from decoderlm.engine.kv_pool import PagedKVCache
from decoderlm.model.cache import (
    BaseLayerCache,
    CacheStep,
    LayerCache,
    RingKVCache,
    StaticKVCache,
)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 3, 60, 42, 7, 1, 8, 9]  # 9 tokens: a ring of 5 slots is full after it
DRAFTS = [11, 12, 13]  # what a draft model proposed, all rejected
TRUE = [21, 22, 23, 24]


def model(**overrides) -> DecoderLM:
    config = dict(
        vocab_size=64,
        context_length=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        mlp="swiglu",
        norm="rmsnorm",
        position="rope",
        bias=False,
    )
    torch.manual_seed(0)
    return DecoderLM(ModelConfig(**{**config, **overrides})).double().eval()


def run(m: DecoderLM, cache, ids: list[int], start: int) -> torch.Tensor:
    """Logits (T, V) of ids written at cache positions start .. start + T − 1, in one step."""
    cache.seek(CacheStep.span(start, len(ids), "cpu"))
    positions = torch.arange(start, start + len(ids))
    with torch.no_grad():
        return m(torch.tensor([ids]), positions, None, cache)[0]


def true_logits(m: DecoderLM, cache, drafts: list[int]) -> torch.Tensor:
    """PROMPT, then `drafts` rolled back, then TRUE one token at a time: the logits of TRUE."""
    run(m, cache, PROMPT, 0)
    if drafts:
        run(m, cache, drafts, len(PROMPT))
        cache.rollback(len(drafts))
    n = len(PROMPT)
    return torch.cat([run(m, cache, [t], n + i) for i, t in enumerate(TRUE)])


CASES = {  # id: (model overrides, cache maker, drafts rolled back)
    "static": ({}, lambda c: StaticKVCache(c, 1, 16, torch.float64), DRAFTS),
    "static-int8": ({}, lambda c: StaticKVCache(c, 1, 16, torch.float64, "cpu", "int8"), DRAFTS),
    "ring-not-full": (
        {"sliding_window": 16},
        lambda c: RingKVCache(c, 1, None, torch.float64),
        DRAFTS,
    ),
    "ring-full-one-token": (
        {"sliding_window": 5},
        lambda c: RingKVCache(c, 1, None, torch.float64),
        DRAFTS[:1],
    ),
    "ring-qwen2-layout": (
        {"sliding_window": 16, "sliding_window_layers": [1]},
        lambda c: RingKVCache(c, 1, 16, torch.float64),
        DRAFTS,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_rolled_back_drafts_leave_the_logits_of_a_cache_that_never_saw_them(case):
    overrides, make, drafts = CASES[case]
    m = model(**overrides)
    clean = true_logits(m, make(m.config), [])
    # The same computation over the same kept keys: equal to the bit (masked slots weigh 0).
    assert torch.equal(true_logits(m, make(m.config), drafts), clean)


def test_a_full_ring_refuses_a_rollback_that_uncovers_overwritten_keys_and_stays_untouched():
    m = model(sliding_window=5, sliding_window_layers=[1])  # layer 0 full, layer 1 a ring of 5
    cache = RingKVCache(m.config, 1, 16, torch.float64)
    run(m, cache, PROMPT, 0)
    run(m, cache, DRAFTS[:2], len(PROMPT))  # position 10 overwrote 5, which position 9 sees
    valid = cache.plan.valid.clone()
    with pytest.raises(DecoderLMError, match="cannot roll back 2 tokens from 11") as info:
        cache.rollback(2)
    assert "\n" not in str(info.value)
    assert [layer.end for layer in cache.layers] == [11, 11]
    assert torch.equal(cache.plan.valid, valid)
    cache.rollback(1)
    assert [layer.end for layer in cache.layers] == [10, 10]


def test_rollback_refuses_more_tokens_than_held_a_whole_buffer_step_and_the_paged_pool():
    m = model()
    cache = StaticKVCache(m.config, 1, 16, torch.float64)
    run(m, cache, PROMPT + DRAFTS, 0)
    cache.rollback(len(DRAFTS))  # the static cache's rollback: attend 3 slots fewer
    assert [layer.end for layer in cache.layers] == [9, 9]
    with pytest.raises(DecoderLMError, match=r"rollback n=10 must be an integer in \[0, 9\]"):
        cache.rollback(10)
    cache.seek(CacheStep(torch.tensor([9])))  # end None: the caller's key mask is the state
    with pytest.raises(DecoderLMError, match="end=None"):
        cache.rollback(1)
    paged = PagedKVCache(m.config, 4, 4, torch.float64, torch.device("cpu"))
    with pytest.raises(DecoderLMError, match="PagedLayerCache cannot roll back"):
        paged.rollback(1)


def test_every_layer_cache_keeps_the_protocol_and_the_base_defaults():
    m = model(sliding_window=4, sliding_window_layers=[1])
    cpu = torch.device("cpu")
    caches = [
        StaticKVCache(m.config, 1, 8),
        RingKVCache(m.config, 1, 8),
        PagedKVCache(m.config, 4, 4, torch.float32, cpu),
    ]
    layers = [layer for cache in caches for layer in cache.layers]
    assert all(isinstance(layer, LayerCache) for layer in layers)
    q = torch.zeros(1, 4, 1, 8)
    for layer in (caches[0][0], caches[1][0]):  # static layers: the defaults
        assert layer.key_padding_mask is None
        assert layer.attend_in_place(q, q[:, :2], q[:, :2], 1.0) is None
    assert isinstance(caches[1][1].key_padding_mask, torch.Tensor)  # the ring masks its own keys
    with pytest.raises(NotImplementedError):
        BaseLayerCache(torch.zeros(1), torch.zeros(1)).update(q, q)
