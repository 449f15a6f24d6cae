"""The Transformer decoder block: Pre-LN (Xiong et al., 2020; GPT-2) or Post-LN (Vaswani et al., 2017)."""

from __future__ import annotations

from torch import Tensor, nn

from decoderlm.model.attention import CausalSelfAttention
from decoderlm.model.cache.protocol import LayerCache
from decoderlm.model.config import ModelConfig
from decoderlm.model.layers import MLP, make_norm


class Block(nn.Module):
    """Pre-LN: x + Attn(LN(x)), then x + MLP(LN(x)).  Post-LN: LN(x + Attn(x)), then LN(x + MLP(x))."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.pre_norm = config.norm_placement == "pre"
        self.norm1 = make_norm(config)
        self.attn = CausalSelfAttention(config, layer)  # layer: which sliding window applies
        self.norm2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None = None,
        key_padding_mask: Tensor | None = None,
        kv_cache: LayerCache | None = None,
        causal: bool = True,
    ) -> Tensor:  # (B, T, d_model) → (B, T, d_model)
        if self.pre_norm:
            x = x + self.attn(self.norm1(x), rope, key_padding_mask, kv_cache, causal)
            return x + self.mlp(self.norm2(x))
        x = self.norm1(x + self.attn(x, rope, key_padding_mask, kv_cache, causal))
        return self.norm2(x + self.mlp(x))
