"""Linear layers whose weights stay in ggml's block formats (a GGUF file's Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, F16 and BF16 rows; `decoderlm.quant.blocks`), multiplied from the blocks themselves.

Decoding reads every weight once per token, so a product that first dequantizes the whole weight
to floats (and writes and reads those again) runs at a fraction of the rate the blocks can be read.
`linear` (the op decoderlm::block_linear, `block_linear.c`) instead computes y = x Ŵᵀ for a few
rows of x straight from the blocks, as llama.cpp's ggml does (its `ggml_vec_dot_q4_1_q8_1` …):
each block of 32 activations is quantized to integers and a block's dot product with the weights'
integers is summed exactly in int32 by the CPU's integer dot-product instructions (AVX-512 VNNI's
vpdpbusd and vpdpwssd, AVX2's vpmaddubsw and vpmaddwd), then scaled once in float32. Where ggml
rounds each activation to one int8 (x ≈ d·a), the kernels keep 16 bits: for the 4- and 5-bit
types two int8, x ≈ e·(256 a + b), an error of at most max|x| / (127 · 256) per activation, 256
times below one int8's, for one more vpdpbusd per 64 weights; for Q8_0 one int16, x ≈ e·c, an
error of at most max|x| / (2 · 32767), its int8 weights widened to int16. Measured to choose
(2026-12-05, one thread of a loaded 2-core Sapphire Rapids, a Q4_1 1536 × 576 product in cache):
two int8 45.9 µs, one int8 45.2 µs, weights dequantized to floats in registers and summed by FMA
(exact but for the order of the sums) 65.3 µs; on SmolLM2-135M's Q4_1 file the logits then move
by 0.03 from the float reference, llama.cpp's by 1.4 (benchmarks/gguf_decode.py). Q8_0 as int16
against two int8 (2026-12-06, a Zen 4, a 1536 × 576 product in cache, one thread): 37 against 42
µs with AVX-512, 46 against 68 µs with AVX2. The 4- and 5-bit types as one int16 against two int8
with AVX2 (2026-12-07, a Zen 4 running the AVX2 build, one thread, the same product, rows 1 / 4 /
16): Q4_1 60 / 129 / 491 against 53 / 134 / 511 µs, Q4_0 56 / 115 / 439 against 54 / 135 / 529,
Q5_1 75 / 149 / 577 against 67 / 149 / 579: slower for the one row of decoding, so two int8
stay. The AVX2 kernel joins them for Q4_0 and Q4_1, c = 256 a + b (the same integer as 256 Σ u a
+ Σ u b: two vpmaddwd and a vpaddd a block, where a and b apart take two vpmaddubsw more), as
the AVX2 tiles do (2026-12-08, the same product, one row, one thread of a Zen 4: 48-50 against
54-56 µs); the 5-bit types keep a and b apart there (their bytes widened to int16 cost more than
that saves at one row). F16 and BF16 weights, and decoderlm.quant's Int8Linear and
Int4Linear (`int8_linear`, `int4_linear`), are widened to float32 and summed by FMA.

More rows run on panels (`block_panels.c`): each thread unpacks the weights of PANEL outputs at a
time into a buffer in its cache and multiplies every row by it there, so that each weight is
unpacked once a call and never written to memory. On AVX-512 VNNI a quantized type's panels hold
its integers (`integer_panels`: from MAX_TILE_KERNEL_ROWS + 1 rows, float32 of any number and
bfloat16 up to MAX_PANEL_ROWS), multiplied by vpdpbusd (the 4- and 5-bit types, against two int8
per activation) or vpdpwssd (Q8_0, against one int16), the activations quantized as the kernels
quantize them, so that a row's are rounded alike at every number of rows; elsewhere float32 rows
up to MAX_PANEL_ROWS run on panels of the dequantized weights, for the
outer-product tile of `outer.h` (the one `invariant.c` runs). More rows still (a prompt's
prefill), or bfloat16 ones, go to a GEMM, as many rows amortize the dequantization: `dequantize`
(decoderlm::block_dequantize) writes the weights' floats with the same C code for the caller to
multiply (`decoderlm.quant.BlockLinear` does, with F.linear, where the number of rows is known);
`linear` itself, given more rows (a batch size left symbolic in a compiled library), dequantizes
a chunk of rows at a time and multiplies it by aten::matmul. Without AVX-512 the CPU has no
bfloat16 arithmetic and PyTorch's bfloat16 GEMM emulates it (slower than float32's, its sums
rounded more): there `linear` widens bfloat16 rows to float32, runs them on the float32 route
(panels, then the GEMM) and rounds the products once.

A batch-invariant engine asks for products whose every row has the bits it has alone
(`linear(..., invariant=True)`, `decoderlm.quant.blocks.InvariantBlockLinear`). The kernels sum
each output in vector lanes of its inputs, the integer tiles one block after another in one lane
an output, and a prompt's GEMM in oneDNN's order, so by default a row's bits change with the
number of rows in its pass. Invariant products never take the panels of dequantized weights or a
GEMM: on AVX-512 VNNI and AVX2 a quantized type's few rows run on `block_panels.c`'s strips, which
read 16 (AVX2: 8) output rows' blocks as they lie and do the tiles' operations in the tiles' order
(each output's int32 block sums gathered into its own lane), and more rows on the tiles, bfloat16
past MAX_PANEL_ROWS too; the AVX2 build's tiles and strips sum the same integers as AVX-512's and
give a row the same bits. Float types, and the portable build, take the block kernel at every
number of rows. The C code is
compiled without -fassociative-math, so that the compiler keeps the sums in the order written
(it vectorises the portable kernel over rows otherwise, each row count in its own order).

`block_linear.c` and `block_panels.c` (with each build's integer code in `block_panels_avx512.h`
and `block_panels_avx2.h`) are built three times (`decoderlm.cpu.native`): for this CPU (`-march=native`:
AVX-512 VNNI code where the CPU has it), for AVX2 (`-mno-avx512f`) and as portable C
(`-mno-avx`); `variant()` is the build the ops call: the native one, unless `DECODERLM_CPU_ISA`
(`decoderlm.cpu.features.isa_cap`) caps it, which is how the AVX2 and portable code run, and are
tested and measured, on an AVX-512 machine. `kernel_name(ggml_type)` says which code a layer runs.
"""

from __future__ import annotations

import ctypes
import functools
import math
import platform
from pathlib import Path

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from decoderlm.cpu import features, native

# The types, in the order of the C code's enum (and of decoderlm.quant.blocks.BLOCK_TYPES).
TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
FLOAT_TYPES = ("F16", "BF16")
VARIANTS = ("portable", "avx2", "native")  # the ops' `variant` argument indexes this
ISAS = ("portable C", "AVX2", "AVX-512")  # what a build's code uses (block_linear_isa_*)
# Rows of x up to which a product runs on the block kernel (which unpacks each weight block once
# per four rows), where the build has no integer panels for the type; MAX_TILE_KERNEL_ROWS where
# it has (block_linear_ops.cpp's `path`): SmolLM2's 30 layers with their weights in memory, 2
# threads of a Zen 4, at 4 / 8 / 12 / 16 rows 8.7 / 17.8 / 22.9 / 27.2 ms on the kernel, 12.4 /
# 17.7 / 16.4 / 19.1 on integer panels.
MAX_ROWS = 16
MAX_TILE_KERNEL_ROWS = 8
# Rows up to which a product runs on panels where they are float32 ones (dequantized weights) or
# the activations are bfloat16 (integer panels); more go to dequantize + GEMM, whose packing of x
# pays off over a prompt's rows.
MAX_PANEL_ROWS = 256

_SOURCES = (Path(__file__).with_name("block_linear.c"), Path(__file__).with_name("block_panels.c"))
# The C code's float sums in the order it writes them (-ffast-math would let the compiler reorder
# them, differently where it vectorises the plain C kernel over rows: a row's bits would then depend
# on the rows beside it, which `linear(..., invariant=True)` rules out).
_FLOAT_ORDER = ("-fno-associative-math",)
_VARIANT_FLAGS = {
    "portable": ("-mno-avx",),
    "avx2": ("-mno-avx512f", "-mno-avxvnni"),
    "native": (),
}

_OPS = torch.library.Library("decoderlm", "FRAGMENT")
_OPS.define(
    "block_linear(Tensor x, Tensor blocks, int ggml_type, int variant, bool invariant) -> Tensor"
)
_OPS.define(
    "block_dequantize(Tensor blocks, int ggml_type, int k, int start, int rows, bool bf16, "
    "int variant) -> Tensor"
)
_OPS.define(
    "int_linear(Tensor x, Tensor weight_q, Tensor scale, Tensor? offset, int bits, int group, "
    "int variant) -> Tensor"
)


def _sources() -> list[native.Source]:
    x86 = platform.machine() in ("x86_64", "AMD64")
    builds: list[native.Source] = [
        native.Build(source, (f"-DVARIANT={name}", *_FLOAT_ORDER, *(flags if x86 else ())))
        for name, flags in _VARIANT_FLAGS.items()
        for source in _SOURCES
    ]
    return [*builds, Path(__file__).with_name("block_linear_ops.cpp")]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The ops' library (its block_linear_isa_* say what each build runs), loaded."""
    fallback = "ggml block products dequantize the weights first"
    return native.load(_sources(), fallback, native.load_ops_library)


@functools.cache
def isa(variant_index: int) -> str:
    """What the build `VARIANTS[variant_index]` runs on this CPU: one of ISAS."""
    function = getattr(_library(), f"block_linear_isa_{VARIANTS[variant_index]}")
    return ISAS[function()]


@torch.compiler.assume_constant_result  # traced code asks too; the answer never changes
def variant() -> int:
    """The build the ops call: native, or the one `features.isa_cap` names (-1: none built)."""
    if _library() is None:
        return -1
    cap = features.isa_cap()
    return VARIANTS.index(cap) if cap is not None else VARIANTS.index("native")


def available() -> bool:
    return variant() >= 0


def _loaded(variant_index: int) -> int:
    """`variant_index`, the library loaded (a caller naming a build has not asked `variant`)."""
    if _library() is None:
        raise RuntimeError("block_linear: the kernels could not be built here")
    return variant_index


def kernel_name(ggml_type: str) -> str:
    """The code a product of `ggml_type` runs for a few rows here, e.g. "int8 dot products,
    AVX-512 VNNI" (Q8_0: "int16 dot products, …")."""
    if not available():
        return "dequantized by PyTorch, F.linear"
    code = isa(variant())
    if ggml_type in FLOAT_TYPES:
        return f"widened to float32, {code}"
    width = "int16" if ggml_type == "Q8_0" else "int8"
    return f"{width} dot products, {code}{' VNNI' if code == 'AVX-512' else ''}"


def few_rows(x: Tensor) -> bool:
    """Whether x (..., K) holds at most MAX_ROWS rows; False, and no guard, where a symbolic
    batch size leaves it open."""
    return statically_known_true(math.prod(x.shape[:-1]) <= MAX_ROWS)


def many_rows(x: Tensor) -> bool:
    """Whether x (..., K) holds more than MAX_ROWS rows; False, and no guard, where a symbolic
    batch size leaves it open."""
    return statically_known_true(math.prod(x.shape[:-1]) > MAX_ROWS)


@torch.compiler.assume_constant_result  # traced code asks too; the answer never changes
def integer_panels(ggml_type: str) -> bool:
    """Whether many rows of `ggml_type` run on integer panels here (`block_panels.c`'s
    block_tiles: a quantized type, AVX-512 VNNI)."""
    return available() and ggml_type not in FLOAT_TYPES and isa(variant()) == "AVX-512"


@torch.compiler.assume_constant_result  # a str torch.compile would break its graph on
def _exact_float32() -> bool:
    """Whether torch's float32 matmul precision asks for float32 products (not "medium"). A
    compiled graph keeps the answer it traced; only the route is fixed so, not the precision:
    `bf16_linear.float32_linear` follows the precision set when it runs."""
    return torch.get_float32_matmul_precision() != "medium"


def on_panels(x: Tensor, ggml_type: str) -> bool:
    """Whether x (..., K), a statically known number of rows past MAX_ROWS, is faster on the op's
    panels than on a GEMM of the dequantized weights: with integer panels (`integer_panels`) up
    to MAX_PANEL_ROWS rows, and float32 past that; with dequantized panels float32 up to
    MAX_PANEL_ROWS. Float32 at torch's float32 matmul precision "medium" goes to the GEMM's
    bfloat16 products (`bf16_linear.float32_linear`) wherever the panels are not integer ones or
    the rows are more than MAX_PANEL_ROWS."""
    rows = math.prod(x.shape[:-1])
    if not statically_known_true(rows > MAX_ROWS):
        return False
    within = statically_known_true(rows <= MAX_PANEL_ROWS)
    exact = x.dtype == torch.float32 and _exact_float32()
    if integer_panels(ggml_type):
        return within or exact
    return within and exact


def runs(x: Tensor, weight: Tensor) -> bool:
    """Whether the kernels take x and the weight: on the CPU, x float32 or bfloat16, no gradient
    to either, and the kernels built."""
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    cpu = x.device.type == "cpu" and weight.device.type == "cpu"
    dtype = x.dtype in (torch.float32, torch.bfloat16)
    return cpu and dtype and not needs_grad and available()


def handles(x: Tensor, weight: Tensor) -> bool:
    """Whether x Ŵᵀ goes to a kernel for a few rows: `runs`, and at most MAX_ROWS rows."""
    return few_rows(x) and runs(x, weight)


def linear(
    x: Tensor,
    blocks: Tensor,
    ggml_type: str,
    variant_index: int | None = None,
    invariant: bool = False,
) -> Tensor:
    """x Ŵᵀ: x (..., K) float32 or bfloat16, blocks (N, row bytes) uint8 of `ggml_type` →
    (..., N) in x's dtype, on the build `variant_index` (default: `variant()`). `invariant`: each
    row's outputs the same bits whatever the rows beside it (a batch-invariant engine): on
    AVX-512 VNNI and AVX2 a quantized type's products in the integer tiles' arithmetic at every
    number of rows (`block_panels.c`'s strips, then its tiles), elsewhere the block kernel at
    every number."""
    chosen = variant() if variant_index is None else _loaded(variant_index)
    return torch.ops.decoderlm.block_linear(x, blocks, TYPES.index(ggml_type), chosen, invariant)


def dequantize(
    blocks: Tensor,
    ggml_type: str,
    k: int,
    start: int,
    rows: int,
    dtype: torch.dtype = torch.float32,
    variant_index: int | None = None,
) -> Tensor:
    """Rows start .. start + rows − 1 of Ŵ (N, k) → (rows, k) float32, or bfloat16 (rounded to
    nearest even) for dtype bfloat16."""
    chosen = variant() if variant_index is None else _loaded(variant_index)
    bf16 = dtype == torch.bfloat16
    return torch.ops.decoderlm.block_dequantize(
        blocks, TYPES.index(ggml_type), k, start, rows, bf16, chosen
    )


def int8_linear(
    x: Tensor, weight_q: Tensor, scale: Tensor, variant_index: int | None = None
) -> Tensor:
    """(x qᵀ)_n · s_n of `decoderlm.quant.Int8Linear`: x (..., K) float32 or bfloat16, weight_q
    (N, K) int8, scale (N,) → (..., N) in x's dtype; the int8 widened to float32 (exact), the
    products summed by FMA."""
    chosen = variant() if variant_index is None else _loaded(variant_index)
    k = weight_q.shape[1]
    return torch.ops.decoderlm.int_linear(x, weight_q, scale.float(), None, 8, k, chosen)


def int4_linear(
    x: Tensor,
    weight_q: Tensor,
    scale: Tensor,
    offset: Tensor,
    group_size: int,
    variant_index: int | None = None,
) -> Tensor:
    """x Ŵᵀ of `decoderlm.quant.Int4Linear`, Ŵ_nk = s_ng q_nk + m_ng: x (..., K) float32 or
    bfloat16, weight_q (N, K/2) uint8 (q_2j in byte j's low nibble, q_2j+1 in its high one), scale
    and offset (N, K/group_size) → (..., N) in x's dtype:
    Σ_g s_ng Σ_{k∈g} x_k q_nk + m_ng Σ_{k∈g} x_k, the integers widened to float32."""
    chosen = variant() if variant_index is None else _loaded(variant_index)
    s, m = scale.float(), offset.float()
    return torch.ops.decoderlm.int_linear(x, weight_q, s, m, 4, group_size, chosen)


@torch.library.register_fake("decoderlm::block_linear", lib=_OPS)
def _(x: Tensor, blocks: Tensor, ggml_type: int, variant: int, invariant: bool) -> Tensor:
    return x.new_empty((*x.shape[:-1], blocks.shape[0]))


@torch.library.register_fake("decoderlm::block_dequantize", lib=_OPS)
def _(
    blocks: Tensor, ggml_type: int, k: int, start: int, rows: int, bf16: bool, variant: int
) -> Tensor:
    return blocks.new_empty((rows, k), dtype=torch.bfloat16 if bf16 else torch.float32)


@torch.library.register_fake("decoderlm::int_linear", lib=_OPS)
def _(
    x: Tensor,
    weight_q: Tensor,
    scale: Tensor,
    offset: Tensor | None,
    bits: int,
    group: int,
    variant: int,
) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight_q.shape[0]))
