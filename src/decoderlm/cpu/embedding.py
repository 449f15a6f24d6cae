"""The token embedding on the CPU, with torch's dense gradient kernel kept opaque to torch.compile.

∂L/∂W of the lookup y = W[idx] sums, into row r, the upstream rows at the positions where
idx == r. Traced, torch.compile lowers that sum to a scatter of atomic adds, which on the CPU is
slower than torch's own kernel (aten::embedding_dense_backward), most of all for a small
(character) vocabulary; the measured figures are kept in benchmarks/README.md. `CPUEmbedding` is
an nn.Embedding whose gradient is that kernel as a custom op, which torch.compile calls as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from decoderlm.errors import DecoderLMError


@torch.library.custom_op("decoderlm::embedding_backward", mutates_args=())
def embedding_backward(grad: Tensor, idx: Tensor, num_embeddings: int) -> Tensor:
    """∂L/∂W of W[idx]: row r of the result sums the rows of `grad` (idx.shape + (d,)) where idx == r."""
    return torch.ops.aten.embedding_dense_backward(grad, idx, num_embeddings, -1, False)


@embedding_backward.register_fake
def _(grad: Tensor, idx: Tensor, num_embeddings: int) -> Tensor:
    return grad.new_empty(num_embeddings, grad.shape[-1])  # (num_embeddings, d)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, idx: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(idx)
        ctx.num_embeddings = weight.shape[0]
        return F.embedding(idx, weight)  # (..., d)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[None, Tensor]:
        (idx,) = ctx.saved_tensors
        return None, embedding_backward(grad, idx, ctx.num_embeddings)


class CPUEmbedding(nn.Embedding):
    """nn.Embedding whose gradient on the CPU is `embedding_backward`; same weight, same outputs.

    Built by `from_embedding`, it shares the Parameter of the nn.Embedding it replaces: a head tied
    to that weight stays tied, and state_dict names and optimizer state are unchanged.
    """

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> CPUEmbedding:
        """A CPUEmbedding holding `embedding.weight` itself (not a copy)."""
        if (
            embedding.padding_idx is not None
            or embedding.max_norm is not None
            or embedding.scale_grad_by_freq
            or embedding.sparse
        ):
            raise DecoderLMError(
                f"CPUEmbedding replaces a plain nn.Embedding only, not {embedding!r} "
                "(no padding_idx, max_norm, scale_grad_by_freq or sparse)"
            )
        new = cls(embedding.num_embeddings, embedding.embedding_dim, _weight=embedding.weight)
        new.weight = embedding.weight  # the same Parameter object, so that ties survive
        return new.train(embedding.training)

    def to_embedding(self) -> nn.Embedding:
        """The plain nn.Embedding holding this module's weight Parameter itself."""
        plain = nn.Embedding(self.num_embeddings, self.embedding_dim, _weight=self.weight)
        plain.weight = self.weight
        return plain.train(self.training)

    def forward(self, idx: Tensor) -> Tensor:  # (...) → (..., d)
        if (
            self.weight.device.type == "cpu"
            and self.weight.requires_grad
            and torch.is_grad_enabled()
        ):
            return _Embedding.apply(idx, self.weight)
        return F.embedding(idx, self.weight)
