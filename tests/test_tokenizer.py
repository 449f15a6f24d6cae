"""Tokenizers: round trips, saved files load to the same ids, deterministic training, clear errors."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decoderlm.errors import DecoderLMError
from decoderlm.tokenizer import Tokenizer

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
    "Ünïcödé text — with ‘quotes’, emoji 😀 and tabs\t.\r\n",
] * 20

# Any Unicode string that UTF-8 can encode: hypothesis' text() leaves out lone surrogates.
UTF8_TEXT = st.text(max_size=200)


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer.train_bpe(CORPUS, vocab_size=300)


@pytest.fixture(scope="module")
def char() -> Tokenizer:
    return Tokenizer.train_char(CORPUS)


@settings(max_examples=200, deadline=None)
@given(text=UTF8_TEXT)
def test_bpe_decode_encode_is_identity_for_any_string(bpe: Tokenizer, text: str) -> None:
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_has_requested_vocab_size_and_eot_special(bpe: Tokenizer) -> None:
    assert bpe.vocab_size == 300
    assert bpe.eot_id is not None
    assert bpe.encode(Tokenizer.EOT) == [bpe.eot_id]
    assert bpe.decode(bpe.encode(f"a{Tokenizer.EOT}b")) == f"a{Tokenizer.EOT}b"


def test_bpe_learns_merges_that_shorten_the_corpus(bpe: Tokenizer) -> None:
    text = CORPUS[0]
    # 43 merges learned on a corpus that repeats this text 20 times: its words become single
    # tokens (17 tokens for 32 bytes), while punctuation stays split by the GPT-2 pre-tokenizer.
    assert len(bpe.encode(text)) <= 0.6 * len(text.encode("utf-8"))


def test_bpe_training_is_deterministic(bpe: Tokenizer) -> None:
    again = Tokenizer.train_bpe(CORPUS, vocab_size=300)
    assert again.backend.to_str() == bpe.backend.to_str()


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=sorted(set("".join(CORPUS))), max_size=200))
def test_char_decode_encode_is_identity_on_its_alphabet(char: Tokenizer, text: str) -> None:
    ids = char.encode(text)
    assert len(ids) == len(text)  # one token per character
    assert char.decode(ids) == text


def test_char_vocab_is_sorted_characters_then_eot(char: Tokenizer) -> None:
    alphabet = sorted(set("".join(CORPUS)))
    assert char.vocab_size == len(alphabet) + 1
    assert char.eot_id == len(alphabet)
    assert char.encode("".join(alphabet)) == list(range(len(alphabet)))
    assert char.encode("\n\r\t") == [alphabet.index(c) for c in "\n\r\t"]


def test_char_unknown_character_raises_naming_it(char: Tokenizer) -> None:
    with pytest.raises(DecoderLMError, match="'Z'"):
        char.encode("aZb")


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_saved_tokenizer_json_loads_to_the_same_ids(kind: str, bpe, char, tmp_path) -> None:
    tok = bpe if kind == "bpe" else char
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    assert json.loads(path.read_text())["model"]["type"] in ("BPE", "WordLevel")
    loaded = Tokenizer.from_file(path)
    loaded_from_dir = Tokenizer.from_file(tmp_path)  # a run/data directory holding tokenizer.json
    texts = [c[:40] for c in CORPUS[:3]] + [Tokenizer.EOT]
    assert loaded.encode_batch(texts) == tok.encode_batch(texts)
    assert loaded_from_dir.encode_batch(texts) == tok.encode_batch(texts)
    assert (loaded.vocab_size, loaded.eot_id) == (tok.vocab_size, tok.eot_id)


def test_encode_batch_equals_encode_of_each(bpe: Tokenizer) -> None:
    texts = [c[:30] for c in CORPUS[:3]]
    assert bpe.encode_batch(texts) == [bpe.encode(t) for t in texts]


def test_foreign_tokenizer_eos_found_and_bos_template_not_applied(tmp_path) -> None:
    # A Llama-2-style file: `</s>` ends a text, and a post-processor prepends `<s>` to every
    # encoding. Token streams for training must not get a BOS per call, so encode() skips it.
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3, "there": 4}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    assert backend.encode("hi there").ids == [1, 3, 4]  # what the file does by default
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert tok.encode("hi there") == [3, 4]
    assert (tok.eot_id, tok.vocab_size) == (2, 5)


def test_transformers_reads_our_bpe_file_to_the_same_ids(bpe: Tokenizer, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    bpe.save(tmp_path / "tokenizer.json")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    texts = [*CORPUS[:3], f"x{Tokenizer.EOT}y", "  leading spaces and ünïcode"]
    for text in texts:
        assert hf(text, add_special_tokens=False)["input_ids"] == bpe.encode(text)
        assert hf.decode(bpe.encode(text)) == text


def test_from_file_errors_are_one_line(tmp_path) -> None:
    with pytest.raises(DecoderLMError, match="no such tokenizer file"):
        Tokenizer.from_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DecoderLMError, match=r"not a valid tokenizer\.json") as info:
        Tokenizer.from_file(bad)
    assert "\n" not in str(info.value)


def test_decode_rejects_out_of_range_ids(char: Tokenizer) -> None:
    with pytest.raises(DecoderLMError, match="out of range"):
        char.decode([0, char.vocab_size])


def test_bpe_rejects_vocab_smaller_than_the_byte_alphabet() -> None:
    with pytest.raises(DecoderLMError, match="vocab_size=100"):
        Tokenizer.train_bpe(CORPUS, vocab_size=100)
