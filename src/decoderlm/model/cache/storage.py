"""Where a cache keeps its K and V: a tensor in the model's dtype, or int8 (`Int8Buffer`).

int8 is symmetric absmax quantization per token and head, dequantized for attention. Each key or
value vector x (head_dim,) of one token and one K/V head is kept as int8 values and one float32
scale, the vector-wise absmax quantization of LLM.int8() (Dettmers et al., 2022):

    s = max_i |x_i| / 127,   x_q = round(x / s) ∈ [−127, 127],   x̂ = s · x_q,   |x − x̂| ≤ s / 2.

A token then costs head_dim + 4 bytes per layer, head and K or V instead of 2 · head_dim (bfloat16)
or 4 · head_dim (float32); `decoderlm.model.cache.kv_cache_bytes_per_token(config, "int8")`
counts both. K/V are quantized as they are written and the attended slots come back dequantized
in the model's dtype, so attention itself is unchanged: the saving is the memory the cache holds
between steps; each step dequantizes the keys/values it attends (there is no int8 kernel).
Every cache takes its storage from `kv_buffer` (an attention layer's K and V from
`layer_kv_buffers`), so int8 is a storage choice, not a cache type.
"""

from __future__ import annotations

import torch
from torch import Tensor

from decoderlm.errors import DecoderLMError
from decoderlm.model.config import ModelConfig

# The `kv_cache_dtype` values besides None (= the model's own dtype).
KV_CACHE_DTYPES = ("int8",)
KV_SCALE_DTYPE = torch.float32  # int8 storage keeps one scale of this dtype per token and head


def check_kv_cache_dtype(kv_cache_dtype: str | None) -> None:
    """DecoderLMError unless `kv_cache_dtype` is None or one of KV_CACHE_DTYPES."""
    if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
        allowed = ", ".join(repr(d) for d in KV_CACHE_DTYPES)
        raise DecoderLMError(
            f"kv_cache_dtype={kv_cache_dtype!r} must be None (the model's dtype) or {allowed}"
        )


def kv_buffer(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str,
    kv_cache_dtype: str | None = None,
) -> Tensor | Int8Buffer:
    """A zeroed K or V buffer of `shape` (..., hd): a tensor of `dtype` (kv_cache_dtype None) or an
    `Int8Buffer` ("int8") that hands its vectors back in `dtype`."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "int8":
        return Int8Buffer(shape, dtype, device)
    return torch.zeros(shape, dtype=dtype, device=device)


def quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (..., hd) → x_q (..., hd) int8 and s (..., 1) float32: s = max|x| / 127, x_q = round(x / s).

    |x / s| ≤ 127 (up to float32 rounding, far below the 0.5 that would round past 127). An all-zero
    vector gets s = 0 and x_q = 0.
    """
    x = x.to(KV_SCALE_DTYPE)
    s = x.abs().amax(dim=-1, keepdim=True) / 127  # (..., 1)
    x_q = torch.round(x / torch.where(s > 0, s, 1.0))  # (..., hd), integers in [−127, 127]
    return x_q.to(torch.int8), s


def dequantize(x_q: Tensor, s: Tensor, dtype: torch.dtype) -> Tensor:
    """x̂ = s · x_q in float32, rounded once to `dtype`: x_q (..., hd) int8, s (..., 1) → (..., hd)."""
    return (x_q.to(s.dtype) * s).to(dtype)


class Int8Buffer:
    """A K or V buffer stored as int8 vectors (..., hd) and their scales (..., 1).

    It stands in for the tensor a cache writes and reads: `index_copy_` quantizes what it writes,
    indexing returns the dequantized vectors in `dtype` (the model's).
    """

    def __init__(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        self.dtype = dtype
        self.values = torch.zeros(shape, dtype=torch.int8, device=device)  # (..., hd)
        self.scales = torch.zeros((*shape[:-1], 1), dtype=KV_SCALE_DTYPE, device=device)  # (..., 1)

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        """Bytes of the int8 values and of their scales."""
        return self.values.nbytes + self.scales.nbytes

    def index_copy_(self, dim: int, index: Tensor, x: Tensor) -> Int8Buffer:
        """Quantize x and store it at `index` along `dim`, as `Tensor.index_copy_` (dim ≠ −1)."""
        x_q, s = quantize(x)
        self.values.index_copy_(dim, index, x_q)
        self.scales.index_copy_(dim, index, s)
        return self

    def __getitem__(self, key: object) -> Tensor:
        """x̂ = s · x_q of the vectors at `key` (an index of the leading dims), in `dtype`."""
        return dequantize(self.values[key], self.scales[key], self.dtype)

    def index_select(self, dim: int, index: Tensor) -> Tensor:
        """x̂ of the entries at `index` along `dim` (dim ≠ −1), as `Tensor.index_select`, in `dtype`."""
        values, scales = self.values.index_select(dim, index), self.scales.index_select(dim, index)
        return dequantize(values, scales, self.dtype)

    def view(self, *shape: int) -> Int8Buffer:
        """The same storage seen as `shape` (whose last entry is head_dim), as `Tensor.view`."""
        viewed = Int8Buffer.__new__(Int8Buffer)
        viewed.dtype, viewed.values = self.dtype, self.values.view(*shape)
        viewed.scales = self.scales.view(*shape[:-1], 1)
        return viewed


def layer_kv_buffers(
    config: ModelConfig,
    batch_size: int,
    length: int,
    dtype: torch.dtype,
    device: torch.device | str,
    kv_cache_dtype: str | None = None,
) -> tuple[Tensor | Int8Buffer, Tensor | Int8Buffer]:
    """One attention layer's zeroed K and V buffers of `length` slots, (B, Hkv, length, hd) each
    (`kv_buffer`)."""
    shape = (batch_size, config.n_kv_heads, length, config.head_dim)
    k, v = (kv_buffer(shape, dtype, device, kv_cache_dtype) for _ in "kv")
    return k, v
