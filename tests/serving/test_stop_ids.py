"""A checkpoint ends its turn where its own files say: the stop ids read in order of authority
(generation_config.json, config.json, tokenizer_config.json, GGUF metadata, else a guessed
end-of-text with a warning) end generate, the engine and the server at the same step as
transformers' generate, special tokens stay out of the text, and the OpenAI fields that change
stopping (stop_token_ids, ignore_eos, min_tokens, include_stop_str_in_output, skip_special_tokens)
do what vLLM's do.

The model: a tiny random Llama whose greedy continuation of PROMPT is made to reach <|im_end|> at
step STEP (two rows of its output head swapped: nothing before that step changes), so that a model
whose files name <|im_end|> stops there, after STEP + 1 tokens, and one whose files do not goes on.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest
import torch

import decoderlm
from conftest import live_server, make_served, serve_args, wait_healthy
from decoderlm import DecoderLM, ModelConfig, generate
from decoderlm.checkpoint import save_model
from decoderlm.cli import main
from decoderlm.engine.engine import Engine
from decoderlm.engine.types import RequestParams
from decoderlm.generation_config import GenerationConfig
from decoderlm.hf import export_hf
from decoderlm.inference.sampling import SamplingParams
from decoderlm.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,\n"
PROMPT = "the cat"
STEP = 3  # the greedy reply's token STEP is <|im_end|>: the reply is STEP + 1 tokens
GREEDY = RequestParams(12, SamplingParams(temperature=0))


def chat_tokenizer() -> Tokenizer:
    """Byte-level BPE (as GGUF files hold), <|endoftext|>, and a chat model's special
    <|im_start|> / <|im_end|>."""
    backend = Tokenizer.train_bpe([ALPHABET * 20], vocab_size=300).backend
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return Tokenizer(backend)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> tuple[DecoderLM, Tokenizer, list[int]]:
    """(model, tokenizer, its greedy reply to PROMPT with no stop: <|im_end|> at STEP)."""
    tok = chat_tokenizer()
    im_end = tok.backend.token_to_id("<|im_end|>")
    torch.manual_seed(0)
    config = ModelConfig.from_preset(
        "llama-tiny", vocab_size=tok.vocab_size, context_length=64, d_model=32, n_layers=2,
        n_heads=4, n_kv_heads=2, tie_embeddings=False,
    )  # fmt: skip
    model = DecoderLM(config).eval()
    with torch.no_grad():
        model.head.weight.mul_(50)  # sharp: no near ties between float32 and transformers
    prompt = tok.encode(PROMPT)
    reply = generate(model, [prompt], STEP + 1, temperature=0)[0][len(prompt) :]
    target = reply[STEP]
    assert target not in reply[:STEP] and im_end not in reply
    with torch.no_grad():  # swap the head's rows: at STEP the argmax is <|im_end|>
        model.head.weight[[target, im_end]] = model.head.weight[[im_end, target]]
    reply = generate(model, [prompt], 10, temperature=0)[0][len(prompt) :]
    assert reply[STEP] == im_end and im_end not in reply[:STEP]
    with torch.no_grad():  # each step's top two logits apart: float32 rounding cannot swap them
        logits = model(torch.tensor([prompt + reply[:STEP]]))[0, len(prompt) - 1 :]
    top2 = logits.topk(2).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 0.01  # float32 rounds logits of ~15 by ~2e-6
    return model, tok, reply


def im_end(tok: Tokenizer) -> int:
    return tok.backend.token_to_id("<|im_end|>")


def hf_dir(made, tmp_path: Path, declare: str) -> Path:
    """An HF directory of the model whose files name its stop ids one way: "generation" (an int
    in generation_config.json), "three" (a list of three there), "config" (config.json only),
    "tokenizer" (tokenizer_config.json only) or "none"."""
    model, tok, _ = made
    run = save_model(tmp_path / "run", model, tok)
    out = export_hf(run, tmp_path / declare)
    (out / "generation_config.json").unlink(missing_ok=True)
    config = json.loads((out / "config.json").read_text())
    config["eos_token_id"] = im_end(tok) if declare == "config" else None
    (out / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config.pop("eos_token", None)
    if declare == "tokenizer":
        tok_config["eos_token"] = "<|im_end|>"
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    declared = {"generation": im_end(tok), "three": [tok.eot_id, 31, im_end(tok)]}
    if declare in declared:
        eos = {"eos_token_id": declared[declare]}
        (out / "generation_config.json").write_text(json.dumps(eos))
    return out


@pytest.mark.parametrize("declare", ["generation", "three", "config", "tokenizer"])
def test_the_files_stop_ids_end_generate_and_the_engine_at_their_step(made, tmp_path, declare):
    path = hf_dir(made, tmp_path, declare)
    model, tok = decoderlm.load(path)
    assert im_end(tok) in tok.stop_ids and not tok.generation.guessed
    prompt = tok.encode(PROMPT)
    row = generate(model, [prompt], 10, temperature=0, eos_id=tok.stop_ids)[0]
    assert row[len(prompt) :] == made[2][: STEP + 1]  # up to and including the stop id
    done = Engine(model, tok).generate([prompt], GREEDY)[0]
    assert done.token_ids == made[2][: STEP + 1] and done.finish_reason == "stop"
    assert "<|im_end|>" not in done.text and done.text == tok.decode(made[2][:STEP])


@pytest.mark.parametrize("declare", ["generation", "three"])
def test_transformers_generate_stops_at_the_same_step(made, tmp_path, declare):
    transformers = pytest.importorskip("transformers")
    path = hf_dir(made, tmp_path, declare)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    prompt = made[1].encode(PROMPT)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0].tolist()
    assert out[len(prompt) :] == made[2][: STEP + 1]


def test_the_authority_order_and_the_sources_info_prints(made, tmp_path, capsys):
    path = hf_dir(made, tmp_path, "three")
    tok = decoderlm.load(path)[1]
    assert tok.stop_ids == (made[1].eot_id, 31, im_end(tok))
    assert set(tok.generation.sources) == {"generation_config.json eos_token_id"}
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"eos_token_id": 5}))
    assert decoderlm.load(path)[1].stop_ids == tok.stop_ids  # generation_config.json wins
    assert main(["info", "--checkpoint", str(path), "--json"]) == 0
    stops = json.loads(capsys.readouterr().out)["generation"]["stop_ids"]
    assert [s["id"] for s in stops] == list(tok.stop_ids)
    assert stops[2]["token"] == "<|im_end|>"


def test_a_gguf_files_eos_and_end_of_turn_ids_are_its_stop_ids(made, tmp_path):
    from decoderlm.gguf import export_gguf
    from decoderlm.tokenizer import SpecialIds

    model, tok, reply = made
    tok = Tokenizer(tok.backend, SpecialIds(eos=tok.eot_id, end_of_turn=im_end(tok)))
    path = export_gguf(model, tok, tmp_path / "model.gguf")
    loaded_model, loaded = decoderlm.load(path)
    assert set(loaded.stop_ids) == {tok.eot_id, im_end(tok)}
    assert all(s.startswith("GGUF tokenizer.ggml.") for s in loaded.generation.sources)
    done = Engine(loaded_model, loaded).generate([tok.encode(PROMPT)], GREEDY)[0]
    assert done.token_ids == reply[: STEP + 1] and done.finish_reason == "stop"


def test_files_that_name_no_stop_id_fall_back_to_the_guess_with_a_warning(made, tmp_path, caplog):
    path = hf_dir(made, tmp_path, "none")
    with caplog.at_level(logging.WARNING, logger="decoderlm.generation_config"):
        model, tok = decoderlm.load(path)
    assert tok.stop_ids == (tok.eot_id,) and tok.generation.guessed
    assert "name no end-of-sequence token" in caplog.text
    done = Engine(model, tok).generate([tok.encode(PROMPT)], GREEDY)[0]
    assert len(done.token_ids) > STEP + 1  # <|im_end|> does not end it


def test_a_bad_declared_id_is_a_one_line_error(made, tmp_path):
    path = hf_dir(made, tmp_path, "generation")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 10_000}))
    with pytest.raises(decoderlm.DecoderLMError, match="eos_token_id = 10000 is not a token id"):
        decoderlm.load(path)


def test_our_runs_record_their_stop_ids(made, tmp_path):
    model, tok = made[0], Tokenizer(made[1].backend)
    tok.generation = GenerationConfig((im_end(tok),), ("here",), {"temperature": 0.0})
    run = save_model(tmp_path / "run", model, tok)
    loaded = decoderlm.load(run)[1]
    assert loaded.stop_ids == (im_end(tok),) and loaded.generation.defaults == {"temperature": 0.0}


# The engine's stopping fields.


@pytest.fixture(scope="module")
def engine(made, tmp_path_factory) -> Engine:
    path = hf_dir(made, tmp_path_factory.mktemp("engine"), "generation")
    return Engine(*decoderlm.load(path), block_size=4)


def run(engine: Engine, params: RequestParams) -> object:
    return engine.generate([engine.tokenizer.encode(PROMPT)], params)[0]


def test_ignore_eos_goes_on_and_the_special_token_shows_only_when_asked(made, engine):
    reply = made[2]
    hidden = run(engine, RequestParams(6, SamplingParams(temperature=0), ignore_eos=True))
    assert hidden.token_ids == reply[:6] and hidden.finish_reason == "length"
    assert "<|im_end|>" not in hidden.text
    shown = RequestParams(
        6, SamplingParams(temperature=0), ignore_eos=True, skip_special_tokens=False
    )
    assert "<|im_end|>" in run(engine, shown).text


def test_stop_token_ids_end_the_reply_with_their_stop_reason(made, engine):
    params = RequestParams(12, SamplingParams(temperature=0), stop_token_ids=(made[2][1],))
    done = run(engine, params)
    assert done.token_ids == made[2][:2] and done.finish_reason == "stop"
    events = []
    engine.submit(engine.tokenizer.encode(PROMPT), params, on_event=events.append)
    while engine.step():
        pass
    assert events[-1].stop_reason == made[2][1]  # the request's id; the model's own: None


def test_min_tokens_holds_the_stop_ids_back(made, engine):
    params = RequestParams(12, SamplingParams(temperature=0), min_tokens=STEP + 3)
    done = run(engine, params)
    assert len(done.token_ids) >= STEP + 3 and done.token_ids[:STEP] == made[2][:STEP]
    assert im_end(engine.tokenizer) not in done.token_ids[: STEP + 3]


def test_include_stop_str_in_output_keeps_the_stop_string(made, engine):
    tok = engine.tokenizer
    stop = tok.decode(made[2][1:2])
    base = RequestParams(12, SamplingParams(temperature=0), stop=(stop,))
    cut = run(engine, base).text
    kept = run(engine, RequestParams(12, SamplingParams(temperature=0), stop=(stop,),
                                     include_stop_str_in_output=True)).text  # fmt: skip
    assert kept == cut + stop and not cut.endswith(stop)


def test_a_stop_id_inside_accepted_drafts_ends_the_row_there(made, tmp_path):
    """A draft model that proposes what the target says: the stop id comes inside an accepted
    proposal, and the reply still ends at it."""
    import copy

    path = hf_dir(made, tmp_path, "generation")
    model, tok = decoderlm.load(path)
    engine = Engine(model, tok, block_size=4, draft=copy.deepcopy(model), num_speculative_tokens=4)
    done = engine.generate([tok.encode(PROMPT)], GREEDY)[0]
    assert done.token_ids == made[2][: STEP + 1] and done.finish_reason == "stop"
    assert engine.stats().speculative_accepted > 0


# The HTTP server.


@pytest.fixture(scope="module")
def server(made, tmp_path_factory):
    from decoderlm.server.app import create_app

    path = hf_dir(made, tmp_path_factory.mktemp("served"), "generation")
    # a chat template that renders a user's message as it is: a chat of PROMPT is the completion
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    served = make_served(path, decoderlm.load(path), block_size=4)
    with live_server(create_app(lambda: served, grace_s=0)) as base:
        wait_healthy(base)
        yield base, served


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=60)


def streamed(base: str, path: str, body: dict) -> tuple[str, list[dict]]:
    """The streamed text and the chunks of a streamed request."""
    chunks = []
    with httpx.stream("POST", f"{base}{path}", json=body | {"stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    key = "text" if path.endswith("/completions") and "chat" not in path else "delta"
    pieces = [c["choices"][0][key] if key == "text" else c["choices"][0]["delta"].get("content", "")
              for c in chunks if c["choices"]]  # fmt: skip
    return "".join(pieces), chunks


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_server_stops_at_the_stop_id_whole_and_streamed_with_usage_to_it(made, server, path):
    base, served = server
    tok = served.tokenizer
    prompt = tok.encode(PROMPT)
    body = {"max_tokens": 12, "temperature": 0}
    body |= (
        {"prompt": prompt}
        if "chat" not in path
        else {"messages": [{"role": "user", "content": PROMPT}]}
    )
    whole = post(base, path, body).json()
    choice = whole["choices"][0]
    text = choice["text"] if "chat" not in path else choice["message"]["content"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
    assert text == tok.decode(made[2][:STEP])  # STEP tokens, then the stop id, hidden and billed
    assert whole["usage"]["completion_tokens"] == STEP + 1
    streamed_text, chunks = streamed(base, path, body)
    assert streamed_text == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_n_and_best_of_stop_at_the_stop_id(made, server):
    base, served = server
    prompt = served.tokenizer.encode(PROMPT)
    greedy = served.tokenizer.decode(made[2][:STEP])
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    for extra in ({"n": 2}, {"n": 1, "best_of": 2}):
        choices = post(base, "/v1/completions", body | extra).json()["choices"]
        assert [c["text"] for c in choices] == [greedy] * extra["n"], extra
        assert {c["finish_reason"] for c in choices} == {"stop"}


def test_a_stop_token_id_outside_the_vocabulary_is_a_400_naming_it(server):
    base, served = server
    bad = served.vocab_size + 3
    r = post(base, "/v1/completions", {"prompt": "the", "stop_token_ids": [1, bad]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "stop_token_ids" and str(bad) in error["message"]
    r = post(base, "/v1/completions", {"prompt": "the", "max_tokens": 2, "min_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    assert post(base, "/v1/completions", {"prompt": "the", "max_tokens": 2}).status_code == 200


def test_requests_that_leave_sampling_out_take_the_models_defaults_unless_vllm(made, tmp_path):
    from decoderlm.commands.serve import load_served
    from decoderlm.server import protocol

    path = hf_dir(made, tmp_path, "generation")
    config = json.loads((path / "generation_config.json").read_text())
    config |= {"temperature": 0.0, "top_k": 0, "top_p": 0.5}
    (path / "generation_config.json").write_text(json.dumps(config))
    for choice, defaults in (("auto", {"temperature": 0.0, "top_p": 0.5}), ("vllm", {})):
        args = serve_args(path, kv_cache_memory="1MiB", max_queue=8, generation_config=choice)
        served = load_served(args)
        try:
            assert served.sampling_defaults == defaults  # top_k 0 is no top-k, as HF reads it
        finally:
            served.engine.shutdown(0)
    body = protocol.CompletionRequest(prompt="x", top_p=0.9)
    params = protocol.to_params(body, 4, None, (), {"temperature": 0.0, "top_p": 0.5})
    assert params.sampling == SamplingParams(temperature=0.0, top_p=0.9)  # the request's wins
