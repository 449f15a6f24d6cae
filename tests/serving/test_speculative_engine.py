"""Speculative decoding in the engine: prompt lookup per running sequence, verified in a pass of its
own; greedy requests give the tokens they give alone without it, and the counts reach the stats and
/metrics."""

from __future__ import annotations

import pytest
import torch

from decoderlm import DecoderLM, DecoderLMError, ModelConfig, generate
from decoderlm.cli import main
from decoderlm.inference.sampling import SamplingParams
from decoderlm.serving.engine import Engine
from decoderlm.serving.metrics import Metrics
from decoderlm.serving.types import RequestParams, TokenEvent
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


def tiny_model(tok: Tokenizer, **overrides) -> DecoderLM:
    torch.manual_seed(0)
    config = ModelConfig(
        **overrides,
        vocab_size=tok.vocab_size,
        context_length=128,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        mlp="swiglu",
        norm="rmsnorm",
        position="rope",
        bias=False,
        init_std=0.5,
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
    params = RequestParams(max_tokens=24, sampling=GREEDY, stop_at_eot=False)
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
    params = RequestParams(max_tokens=24, sampling=GREEDY, stop_at_eot=False)
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
        max_tokens=24, sampling=GREEDY, stop_at_eot=False, logprobs=2, stop=(stop,)
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
        (dict(draft="runs/small"), "'prompt-lookup' only"),
        (dict(num_speculative_tokens=3), "needs draft='prompt-lookup'"),
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
