"""Speculative decoding in the engine: prompt lookup or a draft model per running sequence, all
speculating sequences verified in one target pass; greedy requests give the tokens they give alone
without it, and the counts reach the stats and /metrics."""

from __future__ import annotations

import pytest
import torch

from decoderlm import DecoderLM, DecoderLMError, ModelConfig, generate
from decoderlm.cli import main
from decoderlm.engine.engine import Engine
from decoderlm.engine.types import RequestParams, TokenEvent
from decoderlm.inference.sampling import SamplingParams
from decoderlm.server.metrics import Metrics
from decoderlm.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,\n"
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train_char([ALPHABET])


@pytest.fixture(scope="module")
def model(tok) -> DecoderLM:
    return tiny_model(tok)


def tiny_model(tok: Tokenizer, seed: int = 0, **overrides) -> DecoderLM:
    torch.manual_seed(seed)
    shape = dict(
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        position="rope",
        init_std=0.5,
        context_length=128,
    )
    config = ModelConfig(
        **{**shape, **overrides},
        vocab_size=tok.vocab_size,
        mlp="swiglu",
        norm="rmsnorm",
        bias=False,
    )
    return DecoderLM(config).double().eval()


def prompts(model: DecoderLM) -> list[list[int]]:
    """Prompts of different lengths; two repeat the model's own greedy continuation, so that
    prompt lookup proposes what the model will say."""
    starts = [[3, 9, 4], [7, 1], [12, 5, 20, 8, 2], [0, 17]]
    grounded = [generate(model, [s], 30, temperature=0)[0] + s for s in starts[:2]]
    return [*grounded, *starts[2:]]


def run(engine: Engine, requests: list[list[int]], params: RequestParams) -> list[list[TokenEvent]]:
    """Submit one request per step; the events of each."""
    events: list[list[TokenEvent]] = [[] for _ in requests]
    for i, prompt in enumerate(requests):
        engine.submit(prompt, params, on_event=events[i].append)
        engine.step()
    while engine.step():
        pass
    return events


def token_ids(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


@pytest.mark.parametrize("block_size", [16, 4])
def test_greedy_requests_with_prompt_lookup_give_their_plain_tokens(tok, model, block_size):
    params = RequestParams(max_tokens=24, sampling=GREEDY, ignore_eos=True)
    engine = Engine(
        model, tok, block_size=block_size, draft="prompt-lookup", num_speculative_tokens=4
    )
    requests = prompts(model)
    events = run(engine, requests, params)
    for prompt, got in zip(requests, events, strict=True):
        # float64: the 5-token verification differs from one-token steps by rounding only.
        assert token_ids(got) == generate(model, [prompt], 24, temperature=0)[0][len(prompt) :]
        assert got[-1].finish_reason == "length"
    stats = engine.stats()
    assert stats.speculative_accepted > 0 and stats.speculative_verifications > 0
    assert 0 < stats.speculative_acceptance_rate <= 1
    assert stats.speculative_mean_accepted_length > 0
    assert stats.generated_tokens == 24 * len(requests) and stats.kv_blocks_used == 0
    body = Metrics(engine.stats).render()[0].decode()
    assert (
        f"decoderlm_speculative_accepted_tokens_total {float(stats.speculative_accepted)}" in body
    )
    assert "decoderlm_speculative_acceptance_rate" in body


def test_a_windowed_model_with_prompt_lookup_gives_its_plain_tokens(tok):
    """Windows of 6 tokens, blocks of 4: rejected drafts inside and past the window."""
    model = tiny_model(tok, sliding_window=6)
    params = RequestParams(max_tokens=24, sampling=GREEDY, ignore_eos=True)
    engine = Engine(model, tok, block_size=4, draft="prompt-lookup")
    requests = prompts(model)
    events = run(engine, requests, params)
    for prompt, got in zip(requests, events, strict=True):
        assert token_ids(got) == generate(model, [prompt], 24, temperature=0)[0][len(prompt) :]
    assert engine.stats().speculative_accepted > 0


def test_speculation_keeps_log_probabilities_and_stop_strings(tok, model):
    requests = prompts(model)[:2]
    text = tok.decode(generate(model, [requests[0]], 24, temperature=0)[0][len(requests[0]) :])
    stop = text[10:12]  # inside the continuation: the output ends before it
    params = RequestParams(
        max_tokens=24, sampling=GREEDY, ignore_eos=True, logprobs=2, stop=(stop,)
    )
    plain = run(Engine(model, tok), requests, params)
    fast = run(Engine(model, tok, draft="prompt-lookup"), requests, params)
    for a, b in zip(plain, fast, strict=True):
        assert token_ids(a) == token_ids(b)
        assert "".join(e.text for e in a) == "".join(e.text for e in b)
        assert a[-1].finish_reason == b[-1].finish_reason
        for x, y in zip(a, b, strict=True):
            assert (x.logprob is None) == (y.logprob is None)
            if x.logprob is not None:
                assert x.logprob == pytest.approx(y.logprob, abs=1e-9)


def test_sampled_requests_with_speculation_are_seeded(tok, model):
    params = RequestParams(max_tokens=20, sampling=SamplingParams(temperature=0.8), seed=4)
    requests = prompts(model)
    first = run(Engine(model, tok, draft="prompt-lookup"), requests, params)
    second = run(Engine(model, tok, draft="prompt-lookup"), requests, params)
    assert [token_ids(e) for e in first] == [token_ids(e) for e in second]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(draft="runs/small"), "must be 'prompt-lookup' or a DecoderLM"),
        (dict(num_speculative_tokens=3), "needs a draft"),
        (dict(draft="prompt-lookup", num_speculative_tokens=0), "must be an integer ≥ 1"),
    ],
)
def test_bad_speculation_options_are_one_line_errors(tok, model, kwargs, message):
    with pytest.raises(DecoderLMError, match=message):
        Engine(model, tok, **kwargs)


@pytest.mark.parametrize(
    "flags",
    [
        ["--num-speculative-tokens", "2"],
        ["--draft", "prompt-lookup", "--num-speculative-tokens", "0"],
    ],
)
def test_serve_refuses_bad_speculation_flags_before_loading(tmp_path, capsys, flags):
    assert main(["serve", "--checkpoint", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decoderlm: error: --num-speculative-tokens=") and err.count("\n") == 1


# A draft model in the batch (`engine.proposers.DraftModel`).


def other_shape_draft(tok: Tokenizer) -> DecoderLM:
    """A draft of another shape: 1 layer, d_model 16, MQA, learned positions."""
    return tiny_model(tok, 1, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, position="learned")


@pytest.mark.parametrize("block_size", [16, 4])
def test_greedy_requests_with_a_draft_model_give_their_plain_tokens(tok, model, block_size):
    params = RequestParams(max_tokens=24, sampling=GREEDY, ignore_eos=True)
    draft = other_shape_draft(tok)
    engine = Engine(model, tok, block_size=block_size, draft=draft, num_speculative_tokens=3)
    requests = prompts(model)
    events = run(engine, requests, params)
    for prompt, got in zip(requests, events, strict=True):
        # float64: the verification differs from one-token steps by rounding only.
        assert token_ids(got) == generate(model, [prompt], 24, temperature=0)[0][len(prompt) :]
    stats = engine.stats()
    assert stats.speculative_proposed > 0 and stats.speculative_verifications > 0
    assert stats.generated_tokens == 24 * len(requests) and stats.kv_blocks_used == 0
    assert not engine.core.proposer.held  # finished sequences are forgotten
    # Both pools in the default 256MiB: N blocks each, one kept for the padding, float64 K/V.
    per_token = 2 * 8 * (2 * 2 * 8 + 1 * 1 * 8)  # target: 2 layers, 2 K/V heads of 8; draft: 1, 1
    assert stats.kv_bytes_per_token == per_token
    assert stats.kv_blocks_total == 256 * 2**20 // (block_size * per_token) - 1


def test_a_draft_with_a_shorter_context_stops_proposing_at_its_end(tok, model):
    """Learned positions of 32: the draft proposes only while its drafts' positions fit."""
    draft = tiny_model(tok, 1, d_model=16, n_layers=1, position="learned", context_length=32)
    params = RequestParams(max_tokens=24, sampling=GREEDY, ignore_eos=True)
    engine = Engine(model, tok, block_size=4, draft=draft, num_speculative_tokens=4)
    requests = prompts(model)  # two of 36 and 34 tokens: past the draft's context at once
    events = run(engine, requests, params)
    for prompt, got in zip(requests, events, strict=True):
        assert token_ids(got) == generate(model, [prompt], 24, temperature=0)[0][len(prompt) :]
    assert engine.stats().speculative_proposed > 0


def test_preempted_sequences_with_a_draft_give_their_plain_tokens(tok, model):
    """A pool of 20 blocks for 4 sequences of up to 15: the newest are preempted and recomputed,
    and their draft K/V with them (a new block table starts the draft over). The draft is a copy
    of the target, so stale draft K/V would show as a rejected draft."""
    per_block = 4 * 2 * (2 * 2 * 2 * 8 * 8)  # 4 tokens of target and draft K/V, float64
    params = RequestParams(max_tokens=24, sampling=GREEDY, ignore_eos=True)
    engine = Engine(model, tok, block_size=4, kv_cache_memory=21 * per_block, draft=tiny_model(tok))
    requests = prompts(model)
    events = run(engine, requests, params)
    for prompt, got in zip(requests, events, strict=True):
        assert token_ids(got) == generate(model, [prompt], 24, temperature=0)[0][len(prompt) :]
    stats = engine.stats()
    assert stats.kv_blocks_total == 20 and stats.preemptions > 0
    assert stats.speculative_proposed > 0 and stats.speculative_acceptance_rate == 1.0


def test_the_drafts_kv_is_exact_after_rejections_and_preemptions(tok, model, monkeypatch):
    """At every proposal, the draft's logits after its catch-up on its own paged K/V (kept over
    accepted drafts, rolled back over rejected ones, started over after a preemption) equal a
    forward pass of the draft over the whole sequence: float64 models, whose logits the runner
    hands on in float32, so to float32's rounding (1e-6; stale K/V differs by ~0.1)."""
    from decoderlm.engine.proposers import DraftModel

    draft = tiny_model(tok)  # the target with noise on its head: accepted in part
    with torch.no_grad():
        draft.head.weight.add_(0.1 * torch.randn(draft.head.weight.shape, dtype=torch.float64))
    checked = []
    catch_up = DraftModel._catch_up

    def checked_catch_up(self, seqs):
        logits = catch_up(self, seqs)  # (B, V)
        for seq, row in zip(seqs, logits, strict=True):
            whole = draft(torch.tensor([seq.tokens]))[0, -1].float()  # (V,)
            checked.append(float((row - whole).abs().max()))
        return logits

    monkeypatch.setattr(DraftModel, "_catch_up", checked_catch_up)
    per_block = 4 * 2 * (2 * 2 * 2 * 8 * 8)  # 4 tokens of target and draft K/V, float64
    params = RequestParams(max_tokens=24, sampling=GREEDY, ignore_eos=True)
    engine = Engine(model, tok, block_size=4, kv_cache_memory=21 * per_block, draft=draft)
    run(engine, prompts(model), params)
    stats = engine.stats()
    assert stats.preemptions > 0 and 0 < stats.speculative_acceptance_rate < 1
    assert len(checked) > 20 and max(checked) < 1e-6


def test_the_target_as_its_own_draft_is_a_one_line_error(tok, model):
    with pytest.raises(DecoderLMError, match="the draft model is the target itself"):
        Engine(model, tok, draft=model)


def test_a_draft_with_recurrent_layers_is_a_one_line_error(tok, model):
    draft = tiny_model(tok, seed=1, layer_types=("gdn", "attention"))
    with pytest.raises(
        DecoderLMError, match=r"^the draft model has recurrent layers \(layer_types"
    ):
        Engine(model, tok, draft=draft)


def test_a_draft_equal_to_the_target_is_always_accepted(tok, model):
    """The draft's own KV (caught up, rolled back after rejections, or none: always accepted here)
    is exact: a copy of the target proposes the target's greedy tokens, every one accepted."""
    twin = tiny_model(tok)
    params = RequestParams(max_tokens=20, sampling=GREEDY, ignore_eos=True)
    engine = Engine(model, tok, block_size=4, draft=twin, num_speculative_tokens=4)
    requests = prompts(model)
    events = run(engine, requests, params)
    for prompt, got in zip(requests, events, strict=True):
        assert token_ids(got) == generate(model, [prompt], 20, temperature=0)[0][len(prompt) :]
    stats = engine.stats()
    assert stats.speculative_proposed >= 20 and stats.speculative_acceptance_rate == 1.0


def test_under_concurrency_a_greedy_request_with_a_draft_equals_its_output_alone(tok, model):
    draft = other_shape_draft(tok)
    greedy = RequestParams(max_tokens=20, sampling=GREEDY, ignore_eos=True)
    sampled = RequestParams(
        max_tokens=20, sampling=SamplingParams(temperature=1.0), seed=3, ignore_eos=True
    )
    requests = prompts(model)
    engine = Engine(model, tok, block_size=4, draft=draft, num_speculative_tokens=3)
    alone = token_ids(run(Engine(model, tok, block_size=4), requests[2:3], greedy)[0])
    events: list[list[TokenEvent]] = [[] for _ in requests]
    for i, prompt in enumerate(requests):
        engine.submit(prompt, greedy if i == 2 else sampled, on_event=events[i].append)
    while engine.step():
        pass
    assert token_ids(events[2]) == alone
    assert all(len(token_ids(e)) == 20 for e in events)


def test_sampled_requests_with_a_draft_model_are_seeded(tok, model):
    params = RequestParams(max_tokens=16, sampling=SamplingParams(temperature=0.8), seed=4)
    requests = prompts(model)
    runs = [
        run(Engine(model, tok, draft=other_shape_draft(tok)), requests, params) for _ in range(2)
    ]
    assert [token_ids(e) for e in runs[0]] == [token_ids(e) for e in runs[1]]


def test_sampling_with_a_draft_equal_to_the_target_accepts_every_draft(tok, model):
    """Rejection sampling accepts d with probability min(1, p(d)/q(d)): with q the draft's
    distribution at d's position and the draft a copy of the target, q = p (to float64 rounding),
    so every draft is accepted; a q at the wrong position, or one-hot q, would reject some."""
    params = RequestParams(
        max_tokens=20, sampling=SamplingParams(temperature=0.8), seed=7, ignore_eos=True
    )
    engine = Engine(model, tok, block_size=4, draft=tiny_model(tok), num_speculative_tokens=3)
    run(engine, prompts(model), params)
    stats = engine.stats()
    assert stats.speculative_proposed >= 20 and stats.speculative_acceptance_rate == 1.0


def test_a_draft_with_another_vocabulary_is_a_one_line_error(tok, model):
    other = tiny_model(Tokenizer.train_char(["abc"]))
    with pytest.raises(DecoderLMError, match=r"vocab_size=\d+ differs from the target's"):
        Engine(model, tok, draft=other)


@pytest.mark.parametrize(
    ("dtype", "window", "atol"),
    [
        (torch.float64, 5, 1e-10),  # padded: a windowed layer and a full one, SDPA
        (torch.float64, None, 1e-10),  # padded
        (torch.float32, None, 1e-4),  # packed: attention in place, other linear shapes
    ],
)
def test_batched_verification_equals_each_sequences_own_pass(tok, dtype, window, atol):
    """`ModelRunner.forward_tokens` over rows of different starts and lengths gives each row the logits
    of its own pass, packed or padded; padding writes go nowhere a row reads."""
    from decoderlm.engine.kv_pool import BlockPool
    from decoderlm.engine.passes import Row
    from decoderlm.engine.runner import ModelRunner
    from decoderlm.engine.scheduler import Sequence

    layers = None if window is None else (0,)
    model = tiny_model(tok, sliding_window=window, sliding_window_layers=layers).to(dtype)
    runner = ModelRunner(
        model,
        kv_cache_memory=2**20,
        block_size=4,
        kv_cache_dtype=None,
        cpu_kernels=True,
        ragged=True,
    )
    assert runner.cache.packable == (dtype == torch.float32)
    pool = BlockPool(runner.pool_blocks, 4)
    lengths, drafts = [3, 9, 6], [[1, 2], [5, 6, 7, 8], []]  # rows of 3, 5 and 1 tokens
    seqs = []
    with runner.running():
        for i, (n, d) in enumerate(zip(lengths, drafts, strict=True)):
            tokens = [(7 * i + j) % tok.vocab_size for j in range(n)]
            seq = Sequence(tokens, n, 64, pool.allocate([], 4)[0])
            runner.forward([Row.of(seq, n - 1)])  # all but the last token computed
            seq.n_computed = n - 1
            seq.tokens += d
            seqs.append(seq)
        rows = [Row(s.blocks, s.n_computed, s.tokens[s.n_computed :]) for s in seqs]
        batched = runner.forward_tokens(rows)  # (n_b, V) each
        for seq, got in zip(seqs, batched, strict=True):
            n = len(seq.tokens) - seq.n_computed
            alone = runner.forward_tokens([Row.of(seq, n)])[0]  # (n, V)
            assert got.shape == alone.shape
            assert torch.allclose(got, alone, rtol=0, atol=atol)


def test_serve_refuses_a_missing_draft_directory_before_loading(tmp_path, capsys):
    missing = tmp_path / "no-draft"
    assert main(["serve", "--checkpoint", str(tmp_path), "--draft", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"decoderlm: error: --draft {missing}: no such directory")
    assert err.count("\n") == 1


def test_a_draft_directory_with_another_tokenizer_is_a_one_line_error(tok, model, tmp_path):
    """Same vocab_size, another token ↔ id map: `load_draft` (what `serve --draft RUN` calls)
    refuses it; the same tokenizer loads."""
    from decoderlm.checkpoint import save_model
    from decoderlm.loading import load_draft

    shuffled = Tokenizer.train_char([ALPHABET.replace("z", "Z")])
    assert shuffled.vocab_size == tok.vocab_size
    for name, tokenizer in (("same", tok), ("other", shuffled)):
        save_model(tmp_path / name, other_shape_draft(tok).float(), tokenizer)
    assert load_draft(tmp_path / "same", model, tok).config.d_model == 16
    with pytest.raises(DecoderLMError, match="its tokenizer differs from the target's") as err:
        load_draft(tmp_path / "other", model, tok)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("window", [None, 6])
def test_float32_greedy_requests_with_speculation_give_the_plain_engines_tokens(tok, window):
    """float32 with the CPU kernels: speculating rows and plain ones packed in one pass, attended
    in place (`PagedKVCache.seek_packed`), or with a windowed layer padded, the full layer still
    attending in place; the tokens equal the plain engine's."""
    layers = None if window is None else (0,)
    model = tiny_model(tok, sliding_window=window, sliding_window_layers=layers).float()
    params = RequestParams(max_tokens=24, sampling=GREEDY, ignore_eos=True)
    requests = prompts(model)
    plain = run(Engine(model, tok, block_size=4), requests, params)
    for draft in ("prompt-lookup", other_shape_draft(tok).float()):
        engine = Engine(model, tok, block_size=4, draft=draft, num_speculative_tokens=3)
        assert engine.runner.cache.packable == (window is None)
        fast = run(engine, requests, params)
        assert [token_ids(e) for e in fast] == [token_ids(e) for e in plain]
        assert engine.stats().speculative_verifications > 0


def test_a_served_checkpoint_with_a_draft_directory_gives_its_plain_tokens(run_dir):
    """What `serve --draft RUN` builds (`engine_process.build_engine`): the draft loaded from its
    directory (here the target's own run), greedy tokens the plain engine's."""
    from decoderlm.engine.engine_process import EngineSpec, build_engine

    params = RequestParams(max_tokens=12, sampling=GREEDY, ignore_eos=True)
    plain = build_engine(EngineSpec(str(run_dir), "float32"))
    fast = build_engine(EngineSpec(str(run_dir), "float32", {"draft": str(run_dir)}))
    assert isinstance(fast.core.proposer.runner.model, DecoderLM)
    prompts = ["Hello there", "abc"]
    assert [c.token_ids for c in fast.generate(prompts, params)] == [
        c.token_ids for c in plain.generate(prompts, params)
    ]
    assert fast.stats().speculative_acceptance_rate == 1.0


def test_int8_kv_with_a_draft_model_gives_the_plain_int8_engines_tokens(tok, model):
    params = RequestParams(max_tokens=20, sampling=GREEDY, ignore_eos=True)
    requests = prompts(model)
    plain = run(Engine(model, tok, block_size=4, kv_cache_dtype="int8"), requests, params)
    engine = Engine(model, tok, block_size=4, kv_cache_dtype="int8", draft=other_shape_draft(tok))
    fast = run(engine, requests, params)
    assert [token_ids(e) for e in fast] == [token_ids(e) for e in plain]
    assert engine.stats().speculative_proposed > 0


def counted_rows(runner) -> list[int]:
    """Wraps `runner`'s compiled pass; the list returned gets the rows of each of its calls."""
    rows, step = [], runner.step
    runner.step = lambda token, *rest: rows.append(len(token)) or step(token, *rest)
    runner.step.max_batch = step.max_batch
    return rows


def test_a_compiled_verification_gives_each_token_the_bits_of_its_plain_decode_pass(tok):
    """bfloat16, batch-invariant, compiled: greedy requests speculating by prompt lookup give the
    plain engine's tokens and log probabilities bit for bit, a verification run by the compiled
    pass in one call, a row per token (each token's logits those its own decode pass gives)."""
    requests = prompts(tiny_model(tok))  # grounded in the float64 model's greedy continuations
    model = tiny_model(tok).bfloat16()
    params = RequestParams(max_tokens=24, sampling=GREEDY, ignore_eos=True, logprobs=1)
    options = dict(block_size=4, compile=True, batch_invariant=True)
    plain = Engine(model, tok, **options)
    if plain.runner.step is None:
        pytest.skip("no C++ compiler for the ops of the compiled pass")
    engine = Engine(model, tok, **options, draft="prompt-lookup", num_speculative_tokens=3)
    rows = counted_rows(engine.runner)
    fast, slow = run(engine, requests, params), run(plain, requests, params)
    assert [token_ids(e) for e in fast] == [token_ids(e) for e in slow]
    assert [[e.logprob for e in f] for f in fast] == [[e.logprob for e in s] for s in slow]
    assert engine.stats().speculative_accepted > 0
    # a verification: a row per sequence and per draft, in one call of the library
    assert max(rows) > len(requests)


def test_a_compiled_verification_past_a_chunk_of_keys_gives_each_token_its_decode_bits(tok):
    """Rows of ~300 keys (attended in chunks of 256), batch-invariant and compiled: a verification
    pass of rows of 4, 2 and 1 tokens gives each token the logits of its own one-token pass."""
    from decoderlm.engine.kv_pool import BlockPool
    from decoderlm.engine.passes import Row
    from decoderlm.engine.runner import ModelRunner

    model = tiny_model(tok, context_length=512).bfloat16()
    runner = ModelRunner(
        model,
        kv_cache_memory=2**22,
        block_size=16,
        kv_cache_dtype=None,
        cpu_kernels=True,
        compile=True,
        ragged=True,
        batch_invariant=True,
    )
    if runner.step is None:
        pytest.skip("no C++ compiler for the ops of the compiled pass")
    calls = counted_rows(runner)
    pool = BlockPool(runner.pool_blocks, 16)
    g = torch.Generator().manual_seed(0)
    rows = []
    with runner.running():
        for n, k in ((300, 3), (280, 1), (290, 0)):  # computed tokens, drafts
            tokens = torch.randint(0, tok.vocab_size, (n + 1 + k,), generator=g).tolist()
            blocks = pool.allocate([], -(-(n + 1 + k) // 16))[0]
            runner.forward([Row(blocks, 0, tokens[:5])])  # the prompt, eagerly: a short chunk
            runner.forward([Row(blocks, 5, tokens[5:n])])  # (last logits only) then a long one
            rows.append(Row(blocks, n, tokens[n:]))
        together = runner.forward_tokens(rows)  # (n_b, V) each
        assert calls == [7]  # one pass of the library, a row per token; no prompt chunk
        for row, logits in zip(rows, together, strict=True):
            for t, token in enumerate(row.tokens):
                alone = runner.forward([Row(row.blocks, row.start + t, [token])])[0]  # (V,)
                assert torch.equal(logits[t], alone)
