"""CPU decoding speed paths: F.linear through the kernel that suits its shape, and the one-token
step compiled ahead of time. Both are applied by their call sites (`decoderlm.inference`), as the
`linear_kernels` and `in_place_attention` paths of their `decoderlm.cpu.paths.SpeedPaths`.

- `CPULinearKernels`: F.linear on the CPU through the kernel fastest for its shape.
- `CompiledStep`: the one-token step, run once per generated token, compiled ahead of time, its
  attention read in place from the static cache (`InPlaceLayerCache`) where it can be. It is
  exported with `torch.export` and compiled by AOTInductor into a shared library that Python calls
  directly: no torch.compile wrapper and no guard checks to run for every token. The model's
  weights and the cache buffers are inputs of the library, not constants baked into it, so one
  library serves every model of the same architecture and shapes; it is cached on disk under a
  hash of the exported graph (and of everything else the generated code depends on). It calls
  decoderlm's own ops as C functions, not through AOTInductor's proxy executor
  (`decoderlm.cpu.shims`).
  `torch._inductor.aoti_compile_and_package` and `torch._inductor.aoti_load_package` are the entry
  points PyTorch documents for AOTInductor (docs.pytorch.org, torch.compiler_aot_inductor; a
  prototype feature) despite the underscore in their module.
"""

from __future__ import annotations

import functools
import getpass
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from decoderlm.cpu import block_linear, features, fused, gemv, onednn, paged_attention, shims
from decoderlm.model.cache import (
    CacheStep,
    LayerCache,
    LayerCaches,
    RecurrentLayerCache,
    StaticKVCache,
    StaticLayerCache,
)
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM


class CPULinearKernels(TorchFunctionMode):
    """F.linear on the CPU through the kernel that is fastest for its shape (see benchmarks/decode.py).

    The products are the same; only the order of the sums differs.
    - One row (decoding one sequence, which is bound by reading the weights), eager or compiled:
      the AVX-512 kernels of `decoderlm.cpu.gemv` where this CPU has them.
    - bfloat16 activations and weights on a CPU without bfloat16 instructions (where PyTorch's
      bfloat16 GEMM is emulated, a ninth of float32's speed on an AVX2 EPYC): a few rows on the
      widening kernel of `decoderlm.cpu.block_linear`, more in float32 from the bfloat16 weights
      (as llama.cpp does), rounded back to bfloat16.
    - Otherwise one row under compilation: y_n = Σ_k x_k W_nk as a product and a row sum, which
      inductor fuses into one vectorised pass, faster than F.linear's GEMV.
    - The other float32 calls without autograd (prefill, evaluation, the LM head of the last
      position; eager or compiled): oneDNN's dense linear (`decoderlm.cpu.onednn`), faster than the MKL
      sgemm/sgemv behind F.linear on the llama-55m shapes.
    """

    def __init__(self, compiling: bool = False) -> None:
        super().__init__()
        self.compiling = compiling  # inside a function being compiled (torch.compile, torch.export)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.linear or args[0].device.type != "cpu":
            return func(*args, **kwargs)
        x, weight = args[0], args[1]  # (..., K), (N, K)
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if gemv.handles(x, weight):
            y = gemv.linear(x, weight)  # (..., N)
            return y if bias is None else y + bias
        if (
            x.dtype == weight.dtype == torch.bfloat16
            and features.bf16_emulated()
            and not _needs_grad(args)
        ):
            y = bf16_in_float32(x, weight)  # (..., N)
            return y if bias is None else y + bias
        if self.compiling and gemv.one_row_of(x):
            y = (x.unsqueeze(-2) * weight).sum(-1)  # (..., N)
            return y if bias is None else y + bias
        tensors = [t for t in (x, weight, bias) if t is not None]
        plain_float32 = all(
            type(t) in (Tensor, nn.Parameter) and t.dtype == torch.float32 for t in tensors
        )
        if plain_float32 and not _needs_grad(tensors) and onednn.AVAILABLE:
            return onednn.onednn_linear(x, weight, bias)  # (..., N)
        return func(*args, **kwargs)


def _needs_grad(args: Sequence[Any]) -> bool:
    tensors = [t for t in args if isinstance(t, Tensor)]
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def bf16_in_float32(x: Tensor, weight: Tensor) -> Tensor:
    """x Wᵀ for bfloat16 x (..., K) and W (N, K) computed in float32 and rounded once to
    bfloat16: a few rows on `block_linear`'s BF16 kernel, more by a float32 GEMM."""
    if block_linear.handles(x, weight):
        return block_linear.linear(x, weight.view(torch.uint8).view(weight.shape[0], -1), "BF16")
    return onednn.linear(x.float(), weight.float()).to(torch.bfloat16)


# The forward pass over a cache that the step compiles: (model, cache, idx (B, T), positions
# (B, T), key_padding_mask (B, S) | None, state) → logits (B, V), as
# `decoderlm.inference.generate.next_logits`.
Forward = Callable[
    [
        DecoderLM,
        Sequence[LayerCache],
        Tensor,
        Tensor,
        Tensor | None,
        dict[str, Tensor] | None,
    ],
    Tensor,
]


# Inductor inlines cheap pointwise results (the normalised activations) into their consumers; inside
# a weight reduction that means recomputing them for every output row. Materialising them instead
# makes the one-token step faster, in float32 and more so in bfloat16.
_INDUCTOR_OPTIONS = {"realize_opcount_threshold": 4, "realize_reads_threshold": 1}


class InPlaceLayerCache(StaticLayerCache):
    """A layer of a static cache that attends the step itself: it stores the new K/V at `slots`
    and reads each row's filled slots pad[b] .. slots[0] where they lie
    (`paged_attention.static_decode_attention`), instead of handing SDPA the whole buffer and a
    mask over its unfilled slots. For layers without a window: one query per row in the compiled
    step; several (a prefill of `InPlaceKVCache`), each query over slots pad[b] .. its own
    (`paged_attention.static_attention`, eagerly)."""

    def __init__(self, k: Tensor, v: Tensor, step: CacheStep, pad: Tensor) -> None:
        super().__init__(k, v, step)
        self.pad = pad  # (B,) each row's first real slot

    def attend_in_place(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """q (B, H, T, hd); k, v (B, Hkv, T, hd) → softmax(q Kᵀ · scale) V (B, H, T, hd)."""
        self.store(k, v)
        if q.shape[2] > 1:
            return paged_attention.static_attention(q, self.k, self.v, self.pad, self.slots, scale)
        return paged_attention.static_decode_attention(
            q, self.k, self.v, self.pad, self.slots, scale
        )


class InPlaceKVCache(StaticKVCache):
    """A static cache whose every layer attends in place (`InPlaceLayerCache`), a prefill's
    queries too: each query's attention is computed as it would be alone, over its own row's
    slots pad[b] .. its own, whatever the rows beside it and their padding
    (`generate(batch_invariant=True)`). `pad` (B,): each row's left padding, which the caller
    sets before a prefill. Float32 or bfloat16 K/V, layers without a window
    (`attends_in_place`)."""

    def __init__(
        self, config: ModelConfig, batch_size: int, max_len: int, dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:  # fmt: skip
        super().__init__(config, batch_size, max_len, dtype, device)
        self.pad = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,)
        self.layers = [
            InPlaceLayerCache(layer.k, layer.v, CacheStep(layer.slots, layer.end), self.pad)
            for layer in self.layers
        ]


def attends_in_place(model: DecoderLM, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the one-token step of `model` attends its cache with `InPlaceLayerCache`: on the
    CPU, no layer with a sliding window, and the kernel built for the cache's dtype."""
    return (
        device.type == "cpu"
        and model.config.sliding_window is None
        and paged_attention.static_available(dtype)
    )


def layer_buffers(cache: LayerCaches) -> list[Tensor]:
    """The buffers of every layer of `cache`, in layer order: an attention layer's key and value
    buffers (B, Hkv, S, hd), a recurrent layer's conv state (B, C, K − 1), where it has one, and
    matrix state (B, H, d_k, d_v)."""
    buffers: list[Tensor] = []
    for layer in cache.layers:
        if isinstance(layer, RecurrentLayerCache):
            buffers += [t for t in (layer.conv, layer.state) if t is not None]
        else:
            buffers += [layer.k, layer.v]
    return buffers


class _OneTokenStep(nn.Module):
    """The one-token step as a function of tensors only, for torch.export.

    forward(*state, *buffers, token, slot, pad): the model's parameters and buffers (in the order
    of `names`), every layer's cache buffers (`layer_buffers`), the new tokens (B, 1), the cache
    slot they go to (1,) and each row's left padding (B,) → logits (B, V) in float32: `forward` of
    the model over that cache, traced under `CPULinearKernels` if `linear_kernels`, attending in
    place if `in_place_attention` where `attends_in_place`. The recurrent layers' states after the
    token are copied into their input buffers (S_t over S_{t−1}), as the attention layers store
    their K/V in theirs; the token is real in every row (left padding is all in the prefill), so
    every row's state takes it.
    """

    def __init__(
        self,
        model: DecoderLM,
        names: list[str],
        forward: Forward,
        linear_kernels: bool,
        in_place_attention: bool,
    ) -> None:
        super().__init__()
        self.model, self.names, self.logits = model, names, forward
        self.paths = (linear_kernels, in_place_attention)  # the speed paths traced into the step

    def forward(self, *tensors: Tensor) -> Tensor:
        cfg, n = self.model.config, len(self.names)
        state = dict(zip(self.names, tensors[:n], strict=True))
        token, slot, pad = tensors[-3:]  # (B, 1), (1,), (B,)
        buffers = iter(tensors[n:-3])
        step = CacheStep(slot)  # end None: the whole buffer, masked by key_padding_mask
        linear_kernels, in_place = self.paths
        cache: list[LayerCache] = []
        recurrent: list[tuple[RecurrentLayerCache, Tensor | None, Tensor]] = []
        key_padding_mask = None  # (B, S) each row's tokens, where a layer attends
        for i in range(cfg.n_layers):
            kind = cfg.layer_type(i)
            if kind != "attention":
                conv = None if kind == "linear_attention" else next(buffers)
                layer = RecurrentLayerCache(conv, next(buffers))
                recurrent.append((layer, layer.conv, layer.state))
                cache.append(layer)
                continue
            k, v = next(buffers), next(buffers)  # (B, Hkv, S, hd)
            slots = torch.arange(k.shape[2], device=token.device)  # (S,)
            key_padding_mask = (slots >= pad[:, None]) & (slots <= slot)
            if in_place and attends_in_place(self.model, k.dtype, k.device):
                cache.append(InPlaceLayerCache(k, v, step, pad))
            else:
                cache.append(StaticLayerCache(k, v, step))
        positions = (slot - pad)[:, None]  # (B, 1): 0 at each row's first real token
        with CPULinearKernels(compiling=True) if linear_kernels else nullcontext():
            logits = self.logits(self.model, cache, token, positions, key_padding_mask, state)
        for layer, conv, matrix in recurrent:  # the states after the token, into the buffers
            matrix.copy_(layer.state)
            if conv is not None:
                conv.copy_(layer.conv)
        return logits


class CompiledStep:
    """The one-token step of `model` over `cache`, compiled ahead of time by AOTInductor.

    `step(token, slot, pad)` writes the K/V of token (B, 1) to cache slot `slot` (1,) of every row,
    folds it into every recurrent layer's state, and returns the logits (B, V) in float32 of the
    token after it; row b has `pad[b]` slots of left padding, so its key mask is slots
    pad[b]..slot and its position slot − pad[b]. `forward` is the forward pass that is compiled
    (`decoderlm.inference.generate.next_logits`), under `CPULinearKernels` with `linear_kernels`,
    attending the cache in place with `in_place_attention` (where `attends_in_place`). The library
    is made (or found) once per model object, forward, paths and shapes in a process. A recurrent
    layer's cache holds the states its last eager pass (the prefill) returned; the step copies them
    into the buffers the library updates in place, once, on its first call after that pass.
    batch_invariant: the caller has swapped in the modules of `decoderlm.cpu.invariant`
    (`traceable`), traced as ops (`fused.as_ops`), and Inductor rounds each intermediate where
    eager code does (`emulate_precision_casts`): a row's logits are bit for bit those of an eager
    step of the same modules.
    """

    def __init__(
        self,
        model: DecoderLM,
        cache: LayerCaches,
        forward: Forward,
        *,
        linear_kernels: bool = True,
        in_place_attention: bool = True,
        batch_invariant: bool = False,
    ) -> None:
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        buffers = layer_buffers(cache)
        self.inputs = [*state.values(), *buffers]
        # (layer, its conv state buffer or None, its matrix state buffer): what the library updates
        self.states = [
            (layer, layer.conv, layer.state)
            for layer in cache.layers
            if isinstance(layer, RecurrentLayerCache)
        ]
        step = _OneTokenStep(model, list(state), forward, linear_kernels, in_place_attention)
        batch, device = buffers[0].shape[0], self.inputs[0].device
        extra = [
            torch.zeros(batch, 1, dtype=torch.long, device=device),  # token
            torch.zeros(1, dtype=torch.long, device=device),  # slot
            torch.zeros(batch, dtype=torch.long, device=device),  # pad
        ]
        options = {"emulate_precision_casts": True} if batch_invariant else None
        with fused.as_ops() if batch_invariant else nullcontext():
            self.run = step_library(step, self.inputs, extra, inductor_options=options)

    def __call__(self, token: Tensor, slot: Tensor, pad: Tensor) -> Tensor:
        self._adopt_states()
        return self.run([*self.inputs, token, slot, pad])[0]

    def _adopt_states(self) -> None:
        """Point the cache's recurrent layers back at the library's buffers, with the states an
        eager pass left in new tensors copied into them."""
        for layer, conv, matrix in self.states:
            if layer.state is not matrix:
                layer.state = matrix.copy_(layer.state)
            if conv is not None and layer.conv is not conv:
                layer.conv = conv.copy_(layer.conv)


def _spec(t: Tensor) -> tuple[Any, ...]:
    return tuple(t.shape), t.stride(), t.dtype, t.device


def step_library(
    step: nn.Module,
    inputs: list[Tensor],
    extra: list[Tensor],
    dynamic_shapes: tuple[Any, ...] | None = None,
    inductor_options: dict[str, Any] | None = None,
) -> Callable[[list[Tensor]], list[Tensor]]:
    """The library of a step module over state and caches (`_OneTokenStep`, or the engine's
    `decoderlm.cpu.paged_step` pass), made once per process and key: step(*inputs, *extra) → its
    outputs, where `inputs` are the tensors every call passes as they are (weights, caches) and
    `extra` examples of the per-call ones; `dynamic_shapes` (one entry per input, as
    torch.export takes them) leaves dimensions of the library symbolic; `inductor_options`
    Inductor's settings beyond the defaults here. The step has the attributes `model`, `names`
    (its state's), `logits` (the forward) and `paths`."""
    options = {**_INDUCTOR_OPTIONS, **(inductor_options or {})}
    key = (
        id(step.model),
        type(step.model),
        type(step),
        json.dumps(step.model.config.to_dict(), sort_keys=True, default=str),
        tuple(step.names),
        step.logits,
        step.paths,
        tuple(_spec(t) for t in inputs + extra),  # the batch size and cache length among them
        repr(dynamic_shapes),
        json.dumps(options, sort_keys=True),
        torch.get_num_threads(),  # the generated code's OpenMP thread count
    )
    if key not in _LIBRARIES:
        _LIBRARIES[key] = _build_step_library(step, inputs, extra, dynamic_shapes, options)
    return _LIBRARIES[key]


_LIBRARIES: dict[tuple[Any, ...], Callable[[list[Tensor]], list[Tensor]]] = {}


def _build_step_library(
    step: nn.Module,
    inputs: list[Tensor],
    extra: list[Tensor],
    dynamic_shapes: tuple[Any, ...] | None,
    options: dict[str, Any],
) -> Callable[[list[Tensor]], list[Tensor]]:
    """Export the step, then load its library from the disk cache or compile it there first."""
    device = inputs[0].device
    # Stand-ins of the same layout: the real cache holds inference tensors, which export rejects.
    with torch.inference_mode(False), torch.no_grad():
        examples = [
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            for t in inputs + extra
        ]
        program = torch.export.export(
            step, tuple(examples), dynamic_shapes=dynamic_shapes, strict=False
        )
    graph = program.graph_module.print_readable(
        print_output=False, include_stride=True, include_device=True
    )
    direct_calls = shims.c_shims(program.graph)
    digest = hashlib.sha256(
        "\n".join(
            [
                torch.__version__,
                str(torch.get_num_threads()),
                str(torch.backends.cpu.get_cpu_capability()),
                json.dumps(options, sort_keys=True),
                *(declared for (declared,) in direct_calls.values()),
                graph,
            ]
        ).encode()
    ).hexdigest()[:32]
    path = _cache_dir() / f"step-{digest}.pt2"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".pt2", dir=path.parent)
        os.close(fd)
        try:
            with warnings.catch_warnings():
                # torch's own packaging code trips one of torch's deprecation warnings (2.13).
                warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
                configs = {**options, "aot_inductor.custom_ops_to_c_shims": direct_calls}
                torch._inductor.aoti_compile_and_package(
                    program, package_path=tmp, inductor_configs=configs
                )
            os.replace(tmp, path)  # atomic: another process sees the whole file or none
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return _load(str(path))


@functools.cache
def _load(path: str) -> Callable[[list[Tensor]], list[Tensor]]:
    """The library's entry point: flat input list → flat output list. Loaded once per process,
    however many models (of the same architecture and shapes) use it."""
    return torch._inductor.aoti_load_package(path).loader.run


def _cache_dir() -> Path:
    """Where compiled step libraries are kept: beside torch.compile's own cache, in the directory
    PyTorch documents for it ("Compile Time Caching Configuration"): $TORCHINDUCTOR_CACHE_DIR, by
    default torchinductor_<user> in the system's temporary directory."""
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if root is None:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):  # no name for this uid (as in some containers)
            user = f"uid_{os.getuid()}"
        root = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    return Path(root).absolute() / "decoderlm"
