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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from decoderlm.errors import DecoderLMError
from decoderlm.model.lm import DecoderLM
from decoderlm.quant.linear import INT4_GROUP_SIZES, Bf16Linear, Int4Linear, Int8Linear

QUANTIZATIONS = ("int8", "int4", "bf16")
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
    """{"to": "int8" | "int4" | "bf16", "group_size": G or None} of a quantized model; None if
    float."""
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


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def _swap(model: nn.Module, make: Callable[[str, nn.Linear], nn.Module]) -> None:
    """Set every nn.Linear `name` of `model` to `make(name, linear)`."""
    for name, linear in _linears(model):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, make(name, linear).to(linear.weight.device))
