"""Which CPU speed paths a call site applies: one `SpeedPaths` per call site, one context manager.

Each path is one mechanism of `decoderlm.cpu`, applied from outside the model:

| path | mechanism | generate | engine | training |
|---|---|---|---|---|
| `embedding` | nn.Embedding → `CPUEmbedding` (an opaque gradient kernel) | ✓ | | ✓ |
| `attention` | `CausalSelfAttention.attend` → `cpu_attend` (the blockwise formula; bfloat16 prompts on AMX tiles or AVX512-BF16, `bf16_attention`; float32 prompts on `f32_attention`; others padded to the fused kernel's lengths) | ✓ | ✓ | ✓ |
| `linear_kernels` | F.linear by shape: gemv kernels, oneDNN (`CPULinearKernels`) | ✓ | | |
| `in_place_attention` | decode attention read where the keys lie (`paged_attention`) | ✓ | ✓ | |
| `packed_linears` | linear weights packed for `bf16_linear`'s or the fixed-order kernel (`PackedLinear`; SwiGLU's gate and up as one product: `PackedSwiGLU`) | | ✓ | |
| `fused_ops` | RMSNorm, RoPE and SwiGLU's gate in one pass each (`fused.FusedOps`) | | ✓ | |
| `keep_freed_memory` | glibc keeps freed pages for reuse (`heap`) | | ✓ | ✓ |

The engine leaves out the embedding and the linear kernels generate uses inside the model (they
made its batched steps slower, benchmarks/README.md), and generate applies `linear_kernels` only to
its prefill and compiled steps (the mode's Python hook on every op costs more than it saves in an
eager one-token step).

Compiling is not a path but a call site's option (`generate(compile=True)`, `Engine(compile=True)`:
`decoderlm.cpu.decode.CompiledStep`, `decoderlm.cpu.paged_step.CompiledPagedStep`), as it costs
minutes of startup once per machine; the compiled code traces the linear kernels where its call
site's set has its linear path (generate's `linear_kernels`, the engine's `packed_linears`).

`SpeedPaths.for_generate()` (and `for_engine`, `for_training`) is a call site's set;
`SpeedPaths.none()` switches all off, `.without("attention")` one at a time. `paths.applied(model)`
is the one context manager: it does the once-only work (the heap's thresholds, packing) when it is
made and swaps the model's modules in for each `with` block, restoring them after; on a non-CPU
device it changes nothing. `paths.apply(model)` applies them for good (the trainer). The call
sites accept `cpu_kernels=True | False | SpeedPaths` (`TrainConfig.cpu_kernels`: a bool).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from decoderlm.cpu import heap, optimize
from decoderlm.cpu.attention import cpu_attend
from decoderlm.cpu.decode import CPULinearKernels
from decoderlm.cpu.embedding import CPUEmbedding
from decoderlm.cpu.fused import FusedOps
from decoderlm.cpu.packed_linear import pack_linears
from decoderlm.cpu.swap import Swap, swapped
from decoderlm.errors import DecoderLMError
from decoderlm.model.attention import CausalSelfAttention


@dataclass(frozen=True)
class SpeedPaths:
    """One switch per CPU speed path (module docstring); all off by default."""

    embedding: bool = False
    attention: bool = False
    linear_kernels: bool = False
    in_place_attention: bool = False
    packed_linears: bool = False
    fused_ops: bool = False
    keep_freed_memory: bool = False

    @classmethod
    def none(cls) -> SpeedPaths:
        return cls()

    @classmethod
    def for_generate(cls, enabled: bool = True) -> SpeedPaths:
        """generate, stream and evaluate: the model's inner paths, the linear kernels, in place."""
        on = dict(embedding=True, attention=True, linear_kernels=True, in_place_attention=True)
        return cls(**on) if enabled else cls()

    @classmethod
    def for_engine(cls, enabled: bool = True) -> SpeedPaths:
        """The serving engine's batched steps: `cpu_attend` (for its padded prompts), in-place
        decode attention, packed linears, the fused elementwise kernels, the heap."""
        on = dict(
            attention=True,
            in_place_attention=True,
            packed_linears=True,
            fused_ops=True,
            keep_freed_memory=True,
        )
        return cls(**on) if enabled else cls()

    @classmethod
    def for_training(cls, enabled: bool = True) -> SpeedPaths:
        """The trainer: the embedding's gradient kernel, blockwise attention, the heap."""
        return cls(embedding=True, attention=True, keep_freed_memory=True) if enabled else cls()

    @classmethod
    def resolve(cls, cpu_kernels: bool | SpeedPaths, default: SpeedPaths) -> SpeedPaths:
        """A call site's paths from its `cpu_kernels` argument: True = `default`, False = none,
        a SpeedPaths = exactly those."""
        if isinstance(cpu_kernels, SpeedPaths):
            return cpu_kernels
        if isinstance(cpu_kernels, bool):
            return default if cpu_kernels else cls()
        raise DecoderLMError(f"cpu_kernels={cpu_kernels!r} must be True, False or a SpeedPaths")

    def without(self, *paths: str) -> SpeedPaths:
        """These paths with the named ones switched off."""
        unknown = sorted(set(paths) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            allowed = ", ".join(f.name for f in dataclasses.fields(self))
            raise DecoderLMError(f"unknown speed path(s) {unknown}; allowed: {allowed}")
        return dataclasses.replace(self, **dict.fromkeys(paths, False))

    def on(self, device: torch.device) -> SpeedPaths:
        """These paths where `device` is the CPU, else none (they are CPU paths)."""
        return self if device.type == "cpu" else SpeedPaths()

    def linear(self, enabled: bool = True, compiling: bool = False) -> AbstractContextManager[Any]:
        """F.linear through the CPU kernels for the duration, if `linear_kernels` and `enabled`
        (the caller's say for this pass), else a context that changes nothing. compiling: inside
        a function being compiled (torch.compile, torch.export)."""
        return CPULinearKernels(compiling) if self.linear_kernels and enabled else nullcontext()

    def applied(self, model: nn.Module) -> AppliedPaths:
        """The paths applied to `model`, on its device: a reusable context manager."""
        return AppliedPaths(self, model)

    def apply(self, model: nn.Module) -> nn.Module:
        """The paths applied to `model` for the rest of its life (the trainer's, which is wrapped
        for DDP/FSDP and compiled afterwards), in place; returns it. Packed linears are swapped in
        per pass only, by `applied`."""
        if self.packed_linears:
            raise DecoderLMError("packed_linears are applied per pass: use SpeedPaths.applied")
        paths = AppliedPaths(self, model).paths  # the heap's thresholds set; on the model's device
        if paths.embedding or paths.attention:
            optimize(model, embedding=paths.embedding, attention=paths.attention)
        return model


class AppliedPaths:
    """`SpeedPaths` applied to one model: made once (the heap's thresholds set, linears packed, the
    modules and attention functions to swap found), entered for each pass or generation (`with
    applied:`), which swaps them in and restores the model's own on exit. `paths` holds what
    applies on the model's device."""

    def __init__(self, paths: SpeedPaths, model: nn.Module) -> None:
        weight = next(model.parameters(), None)
        device = weight.device if weight is not None else torch.device("cpu")
        self.paths, self.model = paths.on(device), model
        if self.paths.keep_freed_memory:
            heap.keep_freed_memory()  # process-wide; glibc's thresholds stay raised
        self._embeddings: Swap = (
            [
                (parent, name, child, CPUEmbedding.from_embedding(child))
                for parent in model.modules()
                for name, child in parent.named_children()
                if type(child) is nn.Embedding
            ]
            if self.paths.embedding
            else []
        )
        self._attentions = (
            [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
            if self.paths.attention
            else []
        )
        self._packed = pack_linears(model) if self.paths.packed_linears else []
        taken = [plain for _, _, plain, _ in self._packed]  # (PackedSwiGLU's MLPs)
        self._fused = FusedOps(model, taken) if self.paths.fused_ops else nullcontext()
        self._open: list[
            AbstractContextManager[None]
        ] = []  # the `with` blocks entered, innermost last

    @property
    def kernel_products(self) -> bool:
        """Whether every linear layer (a module with in_ and out_features) is packed
        (`decoderlm.cpu.packed_linear`) with its kernel's op built, or multiplies by an op of its
        own at any number of rows (`op_available()`: a GGUF file's block linears): then a
        compiled pass of several rows takes them as ops (decoderlm::bf16_linear,
        ::invariant_linear, ::block_linear)."""
        ops = {  # each plain linear packed → whether its kernel's op is built
            id(m): packed.op_available()
            for _, _, plain, packed in self._packed
            for m in plain.modules()  # (a PackedSwiGLU's plain: the MLP)
        }
        linears = [
            m
            for m in self.model.modules()
            if hasattr(m, "in_features") and hasattr(m, "out_features")
        ]
        return bool(linears) and all(
            ops[id(m)] if id(m) in ops else hasattr(m, "op_available") and m.op_available()
            for m in linears
        )

    def __enter__(self) -> AppliedPaths:
        swap = self._swapped()
        swap.__enter__()
        self._open.append(swap)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._open.pop().__exit__(*exc)

    @contextmanager
    def _swapped(self) -> Iterator[None]:
        """The modules and attention functions found when this was made, swapped in (a walk
        over the model's modules each time cost ~1 ms, a twelfth of a one-row decode step)."""
        attends = [m.attend for m in self._attentions]
        for m in self._attentions:
            m.__dict__["attend"] = cpu_attend  # a plain attribute: no nn.Module.__setattr__
        try:
            with swapped(self._embeddings), swapped(self._packed), self._fused:
                yield
        finally:
            for m, attend in zip(self._attentions, attends, strict=True):
                m.__dict__["attend"] = attend
