"""Streaming text: token ids to UTF-8-safe text pieces, stop strings held back until they are decided.

`stream` yields the continuation of a prompt as text while it is generated; `IncrementalDecoder`
and `StopMatcher` are the two pieces a server needs for the same job.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from torch import Tensor

from decoderlm.cpu.paths import SpeedPaths
from decoderlm.errors import DecoderLMError
from decoderlm.inference.generate import decode_steps, evaluating
from decoderlm.inference.options import DecodeOptions
from decoderlm.inference.prompts import make_generator, prompt_rows
from decoderlm.inference.sampling import SamplingParams, sampling_params
from decoderlm.model import DecoderLM


class IncrementalDecoder:
    """Turns token ids into text pieces as they arrive, never splitting a multi-byte character.

    It decodes a short window of recent ids and emits what it adds to the previous window's text,
    holding back while the text ends in U+FFFD (an incomplete UTF-8 sequence); the prompt's last
    ids seed the window so tokenizers that strip a leading space decode the first piece right.
    With `skip_special_tokens` the special tokens' text is left out (vLLM's default).
    """

    def __init__(
        self, tokenizer: Any, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-4:])
        self.prefix = 0  # start of the decoding window
        self.read = len(self.ids)  # ids before this have been emitted

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _decode(self, ids: list[int]) -> str:
        if self.skip:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids)

    def _emit(self, final: bool) -> str:
        before = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]


class StopMatcher:
    """Cuts a stream of text pieces at the first stop string (after it, with `include`), holding
    back a possible partial match; `stopped_at` is the stop string that ended it."""

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include
        self.pending = ""
        self.stopped = False
        self.stopped_at: str | None = None

    def feed(self, piece: str, armed: bool = True) -> str:
        """The text that is safe to emit now; sets `stopped` once a stop string is complete
        (never while not `armed`: before a request's min_tokens, stop strings are plain text)."""
        if self.stopped:
            return ""
        text = self.pending + piece
        if not armed:
            self.pending = ""
            return text
        hits = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            at, stop = min(hits)
            self.stopped, self.stopped_at, self.pending = True, stop, ""
            return text[: at + len(stop)] if self.include else text[:at]
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
    params: SamplingParams | None = None,
    *,
    seed: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    refill_past_context: bool = False,
    compile: bool = False,
    cpu_kernels: bool | SpeedPaths = True,
    kv_cache_dtype: str | None = None,
    batch_invariant: bool = False,
    **sampling: Any,
) -> Iterator[str]:
    """An iterator over the continuation of `prompt`, as text pieces while they are generated.

    Stops after `max_new_tokens`, at one of the model's stop ids (`Tokenizer.stop_ids`, unless
    `ignore_eos`) or before the first of the `stop` strings (which is not yielded); special
    tokens' text is left out. Bad arguments raise
    here, before anything is generated. Sampling (`params` and/or its fields as keywords), `seed`,
    `refill_past_context`, `compile`, `cpu_kernels`, `kv_cache_dtype` and `batch_invariant` (the
    logits, bit for bit, of `Engine(batch_invariant=True)`'s same request) are those of
    `decoderlm.inference.generate.generate`; the model is in eval mode (with the speed paths of
    `cpu_kernels` applied) while the iterator runs, restored when it ends or is closed.
    """
    params = sampling_params(params, sampling)
    if not prompt:
        raise DecoderLMError("empty prompt: give some text to continue")
    ids = tokenizer.encode_prompt(prompt)  # a BOS first where the model's tokenizer adds one
    rows = prompt_rows([ids], model.config.vocab_size)
    options = DecodeOptions.of(
        compile, cpu_kernels, kv_cache_dtype, refill_past_context, batch_invariant
    )
    options.check(model, rows, max_new_tokens)
    stops = frozenset(() if ignore_eos else getattr(tokenizer, "stop_ids", ()))
    generator = make_generator(seed, model.tok_emb.weight.device)
    steps = decode_steps(model, rows, max_new_tokens, params, generator, options)
    decoder, matcher = (
        IncrementalDecoder(tokenizer, ids, skip_special_tokens=True),
        StopMatcher(stop),
    )
    return _text_pieces(model, steps, decoder, matcher, stops, options)


def _text_pieces(
    model: DecoderLM,
    steps: Iterator[Tensor],
    decoder: IncrementalDecoder,
    matcher: StopMatcher,
    stops: frozenset[int],
    options: DecodeOptions,
) -> Iterator[str]:
    with evaluating(model), options.applied(model):
        for token in steps:
            token_id = int(token[0])  # streaming needs each token on the host
            if token_id in stops:
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
    model: DecoderLM,
    tokenizer: Any,
    prompt: str,
    max_new_tokens: int,
    params: SamplingParams | None = None,
    **kwargs: Any,
) -> str:
    """The continuation of `prompt` as one string (`stream` joined); the same keyword arguments."""
    return "".join(stream(model, tokenizer, prompt, max_new_tokens, params, **kwargs))
