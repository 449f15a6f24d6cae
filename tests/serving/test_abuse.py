"""Nothing lost, nothing frozen: one request cannot freeze the server, and a dead or broken engine
is an error status (never a 200), an exit for a supervisor, or refused at load.

The cases of benchmarks/abuse.py, each bounded in time; those that involve the engine's process
run a real `decoderlm serve` on loopback.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from conftest import (
    CONTEXT,
    LONG_STREAM,
    TEXT,
    free_port,
    make_served,
    serve_args,
    wait_healthy,
    wait_healthy_process,
)
from decoderlm import DecoderLM, ModelConfig
from decoderlm.chat_template import ChatTemplate
from decoderlm.checkpoint import save_model
from decoderlm.engine.engine import Engine
from decoderlm.engine.sampler import SamplingState, sample
from decoderlm.engine.types import RequestParams
from decoderlm.inference.sampling import SamplingParams
from decoderlm.server.app import create_app
from decoderlm.server.limits import Limits
from decoderlm.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0)


def until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def assert_error_shape(response: httpx.Response, status: int, match: str) -> dict:
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert match in error["message"], error["message"]
    return error


def in_background(fn) -> tuple[threading.Thread, list]:
    """fn() on a thread of its own; (the thread, a list that gets its result)."""
    results: list = []
    thread = threading.Thread(target=lambda: results.append(fn()))
    thread.start()
    return thread, results


def health_ms(base: str) -> float:
    start = time.monotonic()
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    return (time.monotonic() - start) * 1000


@pytest.fixture
def limited(run_dir, loaded, start_server):
    """start(limits, **engine_kwargs) → (base URL, Served) of a fresh app with those limits."""

    def start(limits: Limits, **engine_kwargs):
        served = make_served(run_dir, loaded, kv_cache_memory="1MiB", **engine_kwargs)
        base = start_server(create_app(lambda: served, grace_s=0, limits=limits))
        wait_healthy(base)
        return base, served

    return start


# §2 One request must not freeze the server.


def test_a_body_over_the_limit_is_413_by_content_length_or_by_counting_chunks(limited):
    base, _ = limited(Limits(max_request_bytes=1000))
    body = json.dumps({"prompt": "a" * 2000, "max_tokens": 1}).encode()
    r = httpx.post(f"{base}/v1/completions", content=body,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert_error_shape(r, 413, "larger than the server's limit of 1000 bytes")
    chunked = httpx.post(f"{base}/v1/completions", content=iter([body[:600], body[600:]]),
                         headers={"content-type": "application/json"})  # fmt: skip
    assert "content-length" not in chunked.request.headers
    assert_error_shape(chunked, 413, "--max-request-bytes")
    small = {"prompt": "ab", "max_tokens": 1}
    assert httpx.post(f"{base}/v1/completions", json=small).status_code == 200


def test_a_body_announced_over_the_limit_is_refused_before_it_is_sent(limited):
    # 50 MB announced, none sent: the 413 comes at once, nothing waits for (or buffers) the body.
    base, _ = limited(Limits())
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 50000000\r\n\r\n")  # fmt: skip
        reply = b""
        while b"}}" not in reply:  # the whole reply, as the server closes the connection
            chunk = s.recv(65536)
            assert chunk, reply
            reply += chunk
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413"), reply[:200]
    assert '"error": {"message": "the request body is larger' in reply


def test_too_many_prompts_or_tokens_are_400_before_any_work(limited, monkeypatch):
    base, served = limited(Limits(max_prompts_per_request=4, max_tokens_per_request=40))
    scored = []
    monkeypatch.setattr(served.engine, "score", lambda *a: scored.append(a))
    url = f"{base}/v1/completions"
    five = {"prompt": ["ab"] * 5, "echo": True, "logprobs": 2, "max_tokens": 1}
    assert_error_shape(httpx.post(url, json=five), 400, "at most 4 per request")
    ids = {"prompt": [[1] * 30], "max_tokens": 1, "n": 2}  # 30 tokens × n=2 > 40
    assert_error_shape(httpx.post(url, json=ids), 400, "at most 40 prompt tokens")
    chat = {"messages": [{"role": "user", "content": "a" * 40}], "max_tokens": 1}
    assert_error_shape(httpx.post(f"{base}/v1/chat/completions", json=chat), 400, "at most 40")
    assert scored == [] and served.engine.stats().prompt_tokens == 0


def test_scoring_waits_for_queue_room_and_a_full_queue_scores_nothing(limited, monkeypatch):
    # 6 prompts echoed with logprobs cannot all queue (max_queue 4): 429 before any scoring.
    # The engine's thread is held in a call meanwhile, so that no step takes a queued prompt
    # into the batch (which would make room for the others).
    base, served = limited(Limits(), max_queue=4)
    scored = []
    score = served.engine.score
    monkeypatch.setattr(served.engine, "score", lambda *a: scored.append(a) or score(*a))
    body = {"prompt": ["ab", "cd", "ef", "gh", "ij", "kl"], "echo": True, "logprobs": 2,
            "max_tokens": 1}  # fmt: skip
    held, release = threading.Event(), threading.Event()
    served.engine.call(lambda engine: held.set() or release.wait(30))
    assert held.wait(30)
    try:
        r = httpx.post(f"{base}/v1/completions", json=body)
    finally:
        release.set()
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    assert scored == []
    until(lambda: served.engine.stats().waiting == 0 and served.engine.stats().running == 0)
    body["prompt"] = body["prompt"][:4]
    choices = httpx.post(f"{base}/v1/completions", json=body).json()["choices"]
    assert len(scored) == 4 and [len(c["logprobs"]["tokens"]) for c in choices] == [3] * 4


def _generated(engine: Engine) -> int:
    return engine.core.counters.generated


def test_the_engine_runs_one_call_per_step_so_scoring_takes_turns(loaded):
    # Calls queued together run on successive steps, with a decode step of the running sequence
    # between each: one request's scoring cannot hold the engine's thread for all its prompts.
    model, tokenizer = loaded
    engine = Engine(model, tokenizer, kv_cache_memory="1MiB")
    params = RequestParams(CONTEXT - 2, GREEDY, ignore_eos=True)
    engine.submit("a", params, on_event=lambda event: None)
    engine.step()  # its prefill and first token
    futures = [engine.call(_generated) for _ in range(4)]  # starts the engine's thread
    seen = [f.result(timeout=30) for f in futures]
    engine.shutdown(0)
    assert seen == sorted(set(seen)), seen  # a token generated between every two calls


TEMPLATE_BOMBS = {
    "{{ 'x' * 100000000 }}": "builds a sequence of 100000000 items",
    "{% for i in range(1000000000) %}{{ i }}{% endfor %}": "OverflowError",
    "{% include 'other.jinja' %}": "TypeError: no loader",
    "{{ 7 ** 1000000 }}": "7 ** 1000000: too large",
    "{{ messages[0].content.__class__.__mro__ }}": "attribute '__class__' of 'str' object is unsafe",
    "{{ nothing.at.all }}": "'nothing' is undefined",
    "{{ raise_exception('no system role') }}": "no system role",
    "{{ 1 + messages }}": "TypeError",
    "{% for i in range(99999) %}{{ 'y' * 999 }}{% endfor %}": "exceeds 65536 characters",
    "{% for i in range(99999) %}{% for j in range(99999) %}{% if i.real < 0 %}.{% endif %}{% endfor %}{% endfor %}":
        "took too long",
}  # fmt: skip


def test_chat_template_bombs_are_400s_naming_the_problem_and_health_stays_fast(limited):
    base, served = limited(Limits(max_template_chars=65536, template_timeout_s=0.5))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for source, problem in TEMPLATE_BOMBS.items():
        served.chat_template = ChatTemplate(source)
        url = f"{base}/v1/chat/completions"
        request, replies = in_background(lambda url=url: httpx.post(url, json=chat, timeout=30))
        probes = [health_ms(base)]
        request.join(timeout=30)
        probes.append(health_ms(base))
        error = assert_error_shape(replies[0], 400, problem)
        assert error["param"] == "messages" and "chat template" in error["message"]
        assert max(probes) < 1000, (source, probes)
    served.chat_template = ChatTemplate()
    assert httpx.post(f"{base}/v1/chat/completions", json=chat).status_code == 200


def test_sampling_never_chooses_an_id_past_the_tokenizer():
    logits = torch.zeros(2, 10)
    logits[:, 8] = 50.0  # a padded id the tokenizer cannot decode, likeliest by far
    greedy = SamplingState.create(RequestParams(sampling=GREEDY), 0, [1], 10, torch.device("cpu"))
    hot = RequestParams(sampling=SamplingParams(temperature=2.0), seed=0, logprobs=3)
    sampled = SamplingState.create(hot, 0, [1], 10, torch.device("cpu"))
    chosen = sample(logits, [greedy, sampled], decodable=8)
    assert all(c.token < 8 for c in chosen)
    assert torch.topk(chosen[1].logprobs, 3).indices.max() < 8


# §3 A dead or broken engine.


def _save(path: Path, tokenizer: Tokenizer, vocab_size: int, pad_bias: float = 1.0) -> Path:
    """A tiny model whose vocabulary is `vocab_size` (the tokenizer's may differ); pad_bias > 1
    makes the ids past the tokenizer's the likeliest."""
    torch.manual_seed(0)
    config = ModelConfig.from_preset("llama-tiny", vocab_size=vocab_size, context_length=CONTEXT,
                                     d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                     tie_embeddings=False)  # fmt: skip
    model = DecoderLM(config).eval()
    with torch.no_grad():
        model.head.weight[: tokenizer.vocab_size] *= 0.01
        model.head.weight[tokenizer.vocab_size :] *= pad_bias
    return save_model(path, model, tokenizer)


def test_a_model_vocabulary_padded_past_the_tokenizer_serves_text(tmp_path, start_server):
    # The padded ids are the likeliest tokens; they used to be sampled, failed to decode and ended
    # every request with 200, empty text and finish_reason "error".
    from decoderlm.commands.serve import load_served

    tokenizer = Tokenizer.train_char([TEXT])
    run = _save(tmp_path / "padded", tokenizer, tokenizer.vocab_size + 40, pad_bias=5.0)
    served = load_served(serve_args(run, kv_cache_memory="1MiB", max_queue=8))
    assert served.vocab_size == tokenizer.vocab_size
    base = start_server(create_app(lambda: served, grace_s=0))
    wait_healthy(base)
    for extra in ({"temperature": 0}, {"temperature": 1.5, "seed": 1}):
        body = {"prompt": "ab", "max_tokens": 8, "logprobs": 5, "echo": True} | extra
        r = httpx.post(f"{base}/v1/completions", json=body)
        choice = r.json()["choices"][0]
        assert r.status_code == 200 and choice["finish_reason"] in ("length", "stop"), r.text
        assert choice["text"].startswith("ab") and r.json()["usage"]["completion_tokens"] >= 1
        assert all(len(top) == 5 for top in choice["logprobs"]["top_logprobs"][1:])
    big = {"prompt": [[tokenizer.vocab_size + 1]], "max_tokens": 1}
    assert_error_shape(httpx.post(f"{base}/v1/completions", json=big), 400, "outside the vocab")


def serve_command(run: Path, port: int, *extra: str) -> list[str]:
    # float32: the same tokens on every CPU (the default dtype follows the CPU)
    return [sys.executable, "-m", "decoderlm.cli", "serve", "--checkpoint", str(run),
            "--port", str(port), "--kv-cache-memory", "4MiB", "--dtype", "float32",
            "--no-compile", *extra]  # fmt: skip


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused_at_load(tmp_path):
    tokenizer = Tokenizer.train_char([TEXT])
    run = _save(tmp_path / "small-model", tokenizer, tokenizer.vocab_size - 10)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(serve_command(run, free_port()), env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("decoderlm: error:")]
    assert len(errors) == 1 and "tokenizer has" in errors[0] and "vocabulary only" in errors[0]


def engine_pid(server: subprocess.Popen) -> int:
    """The engine's child process of a `decoderlm serve`."""
    for children in Path(f"/proc/{server.pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                return int(pid)
    raise AssertionError("no engine process")


@pytest.fixture
def serve(long_run_dir):
    """start(*flags) → (base URL, process) of a real `decoderlm serve`; killed after the test."""
    procs = []

    def start(*extra: str):
        port = free_port()
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(serve_command(long_run_dir, port, *extra), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"
        wait_healthy_process(base, proc)
        return base, proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_metrics_and_health_answer_while_the_engine_is_stopped(serve):
    base, proc = serve()
    pid = engine_pid(proc)
    os.kill(pid, signal.SIGSTOP)
    try:
        metrics, probes = in_background(lambda: httpx.get(f"{base}/metrics", timeout=10))
        time.sleep(0.2)
        fast = [health_ms(base) for _ in range(5)]
        metrics.join(timeout=10)
        assert max(fast) < 1000, fast
        assert probes[0].status_code == 200  # the histograms, without the engine's gauges
        assert "decoderlm_time_to_first_token_seconds" in probes[0].text
    finally:
        os.kill(pid, signal.SIGCONT)
    assert "decoderlm_requests_running" in httpx.get(f"{base}/metrics", timeout=10).text


def test_a_killed_engine_fails_requests_with_error_statuses_and_the_server_exits_2(serve):
    base, proc = serve("--grace-period", "5")
    long = {"prompt": "x", "max_tokens": LONG_STREAM, "temperature": 0}
    with httpx.stream("POST", f"{base}/v1/completions", json=long | {"stream": True},
                      timeout=60) as r:  # fmt: skip
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        whole, replies = in_background(
            lambda: httpx.post(f"{base}/v1/completions", json=long, timeout=60)
        )
        time.sleep(0.3)
        os.kill(engine_pid(proc), signal.SIGKILL)
        rest = [line for line in lines if line]
    whole.join(timeout=30)
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: ") :])["error"]
    assert "engine has stopped" in error["message"] and error["type"] == "service_unavailable"
    assert_error_shape(replies[0], 503, "the engine has stopped")
    assert proc.wait(timeout=60) == 2
    output = proc.stdout.read().decode()
    errors = [line for line in output.splitlines() if line.startswith("decoderlm: error:")]
    assert len(errors) == 1 and "exiting for a supervisor to restart" in errors[0], output[-2000:]


def test_a_request_the_engine_fails_is_500_or_an_error_event_never_a_200(limited, monkeypatch):
    base, served = limited(Limits())

    def broken(*args):
        raise RuntimeError("a forward pass failed")

    monkeypatch.setattr(served.engine.runner, "forward", broken)
    body = {"prompt": "ab", "max_tokens": 4}
    whole = httpx.post(f"{base}/v1/completions", json=body)
    assert_error_shape(whole, 500, "the engine failed on this request")
    assert whole.json()["error"]["type"] == "server_error"
    with httpx.stream("POST", f"{base}/v1/completions", json=body | {"stream": True}) as r:
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert "the engine failed" in json.loads(events[-2][len("data: ") :])["error"]["message"]
    assert served.engine.failure is None  # the engine goes on
