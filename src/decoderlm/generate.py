"""Autoregressive generation over a static KV cache: sampling, padded batches, streaming text.

The prompt is run once (prefill) to fill the cache; every later step feeds one token per row with
explicit positions, so RoPE, learned and sinusoidal positions are right at every step. Prompts of
different lengths are left-padded: each row counts its positions from 0 at its first real token and
a key mask hides its padding, so a row decodes exactly as it would alone.

Sampling applies, in Hugging Face's order: the repetition penalty of CTRL (Keskar et al., 2019),
temperature, top-k (Fan et al., 2018) and nucleus / top-p (Holtzman et al., 2020).
"""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from decoderlm.decode_step import CompiledStep, compiled_prefill, next_logits
from decoderlm.errors import DecoderLMError
from decoderlm.kv_cache import StaticKVCache
from decoderlm.model import DecoderLM

Prompt = Tensor | Sequence[Sequence[int]] | Sequence[int]

# Rows stop being checked for end-of-text on every step (a host sync); `generate` looks every this many.
EOS_CHECK_INTERVAL = 16
# Compiled decoding sizes its cache in multiples of this, so nearby lengths share one compiled graph.
COMPILE_CACHE_MULTIPLE = 256
# Compiled prefill left-pads prompts to a multiple of this, for the same reason.
COMPILE_PREFILL_MULTIPLE = 64


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
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def sample_next(
    logits: Tensor,
    params: SamplingParams,
    seen: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next token ids (B,) from logits (B, V); `seen` (B, V) bool marks tokens for the repetition penalty."""
    logits = logits.float()
    if seen is not None and params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if params.top_k is not None:
        logits = top_k_filter(logits, params.top_k)
    if params.top_p is not None:
        logits = top_p_filter(logits, params.top_p)
    return draw(torch.softmax(logits, dim=-1), generator)  # (B,)


def draw(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token per row of probs (B, V), token i with probability probs_i / Σ probs.

    Inverse-CDF sampling: the first token whose cumulative mass exceeds u · total, u ~ U[0, 1).
    Tokens of probability 0 are never drawn. It takes one random number per row, where
    torch.multinomial draws V exponentials (0.54 ms against 0.03 ms for V = 32000 on the CPU).
    """
    cdf = probs.double().cumsum(dim=-1)  # (B, V); float64 keeps the share of tokens of mass ~1e-9
    total = cdf[:, -1:].contiguous()  # (B, 1)
    u = torch.rand(total.shape, dtype=torch.float64, generator=generator, device=probs.device)
    drawn = torch.searchsorted(cdf, u * total, right=True)  # (B, 1): first i with cdf_i > u·total
    last = torch.searchsorted(cdf, total)  # (B, 1) the last token with mass (u·total may round up)
    return torch.minimum(drawn, last).squeeze(-1)


@contextmanager
def evaluating(model: DecoderLM) -> Iterator[None]:
    """Eval mode (no dropout) and no autograd for the duration; the model's mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


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
    rows: list[list[int]], max_new_tokens: int, context_length: int, sliding_window: bool
) -> None:
    """DecoderLMError if a prompt is longer than the context, or the generation would outgrow it."""
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 0):
        raise DecoderLMError(f"max_new_tokens={max_new_tokens!r} must be an integer ≥ 0")
    longest = max(len(row) for row in rows)
    if longest > context_length:
        raise DecoderLMError(
            f"prompt has {longest} tokens, more than the model's context_length={context_length}"
        )
    if longest + max_new_tokens > context_length and not sliding_window:
        raise DecoderLMError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"context_length={context_length}; generate fewer tokens or use a sliding window"
        )


def decode_steps(
    model: DecoderLM,
    rows: list[list[int]],
    max_new_tokens: int,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    sliding_window: bool = False,
    compile: bool = False,
) -> Iterator[Tensor]:
    """Yield the new token of every row, (B,) on the model's device, `max_new_tokens` times.

    Call it under `torch.inference_mode()` with the model in eval mode. Nothing here waits for the
    device: the caller decides when to look at the tokens (and to stop). Past `context_length`,
    either raise (default) or, with `sliding_window`, drop the oldest quarter of the context and
    refill the cache from the rest (one prefill), so every token still sees ≥ 3/4 of a context.
    """
    cfg = model.config
    context = cfg.context_length
    check_lengths(rows, max_new_tokens, context, sliding_window)
    n = max(len(row) for row in rows)  # the first fill: the prompts, left-padded to n tokens
    weight = model.tok_emb.weight
    device = weight.device
    if compile:
        rounded = math.ceil(n / COMPILE_PREFILL_MULTIPLE) * COMPILE_PREFILL_MULTIPLE
        n = rounded if rounded + max_new_tokens <= context else n
    max_len = min(n + max_new_tokens, context)
    if compile:
        max_len = min(math.ceil(max_len / COMPILE_CACHE_MULTIPLE) * COMPILE_CACHE_MULTIPLE, context)
    cache = StaticKVCache(cfg, len(rows), max_len, weight.dtype, device)
    step = CompiledStep(model, cache) if compile else None
    seen = None
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(len(rows), cfg.vocab_size, dtype=torch.bool, device=device)  # (B, V)
        for b, row in enumerate(rows):
            seen[b, row] = True

    produced = 0
    while True:  # one pass per cache fill; more than one only with the sliding window
        pad = torch.tensor([n - len(row) for row in rows], device=device)  # (B,) left padding
        slots = torch.arange(max_len, device=device)  # (S,)
        filled = slots[None, :] >= pad[:, None]  # (B, S) key mask: real tokens, not padding
        padded = bool(pad.any())
        idx = torch.tensor([[0] * (n - len(row)) + row for row in rows], device=device)  # (B, n)
        positions = (slots[None, :n] - pad[:, None]).clamp(min=0)  # (B, n): 0 at the 1st token
        cache.seek(slots[:n], n)
        prefill = compiled_prefill() if compile else next_logits
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
            if n == max_len:
                break  # the cache is full: slide the window
            slot.fill_(n)
            if step is not None:  # fixed shapes: attends the whole buffer, masked in the step
                logits = step(token[:, None], slot, pad)
            else:
                filled[:, n] = True
                cache.seek(slot, n + 1)
                key_mask = filled[:, : n + 1] if padded else None
                logits = next_logits(model, cache, token[:, None], (slot - pad)[:, None], key_mask)
            n += 1
        keep = context - max(1, context // 4)
        generated = torch.stack(new, dim=1).tolist()  # (B, n_new)
        rows = [(row + extra)[-keep:] for row, extra in zip(rows, generated, strict=True)]
        n = keep


def generate(
    model: DecoderLM,
    prompt: Prompt,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    eos_id: int | None = None,
    num_samples: int = 1,
    sliding_window: bool = False,
    compile: bool = False,
) -> list[list[int]]:
    """Continue each prompt row by up to `max_new_tokens` tokens; returns one id list per row.

    prompt: a (B, T) LongTensor, or a list of token-id lists of different lengths (left-padded
    internally). Each returned list is the row's prompt ids followed by its new ids, ending at
    (and including) `eos_id` if that was generated. With `num_samples` > 1, each prompt gives that
    many rows, in order (prompt 0 sample 0, prompt 0 sample 1, ...). temperature 0 = greedy. A seed
    makes sampling reproducible; without one, torch's global generator is used. `compile` compiles
    the prefill with torch.compile and the one-token step ahead of time with AOTInductor (see
    `decoderlm.decode_step`; the first call of a shape pays for the compilation, and prompts are
    left-padded to a multiple of 64 so that nearby lengths share one prefill graph).
    """
    params = SamplingParams(temperature, top_k, top_p, repetition_penalty)
    if not (isinstance(num_samples, int) and num_samples >= 1):
        raise DecoderLMError(f"num_samples={num_samples!r} must be an integer ≥ 1")
    rows = [row for row in prompt_rows(prompt, model.config.vocab_size) for _ in range(num_samples)]
    check_lengths(rows, max_new_tokens, model.config.context_length, sliding_window)
    if max_new_tokens == 0:
        return rows
    generator = _generator(seed, model.tok_emb.weight.device)
    new: list[Tensor] = []
    with evaluating(model):
        steps = decode_steps(
            model, rows, max_new_tokens, params, generator, sliding_window, compile
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


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    if not isinstance(seed, int):
        raise DecoderLMError(f"seed={seed!r} must be an integer (or None)")
    return torch.Generator(device=device).manual_seed(seed)


class IncrementalDecoder:
    """Turns token ids into text pieces as they arrive, never splitting a multi-byte character.

    It decodes a short window of recent ids and emits what it adds to the previous window's text,
    holding back while the text ends in U+FFFD (an incomplete UTF-8 sequence); the prompt's last
    ids seed the window so tokenizers that strip a leading space decode the first piece right.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-4:])
        self.prefix = 0  # start of the decoding window
        self.read = len(self.ids)  # ids before this have been emitted

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]


class StopMatcher:
    """Cuts a stream of text pieces at the first stop string, holding back a possible partial match."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """The text that is safe to emit now; sets `stopped` once a stop string is complete."""
        if self.stopped:
            return ""
        text = self.pending + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return text[: min(hits)]
        hold = next(
            (
                k
                for k in range(min(len(text), max(map(len, self.stops), default=1) - 1), 0, -1)
                if any(s.startswith(text[-k:]) for s in self.stops)
            ),
            0,
        )
        self.pending = text[len(text) - hold :]
        return text[: len(text) - hold]

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


def stream(
    model: DecoderLM,
    tokenizer: Any,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_at_eot: bool = True,
    sliding_window: bool = False,
    compile: bool = False,
) -> Iterator[str]:
    """An iterator over the continuation of `prompt`, as text pieces while they are generated.

    Stops after `max_new_tokens`, at the tokenizer's end-of-text token (unless `stop_at_eot` is
    False) or before the first of the `stop` strings (which is not yielded). Bad arguments raise
    here, before anything is generated.
    """
    params = SamplingParams(temperature, top_k, top_p, repetition_penalty)
    if not prompt:
        raise DecoderLMError("empty prompt: give some text to continue")
    ids = tokenizer.encode(prompt)
    rows = prompt_rows([ids], model.config.vocab_size)
    check_lengths(rows, max_new_tokens, model.config.context_length, sliding_window)
    eot = getattr(tokenizer, "eot_id", None) if stop_at_eot else None
    generator = _generator(seed, model.tok_emb.weight.device)
    steps = decode_steps(model, rows, max_new_tokens, params, generator, sliding_window, compile)
    return _text_pieces(model, steps, IncrementalDecoder(tokenizer, ids), StopMatcher(stop), eot)


def _text_pieces(
    model: DecoderLM,
    steps: Iterator[Tensor],
    decoder: IncrementalDecoder,
    matcher: StopMatcher,
    eot: int | None,
) -> Iterator[str]:
    with evaluating(model):
        for token in steps:
            token_id = int(token[0])  # streaming needs each token on the host
            if token_id == eot:
                break
            piece = matcher.feed(decoder.add(token_id))
            if piece:
                yield piece
            if matcher.stopped:
                return
    tail = matcher.feed(decoder.flush())
    if not matcher.stopped:
        tail += matcher.flush()
    if tail:
        yield tail


def generate_text(
    model: DecoderLM, tokenizer: Any, prompt: str, max_new_tokens: int, **kwargs: Any
) -> str:
    """The continuation of `prompt` as one string (`stream` joined); same keyword arguments."""
    return "".join(stream(model, tokenizer, prompt, max_new_tokens, **kwargs))


class _CallableModule(types.ModuleType):
    """Lets `decoderlm.generate(model, ...)` call `generate` while `decoderlm.generate` stays this module."""

    def __call__(self, *args: Any, **kwargs: Any) -> list[list[int]]:
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
