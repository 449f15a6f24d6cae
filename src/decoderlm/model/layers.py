"""Building blocks of the decoder: normalisation layers and position-wise MLPs.

LayerNorm (Ba et al., 2016), RMSNorm (Zhang & Sennrich, 2019), the GELU MLP of GPT-2, SwiGLU
(Shazeer, 2020) and squared ReLU (So et al., 2021, "Primer"); for the recurrent mixers, the
gated RMSNorm and the short causal depthwise convolution of Mamba (Gu & Dao, 2023) and Gated
DeltaNet (Yang et al., 2024).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from decoderlm.model.config import ModelConfig


class RMSNorm(nn.Module):
    """y = x / √(mean(x²) + ε) · g, computed in (at least) float32 as Llama does, returned in x's dtype.

    With `offset` 1 the gain is stored as g − 1: y = x̂ · (1 + w), computed in float32 and then cast
    (Gemma, Qwen3-Next, Qwen3.5)."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.to(xf.dtype))).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm with a SiLU gate z, over groups of `group_size` features (mamba_ssm's RMSNormGated):

        norm_before_gate:      y = g ⊙ x / √(mean_group(x²) + ε) ⊙ SiLU(z)     (Qwen3-Next's GDN)
        not norm_before_gate:  y = g ⊙ h / √(mean_group(h²) + ε),  h = x ⊙ SiLU(z)   (Mamba-2)

    computed in float32 at least, returned in x's dtype."""

    def __init__(
        self, dim: int, group_size: int, eps: float = 1e-6, norm_before_gate: bool = False
    ) -> None:
        super().__init__()
        self.group_size, self.eps, self.norm_before_gate = group_size, eps, norm_before_gate
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:  # x, z (..., dim) → (..., dim)
        dtype = torch.promote_types(x.dtype, torch.float32)
        h, gate = x.to(dtype), F.silu(z.to(dtype))
        if not self.norm_before_gate:
            h = h * gate
        groups = h.unflatten(-1, (-1, self.group_size))  # (..., dim / group_size, group_size)
        h = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        if self.norm_before_gate:
            h = h * gate
        return (self.weight * h).to(x.dtype)


def short_conv(
    x: Tensor, conv: nn.Conv1d, state: Tensor | None, valid: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The short causal depthwise convolution, then SiLU: y_t = SiLU(b + Σ_{i<K} w_i ⊙ x_{t−K+1+i})
    with `conv`'s weight w (C, 1, K) and bias b; x (B, T, C), state (B, C, K − 1): the K − 1 inputs
    before x (None: zeros). Returns y (B, T, C) and the state after x (its last K − 1 inputs).
    valid (B, T): False at left padding, whose inputs count as zeros, so that a padded row's
    state after its prompt is the state of the prompt alone."""
    k = conv.weight.shape[-1]
    if valid is not None:
        x = x * valid[..., None].to(x.dtype)
    xt = x.transpose(1, 2)  # (B, C, T)
    if state is None:
        state = xt.new_zeros(*xt.shape[:2], k - 1)
    full = torch.cat([state.to(xt.dtype), xt], dim=-1)  # (B, C, K − 1 + T)
    y = F.conv1d(full, conv.weight, conv.bias, groups=full.shape[1])  # (B, C, T)
    return F.silu(y).transpose(1, 2), full[:, :, -(k - 1) :]


def make_norm(config: ModelConfig, dim: int | None = None) -> nn.Module:
    """The configured norm over `dim` features (default d_model)."""
    dim = config.d_model if dim is None else dim
    if config.norm in ("rmsnorm", "rmsnorm_1p"):
        return RMSNorm(dim, config.norm_eps, offset=1.0 if config.norm == "rmsnorm_1p" else 0.0)
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
