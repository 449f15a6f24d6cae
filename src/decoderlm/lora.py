"""LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models"), applied to a
model from outside as `decoderlm.quant` swaps its linears.

A target linear layer y = x·Wᵀ + b keeps its weight W frozen and gains two small float matrices,
A (r, in) and B (out, r), so that

    y = x·Wᵀ + b + (α/r) · dropout(x)·Aᵀ·Bᵀ          (Hu et al., eq. 3; ΔW = (α/r)·B·A)

B starts at zero (the adapted model is the base model at step 0) and A Kaiming-uniform, as peft
initialises them. W may be a float `nn.Linear` or any quantized linear of `decoderlm.quant` (it
has `dequantized(dtype)`): over a quantized base the weights stay quantized while A and B train
in float, QLoRA's recipe (Dettmers et al., 2023).

- `apply_lora(model, rank, alpha, dropout, targets)` wraps the target linears of every block (by
  their names: `qkv`, `proj`, `gate`, `up`, `down`, … as the model names them) in `LoRALinear` and
  freezes every other weight; only the adapters train. The attention's fused projection
  W_Q|W_K|W_V gets one adapter: one A for the three, their B rows stacked — a rank-r update of the
  stacked matrix, where peft's adapters on separate q/k/v projections are three (rank up to 3r,
  three A's).
- `merge_lora(model)` folds ΔW into W and puts plain `nn.Linear`s back; `merged_state_dict(model)`
  is the state dict of the plain float model the adapted one computes (quantized weights
  dequantized), what a fine-tuned run stores.
- `save_adapters` / `load_adapters`: the adapters alone, `adapter.safetensors` with their
  settings in `adapter_config.json`, loaded onto a base model.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from decoderlm.errors import DecoderLMError
from decoderlm.files import atomic_write, write_json

ADAPTER_FILE = "adapter.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
DEFAULT_TARGETS = ("qkv", "proj", "gate", "up", "down")  # attention and MLP projections


@dataclass(frozen=True)
class LoRAConfig:
    """The adapters' settings: rank r, scale numerator α, dropout on their input, target names."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise DecoderLMError(f"LoRA rank={self.rank!r} must be an integer ≥ 1")
        if not isinstance(self.alpha, int | float) or not self.alpha > 0:
            raise DecoderLMError(f"LoRA alpha={self.alpha!r} must be > 0")
        if not isinstance(self.dropout, int | float) or not 0 <= self.dropout < 1:
            raise DecoderLMError(f"LoRA dropout={self.dropout!r} must be in [0, 1)")
        if not self.targets:
            raise DecoderLMError("LoRA needs at least one target module")

    @property
    def scale(self) -> float:
        """α/r, the factor of B·A."""
        return self.alpha / self.rank


def is_linear(module: nn.Module) -> bool:
    """A linear layer LoRA can adapt: `nn.Linear`, or a quantized one (it has `dequantized`)."""
    return isinstance(module, nn.Linear) or callable(getattr(module, "dequantized", None))


def base_weight(linear: nn.Module) -> Tensor:
    """W (out, in) in float32 of a linear layer (a quantized one's dequantized Ŵ)."""
    if isinstance(linear, nn.Linear):
        return linear.weight.detach().float()
    return linear.dequantized(torch.float32)


class LoRALinear(nn.Module):
    """y = base(x) + (α/r)·dropout(x)·Aᵀ·Bᵀ, `base` frozen; lora_A (r, in), lora_B (out, r)."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.scale = alpha / rank
        device = next(iter([*base.parameters(), *base.buffers()])).device
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=device))
        # peft's init: A ~ Kaiming-uniform(a=√5) as nn.Linear's own weights, B = 0.
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:  # (..., in) → (..., out)
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        delta = F.linear(F.linear(self.dropout(x), a), b)  # dropout(x)·Aᵀ·Bᵀ: (..., out)
        return _FrozenLinear.apply(x, self.base) + self.scale * delta

    def merged_weight(self) -> Tensor:
        """W + (α/r)·B·A (out, in), float32."""
        return base_weight(self.base) + self.scale * (self.lora_B.float() @ self.lora_A.float())

    def extra_repr(self) -> str:
        return f"rank={self.lora_A.shape[0]}, scale={self.scale:g}"


class _FrozenLinear(torch.autograd.Function):
    """y = base(x) for a frozen base, whose backward ∂L/∂x = ∂L/∂y · Ŵ makes Ŵ again rather than
    keeping the forward's: a quantized base holds only its integers between the two passes
    (QLoRA's saving; autograd would keep every layer's dequantized float weight)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, base: nn.Module) -> Tensor:
        ctx.base = base
        with torch.no_grad():
            return base(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        weight = ctx.base.weight if isinstance(ctx.base, nn.Linear) else None
        weight = ctx.base.dequantized(grad.dtype) if weight is None else weight.to(grad.dtype)
        return grad @ weight, None  # (..., out) · (out, in) → (..., in)


def target_names(model: nn.Module) -> list[str]:
    """The names LoRA may target in `model`: the last name of each linear layer in its blocks."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in _block_modules(model) if is_linear(m)})


def apply_lora(
    model: nn.Module,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    targets: tuple[str, ...] | list[str] = DEFAULT_TARGETS,
) -> nn.Module:
    """Freeze every weight of `model` and wrap the linears of its blocks named in `targets` in
    `LoRALinear` (in place); returns `model`. A target the model does not have (an MLP's `gate`
    where the MLP is GELU) is skipped if another target is found; a name that is no linear layer
    of the model is a one-line error listing the valid ones."""
    config = LoRAConfig(rank, alpha, dropout, tuple(targets))
    if has_lora(model):
        raise DecoderLMError("the model already has LoRA adapters; merge them first")
    valid = target_names(model)
    unknown = [t for t in config.targets if t not in valid]
    if unknown:
        raise DecoderLMError(
            f"LoRA target {unknown[0]!r} is not a linear layer of this model; valid: "
            f"{', '.join(valid)}"
        )
    model.requires_grad_(False)
    for name, module in _block_modules(model):
        if is_linear(module) and name.rsplit(".", 1)[-1] in config.targets:
            adapted = LoRALinear(module, rank, alpha, dropout).train(model.training)
            _set_module(model, name, adapted)
    model.lora_config = config  # what save_adapters records
    return model


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def lora_config_of(model: nn.Module) -> LoRAConfig:
    config = getattr(model, "lora_config", None)
    if config is None:
        raise DecoderLMError("the model has no LoRA adapters")
    return config


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every `LoRALinear` by an `nn.Linear` of weight W + (α/r)·B·A (float32; a quantized
    base dequantized) and its base's bias; returns `model` (in place)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            merged = nn.Linear(
                module.in_features, module.out_features, bias=_bias(module) is not None
            )
            merged.to(module.lora_A.device)
            with torch.no_grad():
                merged.weight.copy_(module.merged_weight())
                if merged.bias is not None:
                    merged.bias.copy_(_bias(module))
            _set_module(model, name, merged)
    if hasattr(model, "lora_config"):
        del model.lora_config
    return model


def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The state dict of the plain float model `model` computes: adapters merged into their
    weights, quantized weights dequantized (float32), the rest as it is."""
    computed: dict[str, Tensor] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        weight = _float_weight(module)
        if weight is None or any(name.startswith(owner) for owner in computed):
            continue  # a plain module, or the base inside a LoRALinear
        computed[prefix] = weight
    owners = tuple(computed)
    weights = {owner + "weight": weight for owner, weight in computed.items()}
    biases = {
        owner + "bias": bias.detach()
        for owner in owners
        if (bias := _bias(model.get_submodule(owner.removesuffix(".")))) is not None
    }
    state = {
        key: value.detach()
        for key, value in model.state_dict().items()
        if not key.startswith(owners)
    }
    return {**state, **weights, **biases}


def _float_weight(module: nn.Module) -> Tensor | None:
    """The float32 weight a module computes with where it is not a plain parameter: W + ΔW of a
    LoRALinear, Ŵ of a quantized linear, the table of a quantized embedding; else None."""
    if isinstance(module, LoRALinear):
        return module.merged_weight()
    if isinstance(module, nn.Linear | nn.Embedding):
        return None
    if callable(getattr(module, "dequantized", None)):
        return module.dequantized(torch.float32)
    if isinstance(getattr(type(module), "weight", None), property):  # a quantized embedding
        return module.weight.detach().float()
    return None


def _bias(module: nn.Module) -> Tensor | None:
    base = module.base if isinstance(module, LoRALinear) else module
    return getattr(base, "bias", None)


def adapter_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' tensors, under their names in the model (`blocks.0.attn.qkv.lora_A`, …)."""
    return {
        name: param.detach().contiguous()
        for name, param in model.named_parameters()
        if name.endswith((".lora_A", ".lora_B"))
    }


def save_adapters(model: nn.Module, directory: str | Path, base: str | None = None) -> None:
    """`directory`/adapter.safetensors and adapter_config.json (rank, alpha, dropout, targets and
    `base`, the model they adapt), each written atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = adapter_state_dict(model)
    atomic_write(
        directory / ADAPTER_FILE,
        lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}),
    )
    write_json(directory / ADAPTER_CONFIG_FILE, {**asdict(lora_config_of(model)), "base": base})


def read_adapter_config(directory: str | Path) -> dict[str, Any]:
    """adapter_config.json of `directory`: LoRAConfig's fields and "base"; a one-line error if
    it is missing or not a JSON object of them."""
    path = Path(directory) / ADAPTER_CONFIG_FILE
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DecoderLMError(f"{directory} has no {ADAPTER_CONFIG_FILE}") from None
    except (OSError, ValueError) as exc:
        raise DecoderLMError(f"cannot read {path}: {exc}") from None
    if not isinstance(values, dict) or not {"rank", "alpha"} <= set(values):
        raise DecoderLMError(f"{path} must be a JSON object with rank and alpha")
    return values


def load_adapters(model: nn.Module, directory: str | Path) -> nn.Module:
    """Apply the adapters saved in `directory` to the base `model` (in place); returns it. Every
    saved tensor must be one of the adapters its config makes, of the same shape."""
    values = read_adapter_config(directory)
    fields = {k: values[k] for k in ("rank", "alpha", "dropout", "targets") if k in values}
    fields["targets"] = tuple(fields.get("targets", DEFAULT_TARGETS))
    config = LoRAConfig(**fields)
    apply_lora(model, config.rank, config.alpha, config.dropout, config.targets)
    path = Path(directory) / ADAPTER_FILE
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise DecoderLMError(f"cannot read adapters from {path}: {exc}") from None
    load_adapter_tensors(model, tensors, path)
    return model


def load_adapter_tensors(model: nn.Module, tensors: dict[str, Tensor], source: Any) -> None:
    """Copy `tensors` (adapter_state_dict's names) into `model`'s adapters, every one of them
    given, of its shape; a one-line error naming `source` if not."""
    mine = dict(model.named_parameters())
    expected = adapter_state_dict(model)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise DecoderLMError(
            f"adapters in {source} do not fit the model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    with torch.no_grad():
        for name, tensor in tensors.items():
            if tensor.shape != mine[name].shape:
                raise DecoderLMError(
                    f"adapter {name!r} in {source} has shape {tuple(tensor.shape)}, the model "
                    f"needs {tuple(mine[name].shape)}"
                )
            mine[name].copy_(tensor)


def _block_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of the modules inside the model's blocks (the embedding and head are not
    adapted), without what a LoRALinear holds."""
    found: list[tuple[str, nn.Module]] = []
    wrapped: tuple[str, ...] = ()
    for name, module in model.named_modules():
        if not name.startswith("blocks.") or name.startswith(wrapped):
            continue
        found.append((name, module))
        if isinstance(module, LoRALinear):
            wrapped = (*wrapped, name + ".")
    return found


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, module)
