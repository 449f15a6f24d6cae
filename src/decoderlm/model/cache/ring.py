"""A ring-buffer KV cache for sliding-window attention: the "rolling buffer cache" of Mistral 7B
(Jiang et al., 2023).

A layer with window W only ever attends its last W keys, so it keeps W slots: the token at cache
position p lives in slot p mod W, and the cache holds O(W) at any generated length. Positions are
explicit (RoPE is applied before the cache), so slot order does not matter to attention, only
which slots hold a key a query may see: the cache hands attention that key mask itself (its
`key_padding_mask`, which replaces the caller's), built from `CacheStep.valid`. Layers without a
window (Qwen2's full-attention layers) keep a `StaticLayerCache` of `max_len` slots.

One new token (decoding) is written in place and attends the whole ring, a fixed shape for
`torch.compile`. Several new tokens (a prefill, a chunk) attend the older keys still inside some
query's window, oldest first, followed by their own, so the causal window of attention (bottom-right
aligned) applies unchanged; only the last W of them are then kept.

A rollback of n tokens forgets their slots; it is refused once a forgotten token has overwritten
a key that the next token still sees (possible for n ≥ 2 once the ring is full).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from decoderlm.errors import DecoderLMError
from decoderlm.model.cache.protocol import BaseLayerCache, LayerCaches
from decoderlm.model.cache.static import StaticLayerCache
from decoderlm.model.cache.step import CacheStep, check_rollback
from decoderlm.model.cache.storage import Int8Buffer, layer_kv_buffers
from decoderlm.model.config import ModelConfig


@dataclass
class RingPlan:
    """What the ring layers do in the next forward pass (the same for every ring layer)."""

    write: Tensor  # (m,) ring slots of the newest m = min(T, W) tokens, which the ring keeps
    read: Tensor | None  # (n_old,) slots of the older keys to attend, oldest first; None: the ring
    key_padding_mask: Tensor  # (B, Tk) bool over the keys that `update` returns
    valid: Tensor  # (B, W) bool: True where a ring slot holds a real token (every ring layer's)


class RingLayerCache(BaseLayerCache):
    """One windowed layer's ring, k and v (B, Hkv, W, hd): `update(k, v)` stores this step's K/V
    and returns the keys to attend."""

    def __init__(self, k: Tensor | Int8Buffer, v: Tensor | Int8Buffer, plan: RingPlan) -> None:
        super().__init__(k, v)
        self.plan = plan
        self.end: int | None = 0  # the tokens written: cache positions [0, end)

    @property
    def key_padding_mask(self) -> Tensor:
        """(B, Tk) bool over the keys of the last `update`: True where a token is stored."""
        return self.plan.key_padding_mask

    def seek(self, step: CacheStep) -> None:
        self.end = step.end

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v (B, Hkv, T, hd) → keys/values (B, Hkv, W, hd) for T = 1, else
        (B, Hkv, n_old + T, hd)."""
        plan, m = self.plan, self.plan.write.shape[0]
        if plan.read is None:  # one token: written in place, then the whole ring
            self.k.index_copy_(2, plan.write, k)
            self.v.index_copy_(2, plan.write, v)
            return self.k[:], self.v[:]  # a tensor's view of itself; an Int8Buffer dequantized
        k_all = torch.cat([self.k.index_select(2, plan.read), k], dim=2)  # (B, Hkv, n_old + T, hd)
        v_all = torch.cat([self.v.index_select(2, plan.read), v], dim=2)
        self.k.index_copy_(2, plan.write, k[:, :, -m:])  # after the read: the slots may overlap
        self.v.index_copy_(2, plan.write, v[:, :, -m:])
        return k_all, v_all

    def rollback(self, n: int) -> None:
        """Forget the last n tokens: their slots no longer count as real (the same slots in every
        ring layer, so each layer marking them is harmless). DecoderLMError if one of them
        overwrote a key still inside the window of the token after the kept ones."""
        check_ring_rollback(n, self.end, self.k.shape[2])
        first, end, w = self.end - n, self.end, self.k.shape[2]
        forgotten = torch.arange(max(first, end - w), end, device=self.plan.valid.device) % w
        self.plan.valid[:, forgotten] = False
        self.end = first


def check_ring_rollback(n: int, end: int | None, w: int) -> None:
    """DecoderLMError unless a ring of w slots holding positions [0, end) can forget the last n:
    no position q in [end − n + 1, end) with q ≥ w overwrote position q − w > end − n − w, which
    the token at end − n still sees."""
    check_rollback(n, end, "RingKVCache")
    first = end - n
    if max(first + 1, w) < min(end, first + w):
        raise DecoderLMError(
            f"RingKVCache cannot roll back {n} tokens from {end}: its {w} slots no longer hold "
            f"the keys before position {first} that they overwrote; roll back at most 1 token "
            "once the ring is full"
        )


class RingKVCache(LayerCaches):
    """A ring of W = `config.layer_window(i)` slots for each windowed layer, a `StaticLayerCache`
    of `max_len` slots for each other layer (`max_len` is unused when every layer has a window).

    Before each forward call `seek(step)`, as `StaticKVCache.seek`: the new tokens are at cache
    positions `step.slots` (T,), consecutive; the full layers attend slots [0, step.end) (None: the
    whole buffer). `step.valid` (B, T) marks the new tokens that are real (False: left padding);
    None: all are. The ring layers need no more: the positions go on past `max_len` and
    `context_length` with nothing re-filled. kv_cache_dtype "int8": every buffer is an `Int8Buffer`.
    """

    layers: list[RingLayerCache | StaticLayerCache]

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_cache_dtype: str | None = None,
    ) -> None:
        windows = [config.layer_window(i) for i in range(config.n_layers)]
        if config.sliding_window is None:
            raise DecoderLMError("RingKVCache needs a model with a sliding_window, got None")
        if max_len is None and None in windows:
            raise DecoderLMError(
                "RingKVCache needs max_len for the layers without a sliding window "
                f"(sliding_window_layers={config.sliding_window_layers})"
            )
        self.window = config.sliding_window  # W: slots of every ring

        def buffers(length: int) -> tuple[Tensor | Int8Buffer, Tensor | Int8Buffer]:
            return layer_kv_buffers(config, batch_size, length, dtype, device, kv_cache_dtype)

        valid = torch.zeros(batch_size, self.window, dtype=torch.bool, device=device)  # (B, W)
        self.plan = RingPlan(torch.zeros(1, dtype=torch.long, device=device), None, valid, valid)
        super().__init__(
            [
                StaticLayerCache(*buffers(max_len))
                if w is None
                else RingLayerCache(*buffers(w), self.plan)
                for w in windows
            ]
        )

    def seek(self, step: CacheStep) -> None:
        """Plan the next forward pass: new tokens at cache positions `step.slots` (T,), real where
        `step.valid` (B, T) (None: all); the full layers attend slots [0, step.end)."""
        for layer in self.layers:
            layer.seek(step)
        slots, plan, w = step.slots, self.plan, self.window
        t = slots.shape[0]
        new_valid = step.valid
        if new_valid is None:
            new_valid = torch.ones(plan.valid.shape[0], t, dtype=torch.bool, device=slots.device)
        new_valid = new_valid.bool()  # (B, T)
        if t == 1:  # decoding: write in place, attend the whole ring
            plan.write, plan.read = slots % w, None
            plan.valid.index_copy_(1, plan.write, new_valid)
            plan.key_padding_mask = plan.valid
            return
        first = int(slots[0])
        n_old = min(first, w - 1)  # keys older than the first new token that it still sees
        plan.read = torch.arange(first - n_old, first, device=slots.device) % w  # oldest first
        plan.write = slots[-min(t, w) :] % w
        plan.key_padding_mask = torch.cat([plan.valid[:, plan.read], new_valid], dim=1)
        plan.valid.index_copy_(1, plan.write, new_valid[:, -min(t, w) :])

    def rollback(self, n: int) -> int:
        """Forget the last n tokens in every layer, or in none: the rings' check comes first."""
        check_ring_rollback(n, self.layers[0].end, self.window)  # every layer's end is the step's
        return super().rollback(n)
