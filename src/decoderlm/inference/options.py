"""How `generate`, `stream` and `evaluate` decode: one `DecodeOptions`, checked once, passed down.

The options that do not change what is sampled, only how it is computed: torch.compile and the
AOT-compiled one-token step, the CPU speed paths (`decoderlm.cpu.paths.SpeedPaths`), the KV
cache's storage, and refilling the cache past the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from decoderlm.cpu.paths import SpeedPaths
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
    instead of refusing."""

    compile: bool = False
    paths: SpeedPaths = field(default_factory=SpeedPaths.for_generate)
    kv_cache_dtype: str | None = None
    refill_past_context: bool = False

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
        for name in ("compile", "refill_past_context"):
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
    ) -> DecodeOptions:
        """The options of the keyword arguments `generate` takes: cpu_kernels True applies
        `SpeedPaths.for_generate()`, False none, a SpeedPaths exactly those paths."""
        paths = SpeedPaths.resolve(cpu_kernels, SpeedPaths.for_generate())
        return cls(compile, paths, kv_cache_dtype, refill_past_context)

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

    def cache(self, model: DecoderLM, batch_size: int, max_len: int) -> LayerCaches:
        """The cache of one generation (`decoderlm.model.cache.make_cache`): rings for a windowed
        model, conv and matrix states for recurrent layers, else static buffers; K/V in the
        model's dtype or in `kv_cache_dtype`."""
        weight = float_probe(model)
        return make_cache(
            model.config, batch_size, max_len, weight.dtype, weight.device, self.kv_cache_dtype
        )


def float_probe(model: DecoderLM) -> Tensor:
    """A tensor of the dtype and on the device of the model's floats, made without touching a
    weight: a GGUF model's `tok_emb.weight` (`decoderlm.quant.BlockEmbedding`) dequantizes its
    whole table on each access, where its empty `float_dtype` buffer says the same."""
    probe = getattr(model.tok_emb, "float_dtype", None)
    return probe if isinstance(probe, torch.Tensor) else model.tok_emb.weight
