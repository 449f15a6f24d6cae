"""bfloat16 linears on AMX tiles: as close to float64 as F.linear for any row count and output
tails; weights the kernel cannot take stay on oneDNN; the engine's packed linears use it; SwiGLU's
gate and up in one product, the bits of the two linears and silu_mul at any row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from decoderlm import DecoderLM, ModelConfig
from decoderlm.cpu import amx_linear, fused
from decoderlm.cpu.fused import FusedSwiGLU
from decoderlm.cpu.packed_linear import AMX_ROWS_MAX, PackedLinear, PackedSwiGLU
from decoderlm.cpu.paths import SpeedPaths

needs_amx = pytest.mark.skipif(
    not amx_linear.supports(torch.zeros(1, 32, dtype=torch.bfloat16)),
    reason="no AMX-BF16 here, or no C compiler",
)


@needs_amx
@pytest.mark.parametrize("n, k", [(1376, 512), (37, 64), (16, 32), (5, 96)])
# one row, a partial tile, one, one and a row; then the wide path (two tiles of rows per step)
@pytest.mark.parametrize(
    "m", [1, 5, 16, 17, 32, 40, 100, 300]
)  # 300: the wide path's 256-row chunks
def test_tile_product_is_as_close_to_float64_as_f_linear(m, n, k):
    g = torch.Generator().manual_seed(n + m)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    exact = x.double() @ w.double().T
    reference_error = (F.linear(x, w).double() - exact).abs().max()
    got = amx_linear.linear(x, amx_linear.pack(w), n)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().max()  # one bf16 step at the largest
    assert (got.double() - exact).abs().max() <= 2 * reference_error + ulp


@needs_amx
@pytest.mark.parametrize("n", [48, 40])  # an even and an odd number of blocks of 16 outputs
def test_a_row_gets_the_same_bits_alone_or_among_three_hundred(n):
    """The wide path (≥ 32 rows, 256 at a time) sums each output by the same tile products as the
    path for a few rows: batch-invariant."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(n, 96, generator=g).bfloat16()
    x = torch.randn(300, 96, generator=g).bfloat16()
    packed = amx_linear.pack(w)
    whole = amx_linear.linear(x, packed, n)
    for rows in (
        slice(0, 1),
        slice(37, 38),
        slice(299, 300),
        slice(10, 25),
        slice(50, 97),
        slice(200, 290),
    ):
        assert torch.equal(amx_linear.linear(x[rows], packed, n), whole[rows])


@needs_amx
def test_leading_dimensions_are_kept_and_a_wrong_width_is_refused():
    w = torch.randn(24, 64).bfloat16()
    x = torch.randn(3, 2, 64).bfloat16()
    got = amx_linear.linear(x, amx_linear.pack(w), 24)
    assert got.shape == (3, 2, 24)
    assert torch.equal(got[1], amx_linear.linear(x[1], amx_linear.pack(w), 24))
    with pytest.raises(ValueError, match="for a weight of 64 inputs"):
        amx_linear.linear(torch.randn(2, 32).bfloat16(), amx_linear.pack(w), 24)


@needs_amx
def test_packed_bf16_linears_use_the_tiles_and_others_stay_on_onednn():
    torch.manual_seed(0)
    on_tiles = PackedLinear(nn.Linear(64, 40).bfloat16())  # with a bias
    odd_width = PackedLinear(nn.Linear(48, 40).bfloat16())  # 48 inputs: not a multiple of 32
    in_float32 = PackedLinear(nn.Linear(64, 40))
    assert (on_tiles.amx, odd_width.amx, in_float32.amx) == (True, False, False)
    for layer in (on_tiles, odd_width):
        x = torch.randn(6, layer.linear.in_features).bfloat16()
        exact = x.double() @ layer.linear.weight.double().T + layer.linear.bias.double()
        reference_error = (layer.linear(x).double() - exact).abs().max()
        ulp = torch.finfo(torch.bfloat16).eps * exact.abs().max()  # the bias: one more rounding
        assert (layer(x).double() - exact).abs().max() <= 2 * reference_error + ulp
    # a long prefill chunk: whole buckets of 32 rows by oneDNN's GEMM, the last 5 on the tiles
    many = torch.randn(AMX_ROWS_MAX + 5, 64).bfloat16()
    got, head = on_tiles(many), AMX_ROWS_MAX
    assert torch.equal(got[:head], on_tiles.linear(many[:head]))
    tail = amx_linear.linear(many[head:], on_tiles.packed, 40) + on_tiles.bias
    assert torch.equal(got[head:], tail)


@needs_amx
@pytest.mark.parametrize("n", [1536, 40])  # SmolLM2's d_ff; a last block of 8 outputs
@pytest.mark.parametrize("m", [1, 17, 32, 300])  # the few-rows path, then the wide one
def test_swiglu_in_the_epilogue_gives_the_bits_of_two_linears_and_silu_mul(m, n):
    g = torch.Generator().manual_seed(m + n)
    gate, up = (torch.randn(n, 64, generator=g).bfloat16() for _ in range(2))
    x = torch.randn(m, 64, generator=g).bfloat16()
    two = fused.silu_mul(
        amx_linear.linear(x, amx_linear.pack(gate), n), amx_linear.linear(x, amx_linear.pack(up), n)
    )
    assert torch.equal(amx_linear.swiglu(x, amx_linear.pack_swiglu(gate, up), n), two)


@needs_amx
def test_packing_runs_a_swiglu_mlp_whole_and_the_fused_ops_leave_it_to_the_tiles():
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig.from_preset("llama-tiny", d_model=64, n_layers=2, n_heads=4))
    model = model.bfloat16().eval()
    x = torch.randn(5, 64).bfloat16()
    with torch.inference_mode(), SpeedPaths.for_engine().applied(model):
        mlps = [m for m in model.modules() if isinstance(m, PackedSwiGLU)]
        assert len(mlps) == 2 and not any(isinstance(m, FusedSwiGLU) for m in model.modules())
        got = mlps[0](x)
    mlp = mlps[0].mlp  # the plain module, back in place
    exact = mlp.double()(x.double())
    mlp.bfloat16()
    reference_error = (mlp(x).double() - exact).abs().max()
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().max()
    assert (got.double() - exact).abs().max() <= 2 * reference_error + ulp


@needs_amx
def test_a_long_prefill_chunk_runs_swiglu_on_the_tiles_with_each_rows_bits_alone():
    """Gate and up on the tiles at any row count (600: the wide path's 256-row chunks and a
    tail): a row's output has the bits it has alone, the model's formula's rounding."""
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig.from_preset("llama-tiny", d_model=64, n_layers=1, n_heads=4))
    mlp = model.bfloat16().blocks[0].mlp
    packed = PackedSwiGLU(mlp)
    x = torch.randn(600, 64).bfloat16()
    with torch.no_grad():
        whole = packed(x)
        for row in (0, 255, 256, 599):
            assert torch.equal(packed(x[row : row + 1]), whole[row : row + 1])
        h = fused.silu_mul(F.linear(x, mlp.gate.weight), F.linear(x, mlp.up.weight))
    assert torch.equal(amx_linear.swiglu(x, packed.packed, mlp.up.out_features), h)


@needs_amx
def test_an_mlp_with_a_quantized_or_subclassed_linear_is_not_fused():
    model = DecoderLM(ModelConfig.from_preset("llama-tiny", d_model=64, n_layers=1, n_heads=4))
    mlp = model.bfloat16().blocks[0].mlp
    assert PackedSwiGLU.fuses(mlp)

    class Quantized(nn.Linear):  # (a GGUF file's BlockLinear has no weight at all)
        pass

    mlp.gate.__class__ = Quantized
    assert not PackedSwiGLU.fuses(mlp)


@needs_amx
def test_only_a_model_whose_every_linear_is_on_the_tiles_compiles_passes_of_many_rows():
    model = DecoderLM(ModelConfig.from_preset("llama-tiny", d_model=64, n_layers=1, n_heads=4))
    model = model.bfloat16()
    assert SpeedPaths.for_engine().applied(model).tile_products

    class Quantized(nn.Linear):  # what no pack takes: a quantized model's linears
        pass

    model.blocks[0].attn.proj.__class__ = Quantized
    assert not SpeedPaths.for_engine().applied(model).tile_products
    assert not SpeedPaths.for_engine().applied(model.float()).tile_products  # float32: oneDNN


@needs_amx
@pytest.mark.parametrize("swiglu", [False, True])
def test_the_op_that_compiled_passes_call_gives_the_kernels_bits(swiglu):
    # decoderlm::amx_linear (amx_linear_ops.cpp) over the same packs as the ctypes path, x of
    # three dims and transposed (made contiguous by the op).
    assert amx_linear.op_available()
    g = torch.Generator().manual_seed(5)
    gate, up = (torch.randn(40, 96, generator=g).bfloat16() * 0.1 for _ in range(2))
    x = torch.randn(96, 3, 11, generator=g).bfloat16().permute(1, 2, 0)  # (3, 11, 96), strided
    if swiglu:
        packed, expected = (
            amx_linear.pack_swiglu(gate, up),
            amx_linear.swiglu(x, amx_linear.pack_swiglu(gate, up), 40),
        )
    else:
        packed, expected = amx_linear.pack(gate), amx_linear.linear(x, amx_linear.pack(gate), 40)
    got = torch.ops.decoderlm.amx_linear(x, packed, 40, swiglu)
    assert got.shape == (3, 11, 40) and torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="packed weight's 96 inputs"):
        torch.ops.decoderlm.amx_linear(x[..., :64], packed, 40, swiglu)
    with pytest.raises(RuntimeError, match="blocks"):
        torch.ops.decoderlm.amx_linear(x, packed, 80, swiglu)  # more outputs than it holds
