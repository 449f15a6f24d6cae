"""`best_of` and `use_beam_search` on /v1/completions and /v1/chat/completions (server/ranked.py):
best_of keeps the candidates of the highest mean log-probability and bills them all; beam search
through the server equals `decoderlm.search`'s beam search and exhaustive search on a three-token
vocabulary, for each length_penalty as vLLM defines it, and its logprobs are the float64 model's;
both give the same answer alone and in a crowd, with the engine in a thread or a process, and
finish within a drain's grace period; chat's equal completions' over the rendered prompt; bad
combinations are 400s naming the field."""

from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from conftest import CONTEXT, live_server, make_served, paced, until, wait_healthy
from decoderlm import DecoderLM, ModelConfig
from decoderlm.checkpoint import save_model
from decoderlm.engine.engine import Engine
from decoderlm.search.lm import EngineLM
from decoderlm.search.strategies import beam_search
from decoderlm.server.app import create_app, drain
from decoderlm.tokenizer import Tokenizer

BOTH = pytest.mark.parametrize("server", ["thread", "process"], indirect=True)  # engine placement
# The engine's log-probabilities come from float32 logits (engine/runner.py), a float64 model's
# too: against the float64 reference they agree to float32's rounding (~6e-8 relative).
LOGPROB_TOL = 1e-6
SCORE_TOL = 1e-4  # a ranking gap well above that rounding


def post(base: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


def mean_logprob(logprobs: list[float]) -> float:
    return sum(logprobs) / len(logprobs)


@BOTH
def test_best_of_returns_the_n_candidates_of_highest_mean_logprob_and_bills_them_all(server):
    base, _ = server
    body = {"prompt": ["Once", "ab"], "max_tokens": 8, "temperature": 1.0, "seed": 7}
    best = post(base, body | {"n": 2, "best_of": 6, "logprobs": 1}).json()
    every = post(base, body | {"n": 6, "logprobs": 1}).json()  # the same 6 candidates a prompt
    assert len(best["choices"]) == 4 and [c["index"] for c in best["choices"]] == [0, 1, 2, 3]
    for p in range(2):
        candidates = every["choices"][6 * p : 6 * p + 6]
        scores = [mean_logprob(c["logprobs"]["token_logprobs"]) for c in candidates]
        assert len(set(scores)) == 6  # no ties: the ranking below is the only one
        ranked = sorted(zip(scores, candidates, strict=True), key=lambda sc: -sc[0])
        for mine, (_, theirs) in zip(best["choices"][2 * p : 2 * p + 2], ranked, strict=False):
            assert (mine["text"], mine["logprobs"]) == (theirs["text"], theirs["logprobs"])
            assert mine["finish_reason"] == theirs["finish_reason"]
    assert best["usage"] == every["usage"]  # every candidate's tokens, not only those returned
    assert best["usage"]["completion_tokens"] == sum(
        len(c["logprobs"]["tokens"]) for c in every["choices"]
    )


def test_best_of_equal_to_n_is_a_plain_request_that_may_stream(server):
    base, _ = server
    body = {"prompt": "ab", "max_tokens": 5, "n": 2, "seed": 3}
    assert post(base, body | {"best_of": 2}).json()["choices"] == post(base, body).json()["choices"]
    assert post(base, body | {"best_of": 2, "stream": True}).status_code == 200


def python_beams(loaded, prompt, width: int, max_tokens: int, alpha: float, stop=()):
    """`decoderlm.search`'s beam search on an engine of its own, L counted as vLLM counts it:
    its candidates, best first. `prompt`: text or ids."""
    model, tokenizer = loaded
    lm = EngineLM(Engine(model, tokenizer, kv_cache_memory="1MiB"))
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    result = beam_search(lm, ids, 10_000, width=width, max_tokens=max_tokens, alpha=alpha,
                         length="sequence", stop=stop, extract=str)  # fmt: skip
    return sorted(result.candidates, key=lambda c: c.score, reverse=True), result.tokens


@BOTH
def test_beam_search_through_the_server_equals_decoderlm_search_beam(server, loaded):
    base, _ = server
    body = {"prompt": "Once", "max_tokens": 7, "n": 3, "use_beam_search": True,
            "length_penalty": 0.5, "stop": ["e"]}  # fmt: skip
    r = post(base, body).json()
    beams, tokens = python_beams(loaded, "Once", 3, 7, 0.5, stop=("e",))
    got = [(c["text"], c["finish_reason"]) for c in r["choices"]]
    assert got == [(c.text, c.finish) for c in beams[:3]]
    assert r["usage"] == {"prompt_tokens": 4, "completion_tokens": tokens,
                          "total_tokens": 4 + tokens}  # fmt: skip
    wider = post(base, body | {"best_of": 5}).json()  # best_of is the width; n beams return
    assert [c["text"] for c in wider["choices"]] == [
        c.text for c in python_beams(loaded, "Once", 5, 7, 0.5, stop=("e",))[0][:3]
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A server of a random float64 model over a three-token vocabulary (a, b, end-of-text), the
    model (the exhaustive reference) and its tokenizer."""
    torch.manual_seed(3)
    tokenizer = Tokenizer.train_char(["ab"])
    config = ModelConfig(vocab_size=tokenizer.vocab_size, context_length=16, d_model=16,
                         n_layers=1, n_heads=2)  # fmt: skip
    model = DecoderLM(config).double().eval()
    for p in model.parameters():  # a peaked distribution: scores far apart
        p.data.mul_(4)
    run = tmp_path_factory.mktemp("tiny")
    save_model(run, model, tokenizer)
    served = make_served(run, (model, tokenizer), kv_cache_memory="1MiB")
    with live_server(create_app(lambda: served, grace_s=1.0)) as base:
        wait_healthy(base)
        yield base, model, tokenizer


def exhaustive(model, tokenizer, prompt: list[int], max_len: int, alpha: float):
    """Every sequence of at most max_len tokens that ends at end-of-text or has max_len tokens,
    scored by the float64 model as vLLM's get_beam_search_score: logprob / L^alpha, L = prompt +
    generated tokens, less one if the last is end-of-text; best first: [(score, text, finish)]."""
    eot, out = tokenizer.eot_id, []

    @torch.no_grad()
    def next_logprobs(ids: tuple[int, ...]) -> torch.Tensor:
        logits = model(torch.tensor([prompt + list(ids)]))[0, -1]  # (vocab,)
        return torch.log_softmax(logits, -1)

    for length in range(1, max_len + 1):
        for seq in itertools.product(range(tokenizer.vocab_size), repeat=length):
            if eot in seq[:-1] or (seq[-1] != eot and length < max_len):
                continue
            logprob = sum(next_logprobs(seq[:i])[t].item() for i, t in enumerate(seq))
            text = tokenizer.decode([t for t in seq if t != eot])
            counted = len(prompt) + length - (seq[-1] == eot)
            out.append((logprob / counted**alpha, text, "stop" if seq[-1] == eot else "length"))
    return sorted(out, reverse=True)


@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0])
def test_beam_search_equals_exhaustive_search_on_a_three_token_vocabulary(tiny, alpha):
    """Width 16 keeps every prefix of up to 3 tokens (at most 2³ = 8 without end-of-text), and of
    4 tokens the 16 likeliest, so its 5 best beams of at most 4 tokens are the 5 best of all."""
    base, reference, tokenizer = tiny
    body = {"prompt": "ab", "max_tokens": 4, "n": 5, "best_of": 16, "use_beam_search": True,
            "length_penalty": alpha}  # fmt: skip
    r = post(base, body).json()
    best = exhaustive(reference, tokenizer, tokenizer.encode("ab"), 4, alpha)[:5]
    assert [(c["text"], c["finish_reason"]) for c in r["choices"]] == [(t, f) for _, t, f in best]
    assert best[0][0] - best[1][0] > SCORE_TOL  # the best is no near-tie


def test_length_penalty_changes_the_ranking_as_its_formula_says(tiny):
    """Scores logprob / L^alpha: alpha 0 ranks by total log-probability (short sequences win), a
    large alpha by the per-token log-probability of longer ones."""
    base, reference, tokenizer = tiny
    firsts = {}
    for alpha in (0.0, 3.0):
        body = {"prompt": "ab", "max_tokens": 4, "n": 1, "best_of": 16, "use_beam_search": True,
                "length_penalty": alpha}  # fmt: skip
        choice = post(base, body).json()["choices"][0]
        firsts[alpha] = choice["text"], choice["finish_reason"]
        best = exhaustive(reference, tokenizer, tokenizer.encode("ab"), 4, alpha)[0]
        assert firsts[alpha] == best[1:]
    assert firsts[0.0] != firsts[3.0]


@BOTH
def test_best_of_and_beam_in_a_crowd_equal_their_results_alone(server):
    base, _ = server
    ranked = [
        {"prompt": "Once", "max_tokens": 10, "n": 2, "best_of": 5, "seed": 11},
        {"prompt": "ab", "max_tokens": 9, "n": 3, "use_beam_search": True},
    ]
    crowd = [{"prompt": p, "max_tokens": 30, "temperature": t, "seed": s}
             for p, t, s in itertools.product(["x", "The", "12"], [0.0, 1.0], [1, 2])]  # fmt: skip
    alone = [post(base, b).json()["choices"] for b in ranked]

    async def together():
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            replies = await asyncio.gather(
                *(http.post("/v1/completions", json=b) for b in crowd + ranked + crowd)
            )
        return [r.json()["choices"] for r in replies]

    replies = asyncio.run(together())
    assert replies[len(crowd) : len(crowd) + 2] == alone


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
        ({"best_of": 0}, "best_of"),
        ({"best_of": 17}, "best_of"),
        ({"use_beam_search": True, "stream": True}, "use_beam_search"),
        ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
        ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
        ({"use_beam_search": True, "ignore_eos": True}, "ignore_eos"),
        ({"use_beam_search": True, "response_format": {"type": "json_object"}}, "response_format"),
        ({"use_beam_search": True, "length_penalty": "long"}, "length_penalty"),
        ({"use_beam_search": True, "length_penalty": 1000}, "length_penalty"),
    ],
)
def test_bad_best_of_and_beam_requests_are_400s_naming_the_field(server, extra, param):
    base, _ = server
    r = post(base, {"prompt": "ab", "max_tokens": 3} | extra)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]
    assert post(base, {"prompt": "ab", "max_tokens": 3}).status_code == 200  # still serving


def test_the_openai_client_sends_best_of_and_beam_search(server):
    import openai

    base, _ = server
    api = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    best = api.completions.create(model=None, prompt="ab", max_tokens=4, n=1, best_of=3, seed=5)
    every = api.completions.create(model=None, prompt="ab", max_tokens=4, n=3, seed=5)
    assert len(best.choices) == 1 and best.choices[0].text in {c.text for c in every.choices}
    assert best.usage == every.usage  # three candidates billed
    beams = api.completions.create(model=None, prompt="ab", max_tokens=4, n=2, temperature=0,
                                   extra_body={"use_beam_search": True})  # fmt: skip
    assert len(beams.choices) == 2 and beams.choices[0].text != beams.choices[1].text
    echoed = api.completions.create(model=None, prompt="ab", max_tokens=4, n=2, echo=True,
                                    extra_body={"use_beam_search": True})  # fmt: skip
    assert [c.text for c in echoed.choices] == ["ab" + c.text for c in beams.choices]


def test_a_drain_lets_beam_and_best_of_requests_finish_within_the_grace_period(
    run_dir, loaded, start_server, monkeypatch
):
    """What SIGTERM does (`decoderlm serve` calls `drain`): a beam search (whose engine requests
    the search submits, step by step) and a best_of request in flight end with their answers
    alone; a new request gets 503."""
    served = make_served(run_dir, loaded, kv_cache_memory="1MiB")
    app = create_app(lambda: served, grace_s=0)
    base = start_server(app)
    wait_healthy(base)
    ranked = [{"prompt": "Once", "max_tokens": 12, "n": 2, "use_beam_search": True},
              {"prompt": "ab", "max_tokens": 12, "n": 1, "best_of": 3, "seed": 5}]  # fmt: skip
    alone = [post(base, body).json()["choices"] for body in ranked]
    monkeypatch.setattr(served.engine, "step", paced(served.engine.step, 0.02))
    with ThreadPoolExecutor(2) as pool:
        replies = [pool.submit(post, base, body) for body in ranked]
        until(lambda: len(app.state.server.inflight) == 2)  # both under way
        drain(app, 30.0)
        refused = post(base, {"prompt": "B"})
        answers = [r.result() for r in replies]
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
    assert [r.status_code for r in answers] == [200, 200]
    assert [r.json()["choices"] for r in answers] == alone


def test_a_drain_ends_a_beam_search_still_running_when_the_grace_period_ends(
    run_dir, loaded, start_server, monkeypatch
):
    """A search that cannot finish within the grace period is cancelled there, like a stream: its
    engine requests are cancelled, it submits no more, and the client gets 503 at once."""
    served = make_served(run_dir, loaded, kv_cache_memory="1MiB")
    monkeypatch.setattr(served.engine, "step", paced(served.engine.step, 0.02))
    app = create_app(lambda: served, grace_s=0)
    base = start_server(app)
    wait_healthy(base)
    body = {"prompt": "A", "max_tokens": CONTEXT - 2, "n": 2, "use_beam_search": True}
    grace_s = 0.3  # ~90 steps of ≥ 2 paced engine steps: ≥ 3.6 s
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(post, base, body)
        until(lambda: served.engine.stats().running > 0)  # the search's first step
        start = time.monotonic()
        drain(app, grace_s)
        r = reply.result()
        elapsed = time.monotonic() - start
    seen = f"{r.status_code} after {elapsed:.2f} s: {r.text[:300]}"
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], seen
    assert grace_s <= elapsed < grace_s + 1.0, seen
    generated = served.engine.stats().generated_tokens
    time.sleep(0.2)  # no step of the search comes after its answer
    assert served.engine.stats().running == 0
    assert served.engine.stats().generated_tokens == generated


def test_beam_logprobs_are_the_float64_models_and_sum_to_the_beams_logprob(tiny):
    """Each returned token's logprob is log_softmax of a plain float64 forward at that token, its
    top tokens the forward's top-k (LOGPROB_TOL); with length_penalty 0 a beam's score is its
    log-probability, which the logprobs sum to (1e-12: the same numbers). k above the width (3 >
    2) leaves the beams as they are without logprobs."""
    base, model, tokenizer = tiny
    ids_of = {tokenizer.decode([i]): i for i in range(tokenizer.vocab_size)}
    prompt = tokenizer.encode("ab")
    body = {"prompt": "ab", "max_tokens": 4, "n": 2, "best_of": 2, "use_beam_search": True,
            "length_penalty": 0.0}  # fmt: skip
    plain = post(base, body).json()["choices"]
    beams, _ = python_beams((model, tokenizer), prompt, 2, 4, 0.0)
    for k in (0, 1, 3):
        choices = post(base, body | {"logprobs": k}).json()["choices"]
        assert [c["text"] for c in choices] == [c["text"] for c in plain]
        for choice, beam in zip(choices, beams, strict=False):
            got = choice["logprobs"]
            ids = [ids_of[t] for t in got["tokens"]]
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([prompt + ids]))[0], -1)  # (T, V)
            rows = lp[len(prompt) - 1 : -1]  # row t: log p(· | prompt, ids < t)
            assert got["token_logprobs"] == pytest.approx(
                [rows[t, i].item() for t, i in enumerate(ids)], abs=LOGPROB_TOL
            )
            assert sum(got["token_logprobs"]) == pytest.approx(beam.score, abs=1e-12)
            for row, top in zip(rows, got["top_logprobs"], strict=True):
                best = torch.topk(row, k)
                pairs = zip(best.indices.tolist(), best.values.tolist(), strict=True)
                expected = {tokenizer.decode([i]): v for i, v in pairs}
                assert top == pytest.approx(expected, abs=LOGPROB_TOL)
            assert "".join(got["tokens"]).replace("<|endoftext|>", "") == choice["text"]
    echoed = post(base, body | {"logprobs": 1, "echo": True}).json()["choices"]
    alone = post(base, body | {"logprobs": 1}).json()["choices"]
    for mine, theirs in zip(echoed, alone, strict=True):  # the prompt's 2 tokens, then the beam's
        assert mine["text"] == "ab" + theirs["text"]
        assert mine["logprobs"]["token_logprobs"][2:] == theirs["logprobs"]["token_logprobs"]
        assert mine["logprobs"]["token_logprobs"][0] is None


def chat(base: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)


MESSAGES = [{"role": "user", "content": "Once"}]


def test_chat_beam_search_equals_completions_beam_over_the_rendered_prompt(server, loaded):
    """The chat template's prompt, searched by /v1/completions with the template's stop string,
    gives the same beams, logprobs and usage as /v1/chat/completions."""
    base, served = server
    ids = httpx.post(f"{base}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    beam = {"max_tokens": 8, "n": 2, "best_of": 3, "use_beam_search": True, "length_penalty": 0.5}
    got = chat(base, beam | {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2}).json()
    stop = list(served.chat_template.stop)
    want = post(base, beam | {"prompt": ids, "stop": stop, "logprobs": 2}).json()
    assert [c["message"]["content"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
    assert [c["finish_reason"] for c in got["choices"]] == [
        c["finish_reason"] for c in want["choices"]
    ]
    # The logprobs to float32's rounding: a beam step's prefixes are submitted one by one while
    # the engine steps, so which of them share a prefill pass (and its matmul shapes) depends on
    # the threads' timing.
    for mine, theirs in zip(got["choices"], want["choices"], strict=True):
        content = mine["logprobs"]["content"]
        assert [t["logprob"] for t in content] == pytest.approx(
            theirs["logprobs"]["token_logprobs"], abs=LOGPROB_TOL
        )
        tops = [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in content]
        for top, their_top in zip(tops, theirs["logprobs"]["top_logprobs"], strict=True):
            assert top == pytest.approx(their_top, abs=LOGPROB_TOL)
    assert got["usage"] == want["usage"] and got["object"] == "chat.completion"
    python = python_beams(loaded, ids, 3, 8, 0.5, stop=tuple(stop))[0]
    assert [c["message"]["content"] for c in got["choices"]] == [c.text for c in python[:2]]


def test_chat_best_of_returns_the_top_n_of_the_seeded_chat_candidates(server):
    base, _ = server
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 1.0, "seed": 3}
    best = chat(base, body | {"n": 2, "best_of": 5, "logprobs": True}).json()
    every = chat(base, body | {"n": 5, "logprobs": True}).json()["choices"]
    scores = [mean_logprob([t["logprob"] for t in c["logprobs"]["content"]]) for c in every]
    assert len(set(scores)) == 5  # no ties: the ranking below is the only one
    ranked = [c for _, c in sorted(zip(scores, every, strict=True), key=lambda sc: -sc[0])]
    assert [(c["message"], c["logprobs"]) for c in best["choices"]] == [
        (c["message"], c["logprobs"]) for c in ranked[:2]
    ]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert best["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in every)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 2, "stream": True}, "best_of"),
        ({"use_beam_search": True, "stream": True}, "use_beam_search"),
        ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
        ({"use_beam_search": True, "top_k": 2}, "top_k"),
        ({"use_beam_search": True, "guided_regex": "a+"}, "guided_regex"),
    ],
)
def test_bad_chat_best_of_and_beam_requests_are_400s_naming_the_field(server, extra, param):
    base, _ = server
    r = chat(base, {"messages": MESSAGES, "max_tokens": 3} | extra)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]
