"""Batch-invariant layers: a row's results do not depend on the rows computed with it (Thinking
Machines, 2025, "Defeating Nondeterminism in LLM Inference": fixed split sizes for every
reduction). A serving engine runs a row in passes of 1 to 64 rows and in prefill chunks of any
size; a BLAS picks its blocking of the inner dimension by the shape, and a vectorised elementwise
loop computes its last elements by a scalar path whose exp rounds differently, so a row's logits
change with its batch, and with them, in bfloat16, its greedy tokens. With these modules swapped
in (`invariant_modules`) and attention read per query from the paged pool
(`decoderlm.engine.runner`'s `batch_invariant`) or from a static cache
(`decoderlm.cpu.decode.InPlaceKVCache`: `generate(batch_invariant=True)`), a request's tokens are
bit-identical alone or among others.

- `InvariantLinear`: y = x Wᵀ, every output summed over its inputs in one fixed order
  (`invariant.c`: AVX-512, AVX2 + FMA or plain C, chosen when the kernel is built for this CPU,
  never by the shape), on a copy of W packed into panels of outputs (`pack`: the weights' memory
  twice over, as the engine's packed linears). On a CPU with bfloat16 dot products (AMX tiles,
  AVX512-BF16), bfloat16 weights the kernel of `decoderlm.cpu.bf16_linear` takes use it, which
  sums each output in the order of its inputs, whatever the rows.
- `InvariantSwiGLU`: the SwiGLU MLP with silu(g) ⊙ u by `decoderlm.cpu.fused.silu_mul`, whose
  every element goes through the same vector instructions, the last of a row masked.
- A GGUF file's block linears (`decoderlm.quant.BlockLinear`) give their own invariant form
  (`batch_invariant()`: `decoderlm.cpu.block_linear`'s products in one arithmetic at every
  number of rows, traced as decoderlm::block_linear).

RMSNorm and RoPE need no swap: the engine runs them through `decoderlm.cpu.fused`, whose kernels
give every element of a row the same instructions whatever the rows (PyTorch's own RMSNorm is
invariant too: its per-row mean and float32 rsqrt; `tests/serving/test_batch_invariant.py` checks
the whole model), nor do LayerNorm (one row per unit of work) and ReLU² (exact arithmetic). GELU
MLPs are refused (`invariant_modules`).

Traced (torch.export, with `fused.as_ops()`), the fixed-order product goes into the graph as the
op decoderlm::invariant_linear (`invariant_ops.cpp`: the same C code behind PyTorch's stable ABI),
bfloat16 kernel products as decoderlm::bf16_linear: the engine's compiled batch-invariant decode
pass (`traceable`) computes every output as the eager passes do.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor, nn

from decoderlm.cpu import bf16_linear, fused, native
from decoderlm.cpu.swap import Swap
from decoderlm.errors import DecoderLMError
from decoderlm.model.layers import MLP

SOURCE = Path(__file__).with_name("invariant.c")
OPS_SOURCES = [SOURCE, Path(__file__).with_name("invariant_ops.cpp")]
DTYPES = (torch.float32, torch.bfloat16)

_OPS = torch.library.Library("decoderlm", "FRAGMENT")
_OPS.define("invariant_linear(Tensor x, Tensor packed, int out_features) -> Tensor")


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = native.load([SOURCE], "batch-invariant kernels are unavailable", ctypes.CDLL)
    if library is not None:
        library.invariant_linear.restype = None
        library.invariant_linear.argtypes = (
            [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        )
        library.invariant_pack.restype = None
        library.invariant_pack.argtypes = (
            [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
        )
        library.invariant_panel.restype = ctypes.c_int64
        library.invariant_panel.argtypes = []
    return library


def available() -> bool:
    """Whether the kernels build here (a C compiler)."""
    return _library() is not None and fused.available()


@functools.cache
def ops_available() -> bool:
    """Whether the op decoderlm::invariant_linear runs here (built first if need be)."""
    return native.load_ops(OPS_SOURCES, "batch-invariant passes run eagerly")


def traceable(modules: Iterable[nn.Module]) -> bool:
    """Whether a pass over `modules` (those a swap puts in, or a model with its swap in place)
    compiles into a library that computes as the eager passes do: every kernel they and `fused`
    call has its op here."""
    linears = [m for module in modules for m in module.modules() if hasattr(m, "op_available")]
    return fused.ops_available() and all(m.op_available() for m in linears)


def _check(x: Tensor, other: Tensor, what: str) -> None:
    if x.dtype != other.dtype or x.dtype not in DTYPES or x.device.type != "cpu":
        raise ValueError(
            f"invariant {what}: {x.dtype} and {other.dtype} (float32 or bfloat16 on the CPU)"
        )


def pack(weight: Tensor) -> Tensor:
    """weight (N, K) float32 or bfloat16 → (⌈N/P⌉, K, P), the panels of P outputs `linear` reads
    (`invariant.c`: P = 32 with AVX-512, 16 with AVX2), zeros past N."""
    _check(weight, weight, "pack")
    n, k = weight.shape
    panel = _library().invariant_panel()
    packed = weight.new_empty(-(-n // panel), k, panel)
    weight = weight.contiguous()  # held while the kernel reads it
    bf16 = int(weight.dtype == torch.bfloat16)
    _library().invariant_pack(weight.data_ptr(), packed.data_ptr(), n, k, bf16)
    return packed


def linear(x: Tensor, packed: Tensor, out_features: int) -> Tensor:
    """x Wᵀ: x (..., K), packed = pack(W) of W (out_features, K), both float32 or both bfloat16 →
    (..., out_features)."""
    if torch.compiler.is_compiling():
        return torch.ops.decoderlm.invariant_linear(x, packed, out_features)
    _check(x, packed, "linear")
    panels, k, panel = packed.shape
    if x.shape[-1] != k or panel != _library().invariant_panel():
        raise ValueError(f"invariant linear: x {tuple(x.shape)} for a pack {tuple(packed.shape)}")
    if not (panels - 1) * panel < out_features <= panels * panel:
        raise ValueError(f"invariant linear: {out_features} outputs for {panels} panels of {panel}")
    rows = x.reshape(-1, k).contiguous()  # (M, K)
    y = x.new_empty(rows.shape[0], out_features)  # (M, N)
    if rows.shape[0]:
        bf16 = int(x.dtype == torch.bfloat16)
        _library().invariant_linear(rows.data_ptr(), packed.data_ptr(), y.data_ptr(), rows.shape[0], out_features, k, bf16)  # fmt: skip
    return y.view(*x.shape[:-1], out_features)


@torch.library.register_fake("decoderlm::invariant_linear", lib=_OPS)
def _(x: Tensor, packed: Tensor, out_features: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class InvariantLinear(nn.Module):
    """`linear` in place of an nn.Linear (inference only: no gradient reaches W): W packed once
    for `bf16_linear`'s kernel where it takes W, else for this module's fixed-order kernel."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear
        weight = linear.weight.detach()
        self.bf16_kernel = bf16_linear.supports(weight)
        packed = bf16_linear.pack(weight) if self.bf16_kernel else pack(weight)
        self.register_buffer("packed", packed, persistent=False)  # an input of a compiled pass
        self.bias = None if linear.bias is None else linear.bias.detach()

    def op_available(self) -> bool:
        """Whether the op of this pack's kernel is built, for a compiled pass to call."""
        return bf16_linear.op_available() if self.bf16_kernel else ops_available()

    def forward(self, x: Tensor) -> Tensor:  # (..., in_features) → (..., out_features)
        y = self.product(x)
        return y if self.bias is None else y + self.bias

    def product(self, x: Tensor) -> Tensor:  # (..., in_features) → (..., out_features), no bias
        kernel = bf16_linear.linear if self.bf16_kernel else linear
        return kernel(x, self.packed, self.linear.out_features)


def invariant_linear(linear: nn.Module) -> nn.Module:
    """The invariant form of a linear layer: an nn.Linear's `InvariantLinear`, or the one a layer
    of another kind gives itself by its `batch_invariant()` (a GGUF file's block linear,
    `decoderlm.quant.BlockLinear`); ValueError where it has none."""
    if type(linear) is nn.Linear:
        return InvariantLinear(linear)
    if hasattr(linear, "batch_invariant"):
        return linear.batch_invariant()
    raise ValueError(f"{type(linear).__name__} has no batch-invariant form")


class InvariantSwiGLU(nn.Module):
    """A SwiGLU MLP, down(silu(gate(x)) ⊙ up(x)), with `silu_mul` and invariant linears."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate, self.up, self.down = (invariant_linear(m) for m in (mlp.gate, mlp.up, mlp.down))

    def forward(self, x: Tensor) -> Tensor:  # (B, T, d_model) → (B, T, d_model)
        return self.down(fused.silu_mul(self.gate(x), self.up(x)))


def invariant_modules(model: nn.Module) -> Swap:
    """The swap that makes `model` batch-invariant: each SwiGLU MLP, and every other linear layer
    (`invariant_linear`: plain nn.Linear and a GGUF file's block linears; RMSNorm and RoPE as
    `decoderlm.cpu.fused` computes them are invariant already); ValueError naming a module it has
    no invariant form of (a GELU MLP, whose erf and tanh round differently on the vector and
    scalar paths; decoderlm.quant's int8 and int4 linears)."""
    swap: Swap = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, MLP) and child.kind == "swiglu":
                swap.append((parent, name, child, InvariantSwiGLU(child)))
            elif isinstance(child, MLP) and child.kind != "relu2":
                raise ValueError(f"{name}: a {child.kind} MLP (SwiGLU and ReLU² ones are covered)")
            elif hasattr(child, "in_features") and not (
                isinstance(parent, MLP) and parent.kind == "swiglu"
            ):
                try:
                    swap.append((parent, name, child, invariant_linear(child)))
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
    return swap


def batch_invariant_swap(model: nn.Module, kv_cache_dtype: str | None, in_place: bool) -> Swap:
    """`invariant_modules(model)` for a caller whose attention reads each query's keys in place
    (`in_place`: the engine's pools, `decoderlm.cpu.decode.InPlaceKVCache`); DecoderLMError,
    naming the reason, where a row's logits cannot be made independent of its batch: recurrent
    layers (a prompt's state depends on how its prefill was chunked), sliding windows or an int8
    KV cache (their layers cannot attend in place), no in-place kernel for the cache's dtype and
    device, a GELU MLP or decoderlm.quant's int8 and int4 linears (a GGUF file's block linears
    are taken), no C compiler."""
    config = model.config
    reasons = [
        (config.has_recurrent_layers, f"recurrent layers (layer_types {config.layer_types})"),
        (config.sliding_window is not None, f"a sliding window ({config.sliding_window})"),
        (kv_cache_dtype is not None, f"kv_cache_dtype={kv_cache_dtype!r}"),
        (not in_place, "no in-place attention kernel for this dtype and device"),
        (not available(), "no C compiler to build its linears"),
    ]
    for refused, reason in reasons:
        if refused:
            raise DecoderLMError(f"batch_invariant does not support {reason}")
    try:
        return invariant_modules(model)
    except ValueError as exc:
        raise DecoderLMError(f"batch_invariant does not support {exc}") from None
