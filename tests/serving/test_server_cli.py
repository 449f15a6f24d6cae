"""`decoderlm serve` as a process (SIGTERM drains and exits 0), `decoderlm chat`, and chat templates."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from conftest import LONG_STREAM, free_port, serve_args, wait_healthy_process
from decoderlm.chat_template import ChatTemplate, load_chat_template
from decoderlm.cli import main
from decoderlm.errors import DecoderLMError

LLAMA2_STYLE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def test_checkpoint_chat_template_renders_like_transformers(tmp_path):
    config = {"chat_template": LLAMA2_STYLE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = load_chat_template(tmp_path)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert template.render(messages) == "<s>[INST] Hi [/INST] Yo</s>"
    assert template.stop == ()
    with pytest.raises(DecoderLMError, match="roles must alternate"):
        template.render(messages[::-1])


def test_default_template_without_a_tokenizer_config(tmp_path):
    template = load_chat_template(tmp_path, eos_token="<|endoftext|>")
    assert template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False) == (
        "User: Hi\n\n"
    )
    assert template.stop == ("\nUser:",)
    with pytest.raises(DecoderLMError, match="not valid Jinja2"):
        ChatTemplate("{% for %}")


def test_chat_command_streams_replies_and_resets(run_dir, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi!\n/reset\nHey\n/quit\n"))
    argv = ["chat", "--checkpoint", str(run_dir), "--max-tokens", "5", "--temperature", "0",
            "--no-compile"]  # fmt: skip
    assert main([*argv, "--kv-cache-memory", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert "/reset starts over" in out and "(new conversation)" in out
    assert main([*argv, "--top-p", "2"]) == 2


def test_sigterm_lets_a_running_stream_finish_then_exits_0(long_run_dir):
    port = free_port()
    # float32: the same long stream on every CPU (the default dtype follows the CPU)
    cmd = [sys.executable, "-m", "decoderlm.cli", "serve", "--checkpoint", str(long_run_dir),
           "--port", str(port), "--kv-cache-memory", "4MiB", "--grace-period", "60",
           "--dtype", "float32", "--no-compile"]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy_process(base, proc)
        body = {"prompt": "x", "max_tokens": LONG_STREAM, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            events = [first, *(line for line in lines if line)]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
        assert chunks[0]["choices"][0]["finish_reason"] is None  # running when SIGTERM went
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert reasons[-1] == "length"  # finished within the grace period, not cancelled
        assert chunks[-1]["usage"]["completion_tokens"] == LONG_STREAM
        assert proc.wait(timeout=30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{base}/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_takes_its_api_key_from_the_environment_and_its_hosts_from_the_flag(run_dir):
    port = free_port()
    cmd = [sys.executable, "-m", "decoderlm.cli", "serve", "--checkpoint", str(run_dir),
           "--port", str(port), "--kv-cache-memory", "1MiB", "--engine", "thread",
           "--allowed-hosts", "proxy.example,127.0.0.1", "--no-compile"]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "DECODERLM_API_KEY": "sk-env"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy_process(base, proc)
        assert httpx.get(f"{base}/v1/models").status_code == 401
        keyed = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer sk-env"})
        assert keyed.status_code == 200
        for host, status in (("proxy.example", 200), (f"localhost:{port}", 421)):
            assert httpx.get(f"{base}/health", headers={"Host": host}).status_code == status
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("native", [True, False])
def test_serve_picks_bfloat16_where_the_cpu_has_native_bf16_as_train_does(
    native, monkeypatch, capsys
):
    from argparse import Namespace

    from decoderlm.commands.serve import announce_dtype, serving_dtype

    monkeypatch.setattr("decoderlm.cpu.features.has_native_bf16", lambda: native)
    chosen = "bfloat16" if native else "float32"
    assert serving_dtype("auto") == chosen
    announce_dtype(Namespace(dtype=chosen, dtype_chosen=True))
    assert f"serving in {chosen}" in capsys.readouterr().err
    assert serving_dtype("fp32") == "float32" and serving_dtype("bf16") == "bfloat16"
    with pytest.raises(DecoderLMError, match="dtype='int3' must be one of"):
        serving_dtype("int3")


@pytest.mark.parametrize("flag", ["--max-queue", "--max-batched-tokens"])
def test_a_size_below_one_is_a_one_line_error_before_anything_loads(run_dir, capsys, flag):
    assert main(["serve", "--checkpoint", str(run_dir), flag, "0"]) == 2
    assert capsys.readouterr().err == f"decoderlm: error: {flag}=0 must be ≥ 1\n"


def test_serve_runs_its_engine_under_the_float32_matmul_precision_it_is_given(run_dir):
    import torch

    from decoderlm.cli import build_parser
    from decoderlm.commands.serve import load_served

    argv = ["serve", "--checkpoint", str(run_dir), "--matmul-precision", "medium"]
    assert serve_args(run_dir).matmul_precision == "highest"
    args = serve_args(run_dir, matmul_precision=build_parser().parse_args(argv).matmul_precision)
    served = load_served(args)  # the engine built on a thread of this process, as in its own
    try:
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        served.engine.shutdown(0)
