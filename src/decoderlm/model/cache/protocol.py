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
    - `checkpoint()`: mark the state before the next tokens written, the furthest back a
      `rollback` may go where the state cannot forget tokens one by one (a recurrent state keeps
      a copy of itself); nothing for K/V storage, which forgets by count.
    - `forgets(n)`: the tokens `rollback` forgets when the caller drops the last n: n for K/V
      storage; for a recurrent state, with n > 0, every token written since its checkpoint.
    - `rollback(n)`: forget the last n tokens written, as if they had never been (speculative
      decoding drops its rejected draft tokens so); DecoderLMError where the state cannot.

    Where the new tokens go is not an argument: the model's cache is told once per step, before
    the forward pass, by `seek(step)` with a `CacheStep`, and each layer keeps what it needs of it.

    A fixed-size recurrent state (linear attention, Gated DeltaNet, Mamba-2: per layer a conv
    state (B, C, K − 1) and a matrix state (B, H, d_k, d_v)) fits the same contract without
    growing with the tokens (`decoderlm.model.cache.recurrent.RecurrentLayerCache`): its mixer
    reads the states in place of `update`, folds the new tokens in (S ← f(S, x)) and writes the
    new states back; the same `CacheStep` says which new tokens are real (`valid`: padding leaves
    S unchanged); having no keys, its `key_padding_mask` stays None; and `rollback(n)` goes back to
    its checkpoint (the states of the last n tokens are not kept, S_{t−n} is not f⁻¹ of S_t): it
    forgets `forgets(n)` ≥ n tokens, and the caller writes the kept ones again.
    """

    @property
    def key_padding_mask(self) -> Tensor | None: ...

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...

    def attend_in_place(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor | None: ...

    def checkpoint(self) -> None: ...

    def forgets(self, n: int) -> int: ...

    def rollback(self, n: int) -> None: ...


class BaseLayerCache:
    """A layer's K and V storage and the defaults of `LayerCache`: keys in slot order (no mask of
    its own), no in-place attention, no rollback (nor checkpoint: a rollback forgets by count).
    A layer cache subclasses it, writing `update`
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

    def checkpoint(self) -> None:
        pass

    def forgets(self, n: int) -> int:
        return n

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

    def checkpoint(self) -> None:
        """Mark every layer's state before the next tokens written (`LayerCache.checkpoint`)."""
        for layer in self.layers:
            layer.checkpoint()

    def rollback(self, n: int) -> int:
        """Forget the last n tokens written, and return m ≥ n, the tokens forgotten: every layer
        forgets the same m, the most any layer must (`LayerCache.forgets`: with a recurrent layer
        and n > 0, every token since the checkpoint). The caller writes the m − n kept ones again,
        at the same positions: the attention layers store the same keys and values, the recurrent
        ones fold the same tokens into their checkpointed state (S ← f(S, x)), exactly."""
        m = max((layer.forgets(n) for layer in self.layers), default=n)
        for layer in self.layers:
            layer.rollback(m)
        return m

    @property
    def nbytes(self) -> int:
        """Bytes held by all layers' storage."""
        return sum(layer.nbytes for layer in self.layers)
