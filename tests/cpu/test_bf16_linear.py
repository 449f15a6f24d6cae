"""bfloat16 linears on the CPU's dot products, each kernel that runs here (AMX tiles,
AVX512-BF16): as close to float64 as F.linear for any row count and output tails, a row's bits
the same alone or among others; weights the kernel cannot take go to the fixed-order kernel; the
engine's packed linears use it; SwiGLU's gate and up in one product, the bits of the two linears and silu_mul at
any row count; float32 products rounded to bfloat16 only at float32 matmul precision "medium",
compiled graphs following the precision as it is when they run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from decoderlm import DecoderLM, ModelConfig
from decoderlm.cpu import bf16_linear, fused, invariant, onednn
from decoderlm.cpu.fused import FusedSwiGLU
from decoderlm.cpu.packed_linear import KERNEL_ROWS_MAX, PackedLinear, PackedSwiGLU
from decoderlm.cpu.paths import SpeedPaths

needs_kernel = pytest.mark.skipif(
    not bf16_linear.kernels(), reason="no AMX-BF16 or AVX512-BF16 here, or no C compiler"
)


@pytest.fixture(params=bf16_linear.kernels() or ["none"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each kernel that runs here in turn, as the one the packed linears take."""
    monkeypatch.setattr(bf16_linear, "kernel", lambda: request.param)
    return request.param


@needs_kernel
@pytest.mark.parametrize("n, k", [(1376, 512), (37, 64), (16, 32), (5, 96)])
# one row, a partial group of rows, a tile, one and a row; then AMX's wide path (two tiles of
# rows per step)
@pytest.mark.parametrize(
    "m", [1, 5, 16, 17, 32, 40, 100, 300]
)  # 300: the wide path's 256-row chunks
def test_packed_product_is_as_close_to_float64_as_f_linear(kernel, m, n, k):
    g = torch.Generator().manual_seed(n + m)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    exact = x.double() @ w.double().T
    reference_error = (F.linear(x, w).double() - exact).abs().max()
    got = bf16_linear.linear(x, bf16_linear.pack(w), n)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().max()  # one bf16 step at the largest
    assert (got.double() - exact).abs().max() <= 2 * reference_error + ulp


@needs_kernel
@pytest.mark.parametrize("n", [48, 40])  # an even and an odd number of blocks of 16 outputs
def test_a_row_gets_the_same_bits_alone_or_among_three_hundred(kernel, n):
    """Each output is summed by the same dot products whatever the rows (on AMX the wide path,
    ≥ 32 rows 256 at a time, as the path for a few rows): batch-invariant."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(n, 96, generator=g).bfloat16()
    x = torch.randn(300, 96, generator=g).bfloat16()
    packed = bf16_linear.pack(w)
    whole = bf16_linear.linear(x, packed, n)
    for rows in (
        slice(0, 1),
        slice(37, 38),
        slice(299, 300),
        slice(10, 25),
        slice(50, 97),
        slice(200, 290),
    ):
        assert torch.equal(bf16_linear.linear(x[rows], packed, n), whole[rows])


@needs_kernel
def test_leading_dimensions_are_kept_and_a_wrong_width_is_refused(kernel):
    w = torch.randn(24, 64).bfloat16()
    x = torch.randn(3, 2, 64).bfloat16()
    got = bf16_linear.linear(x, bf16_linear.pack(w), 24)
    assert got.shape == (3, 2, 24)
    assert torch.equal(got[1], bf16_linear.linear(x[1], bf16_linear.pack(w), 24))
    with pytest.raises(ValueError, match="for a weight of 64 inputs"):
        bf16_linear.linear(torch.randn(2, 32).bfloat16(), bf16_linear.pack(w), 24)


@needs_kernel
def test_packed_bf16_linears_use_the_kernel_and_others_the_fixed_order_kernel(kernel):
    torch.manual_seed(0)
    on_kernel = PackedLinear(nn.Linear(64, 40).bfloat16())  # with a bias
    odd_width = PackedLinear(nn.Linear(47, 40).bfloat16())  # 47 inputs: no kernel takes them
    in_float32 = PackedLinear(nn.Linear(64, 40))
    assert (on_kernel.bf16_kernel, odd_width.bf16_kernel, in_float32.bf16_kernel) == (
        True,
        False,
        False,
    )
    for layer in (on_kernel, odd_width):
        x = torch.randn(6, layer.linear.in_features).bfloat16()
        exact = x.double() @ layer.linear.weight.double().T + layer.linear.bias.double()
        reference_error = (layer.linear(x).double() - exact).abs().max()
        ulp = torch.finfo(torch.bfloat16).eps * exact.abs().max()  # the bias: one more rounding
        assert (layer(x).double() - exact).abs().max() <= 2 * reference_error + ulp
    for layer in (odd_width, in_float32):
        x = torch.randn(6, layer.linear.in_features).to(layer.linear.weight.dtype)
        fixed_order = invariant.linear(x, invariant.pack(layer.linear.weight.detach()), 40)
        assert torch.equal(layer(x), fixed_order + layer.bias)
    # a long prefill chunk: whole buckets of 32 rows by oneDNN's GEMM, the last 5 on the kernel
    many = torch.randn(KERNEL_ROWS_MAX + 5, 64).bfloat16()
    got, head = on_kernel(many), KERNEL_ROWS_MAX
    assert torch.equal(got[:head], on_kernel.linear(many[:head]))
    tail = bf16_linear.linear(many[head:], on_kernel.packed, 40) + on_kernel.bias
    assert torch.equal(got[head:], tail)


@needs_kernel
@pytest.mark.parametrize("n", [1536, 40])  # SmolLM2's d_ff; a last block of 8 outputs
@pytest.mark.parametrize("m", [1, 17, 32, 300])  # the few-rows path, then the wide one
def test_swiglu_in_the_epilogue_gives_the_bits_of_two_linears_and_silu_mul(kernel, m, n):
    g = torch.Generator().manual_seed(m + n)
    gate, up = (torch.randn(n, 64, generator=g).bfloat16() for _ in range(2))
    x = torch.randn(m, 64, generator=g).bfloat16()
    two = fused.silu_mul(
        bf16_linear.linear(x, bf16_linear.pack(gate), n),
        bf16_linear.linear(x, bf16_linear.pack(up), n),
    )
    assert torch.equal(bf16_linear.swiglu(x, bf16_linear.pack_swiglu(gate, up), n), two)


@needs_kernel
def test_packing_runs_a_swiglu_mlp_whole_and_the_fused_ops_leave_it_to_the_kernel(kernel):
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


@needs_kernel
def test_a_long_prefill_chunk_runs_swiglu_on_the_kernel_with_each_rows_bits_alone(kernel):
    """Gate and up on the kernel at any row count (600: on AMX the wide path's 256-row chunks and
    a tail): a row's output has the bits it has alone, the model's formula's rounding."""
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
    assert torch.equal(bf16_linear.swiglu(x, packed.packed, mlp.up.out_features), h)


@needs_kernel
def test_an_mlp_with_a_quantized_or_subclassed_linear_is_not_fused():
    model = DecoderLM(ModelConfig.from_preset("llama-tiny", d_model=64, n_layers=1, n_heads=4))
    mlp = model.bfloat16().blocks[0].mlp
    assert PackedSwiGLU.fuses(mlp)

    class Quantized(nn.Linear):  # (a GGUF file's BlockLinear has no weight at all)
        pass

    mlp.gate.__class__ = Quantized
    assert not PackedSwiGLU.fuses(mlp)


@needs_kernel
def test_only_a_model_whose_every_linear_is_packed_compiles_passes_of_many_rows():
    model = DecoderLM(ModelConfig.from_preset("llama-tiny", d_model=64, n_layers=1, n_heads=4))
    assert SpeedPaths.for_engine().applied(model).kernel_products  # float32: the fixed order
    model = model.bfloat16()
    assert SpeedPaths.for_engine().applied(model).kernel_products

    class Quantized(nn.Linear):  # what no pack takes: a quantized model's linears
        pass

    model.blocks[0].attn.proj.__class__ = Quantized
    assert not SpeedPaths.for_engine().applied(model).kernel_products
    assert not SpeedPaths.for_engine().applied(model.float()).kernel_products


@needs_kernel
@pytest.mark.parametrize("swiglu", [False, True])
def test_the_op_that_compiled_passes_call_gives_the_kernels_bits(swiglu):
    # decoderlm::bf16_linear (bf16_linear_ops.cpp, built with the kernel the machine runs) over
    # the same packs as the ctypes path, x of three dims and transposed (made contiguous by the op).
    assert bf16_linear.op_available()
    g = torch.Generator().manual_seed(5)
    gate, up = (torch.randn(40, 96, generator=g).bfloat16() * 0.1 for _ in range(2))
    x = torch.randn(96, 3, 11, generator=g).bfloat16().permute(1, 2, 0)  # (3, 11, 96), strided
    if swiglu:
        packed, expected = (
            bf16_linear.pack_swiglu(gate, up),
            bf16_linear.swiglu(x, bf16_linear.pack_swiglu(gate, up), 40),
        )
    else:
        packed, expected = bf16_linear.pack(gate), bf16_linear.linear(x, bf16_linear.pack(gate), 40)
    got = torch.ops.decoderlm.bf16_linear(x, packed, 40, swiglu)
    assert got.shape == (3, 11, 40) and torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="packed weight's 96 inputs"):
        torch.ops.decoderlm.bf16_linear(x[..., :64], packed, 40, swiglu)
    with pytest.raises(RuntimeError, match="blocks"):
        torch.ops.decoderlm.bf16_linear(x, packed, 80, swiglu)  # more outputs than it holds


needs_dpbf16 = pytest.mark.skipif(
    "avx512_bf16" not in bf16_linear.kernels(), reason="no AVX512-BF16 here, or no C compiler"
)


@pytest.mark.parametrize("m, n, k", [(1, 37, 64), (17, 576, 96), (300, 40, 34)])
def test_float32_products_at_highest_precision_are_the_float32_linears_bits(m, n, k):
    g = torch.Generator().manual_seed(m + n)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(m, k, generator=g)
    torch.set_float32_matmul_precision("highest")
    assert torch.equal(bf16_linear.float32_linear(x, w), onednn.linear(x, w.float()))


@needs_dpbf16
@pytest.mark.parametrize("m, n, k", [(1, 37, 64), (17, 576, 96), (300, 40, 34), (7, 16, 2)])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_float32_products_at_medium_precision_sum_the_inputs_rounded_to_bfloat16(
    m, n, k, weight_dtype
):
    """x (and a float32 W) rounded to bfloat16, the products summed in float32 (as close to
    float64 of the rounded inputs as F.linear of them, not to the unrounded product), a row's
    bits alone or among others, output tails and odd row counts included."""
    g = torch.Generator().manual_seed(m + n)
    w, x = torch.randn(n, k, generator=g).to(weight_dtype), torch.randn(2, m, k, generator=g)
    rounded, w_rounded = x.bfloat16(), w.bfloat16()
    exact = rounded.double() @ w_rounded.double().T
    torch.set_float32_matmul_precision("highest")
    reference_error = (F.linear(rounded.float(), w_rounded.float()).double() - exact).abs().max()
    unrounded_error = (x.double() @ w.double().T - exact).abs().max()
    torch.set_float32_matmul_precision("medium")
    y = bf16_linear.float32_linear(x, w)
    assert y.shape == (2, m, n) and y.dtype == torch.float32
    assert (y.double() - exact).abs().max() <= 2 * reference_error + 1e-6
    assert unrounded_error > 100 * (reference_error + 1e-6)  # the rounding is what is measured
    assert torch.equal(bf16_linear.float32_linear(x[1, -1:], w), y[1, -1:])


@needs_dpbf16
def test_a_compiled_graph_follows_the_precision_set_after_it_was_traced():
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(200, 64, generator=g).bfloat16(), torch.randn(40, 64, generator=g)
    compiled = torch.compile(lambda x, w: bf16_linear.float32_linear(x, w) + 1, fullgraph=True)
    got = {}
    for precision in ("highest", "medium", "highest"):
        torch.set_float32_matmul_precision(precision)
        got[precision] = compiled(x, w)
        assert torch.equal(got[precision], bf16_linear.float32_linear(x, w) + 1)
    assert not torch.equal(got["medium"], got["highest"])
