"""ggml's block formats in decoderlm: the dequantized values are bit-equal to gguf-py's
`gguf.quants.dequantize` on random block bytes of every kept type; K-quant tensors load as
float32 equal to it, with a one-line note; a block linear of many rows is its dequantized
product."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T
from gguf_builders import randomize, write_gguf
from gguf_reference import NO_SPECIALS

import decoderlm
from decoderlm.cpu import block_linear, onednn
from decoderlm.cpu.block_linear import MAX_ROWS
from decoderlm.gguf import DEQUANTIZED_TYPES, KEPT_TYPES
from decoderlm.quant.blocks import BlockLinear, dequantize_rows, row_bytes

# Where each kept type keeps its float16 fields (d, and m for the _1 types); F16 is all of them.
_HALVES = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2)}


def random_blocks(kind: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random bytes (rows, row bytes) of `kind` whose float16/bfloat16 values are finite (so that
    bit equality is defined: NaN payloads are not)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, row_bytes(kind, k)), dtype=np.uint8)
    if kind in ("F16", "BF16"):
        halves = raw.view(np.uint16)
        exponent = 0x7C00 if kind == "F16" else 0x7F80
        halves[(halves & exponent) == exponent] &= ~np.uint16(0x4000)  # clear an exponent bit
        return raw
    size = gguf.GGML_QUANT_SIZES[T[kind]][1]
    blocks = raw.reshape(rows, -1, size)
    for at in _HALVES[kind]:
        d = blocks[..., at : at + 2].copy().view(np.uint16)
        d[(d & 0x7C00) == 0x7C00] &= ~np.uint16(0x4000)
        blocks[..., at : at + 2] = d.view(np.uint8)
    return raw


@pytest.mark.parametrize("kind", KEPT_TYPES)
def test_dequantized_blocks_are_bit_equal_to_gguf_py(kind):
    raw = random_blocks(kind, rows=9, k=128)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, T[kind]).astype(np.float32))
    ours = dequantize_rows(torch.from_numpy(raw), kind, 128)
    assert torch.isfinite(expected).all()
    assert torch.equal(ours.view(torch.int32), expected.view(torch.int32))


def test_a_block_linear_is_its_dequantized_product():
    raw = torch.from_numpy(random_blocks("Q4_1", rows=6, k=64))
    linear = BlockLinear(64, 6, "Q4_1", bias=True, blocks=raw)
    linear.bias.copy_(torch.arange(6.0))
    # More rows than the block kernels take (tests/cpu/test_block_linear.py has those): on
    # AVX-512 VNNI the integer panels, their activations rounded to 16 bits (bounded there); else
    # oneDNN's float32 linear on the dequantized weight, to the bit.
    x = torch.randn(3, MAX_ROWS, 64)
    weight = dequantize_rows(raw, "Q4_1", 64)
    exact = not block_linear.integer_panels("Q4_1")
    # each input within max|x| / (127 · 256) of its value, twice that for the float32 sums
    rounding = float(x.abs().max() * weight.abs().sum(1).max()) / (127 * 128)
    torch.testing.assert_close(
        linear(x),
        onednn.linear(x, weight) + torch.arange(6.0),
        rtol=0,
        atol=0 if exact else rounding,
    )
    assert torch.equal(linear.dequantized(), weight)


def test_blocks_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match="uint8"):
        BlockLinear(64, 6, "Q8_0", blocks=torch.zeros(6, 64, dtype=torch.uint8))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # random bytes: NaN scales
@pytest.mark.parametrize("kind", DEQUANTIZED_TYPES)
def test_k_quant_tensors_load_as_float32_equal_to_gguf_py(tmp_path, vocab, kind, caplog):
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(vocab.tokens), **NO_SPECIALS,
    )  # fmt: skip
    hf = randomize(transformers.LlamaForCausalLM(config))
    rows, k = 64, 256  # blk.0.ffn_down: (d_model, d_ff); K-quants have blocks of 256
    shape = gguf.quants.quant_shape_to_byte_shape((rows, k), T[kind])
    blocks = np.random.default_rng(0).integers(0, 256, shape, np.uint8)
    path = write_gguf(tmp_path / "k.gguf", hf, "llama", vocab, T.Q8_0,
                      raw={"blk.0.ffn_down.weight": (blocks, T[kind])})  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="decoderlm.gguf.files"):
        model, _ = decoderlm.load(path)
    down = model.blocks[0].mlp.down
    assert isinstance(down, torch.nn.Linear) and down.weight.dtype == torch.float32
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, T[kind]))
    torch.testing.assert_close(down.weight, expected, rtol=0, atol=0, equal_nan=True)
    assert f"1 tensors of {kind} dequantized to float32" in caplog.text
    assert isinstance(model.blocks[0].mlp.up, BlockLinear)  # the others stay Q8_0 blocks
