"""Weights in ggml's block formats (llama.cpp's GGUF files), kept as the file stores them.

A row of K weights is K/32 blocks of 32; a block holds its weights in a few bits each, a scale d
(float16) and, for the `_1` types, a minimum m (float16) (ggml's `ggml-common.h`, `block_q8_0`…):

    Q8_0  34 bytes: d, 32 int8 q                                    w_j = d · q_j
    Q4_0  18 bytes: d, 16 bytes: q_j in the low nibble of byte j,   w_j = d · (q_j − 8)
                    q_j+16 in its high nibble
    Q4_1  20 bytes: d, m, 16 bytes of nibbles as Q4_0               w_j = d · q_j + m
    Q5_0  22 bytes: d, qh (4 bytes: bit j of the little-endian      w_j = d · (q_j − 16)
                    uint32 is q_j's fifth bit), 16 bytes of nibbles
    Q5_1  24 bytes: d, m, qh, 16 bytes of nibbles                   w_j = d · q_j + m
    F16, BF16: one weight per "block" of 2 bytes                    w_j as stored

`BlockLinear` and `BlockEmbedding` hold such rows in a uint8 buffer `blocks` (rows, K/B · bytes of a
block of B), which may be a view of the memory-mapped file: nothing is inflated to floats but the
rows a step reads. `dequantize_rows` is the one decoder; its float32 values are bit-equal to
gguf-py's `gguf.quants.dequantize` (the products and sums are the same float32 operations in the
same order). The integer buffers never change under `model.to(dtype)`, so a model exported again
writes the same bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from decoderlm.cpu import bf16_linear, block_linear, features
from decoderlm.quant.linear import QuantizedLinear

# type name → (weights per block, bytes per block), as gguf.GGML_QUANT_SIZES.
BLOCK_TYPES = {
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
}
_BITS = torch.arange(8, dtype=torch.uint8)
CHUNK_WEIGHTS = 2**22  # weights a product dequantizes at a time: 16 MiB of float32


def row_bytes(ggml_type: str, k: int) -> int:
    """Bytes of a row of `k` weights of `ggml_type` (k a multiple of the block size)."""
    size, nbytes = BLOCK_TYPES[ggml_type]
    return k // size * nbytes


def dequantize_rows(blocks: Tensor, ggml_type: str, k: int) -> Tensor:
    """Rows of blocks (N, row_bytes) uint8 → the weights (N, k) float32."""
    n = blocks.shape[0]
    if ggml_type in ("F16", "BF16"):
        dtype = torch.float16 if ggml_type == "F16" else torch.bfloat16
        return blocks.contiguous().view(dtype).float().view(n, k)
    size, nbytes = BLOCK_TYPES[ggml_type]
    b = blocks.reshape(n, k // size, nbytes)  # (N, K/32, bytes)
    d = _half(b, 0)  # (N, K/32, 1)
    if ggml_type == "Q8_0":
        return (b[..., 2:].view(torch.int8).float() * d).view(n, k)  # w = d·q
    offset = 4 if ggml_type in ("Q4_1", "Q5_1") else 2  # d, and m for the _1 types
    q = _nibbles(b[..., -16:])  # (N, K/32, 32) uint8 in [0, 15]
    if ggml_type in ("Q5_0", "Q5_1"):
        q = q | (_fifth_bits(b[..., offset : offset + 4]) << 4)  # q ∈ [0, 31]
    if ggml_type in ("Q4_1", "Q5_1"):
        return (d * q.float() + _half(b, 2)).view(n, k)  # w = d·q + m
    zero = 8 if ggml_type == "Q4_0" else 16
    return (d * (q.to(torch.int8) - zero).float()).view(n, k)  # w = d·(q − 8) or d·(q − 16)


def dequantize(blocks: Tensor, ggml_type: str, k: int, dtype: torch.dtype) -> Tensor:
    """All rows (N, k) in `dtype`, decoded CHUNK_WEIGHTS at a time (the float32 temporaries of a
    vocabulary-sized table stay small)."""
    rows = max(1, CHUNK_WEIGHTS // k)
    out = torch.empty(blocks.shape[0], k, dtype=dtype, device=blocks.device)
    for i in range(0, blocks.shape[0], rows):
        out[i : i + rows] = dequantized_chunk(blocks, ggml_type, k, i, rows, dtype)
    return out


def dequantized_chunk(
    blocks: Tensor, ggml_type: str, k: int, start: int, rows: int, dtype: torch.dtype
) -> Tensor:
    """Rows start .. start + rows − 1 (fewer at the end) of the weights (rows, k) in `dtype`: by
    the C kernels of `decoderlm.cpu.block_linear` on the CPU where they are built (float32 or
    bfloat16), else by `dequantize_rows`."""
    rows = min(rows, blocks.shape[0] - start)
    cpu = blocks.device.type == "cpu"
    if cpu and dtype in (torch.float32, torch.bfloat16) and block_linear.available():
        return block_linear.dequantize(blocks, ggml_type, k, start, rows, dtype)
    return dequantize_rows(blocks[start : start + rows], ggml_type, k).to(dtype)


def _half(b: Tensor, at: int) -> Tensor:
    """The float16 at byte `at` (even) of each block (N, nb, bytes) → (N, nb, 1) float32."""
    return b.view(torch.float16)[..., at // 2 : at // 2 + 1].float()


def _nibbles(qs: Tensor) -> Tensor:
    """16 bytes per block → 32 values: the low nibbles (values 0..15), then the high ones."""
    return torch.cat((qs & 15, qs >> 4), dim=-1)


def _fifth_bits(qh: Tensor) -> Tensor:
    """4 bytes per block → 32 bits, bit j of the little-endian uint32 first (value j's)."""
    bits = (qh[..., :, None] >> _BITS.to(qh.device)) & 1  # (N, nb, 4, 8)
    return bits.flatten(-2)


def _rows(blocks: Tensor | None, n: int, k: int, ggml_type: str) -> Tensor:
    """`blocks` checked to be n rows of k weights of `ggml_type`, or zeros of that shape."""
    shape = (n, row_bytes(ggml_type, k))
    if blocks is None:
        return torch.zeros(shape, dtype=torch.uint8)
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != shape:
        got = f"{blocks.dtype} {tuple(blocks.shape)}"
        raise ValueError(f"{ggml_type} blocks of {n}×{k} weights are uint8 {shape}, not {got}")
    return blocks


class BlockLinear(QuantizedLinear):
    """y = x·Ŵᵀ + b with Ŵ in `blocks` (out_features, row_bytes) uint8 of `ggml_type`; bias float."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ggml_type: str,
        bias: bool = False,
        blocks: Tensor | None = None,
    ) -> None:
        """`blocks`: the rows to hold (a view of a mapped file is kept as it is); None: zeros."""
        super().__init__(in_features, out_features, bias)
        self.ggml_type = ggml_type
        self.register_buffer("blocks", _rows(blocks, out_features, in_features, ggml_type))

    @classmethod
    def tied_to(cls, embedding: BlockEmbedding) -> BlockLinear:
        """The LM head that reads the embedding's own blocks (a tied head: one copy)."""
        n, d = embedding.num_embeddings, embedding.embedding_dim
        return cls(d, n, embedding.ggml_type, blocks=embedding.blocks)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize(self.blocks, self.ggml_type, self.in_features, dtype)

    def op_available(self) -> bool:
        """Whether `matmul` traces into a compiled pass as the op decoderlm::block_linear, which
        takes any number of rows (`decoderlm.cpu.paths.AppliedPaths.kernel_products`)."""
        return block_linear.available()

    def matmul(self, x: Tensor) -> Tensor:
        """x·Ŵᵀ (..., in_features) → (..., out_features): a few rows by the block kernels of
        `decoderlm.cpu.block_linear`, more on its integer or dequantized panels where those are
        the faster (`block_linear.on_panels`); else CHUNK_WEIGHTS of Ŵ at a time (a vocabulary-sized head
        would otherwise be made whole, in floats, at every step): float32 x by
        `bf16_linear.float32_linear` (exact, or bfloat16 products at torch's float32 matmul
        precision "medium"), others by F.linear on Ŵ dequantized to x's dtype. Many bfloat16 rows
        on a CPU without bfloat16 instructions go the float32 way, rounded once at the end (as
        llama.cpp computes there; PyTorch's bfloat16 GEMM runs a fraction of float32's speed)."""
        runs = block_linear.runs(x, self.blocks)
        if (
            runs
            and x.dtype == torch.bfloat16
            and block_linear.many_rows(x)  # (before the CPU is asked: not at every decode step)
            and features.bf16_emulated()
        ):
            return self.matmul(x.float()).to(torch.bfloat16)
        if runs and (not block_linear.many_rows(x) or block_linear.on_panels(x, self.ggml_type)):
            # a few rows, a decode step's, or a number left symbolic (the op picks then)
            return block_linear.linear(x, self.blocks, self.ggml_type)
        rows = max(1, CHUNK_WEIGHTS // self.in_features)
        starts = range(0, self.out_features, rows)
        if runs and x.dtype == torch.float32:
            chunks = [bf16_linear.float32_linear(x, self._chunk(i, rows)) for i in starts]
        else:
            chunks = [F.linear(x, self._chunk(i, rows, x.dtype)) for i in starts]  # (..., rows)
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=-1)

    def _chunk(self, start: int, rows: int, dtype: torch.dtype | None = None) -> Tensor:
        """Rows start .. start + rows − 1 of Ŵ in `dtype`; None: BF16's rows as stored (a view),
        others dequantized to float32."""
        if dtype is None and self.ggml_type == "BF16":
            return self.blocks[start : start + rows].view(torch.bfloat16)
        kind, k = self.ggml_type, self.in_features
        return dequantized_chunk(self.blocks, kind, k, start, rows, dtype or torch.float32)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, ggml_type={self.ggml_type}"

    def batch_invariant(self) -> InvariantBlockLinear:
        """This layer with each row's outputs the same bits whatever the rows beside it
        (`decoderlm.cpu.invariant` swaps it in for a batch-invariant engine); ValueError where the
        block kernels are not built here."""
        if not block_linear.available():
            raise ValueError("BlockLinear: no block kernels built here, no batch-invariant form")
        return InvariantBlockLinear(self)


class InvariantBlockLinear(nn.Module):
    """A BlockLinear's y = x·Ŵᵀ + b with every product on the op decoderlm::block_linear in one
    arithmetic at every number of rows (`block_linear.linear(..., invariant=True)`: on AVX-512
    VNNI and AVX2 a quantized type's integer tiles and the strips that compute as they do,
    elsewhere the block kernel), never on a GEMM; inference only, as the kernels."""

    def __init__(self, linear: BlockLinear) -> None:
        super().__init__()
        self.linear = linear

    def op_available(self) -> bool:
        return self.linear.op_available()

    def forward(self, x: Tensor) -> Tensor:  # (..., in_features) → (..., out_features)
        m = self.linear
        y = block_linear.linear(x, m.blocks, m.ggml_type, invariant=True)
        return y if m.bias is None else y + m.bias


class BlockEmbedding(nn.Module):
    """A token embedding whose table (num_embeddings, row_bytes) uint8 stays in `ggml_type`'s
    blocks: a lookup dequantizes the rows it reads, in the dtype of the model's floats."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        ggml_type: str,
        blocks: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.ggml_type = ggml_type
        self.register_buffer("blocks", _rows(blocks, num_embeddings, embedding_dim, ggml_type))
        # Empty; `model.to(dtype)` casts it with the model's other floats, so its dtype is the one
        # the lookup returns.
        self.register_buffer("float_dtype", torch.zeros(0), persistent=False)

    def forward(self, idx: Tensor) -> Tensor:
        """idx (...) token ids → (..., embedding_dim)."""
        rows = dequantize_rows(self.blocks[idx.reshape(-1)], self.ggml_type, self.embedding_dim)
        return rows.to(self.float_dtype.dtype).view(*idx.shape, self.embedding_dim)

    @property
    def weight(self) -> Tensor:
        """The whole table dequantized (num_embeddings, embedding_dim), made anew on each access:
        for callers that read `tok_emb.weight`'s device and dtype."""
        return dequantize(self.blocks, self.ggml_type, self.embedding_dim, self.float_dtype.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, ggml_type={self.ggml_type}"
