"""A tiny random model saved as a run directory, and a real uvicorn server for it on 127.0.0.1."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from decoderlm import DecoderLM, ModelConfig, load
from decoderlm.checkpoint import save_model
from decoderlm.cpu import paged_attention
from decoderlm.tokenizer import Tokenizer

# Every character a test sends, the default chat template's included.
TEXT = (
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789 \n.,:;!?'\"-()[]{}<>/|_+=*#%&@"
    "éàü€😀"
)
CONTEXT = 96
LONG_STREAM = 1500  # tokens of one greedy stream: a second or more of engine steps
# The marks of a module testing the compiled decode pass (`decoderlm.cpu.paged_step`).
COMPILED_PASS = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(
        not paged_attention.static_available(torch.float32),
        reason="no C/C++ compiler for the paged attention op",
    ),
]


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    tokenizer = Tokenizer.train_char([TEXT])
    config = ModelConfig.from_preset(
        "llama-tiny",
        vocab_size=tokenizer.vocab_size,
        context_length=CONTEXT,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
    )
    run = tmp_path_factory.mktemp("run")
    save_model(run, DecoderLM(config).eval(), tokenizer)
    return run


@pytest.fixture(scope="session")
def loaded(run_dir):
    """(model, tokenizer) as `decoderlm serve` loads them, for the solo reference runs."""
    return load(run_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(app) -> Iterator[str]:
    """Run `app` under uvicorn on a free loopback port in a thread; yields its base URL."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def wait_healthy(base: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{base}/health").status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the server never became healthy")
        time.sleep(0.02)


def paced(step, seconds: float):
    """An engine step that waits first: the engine's thread then streams slowly enough to catch."""

    def slow_step():
        time.sleep(seconds)
        return step()

    return slow_step


def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def make_served(run_dir: Path, loaded, **engine_kwargs):
    """A `Served` over a fresh engine on the session's model."""
    from decoderlm.chat_template import load_chat_template
    from decoderlm.engine.engine import Engine
    from decoderlm.server.http import Served

    model, tokenizer = loaded
    return Served(
        engine=Engine(model, tokenizer, **engine_kwargs),
        tokenizer=tokenizer,
        model_name=run_dir.name,
        context_length=model.config.context_length,
        vocab_size=model.config.vocab_size,
        chat_template=load_chat_template(run_dir, Tokenizer.EOT),
    )


def serve_args(checkpoint: Path, **overrides):
    """`decoderlm serve --checkpoint checkpoint --no-compile`'s arguments as its parser makes
    them, the weights in the checkpoint's own dtype (dtype None), 512 tokens a step, then
    `overrides`."""
    from argparse import Namespace

    from decoderlm.cli import build_parser

    args = build_parser().parse_args(["serve", "--checkpoint", str(checkpoint), "--no-compile"])
    return Namespace(**(vars(args) | {"dtype": None, "max_batched_tokens": 512} | overrides))


def process_served(run_dir: Path, **engine_kwargs):
    """A `Served` over an engine in a process of its own, as `decoderlm serve` starts it."""
    from decoderlm.commands.serve import load_served

    return load_served(serve_args(run_dir, **engine_kwargs), engine_process=True)


@pytest.fixture(scope="session")
def server(request, run_dir, loaded) -> Iterator[tuple[str, object]]:
    """(base URL, Served) of a running server with room for many sequences at once; its engine
    runs in a thread of the test's process, or with `parametrize("server", ["process"],
    indirect=True)` in a process of its own."""
    from decoderlm.server.app import create_app

    sizes = {"kv_cache_memory": "4MiB", "max_queue": 64}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: one thread beats two fighting over a shared CPU
    if getattr(request, "param", "thread") == "process":
        served = process_served(run_dir, **sizes)
    else:
        served = make_served(run_dir, loaded, **sizes)
    with live_server(create_app(lambda: served, grace_s=1.0)) as base:
        wait_healthy(base)
        yield base, served
    torch.set_num_threads(threads)


@pytest.fixture
def start_server() -> Iterator[Callable]:
    """Start more servers (each its own app) for one test; all stopped after it."""
    stack: list = []

    def start(app) -> str:
        ctx = live_server(app)
        stack.append(ctx)
        return ctx.__enter__()

    yield start
    for ctx in reversed(stack):
        ctx.__exit__(None, None, None)


@pytest.fixture(scope="session")
def long_run_dir(tmp_path_factory) -> Path:
    """A tiny model with a long context, so one stream runs for a second or more (greedy after
    "x" it meets no end-of-text within LONG_STREAM tokens)."""
    torch.manual_seed(0)
    tokenizer = Tokenizer.train_char([TEXT])
    config = ModelConfig.from_preset("llama-tiny", vocab_size=tokenizer.vocab_size,
                                     context_length=LONG_STREAM + 8, d_model=32, n_layers=2,
                                     n_heads=4, n_kv_heads=2)  # fmt: skip
    run = tmp_path_factory.mktemp("long-run")
    save_model(run, DecoderLM(config).eval(), tokenizer)
    return run


def wait_healthy_process(base: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            wait_healthy(base, timeout=0.5)
            return
        except (httpx.TransportError, RuntimeError):
            time.sleep(0.1)
    raise RuntimeError("decoderlm serve did not become healthy")
