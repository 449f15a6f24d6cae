"""The attention weights of every layer and head for a token sequence, and their entropy.

What a head "looks at" is its row of softmax(QKᵀ/√d_k + M) (Vaswani et al., 2017), as drawn by
attention-visualisation tools such as BertViz (Vig, 2019). The model runs once, as it is, with each
`CausalSelfAttention.attend` swapped for the explicit formula of
`decoderlm.model.attention.scaled_dot_product_attention` (`attend(..., need_weights=True)`, the
`math` path, whatever backend the model uses) whose (B, H, T, T) weights are recorded; the
original functions are put back after. Only calls from the recording thread are recorded: a
server's engine thread running the same model meanwhile goes on through its own functions.

The mean entropy of a layer, −Σ_j p_ij log p_ij (nats) averaged over heads and query rows, is low
when heads attend sharply (a few keys) and log(i + 1) at most for query i (uniform over its keys).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from decoderlm.errors import DecoderLMError
from decoderlm.inference.generate import evaluating
from decoderlm.model.attention import CausalSelfAttention, attend
from decoderlm.model.lm import DecoderLM

AttendFn = Callable[..., tuple[Tensor, Tensor | None]]

_SWAP = threading.Lock()  # one recording at a time: nested swaps would restore out of order


@dataclass(frozen=True)
class AttentionMaps:
    """weights: (n_layers, B, H, T, T), row i the weights query i gives keys 0..T−1 (rows sum to
    1, zero above the diagonal); entropy: (n_layers,) mean attention entropy per layer, nats."""

    weights: Tensor
    entropy: Tensor


def check_index(name: str, value: int, count: int) -> None:
    """DecoderLMError unless 0 ≤ value < count, e.g. check_index("layer", 5, n_layers)."""
    if not 0 <= value < count:
        raise DecoderLMError(
            f"{name}={value} is out of range: the model has {count} {name}s, numbered 0..{count - 1}"
        )


def attention_entropy(weights: Tensor) -> Tensor:
    """Mean over all but the first dim of −Σ_j p_j log p_j; weights (L, ..., T, T) → (L,), nats.

    entr(p) = −p log p, with entr(0) = 0: the masked (zero) weights add nothing.
    """
    row_entropy = torch.special.entr(weights.double()).sum(-1)  # (L, ..., T)
    return row_entropy.flatten(1).mean(1)  # (L,)


def _recording(previous: AttendFn, records: list[Tensor], owner: int) -> AttendFn:
    """An `attend` that, called from thread `owner`, runs the math path and records its weights."""

    def attend_recording(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if threading.get_ident() != owner:
            return previous(q, k, v, **kwargs)
        out, weights = attend(q, k, v, **{**kwargs, "need_weights": True})  # (B, H, Tq, Tk)
        records.append(weights)
        return out, weights

    return attend_recording


@contextmanager
def recorded_attention(model: DecoderLM) -> Iterator[list[Tensor]]:
    """A list that receives each layer's (B, H, Tq, Tk) weights, in order, while inside."""
    modules = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    records: list[Tensor] = []
    owner = threading.get_ident()
    with _SWAP:
        saved = [m.attend for m in modules]
        for module, previous in zip(modules, saved, strict=True):
            module.attend = _recording(previous, records, owner)
        try:
            yield records
        finally:
            for module, previous in zip(modules, saved, strict=True):
                module.attend = previous


def attention_maps(model: DecoderLM, idx: Tensor | list[int]) -> AttentionMaps:
    """The attention weights of every layer and head for idx (B, T) or one sequence of ids.

    Eval mode (no dropout), no autograd; the model's logits are unchanged by the recording.
    """
    if not isinstance(idx, Tensor):
        idx = torch.tensor([idx], dtype=torch.long)
    idx = idx.to(model.tok_emb.weight.device)
    with evaluating(model), recorded_attention(model) as records:
        model(idx)
    weights = torch.stack(records)  # (n_layers, B, H, T, T)
    return AttentionMaps(weights=weights, entropy=attention_entropy(weights))
