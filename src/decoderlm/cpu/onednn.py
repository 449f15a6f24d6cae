"""oneDNN's dense float32 linear as an opaque op, decoderlm::onednn_linear: torch.compile calls it
as it is rather than lowering it to the MKL sgemm/sgemv behind F.linear, which it outruns on the
llama-55m shapes (the float32 prefills and LM heads of `decoderlm.cpu.decode`, the exact
products of `decoderlm.cpu.bf16_linear.float32_linear`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@torch.library.custom_op("decoderlm::onednn_linear", mutates_args=())
def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x Wᵀ + b by oneDNN's dense linear (inference only)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x Wᵀ + b in float32 without autograd: `onednn_linear` where oneDNN is built, else F.linear."""
    return onednn_linear(x, weight, bias) if AVAILABLE else F.linear(x, weight, bias)
