"""The products of ggml blocks and of decoderlm's own int8/int4/bf16 layers on the CPU kernels of
`decoderlm.cpu.block_linear`, each build (the CPU's own, AVX2, portable C): ggml's quantized
weights within the rounding of the activations (per block of 32: Q8_0's to int16, |x − x̂| ≤
max|x| / (2 · 32767); the 4- and 5-bit types' to e·(256 a + b), |x − x̂| ≤ max|x| / (127 · 256))
of the float64 product of the dequantized weights; float16/bfloat16 weights and
Int8Linear / Int4Linear as close to float64 as F.linear; odd numbers of blocks, inputs, outputs
and rows; the dequantizer bit-equal to `dequantize_rows`; layers sending a few rows to the kernels,
a decode step's many to dequantized panels summed as the fixed-order kernel sums, a prompt's to a
GEMM; bfloat16 on a CPU without bfloat16 instructions computed in float32; the
compiled decode step calling the kernels and decoding the eager tokens; DECODERLM_CPU_ISA capping
the build a process uses."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from block_models import in_blocks
from torch import nn
from torch.profiler import profile

from decoderlm import DecoderLM, DecoderLMError, ModelConfig
from decoderlm.cpu import bf16_linear, block_linear, decode, features
from decoderlm.inference.generate import generate
from decoderlm.quant import Int4Linear, Int8Linear, quantize
from decoderlm.quant.blocks import (
    BLOCK_TYPES,
    CHUNK_WEIGHTS,
    BlockLinear,
    dequantize_rows,
    row_bytes,
)
from decoderlm.quant.linear import INT4_GROUP_SIZES

needs_kernels = pytest.mark.skipif(not block_linear.available(), reason="no C/C++ compiler")
QUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
LEVELS = {"Q8_0": 128, "Q4_0": 16, "Q4_1": 16, "Q5_0": 32, "Q5_1": 32}  # max |q − z|
# (N, K, M): an odd number of blocks (the last stands alone), one block, outputs that are no
# multiple of the threads' or rows' steps, one to more than MAX_ROWS rows of x.
QUANTIZED_SHAPES = [(37, 96, 1), (64, 576, 3), (5, 32, 6), (33, 160, 17), (1, 64, 1), (70, 96, 300)]
FLOAT_SHAPES = [(37, 96, 1), (7, 37, 2), (3, 1, 1), (33, 100, 5)]  # K no multiple of 8 or 16
VARIANTS = range(len(block_linear.VARIANTS))


def test_the_kernels_number_the_types_as_the_blocks_do():
    assert tuple(BLOCK_TYPES) == block_linear.TYPES


def random_blocks(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    """n rows of k weights of `kind`: random integers, scales d and minimums m of either sign
    and a few orders of magnitude (float weights: normal)."""
    g = torch.Generator().manual_seed(seed)
    if kind in ("F16", "BF16"):
        w = torch.randn(n, k, generator=g).to(torch.float16 if kind == "F16" else torch.bfloat16)
        return w.view(torch.uint8).view(n, -1).clone()
    blocks = torch.randint(0, 256, (n, row_bytes(kind, k)), dtype=torch.uint8, generator=g)
    per_block = blocks.view(n, k // 32, BLOCK_TYPES[kind][1])
    for at in (0, 2) if kind in ("Q4_1", "Q5_1") else (0,):
        magnitude = 10.0 ** torch.randint(-3, 0, (1,), generator=g).item()
        value = torch.randn(n, k // 32, generator=g) * magnitude
        per_block[..., at : at + 2] = value.half().view(torch.uint8).view(n, k // 32, 2)
    return blocks


def on_integer_panels(kind: str, variant: int, rows: int) -> bool:
    """Whether the op runs `rows` rows of `kind` on the integer panels of the build `variant`."""
    tiles = kind in QUANTIZED and block_linear.isa(variant) == "AVX-512"
    return tiles and rows > block_linear.MAX_TILE_KERNEL_ROWS


def activation_bound(kind: str, blocks: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(M, N) bound on |y − x Ŵᵀ|: each block's inputs rounded by at most max|x| / (2 · 32767)
    for Q8_0 (half a unit of int16, and 1% for the float rounding of x · 32767 / max|x|), else
    max|x| / (127 · 256); plus float32 rounding of the products' terms (|d|·max|q − z| + |m|) |x_j|."""
    n, k = blocks.shape[0], x.shape[-1]
    w = dequantize_rows(blocks, kind, k).double().view(n, k // 32, 32)  # (N, B, 32)
    xb = x.double().view(-1, k // 32, 32)  # (M, B, 32)
    unit = 1.01 / (2 * 32767) if kind == "Q8_0" else 1 / (127 * 256)
    e = xb.abs().amax(-1) * unit  # (M, B)
    rounding = torch.einsum("mb,nb->mn", e, w.abs().sum(-1))
    halves = blocks.view(n, k // 32, -1)[..., :4].contiguous().view(torch.float16).double()
    scale = halves[..., 0].abs() * LEVELS[kind]  # (N, B)
    if kind in ("Q4_1", "Q5_1"):
        scale = scale + halves[..., 1].abs()
    terms = torch.einsum("mb,nb->mn", xb.abs().sum(-1), scale)
    return rounding + 64 * torch.finfo(torch.float32).eps * terms


@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", QUANTIZED)
@pytest.mark.parametrize("n,k,m", QUANTIZED_SHAPES)
def test_quantized_products_are_within_the_activations_rounding_of_float64(variant, kind, n, k, m):
    blocks = random_blocks(kind, n, k, seed=n * k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[:, ::7] *= 30  # outliers, as real activations have
    exact = x.double() @ dequantize_rows(blocks, kind, k).double().T  # (M, N)
    y = block_linear.linear(x, blocks, kind, variant)
    bound = activation_bound(kind, blocks, x)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert ((y.double() - exact).abs() <= bound).all(), float(((y - exact).abs() / bound).max())
    # the bound is tight enough to mean something: a wrong weight or scale is off by |y| itself
    assert float(bound.max()) < 1e-2 * float(exact.abs().max())


@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m", [3, 9])
def test_q8_0_products_are_those_of_the_activations_rounded_to_int16(variant, m):
    """y = Σ_blocks d e Σ_j q_j c_j with e = max|x| / 32767 and c = round(x · 32767 / max|x|) in
    float32, as the kernel file states, on the kernels (3 rows) and the integer panels (9): the
    integer dot products in float64, the float32 scaling and sums within 1e-5 of the terms'
    magnitude."""
    n, k = 37, 96
    blocks = random_blocks("Q8_0", n, k, seed=5)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5))
    x[:, ::7] *= 30
    per_block = blocks.view(n, k // 32, 34)
    d = per_block[..., :2].contiguous().view(torch.float16).double()[..., 0]  # (N, B)
    q = per_block[..., 2:].contiguous().view(torch.int8).long()  # (N, B, 32)
    xb = x.view(m, k // 32, 32)
    amax = xb.abs().amax(-1)  # (M, B) float32, as the kernel computes e and 32767 / max|x|
    c = torch.round(xb * (32767 / amax)[..., None]).long()  # (M, B, 32), half to even
    e = (amax / 32767).double()
    terms = torch.einsum("nb,mb,mnb->mnb", d, e, torch.einsum("nbj,mbj->mnb", q, c).double())
    y = block_linear.linear(x, blocks, "Q8_0", variant).double()
    assert ((y - terms.sum(-1)).abs() <= 1e-5 * terms.abs().sum(-1)).all()


@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", ["F16", "BF16"])
@pytest.mark.parametrize("n,k,m", FLOAT_SHAPES)
def test_float16_and_bfloat16_products_are_as_close_to_float64_as_f_linear(variant, kind, n, k, m):
    blocks = random_blocks(kind, n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    w = dequantize_rows(blocks, kind, k)
    exact = x.double() @ w.double().T
    ulp = float(exact.abs().max()) * torch.finfo(torch.float32).eps
    ours = float((block_linear.linear(x, blocks, kind, variant).double() - exact).abs().max())
    theirs = float((F.linear(x, w).double() - exact).abs().max())
    assert ours <= 2 * theirs + ulp, (ours, theirs)


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_1", "BF16"])
def test_bfloat16_activations_give_the_float32_product_rounded_once(kind):
    blocks = random_blocks(kind, 40, 128, seed=1)
    x = torch.randn(2, 3, 128).to(torch.bfloat16)
    y = block_linear.linear(x, blocks, kind)
    wide = block_linear.linear(x.float(), blocks, kind)  # x's bfloat16 values are exact in float32
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16
    assert torch.equal(y, wide.to(torch.bfloat16))


@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_the_dequantizer_is_bit_equal_to_dequantize_rows(variant, kind):
    blocks = random_blocks(kind, 50, 160, seed=2)
    expected = dequantize_rows(blocks, kind, 160)
    rows = block_linear.dequantize(blocks, kind, 160, 7, 30, variant_index=variant)
    assert torch.equal(rows.view(torch.int32), expected[7:37].view(torch.int32))
    as_bf16 = block_linear.dequantize(blocks, kind, 160, 0, 50, torch.bfloat16, variant)
    assert torch.equal(as_bf16, expected.to(torch.bfloat16))


@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_a_non_finite_activation_makes_its_rows_products_non_finite(variant, bad, kind):
    """On the kernels (2 rows) and on the panels (6 and 40 rows); invariant products too (the
    strips at 2 rows on AVX-512 VNNI)."""
    blocks = random_blocks(kind, 8, 64, seed=4)
    for rows, invariant in itertools.product(
        (2, block_linear.MAX_TILE_KERNEL_ROWS + 2, 40), (False, True)
    ):
        x = torch.randn(rows, 64)
        x[0, 40] = bad
        y = block_linear.linear(x, blocks, kind, variant, invariant=invariant)
        assert not y[0].isfinite().any() and y[1:].isfinite().all()
        assert bad == bad or y[0].isnan().all()  # a NaN stays NaN (an inf gives ±inf or NaN)


@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", BLOCK_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_products_give_a_row_its_bits_alone_among_any_rows(variant, kind, dtype):
    """`linear(..., invariant=True)`, from one row to more than MAX_PANEL_ROWS (where bfloat16
    rows otherwise go to a GEMM): a quantized type's strips and integer tiles on AVX-512 VNNI
    and AVX2, the block kernel elsewhere; within the activations' rounding of float64 as the
    kernels are."""
    n, k = 37, 96  # outputs no multiple of a strip; an odd number of blocks
    blocks = random_blocks(kind, n, k, seed=11)
    x = torch.randn(block_linear.MAX_PANEL_ROWS + 4, k, generator=torch.Generator().manual_seed(11))
    x = x.to(dtype)
    alone = torch.cat(
        [block_linear.linear(row[None], blocks, kind, variant, invariant=True) for row in x]
    )
    for rows in (2, 5, block_linear.MAX_TILE_KERNEL_ROWS + 1, 17, 64, len(x)):
        together = block_linear.linear(x[:rows], blocks, kind, variant, invariant=True)
        assert torch.equal(together, alone[:rows]), rows
    if kind in QUANTIZED and dtype == torch.float32:
        exact = x.double() @ dequantize_rows(blocks, kind, k).double().T
        assert ((alone.double() - exact).abs() <= activation_bound(kind, blocks, x)).all()


@needs_kernels
@pytest.mark.skipif(
    not block_linear.available() or block_linear.isa(2) != "AVX-512",
    reason="the native build is not AVX-512 VNNI code",
)
@pytest.mark.parametrize("kind", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_products_have_the_same_bits_on_the_avx2_and_avx512_builds(kind, dtype):
    """The AVX2 tiles and strips sum the AVX-512 ones' integers (int16 weights and 256 a + b
    against vpdpbusd's two int8) and scale them in the same float32 operations: a row's invariant
    products are bit for bit the same on either build, at every number of rows."""
    for n, k in ((37, 96), (300, 1536), (5, 32)):  # a part strip and panel; one block
        blocks = random_blocks(kind, n, k, seed=n + k)
        x = torch.randn(70, k, generator=torch.Generator().manual_seed(k)).to(dtype)
        x[:, ::7] *= 30
        for rows in (1, 3, 4, 5, block_linear.MAX_TILE_KERNEL_ROWS + 1, 70):
            avx2 = block_linear.linear(x[:rows], blocks, kind, 1, invariant=True)
            avx512 = block_linear.linear(x[:rows], blocks, kind, 2, invariant=True)
            assert torch.equal(avx2, avx512), (n, k, rows)


@needs_kernels
def test_blocks_of_the_wrong_width_or_type_are_refused():
    blocks = random_blocks("Q4_1", 4, 64, seed=0)
    with pytest.raises(RuntimeError, match="blocks must be uint8"):
        block_linear.linear(torch.randn(1, 96), blocks, "Q4_1")
    with pytest.raises(RuntimeError, match="not whole blocks"):
        block_linear.linear(torch.randn(1, 40), blocks, "Q4_1")
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        block_linear.linear(torch.randn(1, 64).half(), blocks, "Q4_1")


def ops_called(fn) -> set[str]:
    with profile() as prof:
        fn()
    return {event.key for event in prof.key_averages()}


def tiny_model() -> DecoderLM:
    """A tiny random model whose layers' inputs are whole blocks of 32 and groups of 64."""
    torch.manual_seed(0)
    config = ModelConfig.from_preset("llama-tiny", vocab_size=97, d_model=64, n_layers=2, d_ff=192)
    return DecoderLM(config).eval()


def block_model(kind: str = "Q4_1") -> DecoderLM:
    """A tiny random model whose linear layers hold blocks of `kind` (quantized by gguf-py)."""
    return in_blocks(tiny_model(), kind)


@needs_kernels
def test_a_block_linear_runs_few_rows_on_the_kernel_a_steps_on_panels_a_prompts_on_a_gemm():
    """A prompt's rows go to the op where it has integer panels (AVX-512 VNNI), else to a GEMM;
    so do a decode step's at torch's float32 matmul precision "medium"."""
    layer = block_model().blocks[0].mlp.gate
    weight = dequantize_rows(layer.blocks, "Q4_1", 64)
    tiles = block_linear.integer_panels("Q4_1")
    with torch.no_grad():
        for rows in (block_linear.MAX_ROWS, block_linear.MAX_ROWS + 1, block_linear.MAX_PANEL_ROWS):
            x = torch.randn(rows, 64)
            assert "decoderlm::block_linear" in ops_called(lambda x=x: layer(x))
        prompt = torch.randn(block_linear.MAX_PANEL_ROWS + 1, 64)
        called = ops_called(lambda: layer(prompt))
        assert ("decoderlm::block_linear" in called) == tiles
        assert ("decoderlm::block_dequantize" in called) != tiles
        if not tiles:
            assert torch.equal(layer(prompt), F.linear(prompt, weight))
        torch.set_float32_matmul_precision("medium")  # (reset by the autouse fixture)
        called = ops_called(lambda: layer(torch.randn(block_linear.MAX_ROWS + 1, 64)))
        assert ("decoderlm::block_linear" in called) == tiles  # else bfloat16 products' GEMM


@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", [*QUANTIZED, "F16", "BF16"])
def test_a_decode_steps_rows_on_panels_sum_as_the_fixed_order_kernel(variant, kind):
    """17 to 256 float32 rows: each output the FMA sum of its dequantized weights in the order of
    k, as `invariant.linear` sums it (bit for bit on the same build), within float32 rounding of
    float64; panels cut short (N no multiple of 32), tiles of fewer rows, K no multiple of 8."""
    from decoderlm.cpu import invariant

    if on_integer_panels(kind, variant, block_linear.MAX_ROWS + 1):
        pytest.skip("integer panels: test_quantized_products_are_within_the_activations_rounding")
    k = 37 if kind in ("F16", "BF16") else 160
    blocks = random_blocks(kind, 45, k, seed=5)
    weight = dequantize_rows(blocks, kind, k)
    for rows in (block_linear.MAX_ROWS + 1, 31, block_linear.MAX_PANEL_ROWS):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        y = block_linear.linear(x, blocks, kind, variant)
        exact = x.double() @ weight.double().T
        bound = (
            4 * k * torch.finfo(torch.float32).eps * (x.abs().double() @ weight.abs().double().T)
        )
        assert ((y.double() - exact).abs() <= bound).all()
        native = block_linear.isa(variant) == block_linear.isa(len(VARIANTS) - 1)
        if native and invariant.available():
            assert torch.equal(y, invariant.linear(x, invariant.pack(weight), 45))


@needs_kernels
@pytest.mark.parametrize("kind", ["BF16", "F16", "Q8_0"])
def test_many_float32_rows_follow_the_float32_matmul_precision(kind):
    """Many float32 rows go to bf16_linear.float32_linear a chunk of Ŵ at a time (BF16's rows as
    stored, others dequantized to float32): exact at "highest", in bfloat16 at "medium"; at
    "highest", a quantized type's go to the op where it has integer panels."""
    n, k = 2 * CHUNK_WEIGHTS // 64 + 5, 64  # three chunks, the last of 5 rows
    blocks = random_blocks(kind, n, k, seed=4)
    layer = BlockLinear(k, n, kind, blocks=blocks)
    w = blocks.view(torch.bfloat16) if kind == "BF16" else dequantize_rows(blocks, kind, k)
    x = torch.randn(block_linear.MAX_PANEL_ROWS + 1, k)  # a prompt's rows
    chunks = torch.split(w, CHUNK_WEIGHTS // k)
    tiles = block_linear.integer_panels(kind)
    with torch.no_grad():
        for precision in ("highest", "medium"):
            torch.set_float32_matmul_precision(precision)
            called = ops_called(lambda: layer(x))
            if tiles and precision == "highest":
                assert "decoderlm::block_linear" in called
                continue
            assert "decoderlm::float32_linear" in called
            expected = torch.cat([bf16_linear.float32_linear(x, c) for c in chunks], dim=-1)
            assert torch.equal(layer(x), expected)
        assert torch.equal(layer(x), bf16_linear.float32_linear(x, w))  # per output: unchunked
        torch.set_float32_matmul_precision("highest")
        if tiles:
            return
        exact = x.double() @ w.double().T
        f_linear_error = (F.linear(x, w.float()).double() - exact).abs().max()
        assert (layer(x).double() - exact).abs().max() <= 2 * f_linear_error  # float32 sums


@needs_kernels
@pytest.mark.parametrize("dtype,kind", [(torch.float32, "F16"), (torch.bfloat16, "Q5_1")])
def test_the_op_given_many_rows_runs_a_gemm_on_the_dequantized_weight(dtype, kind):
    """Past the panels, a GEMM on the weight dequantized in chunks: in x's dtype, but bfloat16
    without AVX-512 (no bfloat16 arithmetic there) in float32, rounded once."""
    blocks = random_blocks(kind, 70_000, 64, seed=3)  # more rows than one chunk dequantizes
    x = torch.randn(block_linear.MAX_PANEL_ROWS + 3, 64).to(dtype)
    widened = dtype == torch.bfloat16 and block_linear.isa(block_linear.variant()) != "AVX-512"
    weight = dequantize_rows(blocks, kind, 64).to(torch.float32 if widened else dtype)
    y = block_linear.linear(x, blocks, kind)
    assert y.dtype == dtype
    expected = F.linear(x.to(weight.dtype), weight).to(dtype)
    torch.testing.assert_close(y, expected)


@needs_kernels
@pytest.mark.parametrize("kind", QUANTIZED)
def test_bfloat16_rows_of_a_decode_step_are_their_float32_products_rounded_once(kind):
    """bfloat16 x of a decode step's rows (9 to 300): its float32 products rounded once, on the
    integer panels (AVX-512 VNNI: the activations quantized from x's exact float32 values, summed
    in int32 and float32) or, on a build without AVX-512, widened to float32 and multiplied on
    the float32 route (dequantized panels, then a float32 GEMM): never PyTorch's emulated
    bfloat16 GEMM, whose sums are rounded more."""
    blocks = random_blocks(kind, 45, 160, seed=7)
    rows_tried = (
        block_linear.MAX_TILE_KERNEL_ROWS + 1,
        block_linear.MAX_ROWS + 1,
        40,
        block_linear.MAX_PANEL_ROWS,
    )
    if not block_linear.integer_panels(kind):
        rows_tried += (block_linear.MAX_PANEL_ROWS + 44,)  # past the panels: the float32 GEMM
    for rows in rows_tried:
        x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows)).bfloat16()
        y = block_linear.linear(x, blocks, kind)
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, block_linear.linear(x.float(), blocks, kind).bfloat16())


@needs_kernels
def test_a_symbolic_number_of_rows_is_traced_to_the_op():
    layer = block_model().blocks[0].mlp.gate
    batch = torch.export.Dim("batch", min=2, max=64)
    with torch.no_grad():
        program = torch.export.export(layer, (torch.randn(4, 64),), dynamic_shapes=({0: batch},))
        assert "block_linear" in program.graph_module.code
        for rows in (3, 40):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(program.module()(x), layer(x))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_forward_traces_as_one_graph(dtype):
    """torch.compile of a GGUF model's prefill (`generate(compile=True)`) sees no graph break: a
    float32 prompt's route (panels or GEMM, by torch's float32 matmul precision) is decided as
    it traces, where asking for the precision broke the graph and left the forward eager."""
    model = block_model().to(dtype).eval()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(torch.randint(0, 64, (2, 40)))
    assert explained.graph_break_count == 0 and explained.graph_count == 1


@needs_kernels
def test_the_compiled_decode_step_calls_the_block_kernels_and_decodes_the_eager_tokens():
    model = block_model()
    prompt = [[5, 17, 3, 42]]
    eager = generate(model, prompt, 12, temperature=0)
    compiled = generate(model, prompt, 12, temperature=0, compile=True)  # builds the step first
    called = ops_called(lambda: generate(model, prompt, 12, temperature=0, compile=True))
    assert "decoderlm::block_linear" in called
    assert compiled == eager


def test_an_unknown_isa_cap_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv(features.ISA_ENV, "avx3")
    with pytest.raises(
        DecoderLMError, match="DECODERLM_CPU_ISA='avx3' must be one of avx2, portable"
    ):
        features.cpu_flags()


CAPPED = """
import torch
from decoderlm.cpu import block_linear, features
blocks = torch.arange(4 * 20 * 2, dtype=torch.int64).remainder(251).to(torch.uint8).view(4, 40)
blocks.view(4, 2, 20)[..., :4] = torch.tensor([0.01, -0.02]).half().view(torch.uint8)
x = torch.linspace(-2, 3, 64).view(1, 64)
print(block_linear.kernel_name("Q4_1"), "avx512f" in features.cpu_flags())
print(block_linear.linear(x, blocks, "Q4_1").view(torch.int32).tolist())
"""


@needs_kernels
@pytest.mark.parametrize("cap,variant,isa", [("avx2", 1, "AVX2"), ("portable", 0, "portable C")])
def test_a_capped_process_runs_that_build_as_an_uncapped_one_does(tmp_path, cap, variant, isa):
    # In a process of its own, which builds the kernels under the cap.
    env = {**os.environ, features.ISA_ENV: cap}
    done = subprocess.run([sys.executable, "-c", CAPPED], capture_output=True, text=True, env=env)
    kernel, products = done.stdout.splitlines()
    blocks = torch.arange(4 * 20 * 2, dtype=torch.int64).remainder(251).to(torch.uint8).view(4, 40)
    blocks.view(4, 2, 20)[..., :4] = torch.tensor([0.01, -0.02]).half().view(torch.uint8)
    here = block_linear.linear(torch.linspace(-2, 3, 64).view(1, 64), blocks, "Q4_1", variant)
    assert kernel == f"int8 dot products, {isa} False", done.stderr  # no AVX-512 flags either
    assert products == str(here.view(torch.int32).tolist())


@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("k", [576, 100, 37])
def test_int8_linear_products_are_as_close_to_float64_as_f_linear(variant, k):
    layer = Int8Linear.from_linear(nn.Linear(k, 70, generator_seed(k)))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(k))
    w = layer.dequantized()
    exact = x.double() @ w.double().T
    ulp = float(exact.abs().max()) * torch.finfo(torch.float32).eps
    y = block_linear.int8_linear(x, layer.weight_q, layer.scale, variant)
    ours, theirs = (float((t.double() - exact).abs().max()) for t in (y, F.linear(x, w)))
    assert ours <= 2 * theirs + ulp, (ours, theirs)


@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("group_size", INT4_GROUP_SIZES)
@pytest.mark.parametrize("m", [1, 6])
def test_int4_linear_products_are_as_close_to_float64_as_f_linear(variant, group_size, m):
    layer = Int4Linear.from_linear(nn.Linear(256, 70, generator_seed(group_size)), group_size)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
    w = layer.dequantized()
    exact = x.double() @ w.double().T
    ulp = float(exact.abs().max()) * torch.finfo(torch.float32).eps
    y = block_linear.int4_linear(x, layer.weight_q, layer.scale, layer.offset, group_size, variant)
    ours, theirs = (float((t.double() - exact).abs().max()) for t in (y, F.linear(x, w)))
    assert ours <= 2 * theirs + 2 * ulp, (ours, theirs)


def generator_seed(seed: int) -> bool:
    """nn.Linear's `bias` argument, with torch's global generator seeded first."""
    torch.manual_seed(seed)
    return False


@needs_kernels
@pytest.mark.parametrize("to", ["int8", "int4", "bf16"])
def test_quantized_layers_run_a_few_rows_on_the_kernels_and_many_as_before(to):
    model = quantize(tiny_model(), to=to)
    layer = model.blocks[0].mlp.up
    few, many = torch.randn(3, layer.in_features), torch.randn(40, layer.in_features)
    with torch.no_grad():
        kernel = "decoderlm::int_linear" if to != "bf16" else "decoderlm::block_linear"
        assert kernel in ops_called(lambda: layer(few))
        assert kernel not in ops_called(lambda: layer(many))
        torch.testing.assert_close(layer(few), F.linear(few, layer.dequantized()))


@needs_kernels
def test_bfloat16_without_bfloat16_instructions_computes_in_float32(monkeypatch):
    monkeypatch.setattr(features, "bf16_emulated", lambda: True)
    w = torch.randn(48, 64).to(torch.bfloat16)
    few, many = torch.randn(2, 64).to(torch.bfloat16), torch.randn(40, 64).to(torch.bfloat16)
    with torch.no_grad(), decode.CPULinearKernels():
        assert "decoderlm::block_linear" in ops_called(lambda: F.linear(few, w))
        y_few, y_many = F.linear(few, w), F.linear(many, w)
    for x, y in ((few, y_few), (many, y_many)):
        float32 = (x.float() @ w.float().T).to(torch.bfloat16)  # one rounding of float32 sums
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, float32, atol=0, rtol=2**-7)


@needs_kernels
@pytest.mark.parametrize("m", [40, 300])  # on the panels; past them
def test_many_bfloat16_rows_of_blocks_without_bfloat16_instructions_are_float32_rounded_once(
    monkeypatch, m
):
    """A GGUF layer's product of many bfloat16 rows, where PyTorch's bfloat16 GEMM is emulated:
    the float32 product of the rows, rounded to bfloat16 once; not a GEMM of the weights rounded
    to bfloat16 (which differs)."""
    layer = BlockLinear(64, 48, "Q4_1", blocks=random_blocks("Q4_1", 48, 64, seed=3))
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    with torch.no_grad():
        float32 = layer.matmul(x.float()).to(torch.bfloat16)
        monkeypatch.setattr(features, "bf16_emulated", lambda: False)
        native = layer.matmul(x)
        monkeypatch.setattr(features, "bf16_emulated", lambda: True)
        emulated = layer.matmul(x)
    assert emulated.dtype == torch.bfloat16
    assert torch.equal(emulated, float32)
    assert m <= block_linear.MAX_PANEL_ROWS or not torch.equal(native, float32)


@needs_kernels
def test_the_compiled_decode_step_of_an_int4_model_calls_the_kernel_and_decodes_the_eager_tokens():
    model = quantize(tiny_model(), to="int4", group_size=32)
    prompt = [[5, 17, 3, 42]]
    eager = generate(model, prompt, 12, temperature=0)
    compiled = generate(model, prompt, 12, temperature=0, compile=True)
    assert "decoderlm::int_linear" in ops_called(
        lambda: generate(model, prompt, 12, temperature=0, compile=True)
    )
    assert compiled == eager
