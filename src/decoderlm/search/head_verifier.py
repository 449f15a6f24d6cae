"""A verifier that is a small head on a frozen language model's hidden states: the outcome
verifier of Cobbe et al. (2021), "Training Verifiers to Solve Math Word Problems", with the base
model frozen and only the head learned (a linear probe, as Alain & Bengio, 2016, "Understanding
intermediate layers using linear classifier probes"):

    v(x) = σ(w·(h_L(x)_T − μ)/s + b)

where h_L(x)_T is the residual stream after block L at the text's last token, and μ, s the mean
and standard deviation of the training features. `decoderlm.training.head_verifier` fits it on
the policy's own samples, labelled by a task's checker at every solution token (Cobbe et al.,
§4.2), so that it also values partial solutions, which step-level search asks of it.

A step-level search scores each partial solution once it is one step longer; `HeadVerifier`
keeps the keys and values of the texts it scored (a bounded cache, least recently used first
out) and runs only the tokens past the longest cached text that prefixes the new one.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from decoderlm.errors import DecoderLMError
from decoderlm.model.cache.protocol import BaseLayerCache
from decoderlm.model.lm import DecoderLM
from decoderlm.search.verifier import padded_batch
from decoderlm.tokenizer import Tokenizer

CACHED_TEXTS = 64  # texts whose keys and values a HeadVerifier keeps
BATCH = 16  # texts a batched pass encodes at once


def trunk(model: DecoderLM, layers: int) -> DecoderLM:
    """The model's first `layers` blocks as a model of their own, sharing its weights, whose
    output is the residual stream after them, (B, T, d_model), instead of logits."""
    if not (isinstance(layers, int) and 1 <= layers <= model.config.n_layers):
        raise DecoderLMError(f"layers={layers!r} must be an integer in 1..{model.config.n_layers}")
    with torch.device("meta"):  # the structure only: every weight is the model's own
        part = DecoderLM(dataclasses.replace(model.config, n_layers=layers))
    part.tok_emb, part.pos_emb, part.rope = model.tok_emb, model.pos_emb, model.rope
    part.blocks = nn.ModuleList(model.blocks[:layers])
    part.norm, part.head = nn.Identity(), nn.Identity()
    return part.eval()


class VerifierHead(nn.Module):
    """s(h) = w·(h − μ)/s + b: one logit from a hidden state (..., d) → (...)."""

    def __init__(self, d_model: int, layer: int) -> None:
        super().__init__()
        self.layer = layer  # the block after which the hidden state is read
        self.register_buffer("mean", torch.zeros(d_model))
        self.register_buffer("scale", torch.ones(d_model))
        self.linear = nn.Linear(d_model, 1)

    def forward(self, h: Tensor) -> Tensor:
        return self.linear((h.float() - self.mean) / self.scale)[..., 0]


class _Extended(BaseLayerCache):
    """One layer's K/V of a cached text, extended by concatenation: `update` makes new tensors,
    so the text it started from keeps its own."""

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k, self.v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        return self.k, self.v  # (1, Hkv, Tk, hd)


@dataclasses.dataclass
class _Entry:
    keys: list[Tensor]  # per layer (1, Hkv, T, hd)
    values: list[Tensor]
    score: float


class HeadVerifier:
    """A `Verifier`: v(prompt + solution) of a head on `part` (a `trunk` of the policy with
    head.layer blocks). Not shared between threads: each search makes its own (`fork`)."""

    def __init__(
        self, part: DecoderLM, tokenizer: Tokenizer, head: VerifierHead, cached: int = CACHED_TEXTS
    ) -> None:
        if part.config.n_layers != head.layer:
            raise DecoderLMError(
                f"the head reads block {head.layer}'s output, the trunk has {part.config.n_layers}"
            )
        self.part, self.tokenizer, self.head, self.cached = part, tokenizer, head, cached
        self.entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self.lengths: Counter[int] = Counter()  # how many cached texts have each length

    def fork(self) -> HeadVerifier:
        """The same verifier with a cache of its own."""
        return HeadVerifier(self.part, self.tokenizer, self.head, self.cached)

    def __call__(self, prompt: str, solution: str) -> float:
        ids = tuple(self.tokenizer.encode(prompt + solution))
        if ids in self.entries:
            self.entries.move_to_end(ids)
            return self.entries[ids].score
        start, base = self._longest_prefix(ids)
        caches = [
            _Extended(k, v) for k, v in zip(base.keys, base.values, strict=True)
        ] if base else [self._empty() for _ in self.part.blocks]  # fmt: skip
        with torch.inference_mode():
            new = torch.tensor([ids[start:]])  # (1, T')
            positions = torch.arange(start, len(ids))  # (T',)
            h = self.part(new, positions=positions, kv_caches=caches)[0, -1]  # (d,)
            score = float(torch.sigmoid(self.head(h)))
        self._keep(ids, _Entry([c.k for c in caches], [c.v for c in caches], score))
        return score

    @torch.inference_mode()
    def scores(self, texts: Sequence[str]) -> list[float]:
        """v of each text, BATCH at a time in one pass each (right-padded; nothing cached)."""
        out: list[float] = []
        for start in range(0, len(texts), BATCH):
            rows = [self.tokenizer.encode(t) for t in texts[start : start + BATCH]]
            ids, last = padded_batch(rows)  # (B, T), (B,)
            h = self.part(ids)[torch.arange(len(rows)), last]  # (B, d)
            out += torch.sigmoid(self.head(h)).tolist()
        return out

    def _longest_prefix(self, ids: tuple[int, ...]) -> tuple[int, _Entry | None]:
        """The longest cached text that is a proper prefix of ids: (its length, its entry)."""
        for n in sorted(self.lengths, reverse=True):
            entry = self.entries.get(ids[:n]) if n < len(ids) else None
            if entry is not None:
                self.entries.move_to_end(ids[:n])
                return n, entry
        return 0, None

    def _empty(self) -> _Extended:
        """A layer's K/V of no tokens, (1, Hkv, 0, hd) in the model's dtype."""
        c, dtype = self.part.config, self.part.tok_emb.weight.dtype
        empty = torch.zeros(1, c.n_kv_heads, 0, c.head_dim, dtype=dtype)
        return _Extended(empty, empty)

    def _keep(self, ids: tuple[int, ...], entry: _Entry) -> None:
        self.entries[ids] = entry
        self.lengths[len(ids)] += 1
        while len(self.entries) > self.cached:
            old, _ = self.entries.popitem(last=False)
            self.lengths[len(old)] -= 1
            if not self.lengths[len(old)]:
                del self.lengths[len(old)]
