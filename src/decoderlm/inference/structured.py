"""Structured output: a grammar masks the tokens a sequence may take next, with xgrammar (Dong et
al., 2024, "XGrammar: Flexible and Efficient Structured Generation Engine for Large Language
Models"), as OpenAI's `response_format` and vLLM's `structured_outputs` ask for it.

A `StructuredOutput` names what the output must be: a JSON schema, any JSON object, a regular
expression, one of a few strings, or an EBNF (GBNF) grammar. `compile_structured` compiles it for
one tokenizer's vocabulary (cached by tokenizer and spec) into a `StructuredGrammar`, which makes
one `Matcher` per sequence. Each step, `mask_logits` fills one bitmask row per constrained
sequence and sets the logits of the tokens the grammar forbids to -inf; the sampled token advances
that sequence's matcher (`Matcher.accept`). A complete output allows only the model's stop ids,
which ends the sequence ("stop"). JSON is compact (no free whitespace: separators "," and ":"),
so a constrained answer ends instead of looping on spaces. Where xgrammar's grammars admit what
no parser reads (UTF-16 surrogates in UTF-8, control characters in JSON strings), the
`Vocabulary`'s bits take those tokens out. A spec that no token can start is refused when it
compiles; an output that dead-ends later (no token spells what comes next) ends there.

xgrammar is an optional dependency (`pip install 'decoderlm[structured]'`), imported on first use.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from decoderlm.errors import DecoderLMError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
SEPARATORS = (",", ":")  # compact JSON, as json.dumps(separators=...)
CACHED_GRAMMARS = 64  # compiled (tokenizer, spec) pairs kept, the least recently used dropped

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StructuredOutput:
    """What a sequence's text must be: `kind` and its `spec`.

    - "json": spec a JSON schema (a dict, or its JSON text; kept as text);
    - "json_object": any JSON object (spec None);
    - "regex": spec a regular expression the whole output matches;
    - "choice": spec a tuple of strings, the output exactly one of them;
    - "grammar": spec an EBNF grammar in GBNF's notation, whose start rule is `root`.
    """

    kind: str
    spec: Any = None

    def __post_init__(self) -> None:
        kind, spec = self.kind, self.spec
        if kind not in KINDS:
            raise DecoderLMError(f"structured output kind={kind!r} must be one of {KINDS}")
        if kind == "json":
            object.__setattr__(self, "spec", _schema_text(spec))
        elif kind == "choice":
            choices = tuple(spec) if isinstance(spec, list | tuple) else ()
            if not choices or not all(isinstance(c, str) for c in choices):
                raise DecoderLMError(f"choice={spec!r:.80} must be a non-empty list of strings")
            object.__setattr__(self, "spec", choices)
        elif kind == "json_object":
            if spec is not None:
                raise DecoderLMError(f"json_object takes no spec (got {spec!r:.80})")
        elif not (isinstance(spec, str) and spec):
            raise DecoderLMError(f"{kind}={spec!r:.80} must be a non-empty string")


def _schema_text(schema: Any) -> str:
    """A JSON schema as JSON text: a dict dumped, a string checked to be a JSON object."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise DecoderLMError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise DecoderLMError(f"the JSON schema must be a JSON object (got {schema!r:.80})")
    return json.dumps(schema, ensure_ascii=False)


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise DecoderLMError(
            "structured output needs xgrammar: pip install 'decoderlm[structured]'"
        ) from None
    return xgrammar


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """A tokenizer's vocabulary as xgrammar compiles for it, and bits (⌈V / 32⌉,) int32 of the
    tokens that keep an output well-formed where xgrammar's grammars let it not be: its UTF-8
    admits the UTF-16 surrogates U+D800–U+DFFF (bytes ED A0–BF ..), which no UTF-8 decoder
    accepts, and its JSON strings admit unescaped control characters U+0000–U+001F, which JSON
    forbids (RFC 8259 §7; mlc-ai/xgrammar#286) and compact JSON, without whitespace, never needs.
    """

    compiler: Any  # xgrammar.GrammarCompiler
    size: int  # the tokenizer's ids, which a bitmask covers
    stop_ids: tuple[int, ...]  # the model's stop ids: the only ones allowed once it is complete
    valid: Tensor  # no surrogate inside the token
    printable: Tensor  # valid, and no control character
    after_ed: Tensor  # not starting with A0–BF: may follow a token that ends in the lead byte ED
    ends_in_ed: frozenset[int]  # the tokens that end in ED
    stop: Tensor  # the stop ids alone


@dataclass(frozen=True, eq=False)
class StructuredGrammar:
    """A `StructuredOutput` compiled for one tokenizer: makes each sequence's `Matcher`."""

    compiled: Any  # xgrammar.CompiledGrammar
    vocab: Vocabulary
    allowed: Tensor  # the vocabulary's bits this grammar's tokens must be among

    @property
    def vocab_size(self) -> int:
        return self.vocab.size

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.vocab.stop_ids

    def matcher(self) -> Matcher:
        """A fresh matcher, at the start of the output."""
        return Matcher(self, _xgrammar().GrammarMatcher(self.compiled))


class Matcher:
    """One sequence's place in its grammar; advanced by the tokens sampled for it."""

    def __init__(self, grammar: StructuredGrammar, state: Any) -> None:
        self.grammar, self._state = grammar, state  # state: an xgrammar.GrammarMatcher
        self._after_ed = False  # the last token ended in ED: no surrogate may follow
        self._dead_end = self._ended = False

    @property
    def terminated(self) -> bool:
        """The output is complete and its stop id was accepted (or it dead-ended)."""
        return self._ended or self._state.is_terminated()

    def fill(self, bitmask: Tensor, row: int) -> None:
        """Row `row` of an int32 bitmask (B, ⌈V / 32⌉): bit t set iff token t may come next.

        At a dead end, where no token of the vocabulary spells what the grammar needs next (a
        character the tokenizer lacks), only the stop ids: the output ends there, as a
        prefix of the grammar's language (logged), rather than sample from nothing."""
        self._dead_end = not self.spellable(bitmask, row)
        if self._dead_end:
            bitmask[row] = self.grammar.vocab.stop
            log.warning("structured output: no token spells what its grammar needs next; it ends")

    def spellable(self, bitmask: Tensor, row: int) -> bool:
        """Fill row `row` with the tokens that may come next; whether there is one."""
        self._state.fill_next_token_bitmask(bitmask, row)
        bitmask[row] &= self.grammar.allowed
        if self._after_ed:
            bitmask[row] &= self.grammar.vocab.after_ed
        return bool(bitmask[row].any())

    def accept(self, token: int) -> None:
        """`token` was sampled: advance. DecoderLMError if the grammar forbids it."""
        if self._dead_end and token in self.grammar.stop_ids:
            self._ended = True
            return
        if not self._state.accept_token(token):
            raise DecoderLMError(f"token {token} does not continue the structured output")
        self._after_ed = token in self.grammar.vocab.ends_in_ed


def mask_logits(logits: Tensor, matchers: Sequence[Matcher | None]) -> None:
    """Set to -inf, in place, each constrained row's logits (B, V) of the tokens its grammar
    forbids next, and of the ids past the tokenizer's vocabulary; rows whose matcher is None or
    terminated are left as they are."""
    rows = [i for i, m in enumerate(matchers) if m is not None and not m.terminated]
    if not rows:
        return
    xgr = _xgrammar()
    vocab_size = matchers[rows[0]].grammar.vocab_size
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    for i in rows:
        matchers[i].fill(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)
    if logits.shape[-1] > vocab_size:
        logits[rows, vocab_size:] = float("-inf")


def accept_tokens(matchers: Sequence[Matcher | None], tokens: Tensor) -> None:
    """Advance each row's matcher (unless None or terminated) by its token in tokens (B,)."""
    for matcher, token in zip(matchers, tokens.tolist(), strict=True):
        if matcher is not None and not matcher.terminated:
            matcher.accept(token)


def compile_structured(tokenizer: Any, spec: StructuredOutput) -> StructuredGrammar:
    """`spec` compiled for `tokenizer` (a `decoderlm.tokenizer.Tokenizer`), cached by both.

    DecoderLMError, one line naming the problem, if it cannot compile (an unsupported or invalid
    schema, a bad regex or grammar), if xgrammar is not installed, or if the model has no stop
    id to end the output with."""
    if not isinstance(spec, StructuredOutput):
        raise DecoderLMError(f"structured={spec!r:.80} must be a StructuredOutput")
    return _compiled(tokenizer, spec)


@functools.lru_cache(maxsize=CACHED_GRAMMARS)
def _compiled(tokenizer: Any, spec: StructuredOutput) -> StructuredGrammar:
    vocab = vocabulary(tokenizer)
    compiler = vocab.compiler
    try:
        if spec.kind == "json":
            compiled = compiler.compile_json_schema(
                spec.spec, any_whitespace=False, separators=SEPARATORS
            )
        elif spec.kind == "json_object":
            compiled = compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=False, separators=SEPARATORS, strict_mode=False
            )
        elif spec.kind == "regex":
            compiled = compiler.compile_regex(spec.spec)
        elif spec.kind == "choice":
            choices = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.spec)
            compiled = compiler.compile_grammar(f"root ::= {choices}")
        else:
            compiled = compiler.compile_grammar(spec.spec)
    except (RuntimeError, UnicodeError) as exc:
        raise DecoderLMError(f"cannot compile the {spec.kind}: {_reason(exc)}") from None
    json_kind = spec.kind in ("json", "json_object")
    grammar = StructuredGrammar(compiled, vocab, vocab.printable if json_kind else vocab.valid)
    if not grammar.matcher().spellable(_xgrammar().allocate_token_bitmask(1, vocab.size), 0):
        raise DecoderLMError(f"no token of the tokenizer can start the {spec.kind}")
    return grammar


@functools.lru_cache(maxsize=8)
def vocabulary(tokenizer: Any) -> Vocabulary:
    """The `Vocabulary` of a `decoderlm.tokenizer.Tokenizer`, whose kind (raw characters,
    byte-level BPE, byte fallback) xgrammar reads from its tokenizer.json as from a Hugging Face
    tokenizer's; an output ends at one of the model's stop ids (`Tokenizer.stop_ids`).
    DecoderLMError if xgrammar is missing or the model has no stop id to end an output with."""
    xgr = _xgrammar()
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        raise DecoderLMError(
            f"structured output needs a decoderlm Tokenizer (got {type(tokenizer).__name__})"
        )
    stop_ids = tuple(tokenizer.stop_ids)
    if not stop_ids:
        raise DecoderLMError(
            "structured output needs a model with a stop id (an end-of-sequence token) to end "
            "the output"
        )
    from transformers import PreTrainedTokenizerFast  # an xgrammar dependency

    info = xgr.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=backend),
        vocab_size=tokenizer.vocab_size,
        stop_token_ids=list(stop_ids),
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # _compiled caches
    tokens = info.decoded_vocab
    valid = [re.search(b"\xed[\xa0-\xbf]", t) is None for t in tokens]
    printable = [
        ok and all(byte >= 0x20 for byte in t) for ok, t in zip(valid, tokens, strict=True)
    ]
    after_ed = [not t or not 0xA0 <= t[0] <= 0xBF for t in tokens]
    return Vocabulary(
        compiler,
        tokenizer.vocab_size,
        stop_ids,
        _pack_bits(valid),
        _pack_bits(printable),
        _pack_bits(after_ed),
        frozenset(i for i, t in enumerate(tokens) if t.endswith(b"\xed")),
        _pack_bits([i in stop_ids for i in range(len(tokens))]),
    )


def _pack_bits(bits: list[bool]) -> Tensor:
    """bits (V,) → int32 words (⌈V / 32⌉,), token t at bit t % 32 of word t // 32, as xgrammar's
    bitmasks hold them."""
    padded = torch.zeros(-(-len(bits) // 32) * 32, dtype=torch.int64)
    padded[: len(bits)] = torch.tensor(bits)
    words = (padded.view(-1, 32) << torch.arange(32)).sum(-1)  # (W,) in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _reason(exc: RuntimeError | UnicodeError) -> str:
    """xgrammar's message without its C++ source location: '[10:05:08] /project/cpp/x.cc:94: '.
    A message that quotes half of a UTF-8 character reaches Python as a UnicodeDecodeError (its
    bytes are kept, the half character replaced); a spec holding a lone surrogate cannot be
    passed to xgrammar at all (UnicodeEncodeError)."""
    if isinstance(exc, UnicodeEncodeError):
        return f"it holds {exc.object[exc.start]!r} at index {exc.start}, which is not UTF-8"
    if isinstance(exc, UnicodeDecodeError):
        text = exc.object.decode("utf-8", "replace")
    else:
        text = str(exc)
    line = next((s for s in text.splitlines() if s.strip()), type(exc).__name__)
    line = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", line)
    return re.sub(r"^Check failed: .*? is false: ", "", line)
