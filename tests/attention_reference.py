"""The references the prompt-attention kernels' tests compare with: the formula in float64 and
torch's SDPA, both for causal attention aligned bottom-right with GQA."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference(q, k, v):
    """softmax(QKᵀ/√d + M)V in float64, M causal aligned bottom-right, K/V heads repeated."""
    t_q, t_k, group = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    visible = torch.ones(t_q, t_k, dtype=torch.bool).tril(t_k - t_q)
    return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v


def sdpa(q, k, v):
    """torch's SDPA of the same attention, in q's dtype."""
    t_q, t_k = q.shape[2], k.shape[2]
    mask = torch.ones(t_q, t_k, dtype=torch.bool).tril(t_k - t_q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
