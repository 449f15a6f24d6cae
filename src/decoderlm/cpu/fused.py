"""RMSNorm, RoPE and SwiGLU's gate in one pass over memory each, on the CPU (`fused.c`), swapped
into a model from outside for inference (`FusedOps`).

PyTorch's eager RMSNorm makes a pass over its rows for each of its operations (widen to float32,
square, mean, add ε, 1/√, scale, narrow, gain), RoPE for each of its products, its negation, its
concatenation and its sum, and SwiGLU's gate two; in the serving engine's passes over SmolLM2-135M
in bfloat16 these took about a quarter of a 512-token prefill pass (benchmarks/README.md,
engine_passes.py). vLLM's CPU backend has kernels of its own for the same three (csrc/cpu:
rms_norm, rotary_embedding, silu_and_mul). Each kernel rounds where the formula it replaces
rounds, so a bfloat16 result differs from it only where a float32 sum in another order or expf's
last ulp crosses a rounding boundary; every one is batch-invariant (`fused.c`).

`FusedOps(model)` finds the modules once: each `RMSNorm` becomes a `FusedRMSNorm`, each SwiGLU
`MLP` a `FusedSwiGLU` (over the MLP's own linears, so a packed or invariant linear swapped into it
is the one called; an MLP that `packed_linear.PackedSwiGLU` runs whole is left to it), each
`CausalSelfAttention` applies RoPE by `apply_rope` here; `with ops:` swaps them in and back.
Where a kernel does not apply — a gradient to keep, a dtype other than float32 and bfloat16,
weights of another dtype than the input, a device other than the CPU, no C compiler — each calls
the model's own formula. Inside torch.compile / torch.export they step aside for it too (Inductor
fuses it with its neighbours), unless traced `as_ops()`: then each goes into the graph as the op
decoderlm::fused_rms_norm, fused_rope or fused_silu_mul (`fused_ops.cpp`: the same C code behind
PyTorch's stable ABI, which an AOTInductor library calls without Python), so that a compiled pass
computes each element as the eager passes do (the engine's batch-invariant decode pass).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Collection, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from decoderlm.cpu import native
from decoderlm.cpu.swap import swapped
from decoderlm.model.attention import CausalSelfAttention
from decoderlm.model.layers import MLP, RMSNorm
from decoderlm.model.positional import apply_rope as plain_rope

SOURCE = Path(__file__).with_name("fused.c")
OPS_SOURCES = [SOURCE, Path(__file__).with_name("fused_ops.cpp")]
DTYPES = (torch.float32, torch.bfloat16)
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p

_OPS = torch.library.Library("decoderlm", "FRAGMENT")
_OPS.define("fused_rms_norm(Tensor x, Tensor weight, float eps, float offset) -> Tensor")
_OPS.define("fused_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor")
_OPS.define("fused_silu_mul(Tensor g, Tensor u) -> Tensor")
_TRACED_AS_OPS = [False]  # inside `as_ops()`


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = native.load([SOURCE], "RMSNorm, RoPE and SwiGLU stay PyTorch's", ctypes.CDLL)
    if library is not None:
        for name in ("fused_rms_norm", "fused_rope", "fused_silu_mul"):
            getattr(library, name).restype = None
        library.fused_rms_norm.argtypes = [_PTR] * 3 + [_I64] * 3 + [ctypes.c_float] * 2 + [ctypes.c_int]  # fmt: skip
        library.fused_rope.argtypes = [_PTR] * 4 + [_I64] * 9 + [ctypes.c_int]
        library.fused_silu_mul.argtypes = [_PTR] * 3 + [_I64] * 2 + [ctypes.c_int]
    return library


def available() -> bool:
    """Whether the kernels build here (a C compiler)."""
    return _library() is not None


@functools.cache
def ops_available() -> bool:
    """Whether the ops decoderlm::fused_* run here (built first if need be)."""
    return native.load_ops(OPS_SOURCES, "a compiled pass computes them by Inductor's code")


@contextmanager
def as_ops() -> Iterator[None]:
    """While tracing inside this block, the kernels go into the graph as the ops decoderlm::fused_*
    instead of stepping aside for the model's formula; RuntimeError where `ops_available()` does
    not hold."""
    if not ops_available():
        raise RuntimeError("the ops decoderlm::fused_* are not built here")
    _TRACED_AS_OPS[0] = True
    try:
        yield
    finally:
        _TRACED_AS_OPS[0] = False


def runs(*tensors: Tensor) -> bool:
    """Whether the kernels take these operands: CPU tensors of one dtype, float32 or bfloat16,
    none needing a gradient, the library built; while tracing, only `as_ops()`."""
    first = tensors[0]
    compiling = torch.compiler.is_compiling()
    return (
        first.dtype in DTYPES
        and first.device.type == "cpu"
        and all(t.dtype == first.dtype and t.device == first.device for t in tensors)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        and (_TRACED_AS_OPS[0] if compiling else _library() is not None)
    )


def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    """`RMSNorm`'s formula over the last dim of x (..., dim) with gain `weight` (dim); `runs`
    must hold. The rows may lie at any stride whose last dim is contiguous."""
    if torch.compiler.is_compiling():
        return torch.ops.decoderlm.fused_rms_norm(x, weight, eps, offset)
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)  # (M, dim): a view where the strides allow
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = x.new_empty(x.shape)
    bf16 = int(x.dtype == torch.bfloat16)
    _library().fused_rms_norm(rows.data_ptr(), weight.contiguous().data_ptr(), y.data_ptr(), rows.shape[0], dim, rows.stride(0), eps, offset, bf16)  # fmt: skip
    return y


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`decoderlm.model.positional.apply_rope`: R_m x for x (B, H, T, D) and cos/sin (T, R) or
    (B, T, R) in x's dtype. The result lies as (B, T, H, D) (a transposed view is returned), the
    layout in which the KV cache stores its keys and attention writes its output."""
    b, h, t, d = x.shape
    if not runs(x, cos, sin) or x.stride(-1) != 1 or cos.shape[-1] % 2 or cos.shape[-2] != t:
        return plain_rope(x, cos, sin)
    if cos.dim() == 3 and cos.shape[0] != b:  # (1, T, R): one table
        cos, sin = cos[0], sin[0]
    if torch.compiler.is_compiling():
        return torch.ops.decoderlm.fused_rope(x, cos, sin).transpose(1, 2)
    cos, sin = cos.contiguous(), sin.contiguous()
    y = x.new_empty(b, t, h, d)
    cs_b = cos.shape[-2] * cos.shape[-1] if cos.dim() == 3 else 0
    bf16 = int(x.dtype == torch.bfloat16)
    _library().fused_rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), b, h, t, d, cos.shape[-1], x.stride(0), x.stride(1), x.stride(2), cs_b, bf16)  # fmt: skip
    return y.transpose(1, 2)  # (B, H, T, D)


def silu_mul(g: Tensor, u: Tensor) -> Tensor:
    """silu(g) ⊙ u, rounded after silu as `F.silu(g) * u` is; g and u of one shape; `runs` must
    hold."""
    if torch.compiler.is_compiling():
        return torch.ops.decoderlm.fused_silu_mul(g, u)
    n = g.shape[-1]
    g, u = g.contiguous(), u.contiguous()
    y = torch.empty_like(g)
    bf16 = int(g.dtype == torch.bfloat16)
    _library().fused_silu_mul(g.data_ptr(), u.data_ptr(), y.data_ptr(), g.numel() // max(n, 1), n, bf16)  # fmt: skip
    return y


@torch.library.register_fake("decoderlm::fused_rms_norm", lib=_OPS)
def _(x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("decoderlm::fused_rope", lib=_OPS)
def _(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    b, h, t, d = x.shape
    return x.new_empty(b, t, h, d)  # (B, T, H, D)


@torch.library.register_fake("decoderlm::fused_silu_mul", lib=_OPS)
def _(g: Tensor, u: Tensor) -> Tensor:
    return torch.empty_like(g, memory_format=torch.contiguous_format)


class FusedRMSNorm(nn.Module):
    """`norm` by `rms_norm` where the kernel runs, else by the module itself."""

    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: Tensor) -> Tensor:
        norm = self.norm
        if not runs(x, norm.weight):
            return norm(x)
        return rms_norm(x, norm.weight.detach(), norm.eps, norm.offset)


class FusedSwiGLU(nn.Module):
    """A SwiGLU `mlp`, down(silu(gate(x)) ⊙ up(x)), its gate by `silu_mul` where the kernel runs
    (the MLP's linears give x's dtype), through the MLP's own linears (whatever is swapped into
    them)."""

    def __init__(self, mlp: MLP) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: Tensor) -> Tensor:  # (B, T, d_model) → (B, T, d_model)
        mlp = self.mlp
        if not runs(x):
            return mlp(x)
        return mlp.dropout(mlp.down(silu_mul(mlp.gate(x), mlp.up(x))))


class FusedOps:
    """The fused kernels in `model` for the duration of each `with` block (re-entered per pass;
    the modules are found once, here). `taken`: modules another swap replaces (the SwiGLU MLPs
    that `packed_linear.PackedSwiGLU` runs whole), left to it."""

    def __init__(self, model: nn.Module, taken: Collection[nn.Module] = ()) -> None:
        self.swap = []
        taken_ids = {id(m) for m in taken}
        for parent in model.modules():
            for name, child in parent.named_children():
                if id(child) in taken_ids:
                    continue
                if type(child) is RMSNorm:
                    self.swap.append((parent, name, child, FusedRMSNorm(child)))
                elif isinstance(child, MLP) and child.kind == "swiglu":
                    self.swap.append((parent, name, child, FusedSwiGLU(child)))
        self.attention = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
        self._open: list[ExitStack] = []

    def __enter__(self) -> FusedOps:
        with ExitStack() as stack:
            stack.enter_context(swapped(self.swap))
            for module in self.attention:  # (the instance dict: nn.Module's setattr is slow)
                stack.callback(module.__dict__.__setitem__, "apply_rope", module.apply_rope)
                module.__dict__["apply_rope"] = apply_rope
            self._open.append(stack.pop_all())
        return self

    def __exit__(self, *exc: Any) -> None:
        self._open.pop().close()
