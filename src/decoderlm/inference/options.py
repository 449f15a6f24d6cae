"""How `generate`, `stream` and `evaluate` decode: one `DecodeOptions`, checked once, passed down.

The options that do not change what is sampled, only how it is computed: torch.compile and the
AOT-compiled one-token step, the CPU speed paths (`decoderlm.cpu.paths.SpeedPaths`), the KV
cache's storage, refilling the cache past the context, and batch invariance (each row's logits
bit for bit those of the row alone).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from decoderlm.cpu import paged_attention
from decoderlm.cpu.decode import InPlaceKVCache, attends_in_place
from decoderlm.cpu.invariant import batch_invariant_swap
from decoderlm.cpu.paths import SpeedPaths
from decoderlm.cpu.swap import swapped
from decoderlm.errors import DecoderLMError
from decoderlm.inference.prompts import check_lengths
from decoderlm.model.cache import LayerCaches, check_kv_cache_dtype, make_cache
from decoderlm.model.lm import DecoderLM


@dataclass(frozen=True)
class DecodeOptions:
    """compile: the prefill under torch.compile and the one-token step compiled ahead of time
    (`decoderlm.cpu.decode.CompiledStep`); paths: the CPU speed paths applied; kv_cache_dtype:
    None (K/V in the model's dtype) or "int8" (`decoderlm.model.cache.storage`);
    refill_past_context: past `context_length`, drop the oldest quarter and refill the cache
    instead of refusing; batch_invariant: every row's logits the bits of the row alone, whatever
    the rows beside it and its padding (`applied`: the linears and MLPs of
    `decoderlm.cpu.invariant`; `cache`: each query attends its own row's keys in place, a
    prompt's too)."""

    compile: bool = False
    paths: SpeedPaths = field(default_factory=SpeedPaths.for_generate)
    kv_cache_dtype: str | None = None
    refill_past_context: bool = False
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
        for name in ("compile", "refill_past_context", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise DecoderLMError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.compile and self.kv_cache_dtype == "int8":
            raise DecoderLMError(
                "compile=True does not support kv_cache_dtype='int8' (the compiled one-token step "
                "takes plain K/V buffers); drop one of the two"
            )

    @classmethod
    def of(
        cls,
        compile: bool = False,
        cpu_kernels: bool | SpeedPaths = True,
        kv_cache_dtype: str | None = None,
        refill_past_context: bool = False,
        batch_invariant: bool = False,
    ) -> DecodeOptions:
        """The options of the keyword arguments `generate` takes: cpu_kernels True applies
        `SpeedPaths.for_generate()`, False none, a SpeedPaths exactly those paths (with
        batch_invariant, the invariant linears instead of packed ones)."""
        default = SpeedPaths.for_generate()
        if batch_invariant:  # the engine's kernels for norms, RoPE and SwiGLU's gate: its bits
            default = dataclasses.replace(default, fused_ops=True)
        paths = SpeedPaths.resolve(cpu_kernels, default)
        if batch_invariant:
            paths = paths.without("packed_linears")
        return cls(compile, paths, kv_cache_dtype, refill_past_context, batch_invariant)

    def check(self, model: DecoderLM, rows: list[list[int]], max_new_tokens: int) -> None:
        """DecoderLMError unless these options can generate `max_new_tokens` after `rows` with
        `model`: a model whose every layer has a sliding window has no length limit past its
        prompt; the compiled step does not take the ring cache a windowed model decodes over."""
        cfg = model.config
        past = self.refill_past_context or cfg.decodes_past_context
        check_lengths(rows, max_new_tokens, cfg.context_length, past)
        if self.compile and cfg.sliding_window is not None:
            raise DecoderLMError(
                f"a model with sliding_window={cfg.sliding_window} decodes over a ring KV cache, "
                "which compile=True does not support yet; drop compile"
            )

    @contextmanager
    def applied(self, model: DecoderLM) -> Iterator[None]:
        """The speed paths applied to `model` for the duration, and with batch_invariant its
        invariant modules swapped in (made on entry; DecoderLMError naming what cannot be made
        invariant: `decoderlm.cpu.invariant.batch_invariant_swap`)."""
        swap = []
        if self.batch_invariant:
            weight = float_probe(model)
            in_place = attends_in_place(model, weight.dtype, weight.device)  # the steps' op
            in_place &= paged_attention.available(weight.dtype, weight.device)  # the prompt's
            swap = batch_invariant_swap(model, self.kv_cache_dtype, in_place)
        with self.paths.applied(model), swapped(swap):
            yield

    def cache(self, model: DecoderLM, batch_size: int, max_len: int) -> LayerCaches:
        """The cache of one generation (`decoderlm.model.cache.make_cache`): rings for a windowed
        model, conv and matrix states for recurrent layers, else static buffers; K/V in the
        model's dtype or in `kv_cache_dtype`; with batch_invariant, an `InPlaceKVCache`."""
        weight = float_probe(model)
        if self.batch_invariant:
            cfg = model.config
            return InPlaceKVCache(cfg, batch_size, max_len, weight.dtype, weight.device)
        return make_cache(
            model.config, batch_size, max_len, weight.dtype, weight.device, self.kv_cache_dtype
        )


def float_probe(model: DecoderLM) -> Tensor:
    """A tensor of the dtype and on the device of the model's floats, made without touching a
    weight: a GGUF model's `tok_emb.weight` (`decoderlm.quant.BlockEmbedding`) dequantizes its
    whole table on each access, where its empty `float_dtype` buffer says the same."""
    probe = getattr(model.tok_emb, "float_dtype", None)
    return probe if isinstance(probe, torch.Tensor) else model.tok_emb.weight
