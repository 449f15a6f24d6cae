"""GGUF tensor names ↔ ours: one table of rules, read in both directions (loading and writing).

GGUF names are llama.cpp's (`gguf.TENSOR_NAMES`: `token_embd`, `blk.N.attn_q`, …, with `.weight`
or `.bias`), their dims stored fastest-moving first (a weight (out, in) is written [in, out]).
Our attention has one fused projection, rows [q | k | v]; llama, qwen2 and qwen3 files store
`attn_q`, `attn_k` and `attn_v` apart (a "split" rule), gpt2 one `attn_qkv` in our layout.
llama.cpp's converter permutes the rows of each head of llama's `attn_q` and `attn_k` (weights
and biases) from rotate-half order (x_i paired with x_{i+d/2}, as HF and decoderlm rotate) to
interleaved order (x_{2i} with x_{2i+1}, as its rope kernel reads them):
`LlamaModel.permute`, `reshape(heads, 2, d/2).swapaxes(1, 2)`. `llama_rows` is that permutation,
undone on reading; whole rows move, so it applies to quantized blocks as to floats. Qwen2 and
Qwen3 run NeoX-style RoPE in llama.cpp: no permutation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import MODEL_TENSOR, TENSOR_NAMES
from torch import Tensor

from decoderlm.model.config import ModelConfig


@dataclass(frozen=True)
class Rule:
    """Our tensor `ours` ↔ GGUF tensors `theirs`: "copy", or "split" (our fused qkv rows are the
    concatenation of theirs, q, k, v); `permuted` says llama's q and k rows are permuted."""

    ours: str
    theirs: tuple[str, ...]
    kind: str = "copy"
    permuted: bool = False


def _name(tensor: MODEL_TENSOR, layer: int | None = None) -> str:
    return TENSOR_NAMES[tensor].format(bid=layer)


def rules(config: ModelConfig, arch: str) -> list[Rule]:
    """The rules of `arch` ("llama", "qwen2", "qwen3" or "gpt2") for our config."""
    c, gpt2 = config, arch == "gpt2"
    out = [Rule("tok_emb.weight", (f"{_name(MODEL_TENSOR.TOKEN_EMBD)}.weight",))]
    if gpt2:
        out.append(Rule("pos_emb.weight", (f"{_name(MODEL_TENSOR.POS_EMBD)}.weight",)))
    for i in range(c.n_layers):
        parts: list[tuple[str, MODEL_TENSOR, bool]] = [  # (ours, theirs, has a bias)
            ("norm1", MODEL_TENSOR.ATTN_NORM, gpt2),
            ("attn.proj", MODEL_TENSOR.ATTN_OUT, c.bias),
            ("norm2", MODEL_TENSOR.FFN_NORM, gpt2),
            ("mlp.up", MODEL_TENSOR.FFN_UP, c.bias),
            ("mlp.down", MODEL_TENSOR.FFN_DOWN, c.bias),
        ]
        if gpt2:
            parts.append(("attn.qkv", MODEL_TENSOR.ATTN_QKV, c.qkv_bias))
        else:
            parts.append(("mlp.gate", MODEL_TENSOR.FFN_GATE, c.bias))
            out += _split_qkv(f"blocks.{i}.attn.qkv", i, c.qkv_bias, permuted=arch == "llama")
        if c.qk_norm:
            parts += [
                ("attn.q_norm", MODEL_TENSOR.ATTN_Q_NORM, False),
                ("attn.k_norm", MODEL_TENSOR.ATTN_K_NORM, False),
            ]
        for ours, theirs, bias in parts:
            suffixes = ("weight", "bias") if bias else ("weight",)
            out += [Rule(f"blocks.{i}.{ours}.{s}", (f"{_name(theirs, i)}.{s}",)) for s in suffixes]
    norm = f"{_name(MODEL_TENSOR.OUTPUT_NORM)}"
    out += [
        Rule(f"norm.{s}", (f"{norm}.{s}",)) for s in (("weight", "bias") if gpt2 else ("weight",))
    ]
    if not c.tie_embeddings:
        out.append(Rule("head.weight", (f"{_name(MODEL_TENSOR.OUTPUT)}.weight",)))
    return out


def _split_qkv(ours: str, layer: int, bias: bool, permuted: bool) -> list[Rule]:
    parts = (MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K, MODEL_TENSOR.ATTN_V)
    return [
        Rule(
            f"{ours}.{s}",
            tuple(f"{_name(p, layer)}.{s}" for p in parts),
            "split",
            permuted,
        )
        for s in (("weight", "bias") if bias else ("weight",))
    ]


def qkv_rows(config: ModelConfig) -> tuple[int, int, int]:
    """The rows of q, k and v in our fused projection."""
    kv = config.n_kv_heads * config.head_dim
    return config.n_heads * config.head_dim, kv, kv


def llama_rows(heads: int, head_dim: int) -> Tensor:
    """The row order llama.cpp writes a llama q or k projection in: GGUF row r is HF row
    llama_rows(...)[r]; within a head, rows (0, d/2, 1, d/2 + 1, …)."""
    return torch.arange(heads * head_dim).view(heads, 2, head_dim // 2).transpose(1, 2).flatten()


def part_heads(config: ModelConfig) -> tuple[int, int, int]:
    """The heads of q, k and v (the permutation works head by head)."""
    return config.n_heads, config.n_kv_heads, config.n_kv_heads
