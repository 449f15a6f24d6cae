"""Structured output (inference/structured.py, xgrammar): every output of a random model sampled at
temperature 1 parses and validates against its JSON schema (the `jsonschema` library), through
`generate` and the engine; regexes, choices and grammars are followed; what cannot compile is a
one-line DecoderLMError."""

from __future__ import annotations

import json
import re
import sys

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

import torch  # noqa: E402

from decoderlm import DecoderLM, DecoderLMError, ModelConfig, generate, load  # noqa: E402
from decoderlm.engine.engine import Engine  # noqa: E402
from decoderlm.engine.types import RequestParams  # noqa: E402
from decoderlm.inference.sampling import SamplingParams  # noqa: E402
from decoderlm.inference.structured import (  # noqa: E402
    StructuredOutput,
    compile_structured,
)
from decoderlm.tokenizer import Tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_TOKENS = 200  # every schema below ends well within: bounded strings, arrays and numbers
SAMPLES = 4  # per schema, each with its own matcher

INT = {"type": "integer", "minimum": -10, "maximum": 10}
NAME = {"type": "string", "maxLength": 5}
SCHEMAS = [
    INT,
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
    {"type": "integer", "minimum": -1000000, "maximum": 1000000},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "number", "exclusiveMinimum": -1, "exclusiveMaximum": 1},
    {"type": "boolean"},
    {"type": "null"},
    {"type": ["integer", "null"], "minimum": 0, "maximum": 3},
    {"enum": ["red", "green", "blue"]},
    {"enum": [1, "two", None, True]},
    {"enum": ['say "hi"', "back\\slash"]},
    {"const": "fixed"},
    {"type": "string", "minLength": 2, "maxLength": 6},
    {"type": "string", "maxLength": 0},
    {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
    {"type": "string", "pattern": "^(cat|dog)s?$"},
    {"type": "object", "properties": {"a": INT, "b": NAME}, "required": ["a", "b"]},
    {"type": "object", "properties": {"x": {"type": "boolean"}, "y": INT}},  # all optional
    {
        "type": "object",
        "properties": {"a": INT, "b": {"type": "boolean"}, "c": NAME},
        "required": ["b"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                "required": ["name", "age"],
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["user", "tags"],
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "object", "properties": {"c": INT}, "required": ["c"]}},
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    {
        "type": "object",
        "properties": {"kind": {"enum": ["x", "y"]}, "size": {"enum": [1, 2]}, "on": {"const": True}},
        "required": ["kind", "size", "on"],
        "additionalProperties": False,
    },
    {"type": "array", "items": INT, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"],
        },
        "maxItems": 3,
    },
    {
        "type": "array",
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2},
        "maxItems": 2,
    },
    {
        "type": "array",
        "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 5}, NAME],
        "items": False,
    },
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 3}]},
    {
        "anyOf": [
            {"type": "object", "properties": {"n": INT}, "required": ["n"]},
            {"type": "object", "properties": {"s": NAME}, "required": ["s"]},
        ]
    },
    {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"v": {"type": "boolean"}}, "required": ["v"]}]},
    {"oneOf": [{"type": "boolean"}, INT]},
    {
        "$defs": {"point": {"type": "object", "properties": {"x": INT, "y": INT}, "required": ["x", "y"]}},
        "type": "object",
        "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
        "required": ["from", "to"],
    },
]  # fmt: skip


@pytest.fixture(scope="module")
def lm(json_run):
    return load(json_run)


def test_there_are_at_least_30_schemas():
    assert len(SCHEMAS) >= 30


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_every_generate_output_parses_and_validates_against_its_schema(lm, schema):
    model, tok = lm
    grammar = compile_structured(tok, StructuredOutput("json", schema))
    prompt = tok.encode("Answer:")
    rows = generate(
        model,
        [prompt],
        MAX_TOKENS,
        temperature=1.0,
        seed=0,
        num_samples=SAMPLES,
        structured=grammar,
    )
    for row in rows:
        new = row[len(prompt) :]
        assert new[-1] == tok.eot_id, f"did not end: {tok.decode(new)!r}"
        jsonschema.validate(json.loads(tok.decode(new[:-1])), schema)


def test_every_engine_output_parses_and_validates_with_all_schemas_in_one_batch(lm):
    model, tok = lm
    engine = Engine(model, tok, kv_cache_memory="16MiB", max_queue=len(SCHEMAS) * SAMPLES)
    sampling = SamplingParams(temperature=1.0)
    results: dict[int, list] = {i: [] for i in range(len(SCHEMAS))}
    for i, schema in enumerate(SCHEMAS):
        params = RequestParams(
            MAX_TOKENS, sampling, seed=i, n=SAMPLES, structured=StructuredOutput("json", schema)
        )
        engine.submit("Answer:", params, on_event=lambda e, i=i: results[i].append(e))
    while engine.step():
        pass
    for i, schema in enumerate(SCHEMAS):
        texts = ["".join(e.text for e in results[i] if e.index == j) for j in range(SAMPLES)]
        reasons = [e.finish_reason for e in results[i] if e.finish_reason]
        assert reasons == ["stop"] * SAMPLES, (schema, texts)
        for text in texts:
            jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        (
            StructuredOutput("regex", r"[a-c]{2,4}@x\.(com|org)"),
            re.compile(r"[a-c]{2,4}@x\.(com|org)").fullmatch,
        ),
        (
            StructuredOutput("choice", ["yes", 'no "way"', "maybe\n"]),
            {"yes", 'no "way"', "maybe\n"}.__contains__,
        ),
        (
            StructuredOutput("grammar", 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [0-9]'),
            re.compile(r"\([0-9](\+[0-9]){0,3}\)").fullmatch,
        ),
    ],
    ids=["regex", "choice", "grammar"],
)
def test_regex_choice_and_grammar_outputs_are_in_their_language(lm, spec, check):
    model, tok = lm
    grammar = compile_structured(tok, spec)
    prompt = tok.encode("Answer:")
    rows = generate(model, [prompt], 64, temperature=1.0, seed=1, num_samples=8, structured=grammar)
    for row in rows:
        new = row[len(prompt) :]
        assert new[-1] == tok.eot_id and check(tok.decode(new[:-1])), tok.decode(new)
        assert tok.eot_id not in new[:-1]


def test_json_object_outputs_that_end_are_json_objects(lm):
    # Any object is unbounded: a random model's keys and values may run past max_tokens.
    model, tok = lm
    grammar = compile_structured(tok, StructuredOutput("json_object"))
    prompt = tok.encode("Answer:")
    rows = generate(
        model, [prompt], 120, temperature=1.0, seed=2, num_samples=16, structured=grammar
    )
    ended = [row[len(prompt) : -1] for row in rows if row[-1] == tok.eot_id]
    assert len(ended) >= 8
    assert all(isinstance(json.loads(tok.decode(new)), dict) for new in ended)


def test_compiling_is_cached_by_tokenizer_and_spec(lm, tmp_path):
    _, tok = lm
    schema = {"type": "object", "properties": {"a": INT}}
    first = compile_structured(tok, StructuredOutput("json", schema))
    assert compile_structured(tok, StructuredOutput("json", json.dumps(schema))) is first
    assert compile_structured(copied(tok, tmp_path), StructuredOutput("json", schema)) is not first


def copied(tok: Tokenizer, folder) -> Tokenizer:
    """Another Tokenizer object with the same vocabulary (compiled anew: no cache hit)."""
    tok.save(folder / "tokenizer.json")
    return Tokenizer.from_file(folder)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (("json", {"type": "foo"}), 'cannot compile the json: Unsupported type "foo"'),
        (("json", "{not json"), "the JSON schema is not valid JSON"),
        (("json", [1]), "the JSON schema must be a JSON object"),
        (("regex", "(("), "cannot compile the regex: Regex parsing error at position 3"),
        (("grammar", "root ::= foo"), 'cannot compile the grammar: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
        (("grammar", "root ::= é"), "EBNF lexer error at line 1, column 10: Unexpected character: \ufffd"),
        (("regex", "[\ud800-\udfff]"), "cannot compile the regex: it holds '\\ud800' at index 1, which is not UTF-8"),
        (("choice", []), "must be a non-empty list of strings"),
        (("yaml", "x"), "kind='yaml' must be one of"),
    ],
)  # fmt: skip
def test_a_spec_that_cannot_compile_is_a_one_line_error_naming_the_problem(lm, spec, message):
    _, tok = lm
    with pytest.raises(DecoderLMError, match=re.escape(message)) as info:
        compile_structured(tok, StructuredOutput(*spec))
    assert "\n" not in str(info.value)


def test_without_xgrammar_the_error_names_the_extra_to_install(lm, monkeypatch, tmp_path):
    _, tok = lm
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    with pytest.raises(DecoderLMError, match=re.escape("pip install 'decoderlm[structured]'")):
        compile_structured(copied(tok, tmp_path), StructuredOutput("regex", "[0-9]{3}"))


def test_generate_refuses_an_uncompiled_spec(lm):
    model, tok = lm
    with pytest.raises(DecoderLMError, match="compile_structured"):
        generate(model, [tok.encode("a")], 4, structured=StructuredOutput("json_object"))


def test_a_grammar_the_vocabulary_cannot_start_is_refused_and_one_it_cannot_finish_ends(caplog):
    # Characters "a", "b", "c" only: "x" cannot start; after "a", "x" cannot follow, so the
    # output ends there (a prefix of the language, logged) instead of sampling from nothing.
    tok = Tokenizer.train_char(["abc"])
    with pytest.raises(DecoderLMError, match="no token of the tokenizer can start the regex"):
        compile_structured(tok, StructuredOutput("regex", "x+"))
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=tok.vocab_size, context_length=16, d_model=16, n_layers=1, n_heads=2
    )
    model = DecoderLM(config).eval()
    grammar = compile_structured(tok, StructuredOutput("regex", "ax"))
    prompt = tok.encode("b")
    rows = generate(model, [prompt], 8, temperature=1.0, seed=0, num_samples=2, structured=grammar)
    assert [row[len(prompt) :] for row in rows] == [[*tok.encode("a"), tok.eot_id]] * 2
    assert "no token spells what its grammar needs next" in caplog.text


def test_structured_output_and_speculation_together(lm):
    """generate refuses the pair (a draft would need a mask at every proposed position); the
    engine serves a constrained request beside speculating ones, without speculating it."""
    model, tok = lm
    schema = SCHEMAS[0]
    grammar = compile_structured(tok, StructuredOutput("json", schema))
    with pytest.raises(DecoderLMError, match="structured output with speculative decoding"):
        generate(model, [tok.encode("Answer:")], 8, structured=grammar, draft="prompt-lookup")
    engine = Engine(model, tok, kv_cache_memory="4MiB", draft="prompt-lookup")
    greedy = SamplingParams(temperature=0)
    free, constrained = [], []
    engine.submit("Answer: {", RequestParams(24, greedy), on_event=free.append)
    params = RequestParams(MAX_TOKENS, greedy, structured=StructuredOutput("json", schema))
    engine.submit("Answer:", params, on_event=constrained.append)
    while engine.step():
        pass
    assert constrained[-1].finish_reason == "stop" and free[-1].finish_reason is not None
    jsonschema.validate(json.loads("".join(e.text for e in constrained)), schema)
