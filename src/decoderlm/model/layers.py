"""Building blocks of the decoder: normalisation layers and position-wise MLPs.

LayerNorm (Ba et al., 2016), RMSNorm (Zhang & Sennrich, 2019), the GELU MLP of GPT-2, SwiGLU
(Shazeer, 2020) and squared ReLU (So et al., 2021, "Primer").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from decoderlm.model.config import ModelConfig


class RMSNorm(nn.Module):
    """y = x / √(mean(x²) + ε) · g, computed in (at least) float32 as Llama does, returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def make_norm(config: ModelConfig, dim: int | None = None) -> nn.Module:
    """The configured norm over `dim` features (default d_model)."""
    dim = config.d_model if dim is None else dim
    if config.norm == "rmsnorm":
        return RMSNorm(dim, config.norm_eps)
    # y = (x − mean) / √(var + ε) · g + b
    return nn.LayerNorm(dim, eps=config.norm_eps, bias=config.bias)


class MLP(nn.Module):
    """Position-wise feed-forward network: down(act(up(x))), or down(silu(gate(x)) ⊙ up(x)) for SwiGLU."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.kind = config.mlp
        d, d_ff = config.d_model, config.d_ff
        if self.kind == "swiglu":
            self.gate = nn.Linear(d, d_ff, bias=config.bias)
        self.up = nn.Linear(d, d_ff, bias=config.bias)
        self.down = nn.Linear(d_ff, d, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, d_model) → (B, T, d_model)
        if self.kind == "swiglu":
            h = F.silu(self.gate(x)) * self.up(x)  # SwiGLU(x) = Swish(xW) ⊙ xV
        elif self.kind == "gelu":
            h = F.gelu(self.up(x))
        elif self.kind == "gelu_tanh":
            h = F.gelu(self.up(x), approximate="tanh")  # GPT-2's "gelu_new"
        else:
            h = F.relu(self.up(x)).square()  # ReLU²
        return self.dropout(self.down(h))  # (B, T, d_model)
