"""A request's prompt and sizes, checked before it reaches the engine's queue, after vLLM's input
Processor (vllm/v1/engine/processor.py): text is tokenized, token ids must be in the vocabulary,
and the sequences must fit the context and the KV pool; a structured output's grammar is
compiled here, in the caller's thread, never on the engine's step thread.
"""

from __future__ import annotations

from typing import Any

from decoderlm.engine.kv_pool import blocks_for
from decoderlm.engine.types import RequestParams
from decoderlm.errors import DecoderLMError
from decoderlm.inference.prompts import prompt_rows
from decoderlm.inference.structured import StructuredGrammar, compile_structured


class InputProcessor:
    """Prompts for a model of `vocab_size` tokens and `max_sequence` tokens of context, served
    from a pool of `num_blocks` blocks of `block_size` tokens with a queue of `max_queue`."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_sequence: int,
        block_size: int,
        num_blocks: int,
        max_queue: int,
    ) -> None:
        self.tokenizer, self.vocab_size, self.max_sequence = tokenizer, vocab_size, max_sequence
        self.block_size, self.num_blocks, self.max_queue = block_size, num_blocks, max_queue

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """The token ids of a text or a list of ids; DecoderLMError if it is empty, holds an id
        outside the vocabulary or is longer than the context."""
        if isinstance(prompt, str):
            if not prompt:
                raise DecoderLMError("empty prompt: give some text to continue")
            prompt = self.tokenizer.encode_prompt(prompt)  # BOS where the tokenizer adds one
        ids = prompt_rows([list(prompt)], self.vocab_size)[0]
        if len(ids) > self.max_sequence:
            raise DecoderLMError(
                f"prompt has {len(ids)} tokens, more than the model's context_length "
                f"({self.max_sequence})"
            )
        return ids

    def max_len(self, ids: list[int], params: RequestParams) -> int:
        """The length at which the request's sequences end: prompt + max_tokens, cut to the
        context. DecoderLMError if one sequence cannot fit the pool, or n exceeds max_queue."""
        max_len = min(len(ids) + params.max_tokens, self.max_sequence)
        needed = blocks_for(max_len, self.block_size)
        if needed > self.num_blocks:
            raise DecoderLMError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs {needed} KV "
                f"blocks but kv_cache_memory holds {self.num_blocks}; lower max_tokens or "
                "raise kv_cache_memory"
            )
        if params.n > self.max_queue:
            raise DecoderLMError(f"n={params.n} exceeds the engine's max_queue={self.max_queue}")
        return max_len

    def grammar(self, params: RequestParams) -> StructuredGrammar | None:
        """The request's structured output compiled for the tokenizer (cached), or None;
        DecoderLMError if it cannot compile."""
        if params.structured is None:
            return None
        return compile_structured(self.tokenizer, params.structured)


def decodable_ids(tokenizer: Any, vocab_size: int) -> int:
    """How many of a model's `vocab_size` ids the tokenizer decodes: all of them, or the
    tokenizer's size when the model's vocabulary is padded beyond it (GPT-2's 50257 → 50304).
    DecoderLMError if the tokenizer is larger than the model's vocabulary: it could encode ids
    the model has no embedding for."""
    size = getattr(tokenizer, "vocab_size", None) or vocab_size
    if size > vocab_size:
        raise DecoderLMError(
            f"the tokenizer has {size} tokens but the model's vocabulary only {vocab_size}: "
            "it is not this model's tokenizer"
        )
    return size
