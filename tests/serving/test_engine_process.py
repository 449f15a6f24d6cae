"""EngineProcess: the engine in a child process answers as the in-process one, and its death or a
failed load is an error the server can report, never a hang."""

from __future__ import annotations

import inspect
import operator
import shutil
import sys
import threading
import time
import types

import httpx
import pytest
import torch

from conftest import process_served, wait_healthy
from decoderlm.engine.engine import Engine
from decoderlm.engine.engine_process import (
    EngineProcess,
    EngineSpec,
    build_engine,
    build_engine_thread,
)
from decoderlm.engine.types import EngineClient, EngineStoppedError, RequestParams
from decoderlm.errors import DecoderLMError
from decoderlm.inference.sampling import SamplingParams
from decoderlm.server.app import create_app
from decoderlm.server.playground import _model_facts

GREEDY = SamplingParams(temperature=0)


@pytest.fixture
def child(run_dir):
    engine = EngineProcess(EngineSpec(str(run_dir), engine={"kv_cache_memory": "1MiB"}, threads=1))
    engine.start()
    yield engine
    engine.shutdown(0)


def test_engine_and_engine_process_have_every_member_of_engine_client(loaded):
    # What the app, the playground and `decoderlm chat` use, with the protocol's signatures.
    model, tokenizer = loaded
    members = {name for name in vars(EngineClient) if not name.startswith("_")}
    assert members == {
        *("max_sequence", "failure", "start", "shutdown", "submit", "stream", "stream_batches"),
        *("cancel", "score", "call", "stats"),
    }
    engines = [Engine(model, tokenizer, kv_cache_memory="1MiB"), EngineProcess(EngineSpec("x"))]
    for name in sorted(members):
        declared = inspect.getattr_static(EngineClient, name)
        for engine in engines:
            found = inspect.getattr_static(engine, name)  # AttributeError if it lacks it
            if isinstance(declared, property):
                want = inspect.signature(declared.fget, eval_str=True).return_annotation
                if isinstance(found, property):
                    assert inspect.signature(found.fget, eval_str=True).return_annotation == want
                else:  # an attribute of the instance
                    assert isinstance(found, want), (type(engine).__name__, name)
            else:
                got = inspect.signature(found, eval_str=True)
                assert got == inspect.signature(declared, eval_str=True), (type(engine), name)


def test_a_checkpoint_that_fails_to_load_is_one_clear_error(tmp_path, run_dir):
    with pytest.raises(DecoderLMError, match=r"no such checkpoint: .*missing; give a run"):
        EngineProcess(EngineSpec(str(tmp_path / "missing"))).start()
    bare = shutil.copytree(run_dir, tmp_path / "bare")
    (bare / "tokenizer.json").unlink()
    with pytest.raises(DecoderLMError, match=r"has no tokenizer\.json, so text cannot be encoded"):
        EngineProcess(EngineSpec(str(bare))).start()
    with pytest.raises(DecoderLMError, match=r"has no tokenizer\.json"):  # --engine thread
        build_engine(EngineSpec(str(bare)))
    with pytest.raises(DecoderLMError, match=r"has no tokenizer\.json"):
        build_engine_thread(EngineSpec(str(bare)))


def test_the_thread_that_loads_the_engine_is_the_one_that_steps_it(run_dir, loaded):
    model, tokenizer = loaded
    engine = build_engine_thread(EngineSpec(str(run_dir), engine={"kv_cache_memory": "1MiB"}))
    steppers = set()
    step = engine.step
    engine.step = lambda: steppers.add(threading.current_thread().name) or step()
    try:
        engine.start()  # a no-op: it already steps
        params = RequestParams(12, GREEDY)
        alone = Engine(model, tokenizer, kv_cache_memory="1MiB").generate(["Hello there"], params)
        assert engine.generate(["Hello there"], params) == alone
        assert steppers == {"decoderlm-engine"}
    finally:
        engine.shutdown(0)  # (its last step, applying the cancels, runs here)


def test_generation_submit_errors_and_calls_equal_the_in_process_engine(child, loaded):
    model, tokenizer = loaded
    params = RequestParams(12, GREEDY, logprobs=2)
    events, done = [], threading.Event()

    def sink(event):
        events.append(event)
        if event.finish_reason is not None:
            done.set()

    child.submit("Hello there", params, on_event=sink)
    assert done.wait(30)
    alone = Engine(model, tokenizer, kv_cache_memory="1MiB").generate(["Hello there"], params)[0]
    assert [e.token_id for e in events if e.token_id is not None] == alone.token_ids
    assert [e.logprob for e in events if e.token_id is not None] == alone.logprobs
    config, dtype, parameters = child.call(_model_facts).result(30)
    assert (config, dtype, parameters) == (model.config, torch.float32, model.num_params())
    with pytest.raises(DecoderLMError, match="more than the model's context_length"):
        child.submit([1] * (model.config.context_length + 1), params, on_event=sink)
    assert child.stats().prompt_tokens == len(tokenizer.encode("Hello there"))


def test_a_call_the_child_cannot_unpickle_or_answer_fails_alone(child, monkeypatch):
    # Only importable functions may be passed (not this test module's: in the child another
    # conftest comes first on sys.path). A function of a module only this process has:
    only_here = types.ModuleType("decoderlm_only_in_this_process")
    exec("def facts(engine):\n    return engine.model.config", only_here.__dict__)
    monkeypatch.setitem(sys.modules, only_here.__name__, only_here)
    with pytest.raises(ModuleNotFoundError, match="decoderlm_only_in_this_process"):
        child.call(only_here.facts).result(30)
    with pytest.raises(DecoderLMError, match="cannot be sent back"):
        child.call(operator.attrgetter("_lock")).result(30)  # a Condition: it does not pickle
    with pytest.raises(AttributeError):  # a lambda does not pickle here, before anything is sent
        child.call(lambda engine: 0)
    assert child.call(_model_facts).result(30)[0].n_layers == 2  # the child goes on


def test_a_dead_engine_process_ends_open_streams_with_error_and_refuses_new_work(child):
    events, lock = [], threading.Lock()

    def sink(event):
        with lock:
            events.append(event)

    params = RequestParams(90, SamplingParams(temperature=1.0), ignore_eos=True, n=2)
    ids = [child.submit("a", params, on_event=sink) for _ in range(8)]  # 16 sequences
    until(lambda: events)
    child._process.kill()
    until(lambda: sum(e.finish_reason is not None for e in events) == 2 * len(ids))
    assert any(e.finish_reason == "error" for e in events)  # some were running when it died
    with pytest.raises(EngineStoppedError, match="engine process has exited"):
        child.submit("b", RequestParams(4, GREEDY), on_event=sink)
    with pytest.raises(EngineStoppedError):
        child.stats()
    assert "engine process has exited" in child.failure


def test_health_is_503_once_the_engine_process_dies_and_requests_are_refused(run_dir, start_server):
    served = process_served(run_dir, kv_cache_memory="1MiB", max_queue=8)
    base = start_server(create_app(lambda: served, grace_s=0))
    wait_healthy(base)
    body = {"prompt": "ab", "max_tokens": 3}
    assert httpx.post(f"{base}/v1/completions", json=body).status_code == 200
    served.engine._process.kill()
    until(lambda: served.engine.failure is not None)
    health = httpx.get(f"{base}/health")
    assert health.status_code == 503 and "engine process has exited" in health.json()["status"]
    refused = httpx.post(f"{base}/v1/completions", json=body)
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "service_unavailable"


def until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_engine_keeps_freed_memory_on_the_cpu_unless_cpu_kernels_is_off(loaded, monkeypatch):
    calls = []
    monkeypatch.setattr("decoderlm.cpu.heap.keep_freed_memory", lambda: calls.append(1))
    model, tokenizer = loaded
    Engine(model, tokenizer, kv_cache_memory="1MiB", cpu_kernels=False)
    assert calls == []
    Engine(model, tokenizer, kv_cache_memory="1MiB")
    assert calls == [1]
