"""Choosing the next token from the logits: greedy, temperature, top-k, top-p, repetition penalty.

Applied in Hugging Face's order: the repetition penalty of CTRL (Keskar et al., 2019), temperature,
top-k (Fan et al., 2018) and nucleus / top-p (Holtzman et al., 2020).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

from decoderlm.errors import DecoderLMError


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the logits; temperature 0 means greedy (argmax)."""

    temperature: float = 1.0
    top_k: int | None = None  # keep the k most likely tokens
    top_p: float | None = None  # keep the smallest set of most likely tokens with mass ≥ top_p
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the row

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, int | float) and self.temperature >= 0):
            raise DecoderLMError(f"temperature={self.temperature!r} must be a number ≥ 0")
        if self.top_k is not None and not (isinstance(self.top_k, int) and self.top_k >= 1):
            raise DecoderLMError(f"top_k={self.top_k!r} must be an integer ≥ 1 (or None)")
        if self.top_p is not None and not (
            isinstance(self.top_p, int | float) and 0 < self.top_p <= 1
        ):
            raise DecoderLMError(f"top_p={self.top_p!r} must be in (0, 1] (or None)")
        if not (isinstance(self.repetition_penalty, int | float) and self.repetition_penalty > 0):
            raise DecoderLMError(f"repetition_penalty={self.repetition_penalty!r} must be > 0")


def sampling_params(params: SamplingParams | None, options: Mapping[str, Any]) -> SamplingParams:
    """`params` (default `SamplingParams()`) with the fields named in `options` replaced, validated.

    How `generate`, `stream` and `generate_text` take their sampling options: a `SamplingParams`,
    keywords (`temperature=0.8, top_k=50`), or both, the keywords winning.
    """
    if params is not None and not isinstance(params, SamplingParams):
        raise DecoderLMError(f"params={params!r} must be a SamplingParams (or None)")
    allowed = [f.name for f in fields(SamplingParams)]
    unknown = [name for name in options if name not in allowed]
    if unknown:
        raise DecoderLMError(
            f"unknown option {unknown[0]}={options[unknown[0]]!r}; the sampling options are "
            f"{', '.join(allowed)}"
        )
    return replace(params if params is not None else SamplingParams(), **options)


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL: a seen token's logit is divided by `penalty` if positive, multiplied if negative. (B, V)."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Set all but the k largest logits of each row to −∞. logits (B, V)."""
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # (B, 1) the k-th largest
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability mass is ≥ p; −∞ elsewhere."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked strictly above
    drop_sorted = mass_before >= p  # the set already reached p without this token
    drop_sorted[:, 0] = False  # the most likely token always stays (a p that rounds to 0 in fp32)
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def greedy_tokens(logits: Tensor, chunk: int = 128) -> Tensor:
    """argmax over the last dim of logits (B, V) → (B,): the first index of each row's maximum,
    as `Tensor.argmax` gives it, from the maxima of `chunk`-wide slices (a vectorised reduction
    on the CPU, where argmax over a large vocabulary is several times slower: benchmarks/README.md)
    and argmax within the first slice that holds the row's maximum."""
    v = logits.shape[-1]
    whole = v - v % chunk
    if whole == 0:
        return logits.argmax(dim=-1)
    maxima = logits[:, :whole].unflatten(-1, (whole // chunk, chunk)).amax(-1)  # (B, V // chunk)
    if whole < v:
        maxima = torch.cat([maxima, logits[:, whole:].amax(-1, keepdim=True)], dim=-1)
    start = maxima.argmax(dim=-1) * chunk  # (B,) the first slice holding the maximum
    columns = (start[:, None] + torch.arange(chunk, device=logits.device)).clamp(max=v - 1)
    return start + logits.gather(-1, columns).argmax(dim=-1)  # (B,)


def sample_next(
    logits: Tensor,
    params: SamplingParams,
    seen: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next token ids (B,) from logits (B, V); `seen` (B, V) bool marks tokens for the repetition penalty."""
    if params.temperature == 0:
        return greedy_tokens(_penalized(logits, params, seen))
    return draw(token_probs(logits, params, seen), generator)  # (B,)


def sample_rows(
    logits: Tensor,
    params: SamplingParams,
    seen: Tensor | None,
    generators: Sequence[torch.Generator | None],
) -> Tensor:
    """Next token ids (B,) from logits (B, V), row b `sample_next` of that row alone with
    `generators[b]`: a row's token depends on its own logits and generator only, whatever rows
    are beside it (the engine's sampler draws each sequence so too)."""
    if params.temperature == 0:  # greedy: row-wise operations, nothing drawn
        return sample_next(logits, params, seen)
    tokens = [
        sample_next(logits[b, None], params, None if seen is None else seen[b, None], g)
        for b, g in enumerate(generators)
    ]
    return torch.cat(tokens)  # (B,)


def token_probs(logits: Tensor, params: SamplingParams, seen: Tensor | None = None) -> Tensor:
    """The distribution (B, V), float64, that `sample_next` draws from: one-hot at the argmax for
    greedy, else the softmax of the penalized logits / T, top-k and top-p filtered."""
    logits = _penalized(logits, params, seen)
    if params.temperature == 0:
        return torch.nn.functional.one_hot(greedy_tokens(logits), logits.shape[-1]).double()
    # (l − max l) / T in float64: the softmax of l / T, and no ∞ − ∞ (NaN) for a tiny T, which
    # float64 also keeps from rounding to 0.
    logits = logits.double()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    if params.top_k is not None:
        logits = top_k_filter(logits, params.top_k)
    if params.top_p is not None:
        logits = top_p_filter(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def _penalized(logits: Tensor, params: SamplingParams, seen: Tensor | None) -> Tensor:
    """logits (B, V) in float32, with the repetition penalty applied to the `seen` tokens."""
    logits = logits.float()
    if seen is not None and params.repetition_penalty != 1.0:
        # A tiny penalty can push a logit past the float32 range: +∞ becomes the largest float.
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
        logits = logits.clamp(max=torch.finfo(logits.dtype).max)
    return logits


def draw(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token per row of probs (B, V), token i with probability probs_i / Σ probs.

    Inverse-CDF sampling: the first token whose cumulative mass exceeds u · total, u ~ U[0, 1).
    Tokens of probability 0 are never drawn; non-finite probabilities are a DecoderLMError (on the
    CPU). It takes one random number per row, where
    torch.multinomial draws V exponentials, so it is the faster of the two for large vocabularies.
    """
    cdf = probs.double().cumsum(dim=-1)  # (B, V); float64 keeps the share of tokens of mass ~1e-9
    total = cdf[:, -1:].contiguous()  # (B, 1)
    # Checked on the CPU only, where it is free: on an accelerator it would wait for the device
    # at every token.
    if probs.device.type == "cpu" and not bool(torch.isfinite(total).all()):
        raise DecoderLMError(
            "cannot sample: the probabilities are not finite (NaN or inf logits; the model's "
            "weights may have diverged)"
        )
    u = torch.rand(total.shape, dtype=torch.float64, generator=generator, device=probs.device)
    drawn = torch.searchsorted(cdf, u * total, right=True)  # (B, 1): first i with cdf_i > u·total
    last = torch.searchsorted(cdf, total)  # (B, 1) the last token with mass (u·total may round up)
    return torch.minimum(drawn, last).squeeze(-1)
