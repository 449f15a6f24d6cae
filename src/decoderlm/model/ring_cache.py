"""A ring-buffer KV cache for sliding-window attention: the "rolling buffer cache" of Mistral 7B
(Jiang et al., 2023).

A layer with window W only ever attends its last W keys, so it keeps W slots: the token at cache
position p lives in slot p mod W, and the cache holds O(W) at any generated length. Positions are
explicit (RoPE is applied before the cache), so slot order does not matter to attention, only
which slots hold a key a query may see: the cache hands attention that key mask itself (its
`key_padding_mask`, which replaces the caller's). Layers without a window (Qwen2's full-attention
layers) keep a `StaticLayerCache` of `max_len` slots, used exactly as in `StaticKVCache`.

With kv_cache_dtype "int8" the rings and the full layers' buffers are `Int8Buffer`s
(`decoderlm.model.int8_cache`): K/V quantized as written, dequantized as attended.

One new token (decoding) is written in place and attends the whole ring, a fixed shape for
`torch.compile`. Several new tokens (a prefill, a chunk) attend the older keys still inside some
query's window, oldest first, followed by their own, so the causal window of attention (bottom-right
aligned) applies unchanged; only the last W of them are then kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from decoderlm.errors import DecoderLMError
from decoderlm.model.config import ModelConfig
from decoderlm.model.int8_cache import Int8Buffer, Int8LayerCache, check_kv_cache_dtype
from decoderlm.model.kv_cache import StaticLayerCache


@dataclass
class RingStep:
    """What the ring layers do in the next forward pass (the same for every layer)."""

    write: Tensor  # (m,) ring slots of the newest m = min(T, W) tokens, which the ring keeps
    read: Tensor | None  # (n_old,) slots of the older keys to attend, oldest first; None: the ring
    key_padding_mask: Tensor  # (B, Tk) bool over the keys that `update` returns


class RingLayerCache:
    """One windowed layer's ring: `update(k, v)` stores this step's K/V, returns the keys to attend."""

    def __init__(self, k: Tensor | Int8Buffer, v: Tensor | Int8Buffer, step: RingStep) -> None:
        self.k, self.v = k, v  # (B, Hkv, W, hd) each
        self.step = step

    @property
    def key_padding_mask(self) -> Tensor:
        """(B, Tk) bool over the keys of the last `update`: True where a token is stored."""
        return self.step.key_padding_mask

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v (B, Hkv, T, hd) → keys/values (B, Hkv, W, hd) for T = 1, else (B, Hkv, n_old + T, hd)."""
        step, m = self.step, self.step.write.shape[0]
        if step.read is None:  # one token: written in place, then the whole ring
            self.k.index_copy_(2, step.write, k)
            self.v.index_copy_(2, step.write, v)
            return self.k[:], self.v[:]  # a tensor's view of itself; an Int8Buffer dequantized
        k_all = torch.cat([self.k.index_select(2, step.read), k], dim=2)  # (B, Hkv, n_old + T, hd)
        v_all = torch.cat([self.v.index_select(2, step.read), v], dim=2)
        self.k.index_copy_(2, step.write, k[:, :, -m:])  # after the read: the slots may overlap
        self.v.index_copy_(2, step.write, v[:, :, -m:])
        return k_all, v_all


class RingKVCache:
    """The caches of all layers, indexed as `kv_caches[i]` by `DecoderLM.forward`: a ring of
    W = `config.layer_window(i)` slots for each windowed layer, a `StaticLayerCache` of `max_len`
    slots for each other layer (`max_len` is unused when every layer has a window).

    Before each forward call `seek(slots, end, valid)`, as `StaticKVCache.seek`: the new tokens
    are at cache positions `slots` (T,), consecutive; the full layers attend slots [0, end) (None:
    the whole buffer). `valid` (B, T) marks the new tokens that are real (False: left padding);
    None: all are. The ring layers need no more: the positions go on past `max_len` and
    `context_length` with nothing re-filled.
    """

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_cache_dtype: str | None = None,
    ) -> None:
        check_kv_cache_dtype(kv_cache_dtype)
        windows = [config.layer_window(i) for i in range(config.n_layers)]
        if config.sliding_window is None:
            raise DecoderLMError("RingKVCache needs a model with a sliding_window, got None")
        if max_len is None and None in windows:
            raise DecoderLMError(
                "RingKVCache needs max_len for the layers without a sliding window "
                f"(sliding_window_layers={config.sliding_window_layers})"
            )
        self.window = config.sliding_window  # W: slots of every ring

        def buffers(length: int) -> list[Tensor | Int8Buffer]:  # K and V, (B, Hkv, length, hd)
            shape = (batch_size, config.n_kv_heads, length, config.head_dim)
            if kv_cache_dtype == "int8":
                return [Int8Buffer(shape, dtype, device) for _ in "kv"]
            return [torch.zeros(shape, dtype=dtype, device=device) for _ in "kv"]

        full_layer = Int8LayerCache if kv_cache_dtype == "int8" else StaticLayerCache

        # (B, W): True where a ring slot holds a real token (the same slots in every ring layer)
        self.valid = torch.zeros(batch_size, self.window, dtype=torch.bool, device=device)
        self.step = RingStep(torch.zeros(1, dtype=torch.long, device=device), None, self.valid)
        self.layers: list[RingLayerCache | StaticLayerCache] = [
            full_layer(*buffers(max_len)) if w is None else RingLayerCache(*buffers(w), self.step)
            for w in windows
        ]

    def __getitem__(self, i: int) -> RingLayerCache | StaticLayerCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def seek(self, slots: Tensor, end: int | None = None, valid: Tensor | None = None) -> None:
        """Plan the next forward pass: new tokens at cache positions `slots` (T,), real where
        `valid` (B, T) (None: all); the full layers attend slots [0, end)."""
        for layer in self.layers:
            if isinstance(layer, StaticLayerCache):
                layer.slots, layer.end = slots, end
        w, t = self.window, slots.shape[0]
        if valid is None:
            valid = torch.ones(self.valid.shape[0], t, dtype=torch.bool, device=self.valid.device)
        new_valid = valid.bool()  # (B, T)
        step = self.step
        if t == 1:  # decoding: write in place, attend the whole ring
            step.write, step.read = slots % w, None
            self.valid.index_copy_(1, step.write, new_valid)
            step.key_padding_mask = self.valid
            return
        first = int(slots[0])
        n_old = min(first, w - 1)  # keys older than the first new token that it still sees
        step.read = torch.arange(first - n_old, first, device=slots.device) % w  # oldest first
        step.write = slots[-min(t, w) :] % w
        step.key_padding_mask = torch.cat([self.valid[:, step.read], new_valid], dim=1)
        self.valid.index_copy_(1, step.write, new_valid[:, -min(t, w) :])

    @property
    def nbytes(self) -> int:
        """Bytes held by all K and V buffers (with int8, their scales too)."""
        return sum(layer.k.nbytes + layer.v.nbytes for layer in self.layers)
