"""What the recurrent mixers share: where their state comes from and goes to.

Without a cache (training, a plain forward) a mixer starts from the zero state and keeps nothing;
`key_padding_mask` (B, T), when given, marks the real tokens. With a `RecurrentLayerCache` it
starts from the cache's conv and matrix state, its `valid` marks the real tokens, and the states
after the step are written back.
"""

from __future__ import annotations

from torch import Tensor, nn

from decoderlm.errors import DecoderLMError
from decoderlm.model.cache.recurrent import RecurrentLayerCache
from decoderlm.model.config import ModelConfig


def split_heads(y: Tensor, d: int, repeat: int = 1) -> Tensor:
    """(B, T, h·d) → (B, h·repeat, T, d): each of the h heads `repeat` times in a row (heads shared
    by a group, as grouped-query attention's K/V heads)."""
    b, t = y.shape[:2]
    return y.reshape(b, t, -1, d).transpose(1, 2).repeat_interleave(repeat, dim=1)


class RecurrentMixer(nn.Module):
    """A token mixer with a fixed-size state; `forward` has attention's signature so that `Block`
    calls either alike (rope is unused: a recurrent layer orders tokens by its recurrence). Its
    output, as attention's, goes through the residual dropout."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None = None,
        key_padding_mask: Tensor | None = None,
        kv_cache: RecurrentLayerCache | None = None,
        causal: bool = True,
    ) -> Tensor:  # (B, T, d_model) → (B, T, d_model)
        if not causal:
            raise DecoderLMError(f"{type(self).__name__} is causal by construction: causal=False")
        if kv_cache is None:
            y, _, _ = self.mix(x, key_padding_mask, None, None)
        else:
            y, kv_cache.conv, kv_cache.state = self.mix(
                x, kv_cache.valid, kv_cache.conv, kv_cache.state
            )
        return self.resid_dropout(y)

    def mix(
        self, x: Tensor, valid: Tensor | None, conv: Tensor | None, state: Tensor | None
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """x (B, T, d_model), valid (B, T) or None, the states before → (y (B, T, d_model), the
        conv state after (or None), the matrix state after)."""
        raise NotImplementedError(type(self).__name__)
