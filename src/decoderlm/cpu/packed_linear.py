"""Linear layers whose weights are packed once, for batched inference on the CPU.

F.linear reorders nothing ahead: for a batch of a few rows (a serving engine's decode step, one row
per running sequence) MKL's float32 GEMM and oneDNN's bfloat16 one read the weight at a fraction
of the memory bandwidth, and in bfloat16 without bfloat16 dot products ATen's product is several
times slower than float32's. Each linear's weight is packed once into the layout of one of our
kernels instead:

- bfloat16 weights, where the CPU has bfloat16 dot products (AMX tiles, or AVX512-BF16): the
  kernel of `decoderlm.cpu.bf16_linear` (`bf16_linear.kernel()`). A SwiGLU MLP's gate and up
  projections then become one product whose epilogue applies silu(g) ⊙ u (`PackedSwiGLU`):
  their outputs are never written out and read back, the same bits as the two linears and
  `decoderlm.cpu.fused.silu_mul`, whatever the rows (on AMX, two oneDNN GEMMs with silu and the
  product in their epilogues measured 1.01-1.45× the tile product's time from 256 to 8,192
  rows: benchmarks/README.md, engine_passes.py);
- every other float32 or bfloat16 weight: the outer-product kernel of `decoderlm.cpu.invariant`
  (panels of outputs, each summed in one fixed order, AVX-512 or AVX2 lanes). Against oneDNN's
  weights packed for it (`mkldnn._reorder_linear_weight`) on a Zen 4, per SmolLM2 layer's four
  products: float32 1.03-1.42× as fast from 1 to 128 rows, 0.96× at 512 and 2,048; with AVX2
  1.04-1.34× at every row count; bfloat16 without its dot products 2.4-2.7× oneDNN's
  (AVX-512), 2.6-3.8× F.linear's (AVX2, where oneDNN packs no bfloat16) from 4 rows on
  (benchmarks/README.md, packed linears).

Both kernels' ops go into a compiled pass (`_traced`), so the engine compiles its decode passes of
many rows wherever every linear is packed (`AppliedPaths.kernel_products`).

From KERNEL_ROWS_MAX rows (a long prefill pass) a bfloat16 linear's GEMM runs on oneDNN (level with
the bfloat16 kernel there). oneDNN compiles a kernel (a "primitive") for every row count it meets,
a few milliseconds each, and keeps the last 1,024: a serving engine's prefill passes, whose rows
are the decoding sequences plus the prompts' chunks, would meet a new count almost every step
(SmolLM2 in bfloat16: a 16-prompt pass of a new row count 1.2× the time of the same pass again;
the 55M model of benchmarks/serve.py 1.9×). So oneDNN takes the rows of whole multiples of
BUCKET_ROWS and the kernel the last few, both written into one output: oneDNN meets 81 row counts
from 1,536 to 4,096.

`pack_linears(model)` returns the swap without applying it; `swapped(swap)` applies it for the
duration of a `with` block (the engine does so around each step), so the model itself stays plain
and its state_dict unchanged. A packed copy of each weight is kept beside the original: the linear
weights take twice their memory.
The packs are taken when `pack_linears` runs; weights changed afterwards need new packs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from decoderlm.cpu import bf16_linear, gemv, invariant
from decoderlm.cpu.invariant import InvariantLinear
from decoderlm.cpu.swap import Swap
from decoderlm.model.layers import MLP

# From this many rows oneDNN's GEMM behind F.linear was level with the AMX tiles or faster in the
# engine's prefill chunks, and 0.97-1.01× the AVX512-BF16 kernel's time at 2,048 rows on a Zen 4
# (benchmarks/README.md, engine_passes.py): they take the plain weight.
KERNEL_ROWS_MAX = 1536
BUCKET_ROWS = 32  # oneDNN's row counts are multiples of this (`PackedLinear._gemm_and_kernel`)


class PackedLinear(InvariantLinear):
    """y = x Wᵀ + b with W packed once for `bf16_linear`'s kernel (bfloat16 where it supports
    it), else for the fixed-order kernel of `decoderlm.cpu.invariant` (`InvariantLinear`'s
    packs), but a long prefill's bfloat16 rows partly on oneDNN (`_gemm_and_kernel`) and a
    compiled pass's one bfloat16 row on `gemv` (`_traced`); inference only (no gradient reaches
    W)."""

    def forward(self, x: Tensor) -> Tensor:  # (..., in_features) → (..., out_features)
        if torch.compiler.is_compiling():
            return self._traced(x)
        if self.bf16_kernel and x.shape[:-1].numel() >= KERNEL_ROWS_MAX:
            return self._gemm_and_kernel(x)
        return super().forward(x)

    def _gemm_and_kernel(self, x: Tensor) -> Tensor:  # (..., in_features) → (..., out_features)
        """x Wᵀ + b: the rows of whole buckets of BUCKET_ROWS by oneDNN's GEMM (its row counts
        multiples of BUCKET_ROWS), the last few on `bf16_linear`'s kernel, into one output (no
        copy of x)."""
        rows = x.reshape(-1, x.shape[-1])  # (M, K)
        m, n = rows.shape[0], self.linear.out_features
        head = m // BUCKET_ROWS * BUCKET_ROWS
        y = rows.new_empty(m, n)  # (M, N)
        weight = self.linear.weight.detach().T
        if self.bias is None:
            torch.mm(rows[:head], weight, out=y[:head])
        else:  # the bias added to the float32 sums, as F.linear does
            torch.addmm(self.bias, rows[:head], weight, out=y[:head])
        if head < m:
            tail = bf16_linear.linear(rows[head:], self.packed, n)
            y[head:] = tail if self.bias is None else tail + self.bias
        return y.view(*x.shape[:-1], n)

    def _traced(self, x: Tensor) -> Tensor:
        """In a compiled pass (`decoderlm.cpu.paged_step`): the kernel's op over the pack, but
        one row of bfloat16 weights by F.linear, which the pass's `CPULinearKernels` routes to
        `gemv` (faster there). The fixed-order kernel takes one row too: a one-row decode step
        of the 55M model of benchmarks/engine_throughput.py in float32 6.2 ms against 7.6 on
        `gemv`, SmolLM2's 19.6 against 21.3-23.1 (Zen 4; `gemv` has no AVX2 build)."""
        if self.bf16_kernel and gemv.one_row_of(x):
            return F.linear(x, self.linear.weight, self.linear.bias)
        y = self.product(x)  # the op, traced
        # (the parameter, an input of the pass, not the detached `bias`, which would be a constant)
        return y if self.linear.bias is None else y + self.linear.bias


class PackedSwiGLU(nn.Module):
    """A SwiGLU `mlp`, down(silu(gate(x)) ⊙ up(x)), its gate and up projections in one pass of
    `bf16_linear`'s kernel with silu·u in the epilogue (`bf16_linear.swiglu`), `down` packed;
    bfloat16 only (`fuses` says which MLPs)."""

    def __init__(self, mlp: MLP) -> None:
        super().__init__()
        self.mlp, self.down = mlp, PackedLinear(mlp.down)
        gate, up = mlp.gate.weight.detach(), mlp.up.weight.detach()
        packed = bf16_linear.pack_swiglu(gate, up)
        self.register_buffer("packed", packed, persistent=False)  # a compiled pass's input

    @staticmethod
    def fuses(mlp: nn.Module) -> bool:
        """Whether `mlp` is a SwiGLU MLP whose gate and up are plain nn.Linear layers without
        biases that `bf16_linear`'s kernel takes (a quantized model's block linears are left as
        they are)."""
        return (
            isinstance(mlp, MLP)
            and mlp.kind == "swiglu"
            and type(mlp.gate) is nn.Linear
            and type(mlp.up) is nn.Linear
            and mlp.gate.bias is None
            and mlp.up.bias is None
            and bf16_linear.supports(mlp.gate.weight)
            and bf16_linear.supports(mlp.up.weight)
        )

    def op_available(self) -> bool:
        """Whether the op of the kernel is built, for a compiled pass to call."""
        return bf16_linear.op_available()

    def forward(self, x: Tensor) -> Tensor:  # (..., d_model) → (..., d_model)
        mlp = self.mlp
        if torch.compiler.is_compiling() and gemv.one_row_of(x):
            return mlp(x)  # compiled, one row: its linears by `CPULinearKernels`
        h = bf16_linear.swiglu(x, self.packed, mlp.up.out_features)  # (..., d_ff)
        return mlp.dropout(self.down(h))


def can_pack(dtype: torch.dtype) -> bool:
    """Whether linears of `dtype` weights are packed here: float32 and bfloat16, where a C
    compiler builds the fixed-order kernel (bfloat16 on `bf16_linear`'s kernel needs it too)."""
    return dtype in invariant.DTYPES and invariant.available()


def packable(linear: nn.Linear) -> bool:
    """Whether `linear`'s weight lies on the CPU in a dtype `can_pack` takes."""
    return linear.weight.device.type == "cpu" and can_pack(linear.weight.dtype)


def pack_linears(model: nn.Module) -> Swap:
    """A PackedSwiGLU for every MLP it `fuses`, and a PackedLinear for every other plain CPU
    nn.Linear of `model` in a packable dtype (quantized and other subclassed linears are left as
    they are)."""
    swap: Swap = []
    fused = [m for m in model.modules() if PackedSwiGLU.fuses(m)]
    inside = {id(linear) for mlp in fused for linear in mlp.children()}
    for parent in model.modules():
        for name, child in parent.named_children():
            if child in fused:
                swap.append((parent, name, child, PackedSwiGLU(child)))
            elif type(child) is nn.Linear and id(child) not in inside and packable(child):
                swap.append((parent, name, child, PackedLinear(child)))
    return swap
