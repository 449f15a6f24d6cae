"""Autoregressive generation over a static KV cache: prefill, one-token steps, padded batches.

The prompt is run once (prefill) to fill the cache; every later step feeds one token per row with
explicit positions, so RoPE, learned and sinusoidal positions are right at every step. Prompts of
different lengths are left-padded: each row counts its positions from 0 at its first real token and
a key mask hides its padding, so a row decodes exactly as it would alone.

Sampling (`decoderlm.inference.sampling`) applies the repetition penalty, temperature, top-k and
top-p in Hugging Face's order; its options are the fields of `SamplingParams`, given once.

How to decode, as opposed to what, is one `DecodeOptions` (`decoderlm.inference.options`):
compilation, the KV cache's storage, refilling past the context, and the CPU speed paths
(`decoderlm.cpu.paths.SpeedPaths.for_generate`: the attention/embedding paths inside the model,
the linear kernels for the prefill and the compiled steps, the compiled step's attention read in
place). `generate(cpu_kernels=False)` runs the model as defined, with F.linear; a `SpeedPaths`
picks paths one by one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from decoderlm.cpu import invariant
from decoderlm.cpu.decode import CompiledStep, InPlaceKVCache
from decoderlm.cpu.paths import SpeedPaths
from decoderlm.errors import DecoderLMError
from decoderlm.inference import speculative
from decoderlm.inference.options import DecodeOptions, float_probe
from decoderlm.inference.prompts import Prompt, make_generator, prompt_rows
from decoderlm.inference.sampling import (
    SamplingParams,
    sample_next,
    sample_rows,
    sampling_params,
)
from decoderlm.inference.speculative import DEFAULT_NUM_SPECULATIVE_TOKENS, Draft, SpeculativeStats
from decoderlm.inference.structured import Matcher, StructuredGrammar, accept_tokens, mask_logits
from decoderlm.model.cache import CacheStep, LayerCache, LayerCaches
from decoderlm.model.lm import DecoderLM

# One generator for the batch, or one per row (`sample_rows`: each row drawn alone from its own).
Generators = torch.Generator | list[torch.Generator | None] | None

# Rows stop being checked for end-of-text on every step (a host sync); `generate` looks every this many.
EOS_CHECK_INTERVAL = 16
# Compiled decoding sizes its cache in multiples of this, so nearby lengths share one compiled graph.
COMPILE_CACHE_MULTIPLE = 256
# Compiled prefill left-pads prompts to a multiple of this, for the same reason.
COMPILE_PREFILL_MULTIPLE = 64


@contextmanager
def evaluating(model: DecoderLM, modules: Sequence[nn.Module] | None = None) -> Iterator[None]:
    """Eval mode (no dropout) and no autograd for the duration; each module's mode is restored after.

    Only the modules in training mode are switched, so a model already in eval mode (a serving
    engine calls this at every step) is not written to at all. modules: `list(model.modules())`,
    made once by a caller that enters this at every step (walking the tree takes ~0.8 ms of a
    135M model's 12 ms decode step)."""
    modules = model.modules() if modules is None else modules
    training = [m for m in modules if m.training]  # (module setattr is slow in Python)
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


def _fill_lengths(
    rows: list[list[int]], max_new_tokens: int, context: int, options: DecodeOptions
) -> tuple[int, int]:
    """(n, max_len): the first fill's length (the prompts, left-padded) and the cache's slots.

    Compiled decoding rounds both up (`COMPILE_PREFILL_MULTIPLE`, `COMPILE_CACHE_MULTIPLE`), so
    that nearby lengths share one compiled graph; in batch-invariant mode only the cache, as its
    prompts run eagerly (padding them would compute rows for nothing: 37-token prompts padded to
    64 took 1.7× the time)."""
    n = max(len(row) for row in rows)
    if options.compile and not options.batch_invariant:
        rounded = math.ceil(n / COMPILE_PREFILL_MULTIPLE) * COMPILE_PREFILL_MULTIPLE
        n = rounded if rounded + max_new_tokens <= context else n
    max_len = min(n + max_new_tokens, context)
    if options.compile:
        max_len = min(math.ceil(max_len / COMPILE_CACHE_MULTIPLE) * COMPILE_CACHE_MULTIPLE, context)
    return n, max_len


def decode_steps(
    model: DecoderLM,
    rows: list[list[int]],
    max_new_tokens: int,
    params: SamplingParams,
    generator: Generators = None,
    options: DecodeOptions | None = None,
    matchers: Sequence[Matcher | None] | None = None,
) -> Iterator[Tensor]:
    """Yield the new token of every row, (B,) on the model's device, `max_new_tokens` times.

    Call it under `torch.inference_mode()` with the model in eval mode and `options.applied(model)`
    (`generate` does both). Nothing here waits for the device: the caller decides when to
    look at the tokens (and to stop). Past `context_length`, either raise (default) or, with
    `refill_past_context`, drop the oldest quarter of the context and refill the cache from the rest
    (one prefill), so every token still sees ≥ 3/4 of a context. The linear-kernels path covers the
    prefill (and with `compile` the one-token step); never the eager one-token step, as the mode's
    Python hook on every op costs more than it saves there. A model with a sliding window keeps its
    windowed layers' K/V in rings of W slots (`RingKVCache`); when every layer has one, decoding
    goes on past `context_length` with nothing refilled. Recurrent layers keep a fixed-size state
    (`HybridCache`), which a padded token leaves unchanged (`CacheStep.valid`); a model with no
    attention layer (and RoPE or no positions) decodes past `context_length` too. `matchers`: one
    per row (None: that row is free), each row's structured output
    (`decoderlm.inference.structured`): its grammar masks the row's logits and takes its tokens,
    one host copy of the tokens per step.
    """
    options = DecodeOptions() if options is None else options
    cfg = model.config
    context = cfg.context_length
    options.check(model, rows, max_new_tokens)
    n, max_len = _fill_lengths(rows, max_new_tokens, context, options)
    cache = options.cache(model, len(rows), max_len)
    seen = _seen_tokens(rows, params, cfg.vocab_size, float_probe(model).device)
    decoder = _Decoder(model, cache, options, params, generator, matchers, seen)
    left = max_new_tokens
    while True:  # one pass per cache fill; more than one only with refill_past_context
        new = yield from decoder.fill(rows, n, max_len, left)
        left -= len(new)
        if left == 0:
            return
        keep = context - max(1, context // 4)  # the refill: the newest 3/4 of the context
        generated = torch.stack(new, dim=1).tolist()  # (B, n_new)
        rows = [(row + extra)[-keep:] for row, extra in zip(rows, generated, strict=True)]
        n = keep


def _seen_tokens(
    rows: list[list[int]], params: SamplingParams, vocab_size: int, device: torch.device
) -> Tensor | None:
    """(B, V): the tokens each row holds, which the repetition penalty lowers; None without one."""
    if params.repetition_penalty == 1.0:
        return None
    seen = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)  # (B, V)
    for b, row in enumerate(rows):
        seen[b, row] = True
    return seen


@dataclass
class _Decoder:
    """What every cache fill of one `decode_steps` call shares: the model and its cache, the
    compiled one-token step (with `compile`), how to pick tokens and what each row has seen."""

    model: DecoderLM
    cache: LayerCaches
    options: DecodeOptions
    params: SamplingParams
    generator: Generators
    matchers: Sequence[Matcher | None] | None
    seen: Tensor | None  # (B, V), for the repetition penalty
    step: CompiledStep | None = field(init=False)  # the compiled one-token step, with `compile`
    unbounded: bool = field(init=False)  # the ring never fills: no refill, no length limit

    def __post_init__(self) -> None:
        paths, batch_invariant = self.options.paths, self.options.batch_invariant
        self.step = None
        # batch-invariant: traced with every kernel an op, or not compiled (eager steps)
        if self.options.compile and (not batch_invariant or invariant.traceable([self.model])):
            self.step = CompiledStep(
                self.model,
                self.cache,
                next_logits,
                linear_kernels=paths.linear_kernels,
                in_place_attention=paths.in_place_attention or batch_invariant,
                batch_invariant=batch_invariant,
            )
        self.unbounded = self.model.config.decodes_past_context

    def fill(
        self, rows: list[list[int]], n: int, max_len: int, budget: int
    ) -> Generator[Tensor, None, list[Tensor]]:
        """Prefill the cache with `rows` left-padded to n tokens, then yield one new token per
        row (B,) per step, into slots n, n + 1, …, until `budget` tokens or a full cache (never
        when unbounded); returns the tokens yielded."""
        logits, pad, filled, padded = self.prefill(rows, n, max_len)
        new: list[Tensor] = []
        slot = torch.zeros(1, dtype=torch.long, device=pad.device)  # (1,) the slot being written
        while True:
            token = self.pick(logits)  # (B,)
            yield token
            new.append(token)
            if len(new) == budget:
                return new
            if self.seen is not None:
                self.seen.scatter_(1, token[:, None], True)
            if n == max_len and not self.unbounded:
                return new  # the cache is full: slide the window
            slot.fill_(n)
            if self.step is not None:  # fixed shapes: attends the whole buffer, masked in the step
                logits = self.step(token[:, None], slot, pad)
            else:
                logits = self.one_token(token, slot, n, pad, filled if padded else None)
            n += 1

    def prefill(
        self, rows: list[list[int]], n: int, max_len: int
    ) -> tuple[Tensor, Tensor, Tensor, bool]:
        """Run `rows`, left-padded to n tokens, into the cache's first n slots: (logits (B, V) of
        each row's next token, pad (B,) its padding, filled (B, S) the slots holding a real token,
        whether any row is padded)."""
        device = float_probe(self.model).device
        compile, paths = self.options.compile, self.options.paths
        pad = torch.tensor([n - len(row) for row in rows], device=device)  # (B,) left padding
        slots = torch.arange(max_len, device=device)  # (S,)
        filled = slots[None, :] >= pad[:, None]  # (B, S) key mask: real tokens, not padding
        padded = bool(pad.any())
        if isinstance(self.cache, InPlaceKVCache):  # each query attends from its row's first slot
            self.cache.pad.copy_(pad)
        idx = torch.tensor([[0] * (n - len(row)) + row for row in rows], device=device)  # (B, n)
        positions = (slots[None, :n] - pad[:, None]).clamp(min=0)  # (B, n): 0 at the 1st token
        self.cache.seek(CacheStep.span(0, n, device, filled[:, :n] if padded else None))
        # batch-invariant prompts attend per query, eagerly (`paged_attention.static_attention`)
        prefill = (
            compiled_prefill() if compile and not self.options.batch_invariant else next_logits
        )
        with paths.linear(compile or n > 1, compiling=compile):
            logits = prefill(
                self.model, self.cache, idx, positions, filled[:, :n] if padded else None
            )
        filled &= slots < n  # from here on: the slots holding a real token
        return logits, pad, filled, padded

    def one_token(
        self, token: Tensor, slot: Tensor, n: int, pad: Tensor, filled: Tensor | None
    ) -> Tensor:
        """Logits (B, V) after token (B,) written into slot n (eager); `filled` (B, S) the slots
        holding a real token, None when no row is padded."""
        key_padding_mask = None  # rings hand attention their own key mask
        if not self.unbounded and filled is not None:
            filled[:, n] = True
            key_padding_mask = filled[:, : n + 1]
        self.cache.seek(CacheStep(slot, n + 1))
        positions = (slot - pad)[:, None]  # (B, 1)
        return next_logits(self.model, self.cache, token[:, None], positions, key_padding_mask)

    def pick(self, logits: Tensor) -> Tensor:
        """The next token (B,) of every row from its logits (B, V): masked by the row's grammar
        (structured output), sampled, and taken by the grammar."""
        if self.matchers is not None:
            mask_logits(logits, self.matchers)
        if isinstance(self.generator, list):
            token = sample_rows(logits, self.params, self.seen, self.generator)  # (B,)
        else:
            token = sample_next(logits, self.params, self.seen, self.generator)
        if self.matchers is not None:
            accept_tokens(self.matchers, token)
        return token


def generate(
    model: DecoderLM,
    prompt: Prompt,
    max_new_tokens: int,
    params: SamplingParams | None = None,
    *,
    seed: int | None = None,
    eos_id: int | Sequence[int] | None = None,
    num_samples: int = 1,
    refill_past_context: bool = False,
    compile: bool = False,
    cpu_kernels: bool | SpeedPaths = True,
    kv_cache_dtype: str | None = None,
    structured: StructuredGrammar | None = None,
    draft: Draft | None = None,
    num_speculative_tokens: int | None = None,
    speculative_stats: SpeculativeStats | None = None,
    batch_invariant: bool = False,
    **sampling: Any,
) -> list[list[int]]:
    """Continue each prompt row by up to `max_new_tokens` tokens; returns one id list per row.

    prompt: a (B, T) LongTensor, or a list of token-id lists of different lengths (left-padded
    internally). Each returned list is the row's prompt ids followed by its new ids, ending at
    (and including) the first of `eos_id` generated: one id or several (a loaded model's
    `tokenizer.stop_ids`, its end-of-sequence and end-of-turn ids). With `num_samples` > 1, each prompt gives that
    many rows, in order (prompt 0 sample 0, prompt 0 sample 1, ...).

    Sampling: `params`, and/or its fields as keywords (`temperature=0.8, top_k=50`; they win over
    `params`); temperature 0 = greedy. Any other keyword raises DecoderLMError. A seed makes
    sampling reproducible; without one, torch's global generator is used. `compile` compiles the
    prefill with torch.compile and the one-token step ahead of time with AOTInductor (see
    `decoderlm.cpu.decode`; over recurrent layers too, their states updated in place in the
    step; the first call of a shape pays for the compilation, and prompts are
    left-padded to a multiple of 64 so that nearby lengths share one prefill graph).
    `cpu_kernels=False` switches off the CPU speed paths, a `SpeedPaths` picks them one by one
    (module docstring). `kv_cache_dtype="int8"`
    keeps the cache in int8 with a scale per token and head (`decoderlm.model.cache.storage`: half
    the bytes of a bfloat16 cache, plus the scales); not with `compile`. `structured`: a
    `StructuredOutput` compiled for the tokenizer (`compile_structured(tokenizer, spec)`) that
    every row's new text follows, each row with its own matcher; `eos_id` defaults to its stop
    ids, which end a complete output.

    Speculative decoding (`decoderlm.inference.speculative`): `draft` a DecoderLM with the same
    vocabulary, or "prompt-lookup"; `num_speculative_tokens` K ≥ 1 proposed per step (default 4);
    rows are decoded one after another; the same output distribution (greedy: the same tokens).
    A `SpeculativeStats` given as `speculative_stats` receives the acceptance counts. Not with
    `structured` (its grammar would have to mask every proposed position).

    `batch_invariant`: each row's logits, and so its greedy tokens, are bit for bit those of the
    row alone, whatever the rows beside it and however much padding its prompt gets, in bfloat16
    too (`DecodeOptions.batch_invariant`: the linears and MLPs of `decoderlm.cpu.invariant`, each
    query attending its own keys in place; the same kernels as `Engine(batch_invariant=True)`).
    With a seed, sample s of each prompt draws from a generator of its own seeded seed + s, so
    its sampled tokens too are those of the prompt alone (sample 0: with `seed`), and those the
    engine gives sample s of a request with `seed`. Without a seed every row draws from torch's
    global generator. With `compile` the one-token step is compiled with every kernel an op (the
    prompt runs eagerly), where the ops are built (else the steps run eagerly). On the CPU, over
    the models `Engine(batch_invariant=True)` takes; not with a draft.
    """
    params = sampling_params(params, sampling)
    if not (isinstance(num_samples, int) and num_samples >= 1):
        raise DecoderLMError(f"num_samples={num_samples!r} must be an integer ≥ 1")
    rows = [row for row in prompt_rows(prompt, model.config.vocab_size) for _ in range(num_samples)]
    options = DecodeOptions.of(
        compile, cpu_kernels, kv_cache_dtype, refill_past_context, batch_invariant
    )
    options.check(model, rows, max_new_tokens)
    if draft is not None and batch_invariant:
        raise DecoderLMError(
            "batch_invariant=True with a draft is not supported (rows are speculated one by one "
            "here): drop one, or use decoderlm.engine.Engine(batch_invariant=True), which speculates"
        )
    k = _speculative_tokens(model, draft, num_speculative_tokens, rows, max_new_tokens, options)
    if max_new_tokens == 0:
        return rows
    device = float_probe(model).device
    generator: Generators = make_generator(seed, device)
    if batch_invariant and seed is not None:  # sample s of each prompt draws from seed + s
        generator = [make_generator(seed, device, i % num_samples) for i in range(len(rows))]
    matchers, stops = _structured_matchers(structured, draft, rows, _stop_ids(eos_id))
    if draft is not None:
        return _speculative_rows(
            model,
            rows,
            max_new_tokens,
            params,
            draft,
            k,
            generator,
            options,
            stops,
            speculative_stats,
        )
    with evaluating(model), options.applied(model):
        steps = decode_steps(model, rows, max_new_tokens, params, generator, options, matchers)
        new = _until_every_row_ends(steps, stops, len(rows))
    generated = torch.stack(new, dim=1).tolist()  # (B, n_new): the only host copy of the tokens
    return [row + _until(extra, stops) for row, extra in zip(rows, generated, strict=True)]


def _speculative_tokens(
    model: DecoderLM,
    draft: Draft | None,
    k: int | None,
    rows: list[list[int]],
    max_new_tokens: int,
    options: DecodeOptions,
) -> int | None:
    """K, the tokens a draft proposes per step (default DEFAULT_NUM_SPECULATIVE_TOKENS), checked
    with the draft; a K without a draft is an error."""
    if draft is not None:
        k = DEFAULT_NUM_SPECULATIVE_TOKENS if k is None else k
        speculative.check(model, draft, k, rows, max_new_tokens, options)
    elif k is not None:
        raise DecoderLMError("num_speculative_tokens needs a draft (a model or 'prompt-lookup')")
    return k


def _speculative_rows(
    model: DecoderLM,
    rows: list[list[int]],
    max_new_tokens: int,
    params: SamplingParams,
    draft: Draft,
    k: int,
    generator: torch.Generator | None,
    options: DecodeOptions,
    stops: tuple[int, ...],
    stats: SpeculativeStats | None,
) -> list[list[int]]:
    """`speculative.speculative_rows`, every model in eval mode with its speed paths applied."""
    drafter = [draft] if isinstance(draft, DecoderLM) and draft is not model else []
    with ExitStack() as stack:
        for m in [model, *drafter]:
            stack.enter_context(evaluating(m))
            stack.enter_context(options.paths.applied(m))
        return speculative.speculative_rows(
            model, rows, max_new_tokens, params, draft, k, generator, options, stops, stats
        )


def _structured_matchers(
    structured: StructuredGrammar | None,
    draft: Draft | None,
    rows: list[list[int]],
    stops: tuple[int, ...],
) -> tuple[list[Matcher | None] | None, tuple[int, ...]]:
    """(one grammar matcher per row, the stop ids defaulting to the grammar's); (None, stops)
    without `structured`."""
    if structured is not None and draft is not None:
        raise DecoderLMError(
            "structured output with speculative decoding is not supported yet: drop draft= or "
            "structured="
        )
    if structured is None:
        return None, stops
    if not isinstance(structured, StructuredGrammar):
        raise DecoderLMError(
            f"structured={structured!r:.80} must be compile_structured(tokenizer, spec)"
        )
    matchers: list[Matcher | None] = [structured.matcher() for _ in rows]
    return matchers, stops or structured.stop_ids


def _stop_ids(eos_id: int | Sequence[int] | None) -> tuple[int, ...]:
    """`generate`'s eos_id as a tuple of ids (none for None); DecoderLMError for anything else."""
    ids = () if eos_id is None else (eos_id,) if isinstance(eos_id, int) else tuple(eos_id)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise DecoderLMError(f"eos_id={eos_id!r} must be a token id, a sequence of them, or None")
    return ids


def _until_every_row_ends(
    steps: Iterator[Tensor], stops: tuple[int, ...], batch: int
) -> list[Tensor]:
    """The tokens (B,) of `steps` until they end or every row has generated one of `stops`
    (looked at every EOS_CHECK_INTERVAL steps: each look waits for the device)."""
    new: list[Tensor] = []
    done, stop = None, None
    for i, token in enumerate(steps):
        new.append(token)
        if stops:
            if stop is None:
                stop = torch.tensor(stops, device=token.device)
                done = torch.zeros(batch, dtype=torch.bool, device=token.device)
            done |= torch.isin(token, stop)
            if (i + 1) % EOS_CHECK_INTERVAL == 0 and bool(done.all()):
                break
    return new


def _until(ids: list[int], stops: tuple[int, ...]) -> list[int]:
    """ids up to and including the first of `stops`."""
    end = next((i for i, token in enumerate(ids) if token in stops), None)
    return ids if end is None else ids[: end + 1]
