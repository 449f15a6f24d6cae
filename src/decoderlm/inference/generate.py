"""Autoregressive generation over a static KV cache: prefill, one-token steps, padded batches.

The prompt is run once (prefill) to fill the cache; every later step feeds one token per row with
explicit positions, so RoPE, learned and sinusoidal positions are right at every step. Prompts of
different lengths are left-padded: each row counts its positions from 0 at its first real token and
a key mask hides its padding, so a row decodes exactly as it would alone.

Sampling (`decoderlm.inference.sampling`) applies the repetition penalty, temperature, top-k and
top-p in Hugging Face's order; its options are the fields of `SamplingParams`, given once.

On the CPU, decoding takes the speed paths of `decoderlm.cpu` from here, all switched by one
keyword, `cpu_kernels` (default True): the attention/embedding paths of `decoderlm.cpu.optimized`,
the linear kernels of `decoderlm.cpu.decode.CPULinearKernels` for the prefill, and (with
`compile=True`) the same kernels in the compiled prefill and one-token step. Off, the model runs
as defined, with F.linear.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from decoderlm.cpu import optimized
from decoderlm.cpu.decode import CompiledStep, linear_kernels
from decoderlm.errors import DecoderLMError
from decoderlm.inference.sampling import SamplingParams, sample_next, sampling_params
from decoderlm.model.cache import (
    CacheStep,
    LayerCache,
    RingKVCache,
    StaticKVCache,
    check_kv_cache_dtype,
)
from decoderlm.model.lm import DecoderLM

Prompt = Tensor | Sequence[Sequence[int]] | Sequence[int]

# Rows stop being checked for end-of-text on every step (a host sync); `generate` looks every this many.
EOS_CHECK_INTERVAL = 16
# Compiled decoding sizes its cache in multiples of this, so nearby lengths share one compiled graph.
COMPILE_CACHE_MULTIPLE = 256
# Compiled prefill left-pads prompts to a multiple of this, for the same reason.
COMPILE_PREFILL_MULTIPLE = 64


@contextmanager
def evaluating(model: DecoderLM) -> Iterator[None]:
    """Eval mode (no dropout) and no autograd for the duration; each module's mode is restored after.

    Only the modules in training mode are switched, so a model already in eval mode (a serving
    engine calls this at every step) is not written to at all."""
    training = [m for m in model.modules() if m.training]  # (module setattr is slow in Python)
    for module in training:
        module.training = False
    try:
        with torch.inference_mode():
            yield
    finally:
        for module in training:
            module.training = True


def next_logits(
    model: DecoderLM,
    cache: Sequence[LayerCache],
    idx: Tensor,
    positions: Tensor,
    key_padding_mask: Tensor | None,
    state: dict[str, Tensor] | None = None,
) -> Tensor:
    """Logits (B, V), in float32, of the token after idx (B, T) at `positions` (B, T), over a cache.

    state: tensors to use in place of the model's parameters and buffers, by name (as in
    `torch.func.functional_call`); the model's own when None.
    """
    args = (idx, positions, key_padding_mask, cache)
    if state is None:
        logits = model(*args, last_only=True)  # (B, 1, V)
    else:
        logits = torch.func.functional_call(model, state, args, {"last_only": True})
    return logits[:, -1].float()


@functools.cache
def compiled_prefill() -> Callable[..., Tensor]:
    """`next_logits` under torch.compile: one graph per (padded) prompt shape, model and kernels."""
    return torch.compile(next_logits, dynamic=False)


def prompt_rows(prompt: Prompt, vocab_size: int) -> list[list[int]]:
    """Normalise a prompt — (B, T) or (T,) ids, a list of id lists, or one id list — to id lists."""
    if isinstance(prompt, Tensor):
        if prompt.is_floating_point() or prompt.dim() not in (1, 2):
            raise DecoderLMError(
                f"prompt tensor must hold integer token ids, shape (B, T) or (T,); got "
                f"{prompt.dtype} of shape {tuple(prompt.shape)}"
            )
        prompt = prompt.tolist()
    rows = list(prompt)
    if rows and not isinstance(rows[0], Sequence | Tensor):
        rows = [rows]  # a single sequence of ids
    rows = [[int(t) for t in row] for row in rows]
    if not rows or any(len(row) == 0 for row in rows):
        raise DecoderLMError("empty prompt: give at least one token per row")
    bad = [t for row in rows for t in row if not 0 <= t < vocab_size]
    if bad:
        raise DecoderLMError(
            f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
        )
    return rows


def check_lengths(
    rows: list[list[int]], max_new_tokens: int, context_length: int, refill_past_context: bool
) -> None:
    """DecoderLMError if a prompt is longer than the context, or the generation would outgrow it."""
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 0):
        raise DecoderLMError(f"max_new_tokens={max_new_tokens!r} must be an integer ≥ 0")
    longest = max(len(row) for row in rows)
    if longest > context_length:
        raise DecoderLMError(
            f"prompt has {longest} tokens, more than the model's context_length={context_length}"
        )
    if longest + max_new_tokens > context_length and not refill_past_context:
        raise DecoderLMError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"context_length={context_length}; generate fewer tokens, or refill past it "
            "(refill_past_context=True, --refill-past-context)"
        )


def check_cache_options(
    kv_cache_dtype: str | None, compile: bool, sliding_window: int | None = None
) -> None:
    """DecoderLMError for an unknown `kv_cache_dtype`, or "int8" with `compile`: the AOT-compiled
    step of `decoderlm.cpu.decode` takes plain K/V buffers as its inputs, not int8 values and scales;
    nor does it take the ring cache (`decoderlm.model.cache.ring`) a windowed model decodes over."""
    check_kv_cache_dtype(kv_cache_dtype)
    if compile and kv_cache_dtype == "int8":
        raise DecoderLMError(
            "compile=True does not support kv_cache_dtype='int8' (the compiled one-token step "
            "takes plain K/V buffers); drop one of the two"
        )
    if compile and sliding_window is not None:
        raise DecoderLMError(
            f"a model with sliding_window={sliding_window} decodes over a ring KV cache, which "
            "compile=True does not support yet; drop compile"
        )


def check_options(
    model: DecoderLM,
    rows: list[list[int]],
    max_new_tokens: int,
    refill_past_context: bool,
    kv_cache_dtype: str | None,
    compile: bool,
) -> None:
    """`check_lengths` and `check_cache_options` for this model: a model whose every layer has a
    sliding window has no length limit past its prompt."""
    cfg = model.config
    past = refill_past_context or cfg.decodes_past_context
    check_lengths(rows, max_new_tokens, cfg.context_length, past)
    check_cache_options(kv_cache_dtype, compile, cfg.sliding_window)


def _fill_lengths(
    rows: list[list[int]], max_new_tokens: int, context: int, compile: bool
) -> tuple[int, int]:
    """(n, max_len): the first fill's length (the prompts, left-padded) and the cache's slots.

    Compiled decoding rounds both up (`COMPILE_PREFILL_MULTIPLE`, `COMPILE_CACHE_MULTIPLE`), so
    that nearby lengths share one compiled graph."""
    n = max(len(row) for row in rows)
    if compile:
        rounded = math.ceil(n / COMPILE_PREFILL_MULTIPLE) * COMPILE_PREFILL_MULTIPLE
        n = rounded if rounded + max_new_tokens <= context else n
    max_len = min(n + max_new_tokens, context)
    if compile:
        max_len = min(math.ceil(max_len / COMPILE_CACHE_MULTIPLE) * COMPILE_CACHE_MULTIPLE, context)
    return n, max_len


def _make_cache(
    model: DecoderLM, batch_size: int, max_len: int, kv_cache_dtype: str | None
) -> StaticKVCache | RingKVCache:
    """The KV cache of one generation: rings for a windowed model, else static buffers; either in
    the model's dtype or int8."""
    cfg, weight = model.config, model.tok_emb.weight
    cache = RingKVCache if cfg.sliding_window is not None else StaticKVCache
    return cache(cfg, batch_size, max_len, weight.dtype, weight.device, kv_cache_dtype)


def decode_steps(
    model: DecoderLM,
    rows: list[list[int]],
    max_new_tokens: int,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    refill_past_context: bool = False,
    compile: bool = False,
    cpu_kernels: bool = True,
    kv_cache_dtype: str | None = None,
) -> Iterator[Tensor]:
    """Yield the new token of every row, (B,) on the model's device, `max_new_tokens` times.

    Call it under `torch.inference_mode()` with the model in eval mode (and, for the CPU attention
    paths, `decoderlm.cpu.optimized`). Nothing here waits for the device: the caller decides when
    to look at the tokens (and to stop). Past `context_length`, either raise (default) or, with
    `refill_past_context`, drop the oldest quarter of the context and refill the cache from the rest
    (one prefill), so every token still sees ≥ 3/4 of a context. `cpu_kernels`: the prefill (and
    with `compile` the one-token step) under `CPULinearKernels`; the eager one-token step never,
    as the mode's Python hook on every op costs more than it saves there. `kv_cache_dtype`: None
    caches K/V in the model's dtype, "int8" quantizes them (`decoderlm.model.cache.storage`). A
    model with a sliding window keeps its windowed layers' K/V in rings of W slots
    (`RingKVCache`); when every layer has one, decoding goes on past `context_length` with nothing
    refilled.
    """
    cfg = model.config
    context = cfg.context_length
    unbounded = cfg.decodes_past_context  # the ring never fills: no refill, no length limit
    check_options(model, rows, max_new_tokens, refill_past_context, kv_cache_dtype, compile)
    n, max_len = _fill_lengths(rows, max_new_tokens, context, compile)
    device = model.tok_emb.weight.device
    cache = _make_cache(model, len(rows), max_len, kv_cache_dtype)
    step = CompiledStep(model, cache, next_logits, cpu_kernels) if compile else None
    seen = None
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(len(rows), cfg.vocab_size, dtype=torch.bool, device=device)  # (B, V)
        for b, row in enumerate(rows):
            seen[b, row] = True

    produced = 0
    while True:  # one pass per cache fill; more than one only with refill_past_context
        pad = torch.tensor([n - len(row) for row in rows], device=device)  # (B,) left padding
        slots = torch.arange(max_len, device=device)  # (S,)
        filled = slots[None, :] >= pad[:, None]  # (B, S) key mask: real tokens, not padding
        padded = bool(pad.any())
        idx = torch.tensor([[0] * (n - len(row)) + row for row in rows], device=device)  # (B, n)
        positions = (slots[None, :n] - pad[:, None]).clamp(min=0)  # (B, n): 0 at the 1st token
        cache.seek(CacheStep.span(0, n, device, filled[:, :n] if padded else None))
        prefill = compiled_prefill() if compile else next_logits
        with linear_kernels(cpu_kernels and (compile or n > 1), compiling=compile):
            logits = prefill(model, cache, idx, positions, filled[:, :n] if padded else None)
        filled &= slots < n  # from here on: the slots holding a real token
        new: list[Tensor] = []
        slot = torch.zeros(1, dtype=torch.long, device=device)  # (1,) the slot being written
        while True:
            token = sample_next(logits, params, seen, generator)  # (B,)
            yield token
            new.append(token)
            produced += 1
            if produced == max_new_tokens:
                return
            if seen is not None:
                seen.scatter_(1, token[:, None], True)
            if n == max_len and not unbounded:
                break  # the cache is full: slide the window
            slot.fill_(n)
            if step is not None:  # fixed shapes: attends the whole buffer, masked in the step
                logits = step(token[:, None], slot, pad)
            else:
                key_padding_mask = None  # rings hand attention their own key mask
                if not unbounded:
                    filled[:, n] = True
                    key_padding_mask = filled[:, : n + 1] if padded else None
                cache.seek(CacheStep(slot, n + 1))
                logits = next_logits(
                    model, cache, token[:, None], (slot - pad)[:, None], key_padding_mask
                )
            n += 1
        keep = context - max(1, context // 4)
        generated = torch.stack(new, dim=1).tolist()  # (B, n_new)
        rows = [(row + extra)[-keep:] for row, extra in zip(rows, generated, strict=True)]
        n = keep


def generate(
    model: DecoderLM,
    prompt: Prompt,
    max_new_tokens: int,
    params: SamplingParams | None = None,
    *,
    seed: int | None = None,
    eos_id: int | None = None,
    num_samples: int = 1,
    refill_past_context: bool = False,
    compile: bool = False,
    cpu_kernels: bool = True,
    kv_cache_dtype: str | None = None,
    **sampling: Any,
) -> list[list[int]]:
    """Continue each prompt row by up to `max_new_tokens` tokens; returns one id list per row.

    prompt: a (B, T) LongTensor, or a list of token-id lists of different lengths (left-padded
    internally). Each returned list is the row's prompt ids followed by its new ids, ending at
    (and including) `eos_id` if that was generated. With `num_samples` > 1, each prompt gives that
    many rows, in order (prompt 0 sample 0, prompt 0 sample 1, ...).

    Sampling: `params`, and/or its fields as keywords (`temperature=0.8, top_k=50`; they win over
    `params`); temperature 0 = greedy. Any other keyword raises DecoderLMError. A seed makes
    sampling reproducible; without one, torch's global generator is used. `compile` compiles the
    prefill with torch.compile and the one-token step ahead of time with AOTInductor (see
    `decoderlm.cpu.decode`; the first call of a shape pays for the compilation, and prompts are
    left-padded to a multiple of 64 so that nearby lengths share one prefill graph).
    `cpu_kernels=False` switches off the CPU speed paths (module docstring). `kv_cache_dtype="int8"`
    keeps the cache in int8 with a scale per token and head (`decoderlm.model.cache.storage`: half
    the bytes of a bfloat16 cache, plus the scales); not with `compile`.
    """
    params = sampling_params(params, sampling)
    if not (isinstance(num_samples, int) and num_samples >= 1):
        raise DecoderLMError(f"num_samples={num_samples!r} must be an integer ≥ 1")
    rows = [row for row in prompt_rows(prompt, model.config.vocab_size) for _ in range(num_samples)]
    check_options(model, rows, max_new_tokens, refill_past_context, kv_cache_dtype, compile)
    if max_new_tokens == 0:
        return rows
    generator = make_generator(seed, model.tok_emb.weight.device)
    new: list[Tensor] = []
    with evaluating(model), optimized(model, enabled=cpu_kernels):
        steps = decode_steps(
            model,
            rows,
            max_new_tokens,
            params,
            generator,
            refill_past_context,
            compile,
            cpu_kernels,
            kv_cache_dtype,
        )
        done = torch.zeros(len(rows), dtype=torch.bool, device=model.tok_emb.weight.device)
        for i, token in enumerate(steps):
            new.append(token)
            if eos_id is not None:
                done |= token == eos_id
                if (i + 1) % EOS_CHECK_INTERVAL == 0 and bool(done.all()):
                    break
    generated = torch.stack(new, dim=1).tolist()  # (B, n_new): the only host copy of the tokens
    return [row + _until(extra, eos_id) for row, extra in zip(rows, generated, strict=True)]


def _until(ids: list[int], eos_id: int | None) -> list[int]:
    """ids up to and including the first eos_id."""
    if eos_id is not None and eos_id in ids:
        return ids[: ids.index(eos_id) + 1]
    return ids


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    if not isinstance(seed, int):
        raise DecoderLMError(f"seed={seed!r} must be an integer (or None)")
    return torch.Generator(device=device).manual_seed(seed)
