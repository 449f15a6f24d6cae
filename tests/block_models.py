"""`in_blocks`: a model's linear layers as a GGUF file of one ggml type loads them (BlockLinear,
the weights quantized by gguf-py), for the tests of the block products in a model."""

from __future__ import annotations

import gguf
import numpy as np
import torch
from torch import nn

from decoderlm.quant.blocks import BlockLinear


def in_blocks(model: nn.Module, kind: str) -> nn.Module:
    """`model` with every nn.Linear (its inputs whole blocks of 32) replaced by a BlockLinear of
    `kind` holding gguf-py's blocks of its weight."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                weight = child.weight.detach().float().numpy()
                data = gguf.quants.quantize(weight, gguf.GGMLQuantizationType[kind])
                n, k = child.out_features, child.in_features
                blocks = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)).view(n, -1)
                setattr(parent, name, BlockLinear(k, n, kind, blocks=blocks))
    return model
