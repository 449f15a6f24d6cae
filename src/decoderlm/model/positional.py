"""Position information: sinusoidal (Vaswani et al., 2017), learned (GPT-2), rotary (RoPE, Su et al., 2021).

Absolute encodings are added to the token embeddings; RoPE rotates queries and keys inside attention.
RoPE uses the rotate-half layout of Hugging Face Llama checkpoints: dimension i is paired with
i + head_dim/2 (not with i+1), so those weights load without any permutation.

Context extension (`rope_scaling`), with the semantics of `transformers.modeling_rope_utils`:
linear (position interpolation, Chen et al., 2023), dynamic (NTK-aware: the base grows with the
sequence past the original length L₀), yarn (NTK-by-parts plus an attention factor, Peng et al.,
2023), longrope (per-frequency factors, Ding et al., 2024) and llama3 (Llama 3.1's smooth ramp).
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
    head_dim: int, theta: float, scaling: dict[str, Any] | None = None, seq_len: int | None = None
) -> Tensor:
    """θ_i = theta^(−2i/head_dim) for i < head_dim/2, rescaled by `scaling`, in float64.

    `seq_len` (largest position + 1) matters to dynamic and longrope only; None means a sequence
    within the original length.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim  # (D/2,): 2i/d
    kind = _kind(scaling)
    if kind == "dynamic":
        length = torch.tensor(float(seq_len or 0), dtype=torch.float64)
        return dynamic_ntk_base(theta, head_dim, scaling, length) ** -exponents
    inv_freq = theta**-exponents  # θ_i = theta^(−2i/d)
    if kind is None:
        return inv_freq
    if kind == "longrope":  # θ_i / λ_i, λ the long factors past the original length, else the short
        long = seq_len is not None and seq_len > scaling["original_max_position_embeddings"]
        factors = scaling["long_factor" if long else "short_factor"]
        return inv_freq / torch.tensor(factors, dtype=torch.float64)
    factor = float(scaling["factor"])
    if kind == "linear":  # position interpolation: m·θ_i/s
        return inv_freq / factor
    if kind == "yarn":
        return _yarn_inverse_frequencies(inv_freq, head_dim, theta, scaling)
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_medium, blended, scaled)


def dynamic_ntk_base(
    theta: float, head_dim: int, scaling: dict[str, Any], seq_len: Tensor
) -> Tensor:
    """Dynamic NTK's base for `seq_len` (a 0-dim tensor, its dtype and device kept).

    b' = b · (s·L/L₀ − (s − 1))^(d/(d−2)) with L = max(seq_len, L₀): b itself up to the original
    length L₀; past it θ_0 = 1 stays and the lowest frequency is divided by s·L/L₀ − (s − 1).
    """
    factor, original = float(scaling["factor"]), scaling["original_max_position_embeddings"]
    length = seq_len.clamp(min=original)
    return theta * (factor * length / original - (factor - 1)) ** (head_dim / (head_dim - 2))


def _yarn_inverse_frequencies(
    inv_freq: Tensor, head_dim: int, theta: float, scaling: dict[str, Any]
) -> Tensor:
    """YaRN's "NTK-by-parts" (Peng et al., 2023): θ_i kept where a wavelength fits more than
    β_fast times into the original length, θ_i/s where it fits fewer than β_slow times, linear
    in i between."""
    factor, original = float(scaling["factor"]), scaling["original_max_position_embeddings"]

    def dimension(rotations: float) -> float:  # i = d·ln(L₀ / (2π·r)) / (2·ln b)
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling.get("beta_fast") or 32), dimension(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers does: no zero-width ramp
    i = torch.arange(head_dim // 2, dtype=torch.float64)  # (D/2,)
    ramp = ((i - low) / (high - low)).clamp(0, 1)  # 0: extrapolate, 1: interpolate
    return inv_freq * (1 - ramp) + inv_freq / factor * ramp


def rope_attention_factor(scaling: dict[str, Any] | None, context_length: int) -> float:
    """a, which cos and sin are multiplied by (so q·k by a²): YaRN's and LongRoPE's attention
    scaling, 1 for the other kinds. An explicit `attention_factor` wins; else, with s = factor:

    yarn:     a = 0.1·ln(s) + 1, or the ratio of that with `mscale` over that with `mscale_all_dim`
    longrope: a = √(1 + ln(s) / ln(L₀)), s defaulting to context_length / L₀ (1 for s ≤ 1)
    """
    kind = _kind(scaling)
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = float(scaling.get("factor") or context_length / original)
    if kind == "longrope":
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _kind(scaling: dict[str, Any] | None) -> str | None:
    return None if scaling is None else scaling.get("type", scaling.get("rope_type"))


class RotaryEmbedding(nn.Module):
    """cos/sin of m·θ_i for the positions m given to `forward`, times the attention factor.

    Dynamic NTK and LongRoPE depend on the sequence, whose length is, as in transformers, the
    largest position of the call + 1: a KV-cached step sees its own positions only, so the keys
    already cached keep the rotation they were computed with, exactly as in transformers'
    cached `generate`. (Transformers' dynamic RoPE also remembers the longest sequence seen until
    one within the original length comes; here each call stands alone, so the two agree for any
    calls whose lengths only grow, such as a fresh model's `generate`.) Dynamic computes m·θ_i in
    float32 at every call, as transformers does; the other kinds look up float64-made tables of
    `context_length` positions, or with `unbounded` (a model whose every layer has a sliding
    window, which decodes past its context) compute the same float64 angles at each call.
    """

    def __init__(
        self,
        context_length: int,
        head_dim: int,
        theta: float = 10000.0,
        scaling: dict[str, Any] | None = None,
        unbounded: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.kind = _kind(scaling)
        self.attention_factor = rope_attention_factor(scaling, context_length)
        self.unbounded = unbounded and self.kind != "longrope"
        if self.unbounded:  # θ_i once, in float64 (a plain tensor: a buffer would follow .to(bf16))
            self.unbounded_inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)  # (D/2,)
        if self.kind == "dynamic" or self.unbounded:
            return  # angles made at each call: see _dynamic and _unbounded
        # One table per set of frequencies: LongRoPE's short (sequences within L₀) and long, else one.
        lengths: tuple[int | None, ...] = (None,)
        if self.kind == "longrope":
            self.original_length = scaling["original_max_position_embeddings"]
            lengths = (None, self.original_length + 1)
        inv_freq = torch.stack(
            [rope_inverse_frequencies(head_dim, theta, scaling, n) for n in lengths]
        )  # (S, D/2)
        positions = torch.arange(context_length, dtype=torch.float64)  # (P,)
        angles = positions[None, :, None] * inv_freq[:, None, :]  # (S, P, D/2)
        angles = torch.cat([angles, angles], dim=-1)  # (S, P, D): rotate-half pairs i with i + D/2
        a = self.attention_factor
        self.register_buffer("cos", (angles.cos() * a).float(), persistent=False)
        self.register_buffer("sin", (angles.sin() * a).float(), persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        if self.kind == "dynamic":
            return self._dynamic(positions)
        if self.unbounded:
            return self._unbounded(positions)
        which = 0  # the table: LongRoPE's long one for calls reaching L₀, a tensor (no host sync)
        if self.kind == "longrope":
            which = (positions.max() >= self.original_length).long().expand_as(positions)
        return self.cos[which, positions], self.sin[which, positions]  # each (..., T, D)

    def _unbounded(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The table's values, computed for any positions: cos/sin(m·θ_i) · a from float64 angles."""
        inv_freq = self.unbounded_inv_freq.to(positions.device)  # (D/2,)
        angles = positions[..., None].double() * inv_freq  # (..., T, D/2)
        angles = torch.cat([angles, angles], dim=-1)  # (..., T, D)
        a = self.attention_factor
        return (angles.cos() * a).float(), (angles.sin() * a).float()

    def _dynamic(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        seq_len = (positions.max() + 1).float()  # L, a 0-dim tensor: no wait on the device
        base = dynamic_ntk_base(self.theta, self.head_dim, self.scaling, seq_len)
        exponents = torch.arange(0, self.head_dim, 2, device=positions.device) / self.head_dim
        inv_freq = 1.0 / base**exponents  # (D/2,): θ_i = b'^(−2i/d)
        angles = positions[..., None].float() * inv_freq  # (..., T, D/2)
        angles = torch.cat([angles, angles], dim=-1)  # (..., T, D)
        return angles.cos(), angles.sin()


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """R_m x for x (B, H, T, D) and cos/sin (T, R) or (B, T, R): x·cos(mθ) + rotate_half(x)·sin(mθ)
    on the first R ≤ D dimensions (partial RoPE, as transformers' partial_rotary_factor), the rest
    passed through."""
    if cos.dim() == 3:  # per-row positions (B, T, R) → broadcast over heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    return (x * cos + rotate_half(x) * sin).to(x.dtype)
