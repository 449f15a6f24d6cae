"""The serving engine over recurrent layers (`decoderlm.serving.state_pool`): hybrid and pure Gated
DeltaNet models give each request the greedy tokens of `decoderlm.generate` on its prompt alone,
alone or in a crowd, prefilled in chunks or not, preempted or not; the state carried across prefill
chunks equals the state of the whole prompt; the budget admits the sequences its rule says; what
recurrent layers rule out is refused in one line; and the HTTP server serves a hybrid."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from conftest import make_served
from decoderlm import DecoderLM, DecoderLMError, ModelConfig, generate
from decoderlm.checkpoint import save_model
from decoderlm.inference.sampling import SamplingParams
from decoderlm.model.cache import (
    CacheStep,
    kv_cache_bytes_per_token,
    make_cache,
    recurrent_state_bytes,
)
from decoderlm.serving.app import create_app
from decoderlm.serving.engine import Engine
from decoderlm.serving.kv_pool import blocks_for
from decoderlm.serving.scheduler import Sequence
from decoderlm.serving.types import RequestParams, TokenEvent
from decoderlm.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,\n"
GREEDY = SamplingParams(temperature=0)
PRESETS = ["hybrid-tiny", "recurrent-tiny"]  # GDN ×3 + attention; GDN ×4


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train_char([ALPHABET])  # 30 characters + <|endoftext|>


def tiny(
    preset: str, vocab_size: int, dtype: torch.dtype = torch.float64, context_length: int = 64
) -> DecoderLM:
    """The preset at d_model 32 (4 heads of 8; GDN: 4 value heads, 2 key heads), chunk 8."""
    torch.manual_seed(0)
    config = ModelConfig.from_preset(
        preset,
        vocab_size=vocab_size,
        context_length=context_length,
        d_model=32,
        d_ff=64,
        n_heads=4,
        recurrent_chunk=8,
        init_std=0.5,  # varied greedy tokens (at 0.02 a random model repeats one character)
    )
    model = DecoderLM(config)
    with torch.no_grad():  # slow decays, α ≈ 0.99 a token: a wrong state shows in every later token
        for block in model.blocks:
            if block.kind == "gdn":
                block.mixer.A_log.fill_(math.log(0.01))
    return model.to(dtype).eval()


def prompts(n: int, vocab: int, seed: int = 1) -> list[list[int]]:
    """n random prompts of 1 to 29 tokens."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 30, (n,), generator=g).tolist()
    return [torch.randint(0, vocab - 1, (size,), generator=g).tolist() for size in sizes]


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def solo(model: DecoderLM, prompt: list[int], n: int) -> list[int]:
    return generate(model, [prompt], n, temperature=0)[0][len(prompt) :]


def run(engine: Engine, requests: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    """Submit one request per step (each arrives while the earlier ones decode); tokens of each."""
    events: list[list[TokenEvent]] = [[] for _ in requests]
    params = RequestParams(max_tokens, GREEDY, stop_at_eot=False)
    for i, prompt in enumerate(requests):
        engine.submit(prompt, params, on_event=events[i].append)
        engine.step()
    while engine.step():
        pass
    return [[e.token_id for e in got if e.token_id is not None] for got in events]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("preset", PRESETS)
def test_concurrent_greedy_requests_each_equal_their_solo_generate(tok, preset, dtype):
    model = tiny(preset, tok.vocab_size, dtype)
    engine = Engine(model, tok, kv_cache_memory="2MiB", prefill_chunk=16)
    requests = prompts(8, tok.vocab_size)
    assert len({len(p) for p in requests}) > 4  # prompts of different lengths, some > the chunk
    # float64: the batched and solo kernels differ by rounding (~1e-15); float32 (~1e-6) also
    # stays far from these argmax gaps: the same tokens, exactly.
    for prompt, got in zip(requests, run(engine, requests), strict=True):
        assert got == solo(model, prompt, 12)
    stats = engine.stats()
    assert stats.max_running_seen == 8 and stats.state_slots_used == 0
    assert stats.state_bytes_per_sequence == recurrent_state_bytes(model.config, dtype)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_prompt_prefilled_in_chunks_of_three_gives_the_tokens_of_one_chunk(tok, preset):
    model = tiny(preset, tok.vocab_size)
    prompt = random_ids(31, tok.vocab_size, seed=5)  # 11 chunks of 3
    chunked = Engine(model, tok, prefill_chunk=3)
    whole = Engine(model, tok, prefill_chunk=128)
    assert run(chunked, [prompt]) == run(whole, [prompt]) == [solo(model, prompt, 12)]


@pytest.mark.parametrize("preset", PRESETS)
def test_the_state_carried_across_prefill_chunks_equals_the_whole_prompts_state(tok, preset):
    """The engine's slot after a prompt run in chunks of 5, 1 and 7 tokens, against the state
    `make_cache` holds after one forward pass over the whole prompt: float64, ≤ 1e-12."""
    model = tiny(preset, tok.vocab_size)
    prompt = random_ids(13, tok.vocab_size, seed=7)
    runner = Engine(model, tok, block_size=4).runner
    seq = Sequence(list(prompt), len(prompt), 64, blocks=list(range(4)))
    seq.slot = runner.states.take()
    with runner.running():
        for n in (5, 1, 7):
            runner.forward([seq], n)
            seq.n_computed += n
        cache = make_cache(model.config, 1, 64, torch.float64)
        cache.seek(CacheStep.span(0, len(prompt), "cpu"))
        model(torch.tensor([prompt]), kv_caches=cache)
    for i, slots in runner.states.layers.items():
        torch.testing.assert_close(
            slots.state_pool[seq.slot], cache[i].state[0], rtol=0, atol=1e-12
        )
        torch.testing.assert_close(slots.conv_pool[seq.slot], cache[i].conv[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_preempted_sequence_frees_its_slot_and_recomputes_its_state_to_the_same_tokens(
    tok, preset
):
    model = tiny(preset, tok.vocab_size)
    engine = Engine(model, tok, prefill_chunk=8)
    requests = prompts(3, tok.vocab_size, seed=3)
    events: list[list[TokenEvent]] = [[] for _ in requests]
    params = RequestParams(12, GREEDY, stop_at_eot=False)
    for prompt, sink in zip(requests, events, strict=True):
        engine.submit(prompt, params, on_event=sink.append)
    for _ in range(8):  # every prompt prefilled, a few tokens decoded
        engine.step()
    scheduler = engine.core.scheduler
    victim = scheduler.running[-1]
    slot, used = victim.slot, engine.stats().state_slots_used
    scheduler._preempt(victim)  # as the scheduler does when the pool runs short
    assert victim.slot is None and engine.stats().state_slots_used == used - 1
    assert slot in scheduler.states._free
    while engine.step():
        pass
    assert engine.stats().preemptions == 1
    for prompt, got in zip(requests, events, strict=True):
        assert [e.token_id for e in got if e.token_id is not None] == solo(model, prompt, 12)


def test_a_pure_recurrent_model_admits_budget_over_state_bytes_at_any_context(tok):
    # recurrent-tiny at d_model 32, float32: 4 GDN layers, each a state of 4 heads · 8 · 8 and a
    # conv state of (2·2·8 + 4·8) channels · 3 taps: 4 · 4 · (256 + 192) = 7168 bytes.
    slots = []
    for context in (64, 4096):
        model = tiny("recurrent-tiny", tok.vocab_size, torch.float32, context_length=context)
        state = recurrent_state_bytes(model.config)
        assert state == 4 * 4 * (4 * 8 * 8 + 64 * 3) == 7168
        assert kv_cache_bytes_per_token(model.config) == 0
        engine = Engine(model, tok, kv_cache_memory=5 * state + state // 2, max_queue=16)
        for prompt in prompts(9, tok.vocab_size):
            engine.submit(prompt, RequestParams(8, stop_at_eot=False), on_event=lambda e: None)
        engine.step()
        stats = engine.stats()
        slots.append((stats.running, stats.waiting, stats.state_slots_total))
    assert slots == [(5, 4, 5), (5, 4, 5)]  # ⌊5.5 · s / s⌋ = 5, whatever the context


def test_a_hybrid_admits_budget_over_state_plus_full_context_blocks(tok):
    # hybrid-tiny at d_model 32, float32: s = 3 GDN layers · 1792 = 5376 bytes; one attention
    # layer with 2 KV heads of 8: b = 16 tokens · 2 · 2 · 8 · 4 = 2048 bytes a block; at context
    # 64, m = 4 blocks: a slot is 5376 + 4 · 2048 = 13568 bytes; at 256, 16 blocks: 38144.
    for context, slot in ((64, 13568), (256, 38144)):
        model = tiny("hybrid-tiny", tok.vocab_size, torch.float32, context_length=context)
        state = recurrent_state_bytes(model.config)
        block = 16 * kv_cache_bytes_per_token(model.config)
        m = blocks_for(context, 16)
        assert (state, block, state + m * block) == (5376, 2048, slot)
        engine = Engine(model, tok, kv_cache_memory=3 * slot + slot - 1, max_queue=16)
        for prompt in prompts(7, tok.vocab_size):
            engine.submit(prompt, RequestParams(8, stop_at_eot=False), on_event=lambda e: None)
        engine.step()
        stats = engine.stats()
        assert (stats.running, stats.waiting) == (3, 4)  # ⌊(4 · slot − 1) / slot⌋ = 3
        assert (stats.state_slots_total, stats.kv_blocks_total) == (3, 3 * m)
        assert engine.runner.budget.sequences_at(context, 16) == 3


def test_prefix_caching_is_off_with_recurrent_layers_and_shared_prefixes_stay_exact(tok):
    model = tiny("hybrid-tiny", tok.vocab_size)
    engine = Engine(model, tok, block_size=4, prefix_caching=True)
    shared = random_ids(12, tok.vocab_size, seed=9)
    requests = [[*shared, 3], [*shared, 5, 6], shared]
    for prompt, got in zip(requests, run(engine, requests), strict=True):
        assert got == solo(model, prompt, 12)
    assert engine.stats().prefix_cache_hit_tokens == 0
    assert not engine.core.pool.prefix_caching


@pytest.mark.parametrize("preset", PRESETS)
def test_speculation_and_a_budget_without_one_slot_are_refused_in_one_line(tok, preset):
    model = tiny(preset, tok.vocab_size)
    with pytest.raises(DecoderLMError, match=r"^draft='prompt-lookup': speculative decoding is "):
        Engine(model, tok, draft="prompt-lookup")
    with pytest.raises(DecoderLMError, match=r"^kv_cache_memory=1000 holds no sequence slot: "):
        Engine(model, tok, kv_cache_memory=1000)


def test_the_http_server_serves_a_hybrid_completion_equal_to_generate(tok, tmp_path, start_server):
    model = tiny("hybrid-tiny", tok.vocab_size, torch.float32)
    save_model(tmp_path, model, tok)
    served = make_served(tmp_path, (model, tok), kv_cache_memory="1MiB")
    base = start_server(create_app(lambda: served, grace_s=0))
    body = {"prompt": "the cat sat", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    expected = solo(model, tok.encode("the cat sat"), 10)
    assert r.json()["choices"][0]["text"] == tok.decode(expected)
    stats = httpx.get(f"{base}/v1/engine_stats").json()
    assert stats["state_bytes_per_sequence"] == recurrent_state_bytes(model.config)
    assert stats["state_slots_total"] == served.engine.runner.budget.num_slots > 0
