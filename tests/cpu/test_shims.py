"""A library compiled by AOTInductor calls decoderlm's ops directly (`decoderlm.cpu.shims`,
`aoti_shim.h`), past the proxy executor: every schema type passed in PyTorch's C shim ABI (a
tensor, an absent and a present optional tensor, int, float), the results the eager op's bits,
the call still seen by torch.profiler, and a kernel's error reported with its message."""

from __future__ import annotations

import warnings
import zipfile

import pytest
import torch
from torch import Tensor, nn

from decoderlm.cpu import block_linear, fused, shims

needs_ops = pytest.mark.skipif(
    not (block_linear.available() and fused.ops_available()), reason="no C/C++ compiler"
)


def test_declarations_put_each_schema_type_in_the_c_shim_abi():
    assert shims.declaration(torch.ops.decoderlm.int_linear.default) == (
        "AOTITorchError aoti_torch_cpu_int_linear(AtenTensorHandle x, AtenTensorHandle weight_q, "
        "AtenTensorHandle scale, AtenTensorHandle* offset, int64_t bits, int64_t group, "
        "int64_t variant, AtenTensorHandle* ret0)"
    )
    assert shims.declaration(torch.ops.decoderlm.fused_rms_norm.default) == (
        "AOTITorchError aoti_torch_cpu_fused_rms_norm(AtenTensorHandle x, AtenTensorHandle weight, "
        "double eps, double offset, AtenTensorHandle* ret0)"
    )
    assert "int32_t bf16, int64_t variant" in shims.declaration(
        torch.ops.decoderlm.block_dequantize.default
    )


class Layers(nn.Module):
    """int8 (no offset) and int4 (an offset) products of `int_linear`, then an RMSNorm."""

    def forward(self, x, q8, s8, q4, s4, m4, gain):
        variant = block_linear.variant()
        y = torch.ops.decoderlm.int_linear(x, q8, s8, None, 8, q8.shape[1], variant)
        y = torch.ops.decoderlm.int_linear(y, q4, s4, m4, 4, 32, variant)
        return torch.ops.decoderlm.fused_rms_norm(y, gain, 1e-5, 0.25)


def operands() -> list[Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(1, 64, generator=g),
        torch.randint(-127, 128, (96, 64), dtype=torch.int8, generator=g),
        torch.rand(96, generator=g) / 100,
        torch.randint(0, 256, (64, 48), dtype=torch.uint8, generator=g),
        torch.rand(64, 3, generator=g) / 10,
        torch.randn(64, 3, generator=g),
        torch.rand(64, generator=g) + 0.5,
    ]


def compiled(module: nn.Module, args: list[Tensor], path: str):
    """module's library (AOTInductor) with the direct calls of `shims.c_shims`, and its C++."""
    program = torch.export.export(module, tuple(args))
    direct = shims.c_shims(program.graph)
    with warnings.catch_warnings():  # as decode.step_library: torch's own deprecation (2.13)
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
        package = torch._inductor.aoti_compile_and_package(
            program,
            package_path=path,
            inductor_configs={"aot_inductor.custom_ops_to_c_shims": direct},
        )
    with zipfile.ZipFile(package) as archive:
        source = "".join(
            archive.read(name).decode() for name in archive.namelist() if name.endswith(".cpp")
        )
    return torch._inductor.aoti_load_package(package).loader.run, direct, source


@needs_ops
def test_a_library_calls_the_ops_directly_with_the_eager_results_and_profiler_events(tmp_path):
    args = operands()
    run, direct, source = compiled(Layers(), args, str(tmp_path / "layers.pt2"))
    assert set(direct) == {
        torch.ops.decoderlm.int_linear.default,
        torch.ops.decoderlm.fused_rms_norm.default,
    }
    assert "proxy_executor_call_function" not in source
    assert source.count("AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_int_linear(") == 2
    with torch.profiler.profile() as prof:
        (y,) = run(args)
    events = [event.key for event in prof.events()]
    assert events.count("decoderlm::int_linear") == 2
    assert events.count("decoderlm::fused_rms_norm") == 1
    assert torch.equal(y, Layers()(*args))


@needs_ops
def test_a_kernels_error_in_a_direct_call_is_raised_with_its_message(tmp_path, capfd):
    class Bad(nn.Module):
        def forward(self, x, q8, s8):
            return torch.ops.decoderlm.int_linear(x, q8, s8, None, 5, 64, block_linear.variant())

    x, q8, s8 = operands()[:3]
    run, direct, _ = compiled(Bad(), [x, q8, s8], str(tmp_path / "bad.pt2"))
    assert torch.ops.decoderlm.int_linear.default in direct
    with pytest.raises(RuntimeError):
        run([x, q8, s8])
    err = capfd.readouterr().err
    assert err.startswith("Error: decoderlm::int_linear: ") and "bits 8 or 4" in err
