"""The tokenizer and chat template of a GGUF file: ids identical to transformers' GGUF tokenizer
(unicode, code, whitespace runs, digits, special-token text) for each pre-tokenizer and for the
SentencePiece model, BOS added to completion prompts where the file says so, special ids kept."""

from __future__ import annotations

import pytest
import transformers
from gguf import GGMLQuantizationType as T
from gguf_builders import CHATML, CORPUS, SAMPLES, bpe_vocab, randomize, spm_vocab, write_gguf

import decoderlm
from conftest import NO_SPECIALS
from decoderlm.chat_template import load_chat_template
from decoderlm.errors import DecoderLMError

KINDS = ["smollm", "default", "gpt2", "llama-bpe", "qwen2", "sentencepiece"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """kind → a tiny llama GGUF file with that tokenizer, made on first use."""
    made = {}

    def make(kind: str):
        if kind not in made:
            vocab = spm_vocab() if kind == "sentencepiece" else bpe_vocab(kind)
            config = transformers.LlamaConfig(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=len(vocab.tokens), **NO_SPECIALS,
            )  # fmt: skip
            hf = randomize(transformers.LlamaForCausalLM(config))
            path = tmp_path_factory.mktemp(kind) / "tok.gguf"
            made[kind] = write_gguf(path, hf, "llama", vocab, T.F32), vocab
        return made[kind]

    return make


@pytest.mark.parametrize("kind", KINDS)
def test_ids_equal_transformers_gguf_tokenizer(files, kind):
    path, _ = files(kind)
    _, ours = decoderlm.load(path)
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in [*SAMPLES, *CORPUS[:6]]:
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text) == ids, text
        assert ours.encode_prompt(text) == theirs.encode(text), text  # BOS where it adds one
        assert ours.decode(ids) == theirs.decode(ids), text


def test_sentencepiece_prompts_get_bos_and_byte_level_ones_do_not(files):
    _, bpe = decoderlm.load(files("smollm")[0])
    _, spm = decoderlm.load(files("sentencepiece")[0])
    assert spm.encode_prompt("hi")[0] == spm.special.bos == 1 and spm.encode("hi")[0] != 1
    assert bpe.encode_prompt("hi") == bpe.encode("hi")  # add_bos_token is false in that file


def test_special_ids_and_special_token_text(files):
    path, vocab = files("smollm")
    _, tokenizer = decoderlm.load(path)
    assert (tokenizer.special.bos, tokenizer.special.eos) == (1, 2)
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[0] == vocab.tokens.index("<|im_start|>")
    assert tokenizer.eot_id == 0  # <|endoftext|>: how generation stops is unchanged


def test_chat_template_from_the_file_renders_as_transformers(files):
    path, _ = files("smollm")
    template = load_chat_template(path)
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert template.source == CHATML and template.eos_token == "<|im_end|>"
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert template.render(messages) == expected


def test_an_unknown_pre_tokenizer_is_a_one_line_error(tmp_path):
    vocab = bpe_vocab("gpt2")
    vocab.pre = "falcon"
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        vocab_size=len(vocab.tokens), **NO_SPECIALS,
    )  # fmt: skip
    path = write_gguf(tmp_path / "x.gguf", transformers.LlamaForCausalLM(config), "llama", vocab)
    with pytest.raises(
        DecoderLMError, match=r"tokenizer.ggml.pre='falcon' is not supported; supported: gpt2"
    ):
        decoderlm.load(path)
