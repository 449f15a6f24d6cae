"""The contract between attention and one layer's inference state: `LayerCache`, its defaults
(`BaseLayerCache`) and the container of all layers (`LayerCaches`)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from decoderlm.errors import DecoderLMError
from decoderlm.model.cache.storage import Int8Buffer


@runtime_checkable
class LayerCache(Protocol):
    """Everything `CausalSelfAttention.forward` (and a decoding loop) asks of one layer's state.

    - `attend_in_place(q, k, v, scale)`: store this step's k, v (B, Hkv, T, hd) and return the
      attention output (B, H, T, hd), read from the state where it lies; or None when this step
      is not handled so (nothing stored), and then attention calls `update`.
    - `update(k, v)`: store k, v (B, Hkv, T, hd) and return the keys and values (B, Hkv, Tk, hd)
      to attend, this step's included (the causal mask is aligned bottom-right).
    - `key_padding_mask`: (B, Tk) bool over the keys of the last `update`, True at a real key,
      which replaces the caller's mask; None: the caller's mask applies (keys in slot order).
    - `rollback(n)`: forget the last n tokens written, as if they had never been (speculative
      decoding drops its rejected draft tokens so); DecoderLMError where the state cannot.

    Where the new tokens go is not an argument: the model's cache is told once per step, before
    the forward pass, by `seek(step)` with a `CacheStep`, and each layer keeps what it needs of it.

    A fixed-size recurrent state (linear attention, Gated DeltaNet, Mamba-2: per layer a conv
    state (B, C, K − 1) and a matrix state (B, H, d_k, d_v)) fits the same contract without
    growing with the tokens (`decoderlm.model.cache.recurrent.RecurrentLayerCache`): its mixer
    reads the states in place of `update`, folds the new tokens in (S ← f(S, x)) and writes the
    new states back; the same `CacheStep` says which new tokens are real (`valid`: padding leaves
    S unchanged); having no keys, its `key_padding_mask` stays None; and `rollback(n)` raises (the
    states of the last n tokens are not kept).
    """

    @property
    def key_padding_mask(self) -> Tensor | None: ...

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...

    def attend_in_place(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor | None: ...

    def rollback(self, n: int) -> None: ...


class BaseLayerCache:
    """A layer's K and V storage and the defaults of `LayerCache`: keys in slot order (no mask of
    its own), no in-place attention, no rollback. A layer cache subclasses it, writing `update`
    and whatever it does otherwise."""

    key_padding_mask: Tensor | None = None

    def __init__(self, k: Tensor | Int8Buffer, v: Tensor | Int8Buffer) -> None:
        self.k, self.v = k, v

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V storage (with int8 storage, its scales too)."""
        return self.k.nbytes + self.v.nbytes

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError(f"{type(self).__name__}.update")

    def attend_in_place(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor | None:
        return None

    def rollback(self, n: int) -> None:
        raise DecoderLMError(f"{type(self).__name__} cannot roll back written tokens yet")


class LayerCaches:
    """The states of all layers, indexed as `kv_caches[i]` by `DecoderLM.forward`."""

    def __init__(self, layers: list[BaseLayerCache]) -> None:
        self.layers = layers

    def __getitem__(self, i: int) -> BaseLayerCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def rollback(self, n: int) -> None:
        """Forget the last n tokens written in every layer (`LayerCache.rollback`)."""
        for layer in self.layers:
            layer.rollback(n)

    @property
    def nbytes(self) -> int:
        """Bytes held by all layers' storage."""
        return sum(layer.nbytes for layer in self.layers)
