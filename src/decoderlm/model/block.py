"""The Transformer decoder block: Pre-LN (Xiong et al., 2020; GPT-2) or Post-LN (Vaswani et al., 2017).

Its token mixer is `config.layer_type(layer)`: softmax attention (`attn`), or a recurrent layer
(`mixer`: linear attention, Gated DeltaNet or Mamba-2), called alike.
"""

from __future__ import annotations

from torch import Tensor, nn

from decoderlm.model.attention import CausalSelfAttention
from decoderlm.model.cache.protocol import LayerCache
from decoderlm.model.config import ModelConfig
from decoderlm.model.gated_deltanet import GatedDeltaNet
from decoderlm.model.layers import MLP, make_norm
from decoderlm.model.linear_attention import LinearAttention
from decoderlm.model.mamba2 import Mamba2
from decoderlm.model.recurrent import RecurrentMixer

# The recurrent mixer of each recurrent layer type (config.LAYER_TYPES besides "attention").
RECURRENT_MIXERS: dict[str, type[RecurrentMixer]] = {
    "linear_attention": LinearAttention,
    "gdn": GatedDeltaNet,
    "mamba2": Mamba2,
}


class Block(nn.Module):
    """Pre-LN: x + Attn(LN(x)), then x + MLP(LN(x)).  Post-LN: LN(x + Attn(x)), then LN(x + MLP(x)).

    With mlp="none" the block is its first half alone (Mamba-2's block: x + Mixer(LN(x)))."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.pre_norm = config.norm_placement == "pre"
        self.norm1 = make_norm(config)
        self.kind = config.layer_type(layer)
        if self.kind == "attention":
            self.attn = CausalSelfAttention(config, layer)  # layer: which sliding window applies
        else:
            self.mixer = RECURRENT_MIXERS[self.kind](config)
        has_mlp = config.mlp != "none"
        self.norm2 = make_norm(config) if has_mlp else None
        self.mlp = MLP(config) if has_mlp else None

    @property
    def mix(self) -> nn.Module:
        """The token mixer: `attn` or `mixer` (one name per kind, so weight names say which)."""
        return self.attn if self.kind == "attention" else self.mixer

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None = None,
        key_padding_mask: Tensor | None = None,
        kv_cache: LayerCache | None = None,
        causal: bool = True,
    ) -> Tensor:  # (B, T, d_model) → (B, T, d_model)
        if self.pre_norm:
            x = x + self.mix(self.norm1(x), rope, key_padding_mask, kv_cache, causal)
            return x if self.mlp is None else x + self.mlp(self.norm2(x))
        x = self.norm1(x + self.mix(x, rope, key_padding_mask, kv_cache, causal))
        return x if self.mlp is None else self.norm2(x + self.mlp(x))
