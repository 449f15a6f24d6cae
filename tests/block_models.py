"""`in_blocks`: a model's linear layers (and its token embedding) as a GGUF file of one ggml type
loads them (BlockLinear, BlockEmbedding: the weights quantized by gguf-py), for the tests of the
block products in a model."""

from __future__ import annotations

import gguf
import numpy as np
import torch
from torch import nn

from decoderlm.quant.blocks import BlockEmbedding, BlockLinear


def in_blocks(model: nn.Module, kind: str, embedding: str | None = None) -> nn.Module:
    """`model` with every nn.Linear (its inputs whole blocks of 32) replaced by a BlockLinear of
    `kind` holding gguf-py's blocks of its weight; with `embedding`, its token embedding too, a
    BlockEmbedding of that type (SmolLM2's file: Q4_1 linears, a Q8_0 embedding)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                blocks = _blocks(child.weight, kind)
                setattr(parent, name, BlockLinear(child.in_features, child.out_features, kind, blocks=blocks))  # fmt: skip
            elif type(child) is nn.Embedding and embedding is not None:
                blocks = _blocks(child.weight, embedding)
                setattr(parent, name, BlockEmbedding(*child.weight.shape, embedding, blocks=blocks))
    return model


def _blocks(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """gguf-py's blocks of weight (N, K) in ggml type `kind`: (N, row bytes) uint8."""
    data = gguf.quants.quantize(weight.detach().float().numpy(), gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)).view(weight.shape[0], -1)
