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

Mamba-2 (llama.cpp's `Mamba2Model.modify_tensors`): its mixer's tensors under `ssm_*` names, the
conv weight (C, 1, K) squeezed to (C, K) ("conv"), D as a column (H, 1) ("column"), the gated
norm's gain as (groups, d_inner / groups) ("grouped"), and A stored as A = −exp(A_log), a column
("a_log"; read back as A_log = ln(−A)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import MODEL_TENSOR, TENSOR_NAMES
from torch import Tensor

from decoderlm.model.config import ModelConfig


@dataclass(frozen=True)
class Rule:
    """Our tensor `ours` ↔ GGUF tensors `theirs`: "copy", "split" (our fused qkv rows are the
    concatenation of theirs, q, k, v; `permuted`: llama's q and k rows are permuted), or one of
    Mamba-2's reshapes (see the module docstring)."""

    ours: str
    theirs: tuple[str, ...]
    kind: str = "copy"
    permuted: bool = False


def _name(tensor: MODEL_TENSOR, layer: int | None = None) -> str:
    return TENSOR_NAMES[tensor].format(bid=layer)


def rules(config: ModelConfig, arch: str) -> list[Rule]:
    """The rules of `arch` ("llama", "qwen2", "qwen3", "gpt2" or "mamba2") for our config."""
    c, gpt2 = config, arch == "gpt2"
    if arch == "mamba2":
        return _mamba2_rules(c)
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
    return out + _final(c, ("weight", "bias") if gpt2 else ("weight",))


def _final(c: ModelConfig, norm: tuple[str, ...]) -> list[Rule]:
    """The final norm (`norm` its parameters) and an untied head."""
    out = [Rule(f"norm.{s}", (f"{_name(MODEL_TENSOR.OUTPUT_NORM)}.{s}",)) for s in norm]
    if not c.tie_embeddings:
        out.append(Rule("head.weight", (f"{_name(MODEL_TENSOR.OUTPUT)}.weight",)))
    return out


def _mamba2_rules(c: ModelConfig) -> list[Rule]:
    out = [Rule("tok_emb.weight", (f"{_name(MODEL_TENSOR.TOKEN_EMBD)}.weight",))]
    for i in range(c.n_layers):
        mixer = f"blocks.{i}.mixer"
        out += [
            Rule(f"blocks.{i}.norm1.weight", (f"{_name(MODEL_TENSOR.ATTN_NORM, i)}.weight",)),
            Rule(
                f"{mixer}.conv1d.weight", (f"{_name(MODEL_TENSOR.SSM_CONV1D, i)}.weight",), "conv"
            ),
            Rule(f"{mixer}.conv1d.bias", (f"{_name(MODEL_TENSOR.SSM_CONV1D, i)}.bias",)),
            Rule(f"{mixer}.dt_bias", (f"{_name(MODEL_TENSOR.SSM_DT, i)}.bias",)),
            Rule(f"{mixer}.A_log", (_name(MODEL_TENSOR.SSM_A, i),), "a_log"),
            Rule(f"{mixer}.D", (_name(MODEL_TENSOR.SSM_D, i),), "column"),
            Rule(f"{mixer}.norm.weight", (f"{_name(MODEL_TENSOR.SSM_NORM, i)}.weight",), "grouped"),
        ]
        for ours, theirs in (("in_proj", MODEL_TENSOR.SSM_IN), ("out_proj", MODEL_TENSOR.SSM_OUT)):
            suffixes = ("weight", "bias") if c.bias else ("weight",)
            out += [Rule(f"{mixer}.{ours}.{s}", (f"{_name(theirs, i)}.{s}",)) for s in suffixes]
    return out + _final(c, ("weight",))


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


def to_ours(rule: Rule, parts: list[Tensor], config: ModelConfig) -> Tensor:
    """Our tensor from the GGUF parts (rows of floats or of blocks): the one part as it is, or
    q, k and v joined, llama's q and k rows put back in rotate-half order."""
    if rule.kind in _RESHAPES:
        return _RESHAPES[rule.kind][0](parts[0])
    if rule.kind == "copy":
        return parts[0]
    q, k, v = parts
    if rule.permuted:  # GGUF row r is our row llama_rows[r]
        q_rows, k_rows = _llama_orders(config)
        q, k = q[torch.argsort(q_rows)], k[torch.argsort(k_rows)]
    return torch.cat([q, k, v], dim=0)


def to_theirs(rule: Rule, tensor: Tensor, config: ModelConfig) -> list[Tensor]:
    """The GGUF parts of our tensor: itself, or its q, k and v rows, llama's q and k rows in
    interleaved order."""
    if rule.kind in _RESHAPES:
        return [_RESHAPES[rule.kind][1](tensor, config.recurrent_dims[1])]
    if rule.kind == "copy":
        return [tensor]
    kv = config.n_kv_heads * config.head_dim
    q, k, v = tensor.split([config.n_heads * config.head_dim, kv, kv], dim=0)
    if rule.permuted:
        q_rows, k_rows = _llama_orders(config)
        q, k = q[q_rows], k[k_rows]
    return [q, k, v]


# Mamba-2's kinds: (GGUF tensor → ours, (ours, groups) → GGUF tensor).
_RESHAPES = {
    "conv": (lambda t: t.unsqueeze(1), lambda t, g: t.squeeze(1)),  # (C, K) ↔ (C, 1, K)
    "column": (lambda t: t.flatten(), lambda t, g: t[:, None]),  # (H, 1) ↔ (H,)
    "grouped": (lambda t: t.flatten(), lambda t, g: t.view(g, -1)),  # (G, d/G) ↔ (d,)
    "a_log": (lambda t: (-t).log().flatten(), lambda t, g: -t.exp()[:, None]),  # A = −exp(A_log)
}


def llama_rows(heads: int, head_dim: int) -> Tensor:
    """The row order llama.cpp writes a llama q or k projection in: GGUF row r is HF row
    llama_rows(...)[r]; within a head, rows (0, d/2, 1, d/2 + 1, …)."""
    return torch.arange(heads * head_dim).view(heads, 2, head_dim // 2).transpose(1, 2).flatten()


def _llama_orders(config: ModelConfig) -> tuple[Tensor, Tensor]:
    """llama_rows of q (n_heads heads) and of k (n_kv_heads heads)."""
    return llama_rows(config.n_heads, config.head_dim), llama_rows(
        config.n_kv_heads, config.head_dim
    )
