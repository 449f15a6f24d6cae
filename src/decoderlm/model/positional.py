"""Position information: sinusoidal (Vaswani et al., 2017), learned (GPT-2), rotary (RoPE, Su et al., 2021).

Absolute encodings are added to the token embeddings; RoPE rotates queries and keys inside attention.
RoPE uses the rotate-half layout of Hugging Face Llama checkpoints: dimension i is paired with
i + head_dim/2 (not with i+1), so those weights load without any permutation.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn


def sinusoidal_table(n_positions: int, d_model: int) -> Tensor:
    """The fixed table of Vaswani et al. (2017), shape (n_positions, d_model), float32."""
    pos = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)  # (P, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (d/2,)
    angle = pos / 10000.0 ** (two_i / d_model)  # (P, d/2)
    table = torch.empty(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)  # PE(pos, 2i)   = sin(pos / 10000^(2i/d))
    table[:, 1::2] = torch.cos(angle)  # PE(pos, 2i+1) = cos(pos / 10000^(2i/d))
    return table.float()


class SinusoidalPositions(nn.Module):
    """Adds nothing learnable: looks up the fixed sinusoidal table by position."""

    def __init__(self, context_length: int, d_model: int) -> None:
        super().__init__()
        self.register_buffer("table", sinusoidal_table(context_length, d_model), persistent=False)

    def forward(self, positions: Tensor) -> Tensor:
        return self.table[positions]  # (..., T, d_model)


class LearnedPositions(nn.Module):
    """One trained vector per position (GPT-2's `wpe`)."""

    def __init__(self, context_length: int, d_model: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(context_length, d_model))

    def forward(self, positions: Tensor) -> Tensor:
        return self.weight[positions]  # (..., T, d_model)


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None = None
) -> Tensor:
    """θ_i = theta^(-2i/head_dim) for i < head_dim/2, optionally rescaled for long context."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return inv_freq
    kind = scaling.get("type", scaling.get("rope_type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables; `forward(positions)` returns them for the given positions."""

    def __init__(
        self,
        context_length: int,
        head_dim: int,
        theta: float = 10000.0,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)  # (D/2,)
        angles = torch.outer(
            torch.arange(context_length, dtype=torch.float64), inv_freq
        )  # (P, D/2)
        angles = torch.cat([angles, angles], dim=-1)  # (P, D): rotate-half pairs i with i + D/2
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.cos[positions], self.sin[positions]  # each (..., T, D)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """R_m x for x (B, H, T, D) and cos/sin (T, D) or (B, T, D): x·cos(mθ) + rotate_half(x)·sin(mθ)."""
    if cos.dim() == 3:  # per-row positions (B, T, D) → broadcast over heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos + rotate_half(x) * sin).to(x.dtype)
