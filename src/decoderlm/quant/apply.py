"""`quantize(model, to, group_size)`: swap a DecoderLM's nn.Linear modules for quantized ones.

Applied from outside the model, as gpt-fast's `WeightOnlyInt8QuantHandler`: the model's code is
unchanged and calls `self.head(x)` or `self.qkv(x)` whatever module sits there.

- `to="int8"`: every linear layer becomes an `Int8Linear`.
- `to="bf16"`: every linear layer becomes a `Bf16Linear`: weights in bfloat16, activations in
  the model's dtype (float32 for the accuracy of float32 at half its weight bytes).
- `to="int4"`: the block layers become `Int4Linear`s with `group_size` inputs per scale; the LM
  head stays int8, as in llama.cpp's Q4 files, which keep the output matrix at higher precision:
  its errors go straight into the logits.
- The embedding table stays float, so the lookup is exact. With tied embeddings the head is
  quantized from the same table into an int8 copy of its own (one byte per entry more).

A model loaded from a GGUF file holds ggml's blocks instead (`BlockLinear`, `BlockEmbedding`):
`quantization_of` names it "gguf" with each module's type, and `swap_blocks` rebuilds those
modules to load a saved one into. `materialize` finishes a model built on the meta device whose
tensors were assigned (how GGUF files and quantized runs load without a float copy first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from decoderlm.errors import DecoderLMError
from decoderlm.model.lm import DecoderLM, rotary_embedding
from decoderlm.quant.blocks import BLOCK_TYPES, BlockEmbedding, BlockLinear
from decoderlm.quant.linear import INT4_GROUP_SIZES, Bf16Linear, Int4Linear, Int8Linear

QUANTIZATIONS = ("int8", "int4", "bf16")
GGUF = "gguf"  # the "to" of a model holding ggml's blocks (decoderlm.gguf loads them)
DEFAULT_GROUP_SIZE = 64  # int4; llama.cpp's Q4_0 uses 32, gpt-fast 128


def check_settings(to: str, group_size: int | None) -> int | None:
    """The group size to use (None for int8), or a one-line error naming the bad value."""
    if to not in QUANTIZATIONS:
        raise DecoderLMError(f"--to {to!r} must be one of {', '.join(QUANTIZATIONS)}")
    if to != "int4":
        if group_size is not None:
            raise DecoderLMError(
                f"--group-size {group_size} applies to int4 only ({to} has no groups)"
            )
        return None
    group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    if group_size not in INT4_GROUP_SIZES:
        raise DecoderLMError(
            f"--group-size {group_size} must be one of {', '.join(map(str, INT4_GROUP_SIZES))}"
        )
    return group_size


def quantization_of(model: nn.Module) -> dict[str, Any] | None:
    """{"to": "int8" | "int4" | "bf16", "group_size": G or None} of a quantized model,
    {"to": "gguf", "types": {module: ggml type}} of one holding ggml's blocks; None if float."""
    blocks = {
        name: m.ggml_type
        for name, m in model.named_modules()
        if isinstance(m, BlockLinear | BlockEmbedding)
    }
    if blocks:
        return {"to": GGUF, "types": blocks}
    int4 = [m for m in model.modules() if isinstance(m, Int4Linear)]
    if int4:
        return {"to": "int4", "group_size": int4[0].group_size}
    if any(isinstance(m, Bf16Linear) for m in model.modules()):
        return {"to": "bf16", "group_size": None}
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        return {"to": "int8", "group_size": None}
    return None


def quantize(model: DecoderLM, to: str = "int8", group_size: int | None = None) -> DecoderLM:
    """Quantize `model`'s linear layers in place (see the module docstring); returns `model`."""
    group_size = check_settings(to, group_size)
    done = quantization_of(model)
    if done is not None:
        raise DecoderLMError(
            f"the model is already quantized ({done['to']}); quantize its float checkpoint instead"
        )
    if group_size is not None:
        for name, module in _linears(model):
            if name != "head" and module.in_features % group_size:
                raise DecoderLMError(
                    f"--group-size {group_size} does not divide the {module.in_features} inputs "
                    f"of {name}; choose one of {', '.join(map(str, INT4_GROUP_SIZES))} that does"
                )
    if to == "bf16":
        _swap(model, lambda name, linear: Bf16Linear.from_linear(linear))
        return model
    _swap(
        model,
        lambda name, linear: (
            Int8Linear.from_linear(linear)
            if group_size is None or name == "head"
            else Int4Linear.from_linear(linear, group_size)
        ),
    )
    return model


def swap_empty(model: DecoderLM, to: str, group_size: int | None) -> DecoderLM:
    """Replace the linear layers by empty quantized ones of the same shapes, to load weights into."""

    def empty(name: str, linear: nn.Linear) -> nn.Module:
        bias = linear.bias is not None
        if to == "bf16":
            return Bf16Linear(linear.in_features, linear.out_features, bias)
        if group_size is None or name == "head":
            return Int8Linear(linear.in_features, linear.out_features, bias)
        return Int4Linear(linear.in_features, linear.out_features, bias, group_size)

    _swap(model, empty)
    return model


def swap_blocks(model: DecoderLM, types: dict[str, str]) -> DecoderLM:
    """Replace the modules `types` names by empty BlockLinear / BlockEmbedding of those ggml
    types (a tied head reads the embedding's blocks), to load saved blocks into."""
    for name, kind in types.items():
        if kind not in BLOCK_TYPES:
            raise DecoderLMError(
                f"ggml type {kind!r} of {name} is not one decoderlm keeps; kept: "
                f"{', '.join(BLOCK_TYPES)}"
            )
        module = model.get_submodule(name)
        if isinstance(module, nn.Embedding):
            new: nn.Module = BlockEmbedding(module.num_embeddings, module.embedding_dim, kind)
        elif isinstance(module, nn.Linear):
            bias = module.bias is not None
            new = BlockLinear(module.in_features, module.out_features, kind, bias)
        else:
            raise DecoderLMError(f"{name} is neither a linear layer nor the embedding")
        set_module(model, name, new)
    _tie_head(model)
    return model


def materialize(model: DecoderLM, state: dict[str, torch.Tensor]) -> DecoderLM:
    """A model built on the meta device, given `state`'s tensors (assigned, not copied): its tied
    head reads the embedding again, its RoPE tables are made, an empty buffer (a dtype marker)
    made empty for real; DecoderLMError naming a tensor still without a value."""
    model.load_state_dict(state, strict=False, assign=True)
    _tie_head(model)
    model.rope = rotary_embedding(model.config)
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta and buffer.numel() == 0:
                setattr(module, name, torch.empty(0, dtype=buffer.dtype))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise DecoderLMError(f"no value was given for {left[0]!r}")
    return model


def _tie_head(model: DecoderLM) -> None:
    """A tied head reads the embedding's table: its blocks, or its float weight (a head
    quantized into a copy of its own, as `quantize` makes, stays as it is)."""
    if not model.config.tie_embeddings:
        return
    if isinstance(model.tok_emb, BlockEmbedding):
        model.head = BlockLinear.tied_to(model.tok_emb)
    elif type(model.head) is nn.Linear:
        model.head.weight = model.tok_emb.weight


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` at `name` (a dotted path) in `model`."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, module)


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def _swap(model: nn.Module, make: Callable[[str, nn.Linear], nn.Module]) -> None:
    """Set every nn.Linear `name` of `model` to `make(name, linear)`."""
    for name, linear in _linears(model):
        set_module(model, name, make(name, linear).to(linear.weight.device))
