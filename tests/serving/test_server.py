"""`decoderlm serve`'s app on a real uvicorn server: OpenAI clients, SSE framing, errors, metrics."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from test_engine import near_tie_gap

import decoderlm
from conftest import CONTEXT, TEXT, make_served, paced, until, wait_healthy
from decoderlm.server.app import create_app, drain

BOTH = pytest.mark.parametrize("server", ["thread", "process"], indirect=True)  # engine placement


def solo(loaded, prompt: str, max_tokens: int, **kwargs) -> str:
    """`decoderlm.generate` on the prompt alone, to end-of-text or max_tokens, as text."""
    model, tokenizer = loaded
    ids = tokenizer.encode(prompt)
    out = decoderlm.generate(model, [ids], max_tokens, eos_id=tokenizer.eot_id, **kwargs)[0]
    new = out[len(ids) :]
    return tokenizer.decode(new[:-1] if new and new[-1] == tokenizer.eot_id else new)


def client(base: str, async_: bool = False):
    cls = openai.AsyncOpenAI if async_ else openai.OpenAI
    return cls(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body, checking that every event is `data: ...\\n\\n`."""
    body = response.read().decode("utf-8")
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), body[:500]
    return [e[len("data: ") :] for e in events]


@BOTH
def test_32_concurrent_streams_each_equal_their_solo_greedy_generate_up_to_near_ties(
    server, loaded
):
    base, served = server
    rng = random.Random(0)
    chars = TEXT[:-5]  # one token per character: equal text is equal tokens
    jobs = []
    for _ in range(32):
        prompt = "".join(rng.choice(chars) for _ in range(rng.randint(1, 60)))
        jobs.append((prompt, rng.randint(1, CONTEXT - len(prompt))))

    async def one(api, prompt, max_tokens):
        stream = await api.completions.create(
            model=served.model_name, prompt=prompt, max_tokens=max_tokens, temperature=0,
            stream=True,
        )  # fmt: skip
        pieces, reasons = [], []
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
            reasons.append(chunk.choices[0].finish_reason)
        return "".join(pieces), reasons

    running = []  # the engine's running sequences, polled while the streams last

    async def watch():
        while True:
            running.append((await asyncio.to_thread(served.engine.stats)).running)
            await asyncio.sleep(0.005)

    async def all_of_them():
        watcher = asyncio.create_task(watch())
        async with client(base, async_=True) as api:
            results = await asyncio.gather(*(one(api, p, m) for p, m in jobs))
        watcher.cancel()
        return results

    results = asyncio.run(all_of_them())
    model, tokenizer = loaded
    for (prompt, max_tokens), (text, reasons) in zip(jobs, results, strict=True):
        ids = tokenizer.encode(prompt)
        alone = decoderlm.generate(
            model, [ids], max_tokens, eos_id=tokenizer.eot_id, temperature=0
        )[0][len(ids) :]
        got = tokenizer.encode(text) + ([tokenizer.eot_id] if reasons[-1] == "stop" else [])
        n = min(len(got), len(alone))  # a difference shows within both: no stop strings here
        near_tie_gap(model, ids, got[:n], alone[:n])  # float32 batches may round a tie otherwise
        assert reasons[:-1] == [None] * (len(reasons) - 1) and reasons[-1] in ("stop", "length")
    assert max(running) > 1  # they did run together (the session's server: its max is older)


@BOTH
def test_seeded_sampled_request_equals_its_solo_run_in_a_crowd(server, loaded):
    base, _ = server
    sampling = {"temperature": 0.9, "top_p": 0.95, "top_k": 40}
    prompt, max_tokens = "Once upon a time", 40

    def ask(api, seed):
        r = api.completions.create(model=None, prompt=prompt, max_tokens=max_tokens, seed=seed,
                                   temperature=0.9, top_p=0.95, extra_body={"top_k": 40})  # fmt: skip
        return r.choices[0].text

    api = client(base)
    alone = ask(api, 1234)
    crowd: list[str] = []
    others = [threading.Thread(target=lambda s=s: crowd.append(ask(api, s))) for s in range(6)]
    for t in others:
        t.start()
    in_crowd = ask(api, 1234)
    for t in others:
        t.join()
    assert in_crowd == alone == solo(loaded, prompt, max_tokens, seed=1234, **sampling)
    assert len(set(crowd)) > 1  # other seeds gave other texts: the sampling is not greedy


@BOTH
def test_completion_fields_n_echo_logprobs_stop_and_usage(server, loaded):
    base, _ = server
    api = client(base)
    r = api.completions.create(model=None, prompt=["ab", "xyz"], max_tokens=6, temperature=0,
                               n=2, echo=True, logprobs=3)  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    model, tokenizer = loaded
    for choice, prompt in zip(r.choices, ["ab", "ab", "xyz", "xyz"], strict=True):
        assert choice.text == prompt + solo(loaded, prompt, 6, temperature=0)
        lp, n = choice.logprobs, len(prompt)  # the char tokenizer: one token per character
        # echo with logprobs reports the prompt's tokens first, as OpenAI's completions API does:
        # the first without a logprob, token t with log p(token t | tokens < t) (float64 ≤ 1e-5).
        assert "".join(lp.tokens) == choice.text and lp.text_offset == list(range(len(lp.tokens)))
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            ref = torch.log_softmax(model.double()(torch.tensor([ids]))[0], dim=-1)
            model.float()
        expected = [ref[t - 1, ids[t]].item() for t in range(1, n)]
        assert lp.token_logprobs[1:n] == pytest.approx(expected, abs=1e-5)
        assert all(len(top) == 3 and max(top.values()) <= 0 for top in lp.top_logprobs[1:])
        for t in range(1, n):
            assert max(lp.top_logprobs[t].values()) == pytest.approx(
                ref[t - 1].max().item(), abs=1e-5
            )
        generated = lp.top_logprobs[n:]
        assert lp.token_logprobs[n:] == [max(top.values()) for top in generated]  # greedy
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == sum(
        len(c.logprobs.tokens) - len(prompt)
        for c, prompt in zip(r.choices, ["ab", "ab", "xyz", "xyz"], strict=True)
    )
    stream = httpx.post(f"{base}/v1/completions", json={"prompt": "xyz", "max_tokens": 3,
                        "temperature": 0, "echo": True, "logprobs": 1, "stream": True})  # fmt: skip
    chunks = [json.loads(e) for e in sse_events(stream)[:-1]]
    opening = chunks[0]["choices"][0]  # the echoed prompt, with its tokens' logprobs
    assert opening["text"] == "xyz" and opening["logprobs"]["tokens"] == ["x", "y", "z"]
    assert opening["logprobs"]["token_logprobs"][0] is None
    offsets = [o for c in chunks for ch in c["choices"] for o in ch["logprobs"]["text_offset"]]
    assert offsets == list(range(len(offsets)))
    full = solo(loaded, "Hello", 30, temperature=0)
    stop = full[5:7]
    r = api.completions.create(model=None, prompt="Hello", max_tokens=30, temperature=0, stop=stop)
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"


@BOTH
def test_chat_uses_the_default_template_and_streams_deltas(server, loaded):
    base, served = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    rendered = served.chat_template.render(messages)
    assert rendered == "System: Be brief.\n\nUser: Hi!\n\nAssistant:"
    expected = solo(loaded, rendered, 20, temperature=0).split("\nUser:")[0]
    api = client(base)
    r = api.chat.completions.create(model=served.model_name, messages=messages, max_tokens=20,
                                    temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
    stream = api.chat.completions.create(model=served.model_name, messages=messages,
                                         max_tokens=20, temperature=0, stream=True,
                                         stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(rendered)


def test_sse_framing_chunk_objects_usage_last_and_done(server):
    base, _ = server
    body = {"prompt": "é€😀", "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{base}/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["choices"] == []
    assert 1 <= chunks[-1]["usage"]["completion_tokens"] <= 8
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "max_tokens": 4, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=chat) as r:
        chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert all("delta" in c["choices"][0] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b'["a list"]', 400, None),
        ("/v1/completions", {"prompt": "Hi", "temperature": 2.5}, 400, "temperature"),
        ("/v1/completions", {"prompt": "Hi", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": True}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": "5"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [True, 2]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "Hi", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ("/v1/completions", {"prompt": "Hi", "stream_options": {}}, 400, "stream_options"),
        ("/v1/completions", {"prompt": "a" * CONTEXT}, 400, "prompt"),
        ("/v1/completions", {"prompt": "ß not in the vocabulary"}, 400, "prompt"),
        ("/v1/completions", {"prompt": [10**6]}, 400, "prompt"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "king", "content": "x"}]},
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            400,
            "top_logprobs",
        ),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/tokenize", {}, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_shaped_errors_naming_the_field(server, path, body, status, param):
    base, _ = server
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{base}{path}", headers={"content-type": "application/json"}, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert httpx.get(f"{base}/health").status_code == 200  # and the server lives on


def test_unknown_request_fields_are_ignored_and_named_in_the_log(server, caplog):
    base, _ = server
    body = {"prompt": "ab", "max_token": 3, "temperature": 0, "service_tier": "auto"}
    with caplog.at_level("WARNING", logger="decoderlm.serve"):
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "foo": 1}
        r_chat = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == r_chat.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 16  # max_token is not max_tokens
    logged = [rec.getMessage() for rec in caplog.records]
    assert "/v1/completions: ignored unknown request fields max_token, service_tier" in logged
    assert "/v1/chat/completions: ignored unknown request fields foo" in logged


def test_tokenize_detokenize_round_trip_and_models(server):
    base, served = server
    r = httpx.post(f"{base}/tokenize", json={"prompt": "Hello é"}).json()
    assert r["count"] == 7 and r["max_model_len"] == CONTEXT
    assert httpx.post(f"{base}/detokenize", json={"tokens": r["tokens"]}).json() == {
        "prompt": "Hello é"
    }
    chat = httpx.post(f"{base}/tokenize", json={"messages": [{"role": "user", "content": "Yo"}]})
    assert chat.json()["count"] == len("User: Yo\n\nAssistant:")
    models = client(base).models.list().data
    assert [m.id for m in models] == [served.model_name]


@BOTH
def test_health_and_metrics_parse_with_counts_that_moved(server):
    base, _ = server
    client(base).completions.create(model=None, prompt="Hi", max_tokens=5, temperature=0)
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    families = {
        f.name: f for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
    }
    for name in ("requests_running", "requests_waiting", "kv_blocks_used", "kv_blocks_total"):
        assert families[f"decoderlm_{name}"].type == "gauge"
    value = {f.name: f.samples[0].value for f in families.values()}
    assert value["decoderlm_prompt_tokens"] >= 2 and value["decoderlm_generation_tokens"] >= 5
    assert value["decoderlm_kv_blocks_total"] > 0
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        family = families[f"decoderlm_{name}"]
        count = next(s.value for s in family.samples if s.name.endswith("_count"))
        assert family.type == "histogram" and count >= 1


def test_health_is_503_while_loading_then_200(run_dir, loaded, start_server):
    release = threading.Event()
    served = make_served(run_dir, loaded, kv_cache_memory="1MiB")

    def load():
        release.wait(30)
        return served

    base = start_server(create_app(load, grace_s=0))
    assert httpx.get(f"{base}/health").status_code == 503
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    release.set()
    wait_healthy(base, timeout=10)


def test_client_disconnect_mid_stream_cancels_its_request(server, monkeypatch):
    base, served = server
    engine = served.engine
    cancelled: list[str] = []
    cancel = engine.cancel
    monkeypatch.setattr(engine, "cancel", lambda rid: (cancelled.append(rid), cancel(rid)))
    monkeypatch.setattr(engine, "step", paced(engine.step, 0.01))
    generated = engine.stats().generated_tokens
    body = {"prompt": "A", "max_tokens": CONTEXT - 1, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line)[len("data: ") :])
    until(lambda: engine.stats().running == 0)
    assert set(cancelled) == {f"{first['id']}-0"}  # by the app, and by the closed iterator
    assert engine.stats().running == 0
    assert engine.stats().generated_tokens - generated < CONTEXT - 1


def test_a_full_queue_is_refused_with_429(run_dir, loaded, start_server, monkeypatch):
    # One sequence's worth of KV blocks and a queue of one: A runs, B (a long prompt) waits, C is refused.
    served = make_served(run_dir, loaded, kv_cache_memory=CONTEXT * 256, max_queue=1)
    monkeypatch.setattr(served.engine, "step", paced(served.engine.step, 0.01))
    base = start_server(create_app(lambda: served, grace_s=0))
    wait_healthy(base)
    stats = served.engine.stats
    long = {"prompt": "A", "max_tokens": CONTEXT - 1, "temperature": 0, "stream": True}
    waits = {"prompt": "B" * (CONTEXT - 16), "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=long) as a:
        assert a.status_code == 200
        with httpx.stream("POST", f"{base}/v1/completions", json=waits) as b:
            assert b.status_code == 200
            until(lambda: stats().running == 1 and stats().waiting == 1)
            c = httpx.post(f"{base}/v1/completions", json={"prompt": "C"})
            assert c.status_code == 429 and c.headers["retry-after"] == "1"
            assert c.json()["error"]["code"] == "queue_full"


def test_a_drain_cancels_the_streams_still_running_when_the_grace_period_ends(
    run_dir, loaded, start_server, monkeypatch
):
    # What SIGTERM does (`decoderlm serve` calls `drain`): new requests get 503 at once; a stream
    # that cannot finish within the grace period ends there, cancelled, and is still framed whole.
    served = make_served(run_dir, loaded, kv_cache_memory="1MiB")
    monkeypatch.setattr(served.engine, "step", paced(served.engine.step, 0.02))
    app = create_app(lambda: served, grace_s=0)
    base = start_server(app)
    wait_healthy(base)
    grace_s = 0.3
    body = {"prompt": "A", "max_tokens": CONTEXT - 1, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        start = time.monotonic()
        drain(app, grace_s)
        until(lambda: httpx.get(f"{base}/health").status_code == 503)
        refused = httpx.post(f"{base}/v1/completions", json={"prompt": "B"})
        rest = [line for line in lines if line]
        elapsed = time.monotonic() - start
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in rest[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "cancelled"
    # ~95 paced steps would take ≥ 1.9 s; the stream ended one step after the grace period instead.
    assert grace_s <= elapsed < grace_s + 1.0
    assert len(chunks) < CONTEXT - 1


def test_created_is_the_requests_time_not_the_models(server, monkeypatch):
    base, served = server
    monkeypatch.setattr(served, "created", 0)  # the model's load time, long ago
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    before = int(time.time())
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", chat)):
        whole = httpx.post(f"{base}{path}", json=body | {"max_tokens": 2}, timeout=60).json()
        streamed = httpx.post(f"{base}{path}", json=body | {"max_tokens": 2, "stream": True})
        chunks = [json.loads(e) for e in sse_events(streamed)[:-1]]
        after = int(time.time())
        assert all(before <= c["created"] <= after for c in [whole, *chunks]), path
    assert client(base).models.list().data[0].created == 0  # a model's is its own


def test_ignore_eos_goes_on_past_the_end_of_text_token(server, loaded, caplog):
    base, _ = server
    model, tokenizer = loaded
    max_tokens = 40

    def greedy(prompt: str) -> list[int]:
        ids = tokenizer.encode(prompt)
        return decoderlm.generate(model, [ids], max_tokens, temperature=0)[0][len(ids) :]

    prompt = next((c for c in TEXT if tokenizer.eot_id in greedy(c)), None)
    assert prompt is not None, "no prompt of one character makes the test model end its text"
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    stopped = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] < max_tokens
    with caplog.at_level("WARNING", logger="decoderlm.serve"):
        full = httpx.post(f"{base}/v1/completions", json=body | {"ignore_eos": True}, timeout=60)
        chat = {"messages": [{"role": "user", "content": prompt}], "ignore_eos": True}
        r_chat = httpx.post(f"{base}/v1/chat/completions", json=chat | {"max_tokens": 2})
    choice = full.json()["choices"][0]  # the special token's text left out, as vLLM does
    assert choice["finish_reason"] == "length"
    assert choice["text"] == tokenizer.decode(greedy(prompt), skip_special_tokens=True)
    shown = httpx.post(
        f"{base}/v1/completions",
        json=body | {"ignore_eos": True, "skip_special_tokens": False},
        timeout=60,
    )
    assert shown.json()["choices"][0]["text"] == tokenizer.decode(greedy(prompt))
    assert full.json()["usage"]["completion_tokens"] == max_tokens
    assert r_chat.status_code == 200 and not caplog.records  # a known field, not an ignored one
