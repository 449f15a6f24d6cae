"""Mamba-2: Dao & Gu (2024), "Transformers are SSMs: Generalized Models and Efficient Algorithms
Through Structured State Space Duality" — the selective state-space layer with a scalar-times-
identity A (SSD), in the layout of transformers' `Mamba2Mixer` (its parameter names: in_proj,
conv1d, dt_bias, A_log, D, norm, out_proj).

in_proj gives the gate z (d_inner = H·P), xBC (d_inner + 2·G·N) and Δ (H). xBC goes through a
short causal depthwise conv and SiLU and splits into x (H heads of P), B and C (G groups of N,
each shared by H / G heads). Δ = softplus(Δ + dt_bias), A = −exp(A_log) (one scalar per head).
Per head, with state h (N, P):

    h_t = exp(Δ_t A) h_{t−1} + B_t (Δ_t x_t)ᵀ,      y_t = h_tᵀ C_t + D x_t

— gated linear attention with q = C, k = B, v = Δ·x, g = Δ·A (`decoderlm.model.scans`), computed
chunk by chunk (the SSD algorithm's block decomposition) or token by token. Output:
out_proj(RMSNorm(y ⊙ SiLU(z))), the norm over groups of d_inner / G features.
Config: H = recurrent_heads, P = recurrent_value_dim, N = recurrent_key_dim (state_size),
G = recurrent_key_heads (n_groups).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from decoderlm.model.config import ModelConfig
from decoderlm.model.layers import GatedRMSNorm, short_conv
from decoderlm.model.recurrent import RecurrentMixer, split_heads
from decoderlm.model.scans import (
    chunk_gated_linear_attention,
    mask_padding,
    recurrent_gated_linear_attention,
)

# Mamba-2's initial Δ: log-uniform in [DT_MIN, DT_MAX], at least DT_FLOOR.
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 0.1, 1e-4


class Mamba2(RecurrentMixer):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        d = config.d_model
        self.heads, self.groups, self.d_state, self.head_dim = config.recurrent_dims
        self.chunk = config.recurrent_chunk
        self.d_inner = self.heads * self.head_dim
        channels = config.recurrent_conv_channels  # x, B, C
        k = config.recurrent_conv
        self.conv1d = nn.Conv1d(channels, channels, k, groups=channels, padding=k - 1)
        self.in_proj = nn.Linear(d, self.d_inner + channels + self.heads, bias=config.bias)
        # Mamba-2's initialisation: A = 1..H; Δ log-uniform, dt_bias = softplus⁻¹(Δ); D = 1.
        dt = torch.exp(
            torch.rand(self.heads) * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)
        ).clamp(min=DT_FLOOR)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.A_log = nn.Parameter(torch.arange(1, self.heads + 1, dtype=torch.float32).log())
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = GatedRMSNorm(self.d_inner, self.d_inner // self.groups, config.norm_eps)
        self.out_proj = nn.Linear(self.d_inner, d, bias=config.bias)

    def mix(
        self, x: Tensor, valid: Tensor | None, conv: Tensor | None, state: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        b, t, _ = x.shape
        group = self.heads // self.groups
        n_bc = self.groups * self.d_state
        z, xbc, dt = self.in_proj(x).split([self.d_inner, self.d_inner + 2 * n_bc, self.heads], -1)
        xbc, conv = short_conv(xbc, self.conv1d, conv, valid)
        xs, bs, cs = xbc.split([self.d_inner, n_bc, n_bc], dim=-1)

        work = torch.promote_types(x.dtype, torch.float32)
        xs = split_heads(xs, self.head_dim).to(work)  # (B, H, T, P)
        bs = split_heads(bs, self.d_state, group)  # (B, H, T, N), a group's B shared by its heads
        cs = split_heads(cs, self.d_state, group)
        dt = F.softplus(dt.to(work) + self.dt_bias.to(work)).transpose(1, 2)  # Δ (B, H, T)
        (dt,) = mask_padding(valid, dt)  # Δ = 0: exp(0·A) = 1 and Δ·x = 0, h unchanged
        g = dt * -self.A_log.to(work).exp()[:, None]  # Δ·A ≤ 0, (B, H, T)
        v = xs * dt[..., None]  # Δ·x (B, H, T, P)
        if t == 1:
            o, state = recurrent_gated_linear_attention(cs, bs, v, g, state)
        else:
            o, state = chunk_gated_linear_attention(cs, bs, v, g, state, min(self.chunk, t))
        y = o + self.D.to(work)[:, None, None] * xs  # + D·x, (B, H, T, P)
        y = self.norm(y.transpose(1, 2).reshape(b, t, -1).to(x.dtype), z)  # (B, T, d_inner)
        return self.out_proj(y), conv, state
