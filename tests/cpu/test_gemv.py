"""The one-row linear kernels (`decoderlm.cpu.gemv`): as close to float64 as F.linear for float32,
bfloat16 and int8 weights (and bfloat16 weights under float32 activations), with N and K that
are not multiples of the vector width; one row only;
called by the compiled decode step, which then decodes the tokens of the eager model; and, where
they cannot be built, PyTorch's kernels instead."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from decoderlm import DecoderLM, ModelConfig
from decoderlm.cpu import gemv
from decoderlm.inference.generate import generate
from decoderlm.quant import quantize

needs_kernel = pytest.mark.skipif(
    not gemv.available(torch.float32, torch.float32), reason="no AVX-512, or no C/C++ compiler"
)
SHAPES = [(768, 512), (5, 37), (3, 1), (33, 100)]  # (N, K): tails of 4 rows and of 16/32 inputs


def rounding_error(y: torch.Tensor, exact: torch.Tensor) -> float:
    return float((y.double() - exact).abs().max())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_one_row_product_is_as_close_to_float64_as_f_linear(dtype, n, k):
    if not gemv.available(dtype, dtype):
        pytest.skip(f"no {dtype} kernel on this CPU")
    g = torch.Generator().manual_seed(n * k)
    x, w = torch.randn(1, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    exact = x.double() @ w.double().T  # the same rounded inputs, summed in float64
    ulp = float(exact.abs().max()) * torch.finfo(dtype).eps  # one rounding of the output
    ours, theirs = rounding_error(gemv.linear(x, w), exact), rounding_error(F.linear(x, w), exact)
    assert ours <= 2 * theirs + ulp, (ours, theirs)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_int8_product_is_as_close_to_float64_as_the_dequantized_f_linear(dtype, n, k):
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g).to(dtype)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) / 127
    exact = (x.double() @ q.double().T) * scale.double()  # (x·qᵀ)_n · s_n
    ulp = float(exact.abs().max()) * torch.finfo(dtype).eps
    theirs = rounding_error(F.linear(x, q.to(dtype)) * scale.to(dtype), exact)
    ours = rounding_error(gemv.int8_linear(x, q, scale), exact)
    assert ours <= 2 * theirs + ulp, (ours, theirs)


@needs_kernel
@pytest.mark.parametrize("n,k", SHAPES)
def test_bf16_weights_under_float32_activations_are_as_close_to_float64_as_f_linear(n, k):
    g = torch.Generator().manual_seed(3 * n + k)
    x, w = torch.randn(1, k, generator=g), torch.randn(n, k, generator=g).to(torch.bfloat16)
    exact = x.double() @ w.double().T  # the bfloat16 weights, exact in float64
    ulp = float(exact.abs().max()) * torch.finfo(torch.float32).eps
    y = gemv.linear(x, w)
    theirs = rounding_error(F.linear(x, w.float()), exact)
    assert y.dtype == torch.float32
    assert rounding_error(y, exact) <= 2 * theirs + ulp, (rounding_error(y, exact), theirs)


@needs_kernel
def test_more_than_one_row_or_a_wrong_width_is_refused():
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="one row"):
        gemv.linear(torch.randn(2, 16), w)
    with pytest.raises(RuntimeError, match="one row"):
        gemv.linear(torch.randn(1, 15), w)


def tiny_model() -> DecoderLM:
    torch.manual_seed(0)
    config = ModelConfig.from_preset("llama-tiny", vocab_size=97, d_model=64, n_layers=2)
    return DecoderLM(config).eval()


def ops_called(fn) -> set[str]:
    with profile() as prof:
        fn()
    return {event.key for event in prof.key_averages()}


@needs_kernel
@pytest.mark.parametrize("weights", ["fp32", "int8", "bf16"])
def test_the_compiled_decode_step_calls_the_kernels_and_decodes_the_eager_tokens(weights):
    model = tiny_model()
    if weights != "fp32":
        model = quantize(model, to=weights)  # bf16: bfloat16 weights, float32 activations
    prompt = [[5, 17, 3, 42]]
    eager = generate(model, prompt, 12, temperature=0)
    compiled = generate(model, prompt, 12, temperature=0, compile=True)  # builds the step first
    op = "decoderlm::gemv_int8" if weights == "int8" else "decoderlm::gemv"
    assert op in ops_called(lambda: generate(model, prompt, 12, temperature=0, compile=True))
    assert compiled == eager


WITHOUT_KERNELS = """
import torch
import torch.nn.functional as F
from decoderlm.cpu import gemv
from decoderlm.cpu.decode import CPULinearKernels

x, w = torch.randn(1, 8), torch.randn(4, 8)
print(gemv.available(torch.float32, torch.float32))
with CPULinearKernels():
    y = F.linear(x, w)
print(torch.allclose(y, x @ w.T, atol=1e-6))
"""


def test_without_a_compiler_one_row_products_run_on_pytorch(tmp_path):
    # In a process of its own: this one has registered the kernels already.
    env = {**os.environ, "CC": "false", "CXX": "false", "DECODERLM_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_KERNELS], capture_output=True, text=True, env=env
    )
    assert done.stdout.split() == ["False", "True"], done.stderr
    assert not list(tmp_path.glob("kernels/*.so"))
