"""The serving engine over recurrent layers (`decoderlm.engine.state_pool`): hybrid and pure Gated
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
from decoderlm.engine.engine import Engine
from decoderlm.engine.kv_pool import blocks_for
from decoderlm.engine.passes import Row
from decoderlm.engine.scheduler import Sequence
from decoderlm.engine.types import RequestParams, TokenEvent
from decoderlm.inference.sampling import SamplingParams
from decoderlm.model.cache import (
    CacheStep,
    kv_cache_bytes_per_token,
    make_cache,
    recurrent_state_bytes,
)
from decoderlm.server.app import create_app
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
    params = RequestParams(max_tokens, GREEDY, ignore_eos=True)
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
    assert stats.max_running_seen == 8 and stats.state_pages_used == 0
    assert stats.state_bytes_per_sequence == recurrent_state_bytes(model.config, dtype)


def test_mamba2_and_linear_attention_layers_serve_their_solo_tokens_beside_attention(tok):
    """A hybrid of all three recurrent kinds (linear attention keeps no conv state): float64."""
    torch.manual_seed(0)
    config = ModelConfig.from_preset(
        "hybrid-tiny",
        vocab_size=tok.vocab_size,
        context_length=64,
        d_model=32,
        d_ff=64,
        n_heads=4,
        n_layers=3,
        layer_types=("linear_attention", "attention", "mamba2"),
        recurrent_chunk=8,
        init_std=0.5,
    )
    model = DecoderLM(config).double().eval()
    engine = Engine(model, tok, kv_cache_memory="1MiB", prefill_chunk=8)
    requests = prompts(5, tok.vocab_size, seed=8)
    for prompt, got in zip(requests, run(engine, requests), strict=True):
        assert got == solo(model, prompt, 12)


def test_a_hybrid_with_an_int8_kv_pool_equals_its_solo_int8_generate(tok):
    """The states then live in the rows of int8 values and float32 scales; float64 model."""
    model = tiny("hybrid-tiny", tok.vocab_size)
    engine = Engine(model, tok, kv_cache_memory="1MiB", kv_cache_dtype="int8", prefill_chunk=8)
    requests = prompts(4, tok.vocab_size, seed=6)
    for prompt, got in zip(requests, run(engine, requests), strict=True):
        solo_int8 = generate(model, [prompt], 12, temperature=0, kv_cache_dtype="int8")[0]
        assert got == solo_int8[len(prompt) :]


@pytest.mark.parametrize("preset", PRESETS)
def test_a_prompt_prefilled_in_chunks_of_three_gives_the_tokens_of_one_chunk(tok, preset):
    model = tiny(preset, tok.vocab_size)
    prompt = random_ids(31, tok.vocab_size, seed=5)  # 11 chunks of 3
    chunked = Engine(model, tok, prefill_chunk=3)
    whole = Engine(model, tok, prefill_chunk=128)
    assert run(chunked, [prompt]) == run(whole, [prompt]) == [solo(model, prompt, 12)]


@pytest.mark.parametrize("preset", PRESETS)
def test_the_state_carried_across_prefill_chunks_equals_the_whole_prompts_state(tok, preset):
    """The engine's state after a prompt run in chunks of 5, 1 and 7 tokens, and read back from
    its pages, against the state `make_cache` holds after one forward pass over the whole prompt:
    float64, ≤ 1e-12."""
    model = tiny(preset, tok.vocab_size)
    prompt = random_ids(13, tok.vocab_size, seed=7)
    engine = Engine(model, tok, block_size=4)
    runner, pages = engine.runner, engine.core.scheduler.states
    seq = Sequence(list(prompt), len(prompt), 64, blocks=engine.core.pool.allocate((), 4)[0])
    seq.state_pages = pages.pool.allocate((), pages.per_sequence)[0]
    with runner.running():
        for n in (5, 1, 7):
            runner.forward([Row.of(seq, n)])
            seq.n_computed += n
        cache = make_cache(model.config, 1, 64, torch.float64)
        cache.seek(CacheStep.span(0, len(prompt), "cpu"))
        model(torch.tensor([prompt]), kv_caches=cache)
    runner.states.seek([seq.state_pages], torch.tensor([13]))  # unpacked from the pages again
    for i, state in runner.states.caches.items():
        torch.testing.assert_close(state.state, cache[i].state, rtol=0, atol=1e-12)
        torch.testing.assert_close(state.conv, cache[i].conv, rtol=0, atol=1e-12)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_preempted_sequence_frees_its_pages_and_recomputes_its_state_to_the_same_tokens(
    tok, preset
):
    model = tiny(preset, tok.vocab_size)
    engine = Engine(model, tok, prefill_chunk=8)
    requests = prompts(3, tok.vocab_size, seed=3)
    events: list[list[TokenEvent]] = [[] for _ in requests]
    params = RequestParams(12, GREEDY, ignore_eos=True)
    for prompt, sink in zip(requests, events, strict=True):
        engine.submit(prompt, params, on_event=sink.append)
    for _ in range(8):  # every prompt prefilled, a few tokens decoded
        engine.step()
    scheduler = engine.core.scheduler
    victim = scheduler.running[-1]
    free, used = scheduler.states.pool.num_free, engine.stats().state_pages_used
    scheduler._preempt(victim)  # as the scheduler does when the pool runs short
    per_sequence = scheduler.states.per_sequence
    assert victim.state_pages == [] and engine.stats().state_pages_used == used - per_sequence
    assert scheduler.states.pool.num_free >= free + per_sequence
    while engine.step():
        pass
    assert engine.stats().preemptions == 1
    for prompt, got in zip(requests, events, strict=True):
        assert [e.token_id for e in got if e.token_id is not None] == solo(model, prompt, 12)


def test_a_hybrid_pool_short_of_blocks_preempts_and_each_request_still_equals_its_solo_run(tok):
    # float64, block_size 4: b = 4 tokens · 2 · 2 heads · 8 · 8 bytes = 1024, s = 3 GDN layers ·
    # (4 · 8 · 8 + 64 · 3) · 8 = 10752, so a state takes 11 blocks; up to 41 tokens take 11 more.
    model = tiny("hybrid-tiny", tok.vocab_size)
    engine = Engine(model, tok, kv_cache_memory=50 * 1024, block_size=4, prefill_chunk=8)
    assert engine.runner.budget.state_pages == 11 and engine.runner.num_blocks == 50
    requests = prompts(6, tok.vocab_size, seed=4)
    for prompt, got in zip(requests, run(engine, requests), strict=True):
        assert got == solo(model, prompt, 12)
    assert engine.stats().preemptions > 0 and engine.stats().kv_blocks_used == 0


def test_a_hybrid_request_whose_blocks_and_state_cannot_fit_the_pool_is_refused_at_submit(tok):
    # float64, block_size 4: a state takes 11 blocks of 1024 bytes (as above), so of 20 blocks one
    # sequence's K/V may take 9, 36 tokens: 30 + 20 = 50 tokens would preempt itself forever.
    model = tiny("hybrid-tiny", tok.vocab_size)
    engine = Engine(model, tok, kv_cache_memory=20 * 1024, block_size=4)
    with pytest.raises(DecoderLMError, match=r"needs 13 KV blocks but kv_cache_memory holds 9"):
        engine.submit(random_ids(30, tok.vocab_size, 1), RequestParams(20), on_event=lambda e: None)
    prompt = random_ids(30, tok.vocab_size, 1)
    assert run(engine, [prompt], max_tokens=6) == [solo(model, prompt, 6)]  # 36 tokens fit


def test_a_state_lives_in_its_kv_blocks_and_they_are_zeroed_when_it_leaves(tok):
    """A hybrid's state pages are rows of the attention layer's K/V tensors: written while the
    sequence runs, zero after it (so a block handed out for K/V never holds a state's bytes)."""
    model = tiny("hybrid-tiny", tok.vocab_size, torch.bfloat16)
    engine = Engine(model, tok, kv_cache_memory="1MiB")
    layer = engine.runner.cache.layers[0]
    engine.submit(
        random_ids(20, tok.vocab_size, 2), RequestParams(6, GREEDY), on_event=lambda e: None
    )
    engine.step()
    pages = engine.core.scheduler.running[0].state_pages
    # bfloat16: 3 GDN layers · (a float32 state 4 · 8 · 8 · 4 + a conv 64 · 3 · 2) bytes in blocks
    # of 16 · 2 · 2 · 8 · 2 = 1024 bytes: ⌈4224 / 1024⌉ = 5 blocks.
    assert len(pages) == engine.runner.budget.state_pages == 5
    assert bool(layer.k[pages].any()) and bool(layer.v[pages].any())
    while engine.step():
        pass
    assert not layer.k[pages].any() and not layer.v[pages].any()


def test_a_pure_recurrent_model_admits_budget_over_state_bytes_at_any_context(tok):
    # recurrent-tiny at d_model 32, float32: 4 GDN layers, each a state of 4 heads · 8 · 8 and a
    # conv state of (2·2·8 + 4·8) channels · 3 taps: 4 · 4 · (256 + 192) = 7168 bytes.
    admitted = []
    for context in (64, 4096):
        model = tiny("recurrent-tiny", tok.vocab_size, torch.float32, context_length=context)
        state = recurrent_state_bytes(model.config)
        assert state == 4 * 4 * (4 * 8 * 8 + 64 * 3) == 7168
        assert kv_cache_bytes_per_token(model.config) == 0
        engine = Engine(model, tok, kv_cache_memory=5 * state + state // 2, max_queue=16)
        for prompt in prompts(9, tok.vocab_size):
            engine.submit(prompt, RequestParams(8, ignore_eos=True), on_event=lambda e: None)
        engine.step()
        stats = engine.stats()
        admitted.append((stats.running, stats.waiting, stats.state_pages_total))
        assert engine.runner.states.tensors[0].nbytes == 5 * state  # within the budget
    assert admitted == [(5, 4, 5), (5, 4, 5)]  # ⌊5.5 · s / s⌋ = 5, whatever the context


@pytest.mark.parametrize("prompt_tokens, admitted", [(20, 3), (5, 4)])
def test_a_hybrid_admits_as_many_sequences_as_their_blocks_and_states_take(
    tok, prompt_tokens, admitted
):
    # hybrid-tiny at d_model 32, float32: s = 3 GDN layers · 1792 = 5376 bytes; one attention
    # layer with 2 KV heads of 8: b = 16 tokens · 2 · 2 · 8 · 4 = 2048 bytes a block, so a state
    # takes ⌈5376 / 2048⌉ = 3 blocks. Of 17 blocks, a 20-token prompt (and its first new token)
    # takes 2 + 3: 3 sequences fit; a 5-token one 1 + 3: 4 fit.
    model = tiny("hybrid-tiny", tok.vocab_size, torch.float32)
    state, block = recurrent_state_bytes(model.config), 16 * kv_cache_bytes_per_token(model.config)
    assert (state, block) == (5376, 2048)
    engine = Engine(model, tok, kv_cache_memory=17 * block, max_queue=16)
    assert engine.runner.cache.nbytes == 17 * block  # the states live in these bytes
    for prompt in prompts(7, tok.vocab_size):
        prompt = (prompt * prompt_tokens)[:prompt_tokens]
        engine.submit(prompt, RequestParams(8, ignore_eos=True), on_event=lambda e: None)
    engine.step()
    stats = engine.stats()
    assert (stats.running, stats.waiting) == (admitted, 7 - admitted)
    assert stats.kv_blocks_used == admitted * (blocks_for(prompt_tokens + 1, 16) + 3)
    assert stats.state_pages_used == 3 * admitted
    assert engine.runner.budget.sequences_at(prompt_tokens + 1, 16) == admitted


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
def test_speculation_and_a_budget_without_one_sequence_are_refused_in_one_line(tok, preset):
    model = tiny(preset, tok.vocab_size)
    with pytest.raises(DecoderLMError, match=r"^draft='prompt-lookup': speculative decoding is "):
        Engine(model, tok, draft="prompt-lookup")
    draft = tiny(PRESETS[0], tok.vocab_size)
    with pytest.raises(DecoderLMError, match=r"^draft=a draft model: speculative decoding is "):
        Engine(model, tok, draft=draft)
    with pytest.raises(DecoderLMError, match=r"^kv_cache_memory=1000 holds no "):
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
    assert stats["state_pages_per_sequence"] == served.engine.runner.budget.state_pages > 0


def test_a_batch_reads_only_its_rows_own_blocks_so_a_state_page_never_reaches_attention(tok):
    """Block 0 held as a state page and filled with NaN: the rows of a decode batch whose block
    tables differ in length (gathered and masked, not attended in place) never read it."""
    model = tiny("hybrid-tiny", tok.vocab_size, torch.float32)
    engine = Engine(model, tok, block_size=4, cpu_kernels=False)
    assert engine.core.pool.allocate((), 1)[0] == [0]  # the first block, now nobody's K/V
    for buf in (engine.runner.cache.layers[0].k, engine.runner.cache.layers[0].v):
        buf[0] = float("nan")
    requests = [random_ids(3, tok.vocab_size, 11), random_ids(14, tok.vocab_size, 12)]
    for prompt, got in zip(requests, run(engine, requests), strict=True):
        assert got == solo(model, prompt, 12)
