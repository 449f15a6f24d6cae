"""`decoderlm convert --to-gguf`: files that gguf-py, transformers' GGUF loader and decoderlm read
back to the same model, tokenizer and chat template; a model loaded from a GGUF file (or a run
converted from one) writes its blocks back byte for byte."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_builders import CORPUS, SAMPLES
from gguf_reference import float32_linears, reference
from test_gguf_load import LOGITS_ATOL, llama_cpp_rope_freqs

import decoderlm
from decoderlm import DecoderLM, ModelConfig
from decoderlm.checkpoint import save_model
from decoderlm.cli import main
from decoderlm.errors import DecoderLMError
from decoderlm.gguf import export_gguf
from decoderlm.tokenizer import Tokenizer


def tensors(path) -> dict[str, tuple[str, list[int], bytes]]:
    return {
        t.name: (t.tensor_type.name, t.shape.tolist(), t.data.tobytes())
        for t in gguf.GGUFReader(path).tensors
    }


def test_a_gguf_loaded_model_writes_its_blocks_byte_for_byte(tiny_gguf, tmp_path):
    _, path = tiny_gguf("llama", T.Q4_1)  # token_embd, q, k (permuted), v, … in Q4_1; norms F32
    assert main(["convert", "--to-gguf", str(path), "--out", str(tmp_path / "copy.gguf")]) == 0
    assert tensors(tmp_path / "copy.gguf") == tensors(path)
    assert main(["convert", "--from-gguf", str(path), "--out", str(tmp_path / "run")]) == 0
    assert (
        main(["convert", "--to-gguf", str(tmp_path / "run"), "--out", str(tmp_path / "run.gguf")])
        == 0
    )
    assert tensors(tmp_path / "run.gguf") == tensors(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A decoderlm run: a Llama-style model (GQA, untied) and a byte-level BPE tokenizer."""
    tokenizer = Tokenizer.train_bpe(CORPUS, vocab_size=320)
    config = ModelConfig.from_preset(
        "llama-tiny", vocab_size=tokenizer.vocab_size, d_model=64, n_heads=4, n_kv_heads=2,
        d_ff=128, n_layers=2, context_length=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = DecoderLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return save_model(tmp_path_factory.mktemp("run"), model, tokenizer)


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"])
def test_an_exported_run_reads_back_in_transformers_as_in_decoderlm(run, tmp_path, kind):
    out = tmp_path / f"run-{kind}.gguf"
    assert main(["convert", "--to-gguf", str(run), "--out", str(out), "--type", kind]) == 0
    model, tokenizer = decoderlm.load(out)
    original, original_tokenizer = decoderlm.load(run)
    theirs = reference(out)
    ids = torch.randint(
        0, tokenizer.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        logits = float32_linears(model)(ids)  # the block products' own rounding: test_gguf_load
        torch.testing.assert_close(logits, theirs(ids).logits, atol=LOGITS_ATOL, rtol=0)
        if kind == "f32":
            torch.testing.assert_close(logits, original(ids), atol=LOGITS_ATOL, rtol=0)
    weights = {t.tensor_type.name for t in gguf.GGUFReader(out).tensors if len(t.shape) == 2}
    assert weights == {kind.upper()}
    for text in SAMPLES:
        assert tokenizer.encode(text) == original_tokenizer.encode(text), text


def test_the_tokenizer_written_is_transformers_too(run, tmp_path):
    import transformers

    out = export_gguf(*decoderlm.load(run), tmp_path / "t.gguf")
    theirs = transformers.AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)
    _, ours = decoderlm.load(run)
    for text in [*SAMPLES, *CORPUS[:6]]:
        assert theirs.encode(text, add_special_tokens=False) == ours.encode(text), text


def test_llama3_scaling_is_written_as_llama_cpps_rope_freqs(tmp_path):
    scaling = dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)  # fmt: skip
    config = ModelConfig.from_preset(
        "llama-tiny", vocab_size=320, d_model=64, n_heads=1, n_kv_heads=1, n_layers=1,
        rope_theta=500000.0, rope_scaling=scaling, context_length=16384,
    )  # fmt: skip
    tokenizer = Tokenizer.train_bpe(CORPUS, vocab_size=320)
    out = export_gguf(DecoderLM(config).eval(), tokenizer, tmp_path / "l3.gguf")
    freqs = next(t for t in gguf.GGUFReader(out).tensors if t.name == "rope_freqs.weight")
    expected = llama_cpp_rope_freqs(500000.0, 64, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(freqs.data, expected, rtol=1e-6)
    assert decoderlm.loading.read_config(out).rope_scaling == scaling


def test_what_gguf_cannot_hold_is_a_one_line_error(tmp_path, run):
    tokenizer = Tokenizer.train_char(["abc"])
    model = DecoderLM(ModelConfig.from_preset("llama-tiny", vocab_size=tokenizer.vocab_size))
    with pytest.raises(DecoderLMError, match="cannot export this tokenizer to GGUF"):
        export_gguf(model, tokenizer, tmp_path / "c.gguf")
    windowed = DecoderLM(ModelConfig.from_preset("llama-tiny", sliding_window=64))
    with pytest.raises(DecoderLMError, match="cannot export a sliding window to GGUF"):
        export_gguf(windowed, Tokenizer.train_bpe(CORPUS, 300), tmp_path / "w.gguf")
    assert (
        main(["convert", "--to-gguf", str(run), "--out", str(tmp_path / "x"), "--type", "q2_k"])
        == 2
    )
    assert not (tmp_path / "c.gguf").exists() and not (tmp_path / "x").exists()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_mamba2_file_written_back_reads_the_same(tmp_path, vocab):
    import transformers
    from gguf_builders import randomize, write_gguf
    from gguf_reference import NO_SPECIALS

    config = transformers.Mamba2Config(
        vocab_size=len(vocab.tokens), hidden_size=64, num_hidden_layers=2, num_heads=4,
        head_dim=32, state_size=16, n_groups=2, **NO_SPECIALS,
    )  # fmt: skip
    path = write_gguf(tmp_path / "m.gguf", randomize(transformers.Mamba2ForCausalLM(config)),
                      "mamba2", vocab, T.Q8_0)  # fmt: skip
    assert main(["convert", "--to-gguf", str(path), "--out", str(tmp_path / "copy.gguf")]) == 0
    original, copy = tensors(path), tensors(tmp_path / "copy.gguf")
    assert original.keys() == copy.keys()
    for name, (kind, shape, data) in original.items():
        assert copy[name][:2] == (kind, shape), name
        if not name.endswith("ssm_a"):  # A = −exp(ln(−A)): equal within a rounding
            assert copy[name][2] == data, name
    model, _ = decoderlm.load(path)
    again, _ = decoderlm.load(tmp_path / "copy.gguf")
    ids = torch.randint(0, len(vocab.tokens), (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(again(ids), model(ids), atol=1e-5, rtol=0)
