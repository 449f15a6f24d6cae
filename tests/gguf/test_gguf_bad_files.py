"""A GGUF file is untrusted: a truncated file, a wrong magic, a declared array or tensor larger
than the file, an unsupported type, a tensor whose shape contradicts the metadata — each is a
one-line error (the CLI's `decoderlm: error: …`, exit status 2), and nothing is allocated for
what a file declares beyond its size (traced Python and numpy allocations stay within the file's
size plus `OVERHEAD`, the same for any declared size)."""

from __future__ import annotations

import shutil
import struct
import tracemalloc

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import decoderlm
from decoderlm.cli import main
from decoderlm.errors import DecoderLMError
from decoderlm.gguf import open_gguf

OVERHEAD = 2**20  # the objects of any parse and its error, whatever the file declares


@pytest.fixture
def good(tiny_gguf, tmp_path):
    """A copy of a valid tiny llama file, for a test to damage."""
    _, path = tiny_gguf("llama", T.Q8_0)
    return shutil.copy(path, tmp_path / "model.gguf")


def patch(path, offset: int, fmt: str, value) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))


def kv_value_offset(path, key: str) -> int:
    """Where a metadata entry's value starts (for an array: its item type, then its count)."""
    field = gguf.GGUFReader(path).fields[key]
    return field.offset + 8 + len(key.encode()) + 4


def tensor_dims_offset(path, name: str) -> int:
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return tensor.field.offset + 8 + len(name.encode()) + 4


def refused(path, match: str) -> str:
    """The one-line error loading `path` gives (checked to match), with allocations traced."""
    tracemalloc.start()
    try:
        with pytest.raises(DecoderLMError, match=match) as info:
            decoderlm.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    size = path.stat().st_size
    assert peak < size + OVERHEAD, f"{peak} bytes allocated for a {size}-byte file"
    return message


@pytest.mark.parametrize("keep", [0.001, 0.3, 0.6, 0.999])
def test_a_truncated_file_is_a_one_line_error(good, keep):
    data = good.read_bytes()
    good.write_bytes(data[: max(8, int(len(data) * keep))])
    refused(good, "truncated or corrupt|not a valid GGUF")


def test_a_wrong_magic_is_a_one_line_error(good):
    patch(good, 0, "4s", b"GGML")
    assert "not a GGUF file: it starts with b'GGML'" in refused(good, "not a GGUF file")


def test_an_array_longer_than_the_file_is_refused_before_it_is_read(good):
    patch(good, kv_value_offset(good, "tokenizer.ggml.tokens") + 4, "<Q", 2**60)
    refused(good, r"declares an array of 1152921504606846976 items where \d+ bytes are left")


def test_a_byte_array_longer_than_the_file_is_refused(good):
    at = kv_value_offset(good, "tokenizer.ggml.token_type")
    patch(good, at, "<I", gguf.GGUFValueType.UINT8)
    patch(good, at + 4, "<Q", 10**9)
    refused(good, "declares an array of 1000000000 items")


def test_a_tensor_larger_than_the_file_is_refused(good):
    patch(good, tensor_dims_offset(good, "token_embd.weight") + 8, "<Q", 2**40)
    refused(good, r"declares tensor 'token_embd.weight' of \d+ bytes where \d+ bytes are left")


def test_an_unknown_tensor_type_is_refused(good):
    name = "blk.0.ffn_up.weight"
    patch(good, tensor_dims_offset(good, name) + 2 * 8, "<I", 99)
    refused(good, f"tensor '{name}' has an unknown ggml type 99")


def test_an_unsupported_tensor_type_names_it_and_the_supported_ones(tmp_path, vocab):
    import transformers
    from gguf_builders import randomize, write_gguf

    from conftest import hf_config

    hf = randomize(
        transformers.AutoModelForCausalLM.from_config(hf_config("llama", len(vocab.tokens)))
    )
    blocks = np.zeros(gguf.quants.quant_shape_to_byte_shape((128, 64), T.IQ4_NL), np.uint8)
    path = write_gguf(
        tmp_path / "iq.gguf", hf, "llama", vocab, raw={"blk.0.ffn_up.weight": (blocks, T.IQ4_NL)}
    )
    message = refused(path, "has type IQ4_NL, which decoderlm does not read; supported: F32, F16")
    assert "Q4_1" in message and "Q6_K" in message


def test_a_tensor_whose_shape_contradicts_the_metadata_is_refused(good):
    patch(good, kv_value_offset(good, "llama.feed_forward_length"), "<I", 96)
    refused(
        good, r"tensor 'blk.0.ffn_up.weight' has shape \(128, 64\); the metadata implies \(96, 64\)"
    )


def test_an_unknown_architecture_lists_the_supported_ones(good, tmp_path):
    reader = gguf.GGUFReader(good)
    field = reader.fields["general.architecture"]
    patch(good, field.offset + 8 + len(b"general.architecture") + 4 + 8, "5s", b"bloom")
    refused(good, "architecture 'bloom' is not supported; supported: llama, qwen2, qwen3, gpt2")


def test_the_cli_prints_one_line_and_exits_2(good, capsys):
    patch(good, 0, "4s", b"XXXX")
    assert main(["generate", "--checkpoint", str(good), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("decoderlm: error: ") and "not a GGUF file" in err and "\n" not in err


def test_an_empty_file_and_a_missing_name_are_one_line_errors(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(DecoderLMError, match="is empty, not a GGUF file"):
        open_gguf(tmp_path / "empty.gguf")
    with pytest.raises(DecoderLMError, match=r"no such checkpoint: nowhere\.gguf"):
        decoderlm.load("nowhere.gguf")
