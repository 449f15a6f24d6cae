"""Structured output through the engine and the HTTP app: OpenAI's response_format and vLLM's
structured_outputs (and guided_*) give answers in their language with finish_reason "stop", each
of n choices with its own matcher; a spec that cannot compile is a 400 and the server goes on;
constrained rows leave the unconstrained rows of a batch as they are, and preemption does not
advance a matcher twice."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from conftest import live_server, make_served, process_served, wait_healthy  # noqa: E402
from decoderlm import generate, load  # noqa: E402
from decoderlm.engine.engine import Engine  # noqa: E402
from decoderlm.engine.types import RequestParams  # noqa: E402
from decoderlm.inference.sampling import SamplingParams  # noqa: E402
from decoderlm.inference.structured import StructuredOutput  # noqa: E402
from decoderlm.model.cache import kv_cache_bytes_per_token  # noqa: E402
from decoderlm.server.app import create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "email": {"type": "string", "pattern": "^[a-z]{1,4}@[a-z]{1,4}\\.com$"},
    },
    "required": ["name", "age", "tags"],
}


@pytest.fixture(scope="module")
def lm(json_run):
    return load(json_run)


@pytest.fixture(scope="module")
def base(json_run, lm):
    served = make_served(json_run, lm, kv_cache_memory="8MiB", max_queue=64)
    with live_server(create_app(lambda: served, grace_s=1.0)) as url:
        wait_healthy(url)
        yield url


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/v1/{path}", json=body, timeout=120)


def streamed_texts(response: httpx.Response, n: int) -> tuple[list[str], list[str]]:
    """Each choice's text and finish_reason from a chat completion's server-sent events."""
    texts, reasons = [""] * n, [""] * n
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                texts[choice["index"]] += choice["delta"].get("content") or ""
                reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
    return texts, reasons


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_with_a_json_schema_response_format_answers_json_that_validates(base, stream):
    body = {
        "messages": [{"role": "user", "content": "Who?"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
        "max_tokens": 200,
        "temperature": 1.0,
        "seed": 5,
        "n": 4,
        "stream": stream,
    }
    response = post(base, "chat/completions", body)
    assert response.status_code == 200, response.text
    if stream:
        texts, reasons = streamed_texts(response, 4)
    else:
        choices = response.json()["choices"]
        texts = [c["message"]["content"] for c in choices]
        reasons = [c["finish_reason"] for c in choices]
    assert reasons == ["stop"] * 4
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 1  # each choice samples with its own matcher


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"json": PERSON}}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, re.compile("[0-9]{3}-[a-z]{2}").fullmatch),
        ({"structured_outputs": {"choice": ["left", "right"]}}, {"left", "right"}.__contains__),
        ({"structured_outputs": {"grammar": 'root ::= ("ab" | "c")+ "!"'}}, re.compile("(ab|c)+!").fullmatch),
        ({"guided_json": json.dumps(PERSON)}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        ({"guided_regex": "x[0-9]?y"}, re.compile("x[0-9]?y").fullmatch),
        ({"guided_choice": ["one", "two"]}, {"one", "two"}.__contains__),
        ({"guided_grammar": 'root ::= [0-9] [0-9]'}, re.compile("[0-9]{2}").fullmatch),
        ({"guided_choice": ["one", "two"], "ignore_eos": True}, {"one", "two"}.__contains__),  # a grammar still ends
    ],
    ids=["json", "regex", "choice", "grammar", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "ignore_eos"],
)  # fmt: skip
def test_completions_follow_vllm_structured_outputs_and_guided_fields(base, extra, check):
    body = {"prompt": "Say:", "max_tokens": 200, "temperature": 1.0, "seed": 1, "n": 3} | extra
    response = post(base, "completions", body)
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        assert check(choice["text"]), choice["text"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
            'cannot compile the json: Unsupported type "foo"',
        ),
        ({"structured_outputs": {"regex": "(("}}, "cannot compile the regex: Regex parsing error"),
        ({"structured_outputs": {"grammar": "root ::= nope"}}, 'Rule "nope" is not defined'),
        ({"guided_json": "{oops"}, "the JSON schema is not valid JSON"),
        ({"response_format": {"type": "json_schema"}}, "json_schema needs its json_schema"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "give one structured output, not response_format and guided_regex",
        ),
    ],
    ids=["schema", "regex", "grammar", "not-json", "no-schema", "two-specs"],
)  # fmt: skip
def test_a_spec_that_cannot_compile_is_a_400_and_the_next_request_is_served(base, extra, message):
    good = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    response = post(base, "chat/completions", good | extra)
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert post(base, "chat/completions", good).status_code == 200


def test_json_object_response_format_answers_json_objects(base):
    # Any object is unbounded: a random model's keys and values may run past max_tokens.
    body = {"prompt": "Say:", "max_tokens": 120, "n": 8, "seed": 2, "response_format": {"type": "json_object"}}  # fmt: skip
    choices = post(base, "completions", body).json()["choices"]
    ended = [c["text"] for c in choices if c["finish_reason"] == "stop"]
    assert len(ended) >= 4
    assert all(isinstance(json.loads(text), dict) for text in ended)


def test_an_engine_in_its_own_process_serves_structured_output_and_its_400s(json_run, start_server):
    served = process_served(json_run, kv_cache_memory="4MiB", max_queue=8)
    url = start_server(create_app(lambda: served, grace_s=0))
    wait_healthy(url)
    body = {"prompt": "Say:", "max_tokens": 200, "temperature": 1.0, "seed": 0, "n": 2}
    good = post(url, "completions", body | {"structured_outputs": {"json": PERSON}})
    for choice in good.json()["choices"]:
        jsonschema.validate(json.loads(choice["text"]), PERSON)
    bad = post(url, "completions", body | {"guided_json": {"type": "foo"}})
    assert bad.status_code == 400 and "Unsupported type" in bad.json()["error"]["message"]
    assert post(url, "completions", body).status_code == 200


# The engine.


def test_unconstrained_requests_in_a_batch_with_constrained_ones_equal_their_solo_output(json_run):
    # float64: batched and solo kernels differ by rounding (~1e-15), far below any argmax gap.
    model, tok = load(json_run, dtype=torch.float64)
    engine = Engine(model, tok, kv_cache_memory="16MiB")
    prompts = ["Say:", "Once upon", '{"name', "x"]
    free = RequestParams(24, SamplingParams(temperature=0), ignore_eos=True)
    constrained = RequestParams(
        200,
        SamplingParams(temperature=1.0),
        seed=3,
        n=2,
        structured=StructuredOutput("json", PERSON),
    )
    events: dict[str, list] = {}
    for i, prompt in enumerate(prompts):
        for name, params in ((f"free{i}", free), (f"json{i}", constrained)):
            events[name] = []
            engine.submit(prompt, params, request_id=name, on_event=events[name].append)
    while engine.step():
        pass
    for i, prompt in enumerate(prompts):
        ids = tok.encode(prompt)
        solo = generate(model, [ids], 24, temperature=0)[0][len(ids) :]
        assert [e.token_id for e in events[f"free{i}"] if e.token_id is not None] == solo
        for j in range(2):
            text = "".join(e.text for e in events[f"json{i}"] if e.index == j)
            jsonschema.validate(json.loads(text), PERSON)


def test_preempted_constrained_sequences_still_validate(lm):
    # A pool of 16 blocks of 4 tokens for 8 sequences of up to 52: sequences are preempted and
    # recomputed; their matchers advance on sampled tokens only, so the JSON stays valid.
    model, tok = lm
    per_token = kv_cache_bytes_per_token(model.config, model.tok_emb.weight.dtype)
    engine = Engine(model, tok, kv_cache_memory=16 * 4 * per_token, block_size=4, prefill_chunk=8)
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 8, "maxItems": 12}  # fmt: skip
    params = RequestParams(
        44,
        SamplingParams(temperature=1.0),
        seed=0,
        n=8,
        structured=StructuredOutput("json", schema),
    )
    events: list = []
    engine.submit("Numbers:", params, on_event=events.append)
    while engine.step():
        pass
    assert engine.stats().preemptions > 0
    assert sorted(e.finish_reason for e in events if e.finish_reason) == ["stop"] * 8
    for j in range(8):
        jsonschema.validate(json.loads("".join(e.text for e in events if e.index == j)), schema)
