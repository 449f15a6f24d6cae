"""Causal linear attention: Katharopoulos, Vyas, Pappas & Fleuret (2020), "Transformers are RNNs:
Fast Autoregressive Transformers with Linear Attention".

softmax(q·k) is replaced by a kernel φ(q)ᵀφ(k) with the feature map φ(x) = elu(x) + 1 (> 0, their
§3.2.1), so causal attention becomes a recurrence over a matrix state S and a normaliser z (§3.4):

    S_t = S_{t−1} + φ(k_t) v_tᵀ,      z_t = z_{t−1} + φ(k_t),
    o_t = φ(q_t)ᵀ S_t / (φ(q_t)ᵀ z_t + ε).

z is carried as one more column of S (v extended by a 1), so one scan gives both numerator and
denominator: `decoderlm.model.scans` with decay 1 (g = 0). H_k key heads (`recurrent_key_heads`)
are shared by H / H_k heads each, as grouped-query attention shares its K/V heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from decoderlm.model.config import ModelConfig
from decoderlm.model.recurrent import RecurrentMixer, split_heads
from decoderlm.model.scans import (
    chunk_gated_linear_attention,
    mask_padding,
    recurrent_gated_linear_attention,
)

EPS = 1e-6  # ε of the normaliser


class LinearAttention(RecurrentMixer):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        d = config.d_model
        self.heads, self.key_heads, self.d_k, self.d_v = config.recurrent_dims
        self.chunk = config.recurrent_chunk
        self.q_proj = nn.Linear(d, self.key_heads * self.d_k, bias=config.bias)
        self.k_proj = nn.Linear(d, self.key_heads * self.d_k, bias=config.bias)
        self.v_proj = nn.Linear(d, self.heads * self.d_v, bias=config.bias)
        self.out_proj = nn.Linear(self.heads * self.d_v, d, bias=config.bias)

    def mix(
        self, x: Tensor, valid: Tensor | None, conv: Tensor | None, state: Tensor | None
    ) -> tuple[Tensor, None, Tensor]:
        b, t, _ = x.shape
        group = self.heads // self.key_heads

        q = F.elu(split_heads(self.q_proj(x), self.d_k, group)) + 1  # φ(q) (B, H, T, d_k)
        k = F.elu(split_heads(self.k_proj(x), self.d_k, group)) + 1  # φ(k)
        v = split_heads(self.v_proj(x), self.d_v)  # (B, H, T, d_v)
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (B, H, T, d_v + 1): z's column
        (k,) = mask_padding(valid, k)  # φ(k) = 0: a padded token adds nothing to S or z
        g = k.new_zeros(b, self.heads, t)  # no decay
        if t == 1:
            o, state = recurrent_gated_linear_attention(q, k, v, g, state)
        else:
            o, state = chunk_gated_linear_attention(q, k, v, g, state, min(self.chunk, t))
        o = o[..., :-1] / (o[..., -1:] + EPS)  # φ(q)ᵀS / (φ(q)ᵀz + ε), (B, H, T, d_v)
        y = o.transpose(1, 2).reshape(b, t, -1).to(x.dtype)  # (B, T, H·d_v)
        return self.out_proj(y), None, state
