"""Language-model evaluation: loss, perplexity and bits per byte over a token stream or a text file.

The stream is cut into windows of `context_length` tokens, each predicting its next tokens. With
the default stride (= context_length) windows do not overlap and every token is predicted once,
the early tokens of each window with little context. A smaller stride (the sliding-window
evaluation of the Hugging Face perplexity guide) starts a window every `stride` tokens and scores
only its last `stride` targets, so each token is still scored once but sees ≥ context − stride
tokens of context: lower (better) loss, context/stride times the compute.

The loss is also reported per position bucket: the mean over the targets predicted at window
positions [k·w, (k+1)·w) (w = `bucket_width`, default T/8), that is, with k·w+1 to (k+1)·w tokens
of context. Evaluating past the training context (a model whose RoPE was scaled, or extended with
`decoderlm train --init-from RUN --context-length ...`) shows there where the loss rises.

Bits per byte = total nats / (ln 2 · UTF-8 bytes): unlike perplexity it does not depend on the
tokenizer, so models with different vocabularies can be compared on the same text.

On the CPU the forward passes take `generate`'s speed paths (`decoderlm.cpu.paths.SpeedPaths`:
the attention and embedding paths, the linear kernels) unless `cpu_kernels=False`.

`kv_cache_dtype="int8"` scores the model as it decodes over an int8 cache
(`decoderlm.model.cache.storage`): each window's forward pass writes its K/V to a fresh cache at
positions 0..T−1 and attends them from there, so the keys and values are quantized as cached ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from decoderlm.cpu.paths import SpeedPaths
from decoderlm.data import read_text_file
from decoderlm.errors import DecoderLMError
from decoderlm.inference.generate import evaluating
from decoderlm.inference.options import DecodeOptions
from decoderlm.model.cache import CacheStep, make_cache
from decoderlm.model.lm import DecoderLM

# Windows per forward pass are chosen so that a batch holds about this many tokens (bounds the
# (B, T, vocab) logits: 2048 tokens × 32k vocabulary × 4 bytes = 256 MiB).
TOKENS_PER_BATCH = 2048
IGNORE = -100  # target id that cross_entropy skips


def bits_per_byte(mean_loss_nats: float, n_tokens: int, n_bytes: int) -> float:
    """bpb = n_tokens · loss / (ln 2 · n_bytes): the stream's total information in bits per UTF-8 byte."""
    if n_bytes <= 0:
        raise DecoderLMError(f"n_bytes={n_bytes} must be > 0 for bits per byte")
    return mean_loss_nats * n_tokens / (math.log(2) * n_bytes)


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean cross-entropy, nats per scored token
    perplexity: float  # exp(loss)
    n_tokens: int  # tokens scored (each once)
    context_length: int
    stride: int  # context_length = non-overlapping windows
    bucket_width: int  # window positions per bucket
    bucket_losses: tuple[float | None, ...]  # mean loss per position bucket, None if none scored
    bucket_tokens: tuple[int, ...]  # targets scored per bucket
    bits_per_byte: float | None = None  # when the bytes of the scored text are known
    n_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def window_plan(n_tokens: int, context_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first_scored) per window: inputs tokens[start:end], targets tokens[start+1:end+1],
    scoring targets from index `first_scored` (in the stream) on, so that each target is scored once."""
    plan: list[tuple[int, int, int]] = []
    scored_to = 0  # targets with stream index ≤ scored_to are done (token 0 is never a target)
    for start in range(0, n_tokens - 1, stride):
        end = min(start + context_length, n_tokens - 1)
        plan.append((start, end, scored_to + 1))
        scored_to = end
        if end == n_tokens - 1:
            break
    return plan


def evaluate_tokens(
    model: DecoderLM,
    tokens: Tensor | np.ndarray | Sequence[int],
    context_length: int | None = None,
    stride: int | None = None,
    batch_size: int | None = None,
    progress: bool = False,
    cpu_kernels: bool | SpeedPaths = True,
    kv_cache_dtype: str | None = None,
    bucket_width: int | None = None,
) -> EvalResult:
    """Mean next-token loss of `model` over a 1-D stream of token ids (the first id is context only).

    `cpu_kernels=False` runs the model as defined, without the CPU speed paths (a `SpeedPaths`
    picks them); `kv_cache_dtype` "int8" runs each window through an int8 cache; `bucket_width`
    positions per loss bucket (default ⌈T/8⌉; module docstring).
    """
    options = DecodeOptions.of(cpu_kernels=cpu_kernels, kv_cache_dtype=kv_cache_dtype)
    cfg = model.config
    context = cfg.context_length if context_length is None else context_length
    if not 1 <= context <= cfg.context_length:
        raise DecoderLMError(
            f"context_length={context} must be between 1 and the model's {cfg.context_length}"
        )
    stride = context if stride is None else stride
    if not 1 <= stride <= context:
        raise DecoderLMError(f"stride={stride} must be between 1 and context_length={context}")
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64)).flatten()  # (N,)
    if ids.numel() < 2:
        raise DecoderLMError(f"need at least 2 tokens to evaluate, got {ids.numel()}")
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise DecoderLMError(
            f"token ids must be in [0, {cfg.vocab_size}); found {int(ids.min())}..{int(ids.max())}"
        )
    bucket_width = -(-context // 8) if bucket_width is None else bucket_width
    if not 1 <= bucket_width <= context:
        raise DecoderLMError(
            f"bucket_width={bucket_width} must be between 1 and context_length={context}"
        )
    batch_size = batch_size or max(1, TOKENS_PER_BATCH // context)
    plan = window_plan(ids.numel(), context, stride)
    device = model.tok_emb.weight.device
    n_buckets = -(-context // bucket_width)
    bucket_nats = torch.zeros(n_buckets, dtype=torch.float64)
    bucket_tokens = torch.zeros(n_buckets, dtype=torch.long)
    batches = [plan[i : i + batch_size] for i in range(0, len(plan), batch_size)]
    if progress:
        from tqdm import tqdm

        batches = tqdm(batches, desc="eval", unit="batch")
    with evaluating(model), options.paths.applied(model), options.paths.linear():
        for batch in batches:
            x, y = _window_batch(ids, batch)  # (B, T) inputs and targets
            logits = _window_logits(model, x.to(device), kv_cache_dtype)  # (B, T, V)
            nats = F.cross_entropy(
                logits.transpose(1, 2).float(), y.to(device), ignore_index=IGNORE, reduction="none"
            ).cpu()  # (B, T): −log p(y_t | x_≤t), 0 where ignored
            scored = y != IGNORE  # (B, T)
            bucket = torch.arange(y.shape[1]) // bucket_width  # (T,) the bucket of position t
            bucket_nats.index_add_(0, bucket, nats.double().sum(0))
            bucket_tokens.index_add_(0, bucket, scored.sum(0))
    n_scored = int(bucket_tokens.sum())
    loss = float(bucket_nats.sum()) / n_scored
    losses = tuple(
        float(n / c) if c else None
        for n, c in zip(bucket_nats.tolist(), bucket_tokens.tolist(), strict=True)
    )
    return EvalResult(
        loss,
        math.exp(min(loss, 700.0)),
        n_scored,
        context,
        stride,
        bucket_width,
        losses,
        tuple(bucket_tokens.tolist()),
    )


def _window_logits(model: DecoderLM, x: Tensor, kv_cache_dtype: str | None) -> Tensor:
    """Logits (B, T, V) of windows x (B, T), causal (so right padding changes nothing); through a
    fresh cache at slots 0..T−1 when `kv_cache_dtype` is given."""
    if kv_cache_dtype is None:
        return model(x)
    b, t = x.shape
    dtype = model.tok_emb.weight.dtype
    cache = make_cache(model.config, b, t, dtype, x.device, kv_cache_dtype)
    cache.seek(CacheStep.span(0, t, x.device))  # a prefill: the usual causal triangle
    return model(x, None, None, cache)


def _window_batch(ids: Tensor, batch: list[tuple[int, int, int]]) -> tuple[Tensor, Tensor]:
    """Right-padded inputs (B, T) and targets (B, T), IGNORE where padded or scored before."""
    width = max(end - start for start, end, _ in batch)
    x = torch.zeros(len(batch), width, dtype=torch.long)
    y = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    for b, (start, end, first) in enumerate(batch):
        x[b, : end - start] = ids[start:end]
        skip = first - (start + 1)  # targets before `first` were scored by an earlier window
        y[b, skip : end - start] = ids[first : end + 1]
    return x, y


def evaluate_text(
    model: DecoderLM, tokenizer: Any, text: str, max_tokens: int | None = None, **kwargs: Any
) -> EvalResult:
    """Loss, perplexity and bits per byte of `model` on `text`; `kwargs` are `evaluate_tokens`'s.

    The end-of-text token (when the tokenizer has one) is put before the text so that every token of
    the text is scored and bits per byte covers all of its bytes. Without one, the first token is
    context only and its bytes are left out of the count. `max_tokens` keeps the first tokens only.
    """
    ids = tokenizer.encode(text)
    eot = getattr(tokenizer, "eot_id", None)
    if max_tokens is not None:
        if max_tokens < 2:
            raise DecoderLMError(f"max_tokens={max_tokens} must be ≥ 2")
        ids = ids[:max_tokens]
        text = tokenizer.decode(ids)
    n_bytes = len(text.encode("utf-8"))
    if eot is not None:
        ids = [eot, *ids]
    elif ids:
        n_bytes -= len(tokenizer.decode(ids[:1]).encode("utf-8"))
    result = evaluate_tokens(model, ids, **kwargs)
    bpb = bits_per_byte(result.loss, result.n_tokens, n_bytes)
    return EvalResult(**{**result.to_dict(), "bits_per_byte": bpb, "n_bytes": n_bytes})


def evaluate_file(model: DecoderLM, tokenizer: Any, path: str | Path, **kwargs: Any) -> EvalResult:
    """`evaluate_text` on a UTF-8 text file; same keyword arguments."""
    text = read_text_file(path)
    if not text:
        raise DecoderLMError(f"{path} is empty")
    return evaluate_text(model, tokenizer, text, **kwargs)
