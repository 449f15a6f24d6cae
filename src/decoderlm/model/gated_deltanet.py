"""Gated DeltaNet: Yang, Kautz & Hatamizadeh (2024), "Gated Delta Networks: Improving Mamba2 with
Delta Rule", in the layout of Qwen3-Next / Qwen3.5 (transformers' `Qwen3_5GatedDeltaNet`, its
parameter names: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, dt_bias, A_log, norm,
out_proj).

Per token: q, k, v from one projection through a short causal depthwise conv and SiLU; q and k
L2-normalised per head (q also scaled by 1/√d_k); β = sigmoid(b) ∈ (0, 1), the write strength;
the decay α = exp(g) with g = −exp(A_log) · softplus(a + dt_bias) ≤ 0 (a softplus-parametrised
step times a learned rate, as Mamba-2's Δ·A). The state follows the gated delta rule
(`decoderlm.model.scans`; the paper's S ∈ R^{d_v×d_k}):

    S_t = α_t S_{t−1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,      o_t = S_t q_t

and the output is gated: y = out_proj(RMSNorm(o) ⊙ SiLU(z)), the norm per head. H_k key heads
(`recurrent_key_heads`) serve H / H_k value heads each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from decoderlm.model.config import ModelConfig
from decoderlm.model.layers import GatedRMSNorm, short_conv
from decoderlm.model.recurrent import RecurrentMixer, split_heads
from decoderlm.model.scans import chunk_gated_delta_rule, mask_padding, recurrent_gated_delta_rule

L2_EPS = 1e-6  # x / √(Σx² + ε), as flash-linear-attention's l2norm


def l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)


class GatedDeltaNet(RecurrentMixer):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        d = config.d_model
        self.heads, self.key_heads, self.d_k, self.d_v = config.recurrent_dims
        self.chunk = config.recurrent_chunk
        self.key_dim, self.value_dim = self.key_heads * self.d_k, self.heads * self.d_v
        channels = config.recurrent_conv_channels  # q, k, v
        k = config.recurrent_conv
        self.conv1d = nn.Conv1d(channels, channels, k, groups=channels, padding=k - 1, bias=False)
        self.in_proj_qkv = nn.Linear(d, channels, bias=False)
        self.in_proj_z = nn.Linear(d, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(d, self.heads, bias=False)
        self.in_proj_a = nn.Linear(d, self.heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        # Qwen3-Next's initialisation: A uniform in [0.01, 16], so −exp(A_log) ∈ [−16, −0.01].
        self.A_log = nn.Parameter(torch.empty(self.heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.d_v, self.d_v, config.norm_eps, norm_before_gate=True)
        self.out_proj = nn.Linear(self.value_dim, d, bias=False)

    def mix(
        self, x: Tensor, valid: Tensor | None, conv: Tensor | None, state: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        b, t, _ = x.shape
        group = self.heads // self.key_heads
        qkv = self.in_proj_qkv(x)  # (B, T, 2·H_k·d_k + H·d_v)
        qkv, conv = short_conv(qkv, self.conv1d, conv, valid)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)

        work = torch.promote_types(x.dtype, torch.float32)
        q = l2norm(split_heads(q, self.d_k, group).to(work)) * self.d_k**-0.5  # (B, H, T, d_k)
        k = l2norm(split_heads(k, self.d_k, group).to(work))
        v = split_heads(v, self.d_v)  # (B, H, T, d_v)
        beta = self.in_proj_b(x).to(work).sigmoid().transpose(1, 2)  # β (B, H, T)
        a = self.in_proj_a(x).to(work).transpose(1, 2)  # (B, H, T)
        g = -self.A_log.to(work).exp()[:, None] * F.softplus(a + self.dt_bias.to(work)[:, None])
        beta, g = mask_padding(valid, beta, g)  # β = 0, g = 0: S unchanged at a padded token
        if t == 1:
            o, state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
        else:
            o, state = chunk_gated_delta_rule(q, k, v, g, beta, state, min(self.chunk, t))
        z = self.in_proj_z(x).view(b, t, self.heads, self.d_v)
        y = self.norm(o.transpose(1, 2).to(x.dtype), z)  # (B, T, H, d_v)
        return self.out_proj(y.reshape(b, t, -1)), conv, state
