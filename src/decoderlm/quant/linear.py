"""Linear layers with quantized weights: y = x·Ŵᵀ + b, Ŵ the dequantized weight.

- `Int8Linear`: per-output-channel symmetric int8 (the scheme of gpt-fast's int8 and close to
  llama.cpp's Q8_0, which scales blocks of 32 instead of whole rows):
  s_n = max_k |W_nk| / 127, q_nk = round(W_nk / s_n) ∈ [−127, 127], Ŵ_nk = s_n · q_nk.
- `Int4Linear`: asymmetric int4 in groups of `group_size` consecutive inputs (a row's group g is
  W_n,gG..(g+1)G−1), two values packed per byte: m_ng = min W, s_ng = (max W − min W) / 15,
  q_nk = round((W_nk − m_ng) / s_ng) ∈ [0, 15], Ŵ_nk = s_ng · q_nk + m_ng. Asymmetric because a
  group's minimum and maximum are rarely opposite, and with 16 levels every one counts.

- `Bf16Linear`: the weight rounded to bfloat16 (to nearest even), Ŵ = bf16(W), for float32
  activations: half the bytes of float32 weights, the products and sums of float32 (llama.cpp's
  bf16 files store their weights so, but round the activations to bfloat16 for the product too).

Each rounds to the nearest level, so |W − Ŵ| ≤ s / 2 element by element (bf16: half an ulp).
The scales are float32
when quantized and follow the model's dtype when it is cast; the integer weights never change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from decoderlm.cpu import block_linear, gemv

INT4_GROUP_SIZES = (32, 64, 128)

# A few rows on the CPU (decoding) run on C kernels that read the integers as they are stored:
# one row on `decoderlm.cpu.gemv` where it is built (AVX-512), up to `block_linear.MAX_ROWS` on
# `decoderlm.cpu.block_linear.int8_linear` / `int4_linear` / `linear` (AVX-512, AVX2 or portable
# C): converting the whole weight on every call (or PyTorch's packed int8/int4 kernels) decodes
# slower than float32 weights (measured on a loaded Sapphire Rapids under ATEN_CPU_CAPABILITY=avx2,
# 30 products of 1536 × 576, one row, one thread: float32 16 ms; int8 converted 17 ms,
# torch._weight_int8pack_mm 29; int4 dequantized 189, torch._weight_int4pack_mm_for_cpu 81;
# bfloat16 converted 23, block_linear 9.5). Where no kernel is built, bfloat16 activations of a
# few rows use `torch._weight_int8pack_mm` (faster there than converting the weight first).
_INT8PACK_MAX_ROWS = 8


class QuantizedLinear(nn.Module):
    """What both layers share: the shape, an optional float bias, y = x·Ŵᵀ + b."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    def forward(self, x: Tensor) -> Tensor:
        y = self.matmul(x)  # (..., out_features)
        return y if self.bias is None else y + self.bias

    def matmul(self, x: Tensor) -> Tensor:
        """x·Ŵᵀ: x (..., in_features) → (..., out_features)."""
        return F.linear(x, self.dequantized(x.dtype))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """Ŵ (out_features, in_features) in `dtype`."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


class Int8Linear(QuantizedLinear):
    """Buffers: weight_q int8 (N, K), scale (N,), bias (N,) or None."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)
        self.register_buffer("weight_q", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features))

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        w = linear.weight.detach().float()  # (N, K)
        new = cls(linear.in_features, linear.out_features, linear.bias is not None)
        amax = w.abs().amax(dim=1)  # (N,)
        scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # s_n = max_k |W_nk| / 127
        new.weight_q.copy_(torch.round(w / scale[:, None]).clamp(-127, 127))  # q = round(W / s)
        new.scale.copy_(scale)
        if linear.bias is not None:
            new.bias.copy_(linear.bias.detach())
        return new

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return self.weight_q.to(dtype) * self.scale.to(dtype)[:, None]  # Ŵ_nk = s_n q_nk

    def matmul(self, x: Tensor) -> Tensor:
        if gemv.handles(x, self.weight_q):
            return gemv.int8_linear(x, self.weight_q, self.scale)  # (..., N)
        if block_linear.handles(x, self.weight_q):
            return block_linear.int8_linear(x, self.weight_q, self.scale)  # (..., N)
        scale = self.scale.to(x.dtype)  # (N,)
        rows = x.shape[:-1].numel()
        if (
            x.device.type == "cpu"
            and x.dtype == torch.bfloat16
            and rows <= _INT8PACK_MAX_ROWS
            and not torch.compiler.is_compiling()
        ):
            y = torch._weight_int8pack_mm(x.reshape(rows, -1), self.weight_q, scale)  # (rows, N)
            return y.view(*x.shape[:-1], self.out_features)
        # (x·qᵀ)_n · s_n = (x·Ŵᵀ)_n; under compilation the conversion fuses into the matmul.
        return F.linear(x, self.weight_q.to(x.dtype)) * scale


class Bf16Linear(QuantizedLinear):
    """Buffers: weight_bits int16 (N, K), the bits of the bfloat16 weight (an integer dtype, so
    that `model.to(dtype)` never casts it: activations follow the model's dtype, the weight
    stays bfloat16), and bias (N,) or None."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)
        self.register_buffer(
            "weight_bits", torch.zeros(out_features, in_features, dtype=torch.int16)
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Bf16Linear:
        new = cls(linear.in_features, linear.out_features, linear.bias is not None)
        new.weight_bits.copy_(linear.weight.detach().to(torch.bfloat16).view(torch.int16))
        if linear.bias is not None:
            new.bias.copy_(linear.bias.detach())
        return new

    @property
    def weight(self) -> Tensor:
        """Ŵ (N, K) bfloat16, a view of weight_bits."""
        return self.weight_bits.view(torch.bfloat16)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return self.weight.to(dtype)  # exact: every bfloat16 is a float32

    def matmul(self, x: Tensor) -> Tensor:
        if gemv.handles(x, self.weight):
            return gemv.linear(x, self.weight)  # (..., N)
        if block_linear.handles(x, self.weight_bits):
            bits = self.weight_bits.view(torch.uint8).view(self.out_features, -1)  # BF16 "blocks"
            return block_linear.linear(x, bits, "BF16")  # (..., N)
        return super().matmul(x)


class Int4Linear(QuantizedLinear):
    """Buffers: weight_q uint8 (N, K/2), byte j of a row holding q_2j (low nibble) and q_2j+1
    (high nibble); scale and offset (N, K/group_size); bias (N,) or None."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, group_size: int = 64
    ) -> None:
        super().__init__(in_features, out_features, bias)
        self.group_size = group_size
        groups = in_features // group_size
        self.register_buffer(
            "weight_q", torch.zeros(out_features, in_features // 2, dtype=torch.uint8)
        )
        self.register_buffer("scale", torch.ones(out_features, groups))
        self.register_buffer("offset", torch.zeros(out_features, groups))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> Int4Linear:
        n, k = linear.out_features, linear.in_features
        new = cls(k, n, linear.bias is not None, group_size)
        w = linear.weight.detach().float().view(n, k // group_size, group_size)  # (N, K/G, G)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # (N, K/G)
        scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(lo))  # s = (max − min) / 15
        q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
        q = q.view(n, k)  # q = round((W − m) / s): (N, K)
        new.weight_q.copy_(q[:, 0::2] | (q[:, 1::2] << 4))  # two values per byte
        new.scale.copy_(scale)
        new.offset.copy_(lo)
        if linear.bias is not None:
            new.bias.copy_(linear.bias.detach())
        return new

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        n, k, g = self.out_features, self.in_features, self.group_size
        q = torch.stack((self.weight_q & 15, self.weight_q >> 4), dim=-1)  # (N, K/2, 2)
        q = q.view(n, k // g, g).to(dtype)  # (N, K/G, G)
        w = q * self.scale.to(dtype)[..., None] + self.offset.to(dtype)[..., None]  # Ŵ = s q + m
        return w.view(n, k)

    def matmul(self, x: Tensor) -> Tensor:
        if block_linear.handles(x, self.weight_q):
            q, s, m, g = self.weight_q, self.scale, self.offset, self.group_size
            return block_linear.int4_linear(x, q, s, m, g)  # (..., N)
        return super().matmul(x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"
