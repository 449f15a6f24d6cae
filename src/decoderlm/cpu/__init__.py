"""CPU speed paths, each applied from a call site outside the model and each switchable off.

`optimize(model)` / `optimized(model)` apply the paths that live inside the model's modules: the
token embedding with an opaque gradient kernel (`embedding.CPUEmbedding`) and the CPU attention
function (`attention.cpu_attend`). They change no parameter, so outputs agree with the plain model
up to the order of floating-point sums. Which paths a call site applies, these and the others
(decode.py's linear kernels and compiled step, paged_attention, packed_linear, heap), is one
`paths.SpeedPaths` per call site.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from decoderlm.cpu.attention import cpu_attend
from decoderlm.cpu.embedding import CPUEmbedding
from decoderlm.model.attention import CausalSelfAttention, attend

__all__ = ["optimize", "optimized"]


def optimize(
    model: nn.Module,
    enabled: bool = True,
    *,
    embedding: bool | None = None,
    attention: bool | None = None,
) -> nn.Module:
    """Apply the CPU paths inside the model to `model` (a DecoderLM, or a module holding one) in
    place; return it.

    embedding (default: `enabled`): each nn.Embedding becomes a `CPUEmbedding` holding the same
    weight Parameter (tied weights stay tied, state_dict names are unchanged); off, the plain
    nn.Embedding again. attention (default: `enabled`): each `CausalSelfAttention` calls
    `cpu_attend`; off, the model's `attend` again. Idempotent. A model compiled before this call
    recompiles on its next call.
    """
    embedding = enabled if embedding is None else embedding
    attention = enabled if attention is None else attention
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if embedding and type(child) is nn.Embedding:
                setattr(parent, name, CPUEmbedding.from_embedding(child))
            elif not embedding and isinstance(child, CPUEmbedding):
                setattr(parent, name, child.to_embedding())
        if isinstance(parent, CausalSelfAttention):
            parent.attend = cpu_attend if attention else attend
    return model


@contextmanager
def optimized(
    model: nn.Module,
    enabled: bool = True,
    *,
    embedding: bool | None = None,
    attention: bool | None = None,
) -> Iterator[nn.Module]:
    """`optimize(model, enabled, embedding=..., attention=...)` for the duration of a `with`
    block; on exit, the embedding modules and attention functions that `model` had on entry are put
    back."""
    embeddings = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Embedding)
    ]
    attends = [(m, m.attend) for m in model.modules() if isinstance(m, CausalSelfAttention)]
    optimize(model, enabled, embedding=embedding, attention=attention)
    try:
        yield model
    finally:
        for parent, name, child in embeddings:
            setattr(parent, name, child)
        for module, fn in attends:
            module.attend = fn
