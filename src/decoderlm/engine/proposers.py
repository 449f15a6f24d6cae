"""Speculative decoding's proposers in the engine: who guesses each speculating sequence's next
tokens, for all of them at once (Leviathan et al., 2023; Chen et al., 2023), behind one protocol,
`Proposer`, after vLLM's proposers (vllm/v1/spec_decode/).

The engine asks a proposer how many drafts it can give a sequence (`limit`), makes room for them
in the sequence's blocks, then, in the step's `passes.VerifyPass`, asks it to `propose` for every
speculating sequence at once; the target verifies them in one pass (`sampler.verify`, which keeps
the target's distribution whatever is proposed: a proposer affects the speed only, never the
tokens), and tells it how many it `accepted`. A proposer that reads the target's hidden states
(an EAGLE or MTP head) fits the same protocol, fed from the verification's pass.

- `PromptLookup` (Saxena, 2023, "Prompt Lookup Decoding"): the tokens that followed the latest
  earlier occurrence of the sequence's last n-gram (`decoderlm.inference.speculative.PromptLookup`,
  one sequence at a time); deterministic (q one-hot); no memory of its own.
- `DraftModel`: a smaller model with the target's vocabulary, in a paged KV pool of its own with
  as many blocks as the target's and indexed by the same block tables: a sequence's block b holds
  its target K/V in the target's pool and its draft K/V in the draft's, so the scheduler's
  allocation, growth and preemption serve both. Both pools come out of one `kv_cache_memory`
  budget (`split_kv_budget`). The draft's K/V of a sequence is its own (`_Held`): it starts empty
  (shared prefix blocks are written again, with the same tokens' draft K/V, since the draft may
  not have run over them yet), and it starts again when the sequence was preempted (a new block
  table). A proposal of k_b tokens for each sequence b: one ragged pass catches the draft up on
  the tokens the sequence took since its last proposal (1 or 2 after a verification, the prompt
  after a prefill: those long ones in a pass of their own) and gives d_1; then k − 1 one-token
  passes over the rows still drafting give d_2 … d_k. Each d_i is drawn from q_i = `token_probs`
  of the draft's logits with the sequence's own sampling parameters and generator (the argmax
  for a greedy one). After verification the draft keeps its K/V of the accepted drafts
  (`accepted`); the rest is written over at the next proposal, as the target's is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from decoderlm.engine.kv_pool import parse_bytes
from decoderlm.engine.passes import Proposal, Row
from decoderlm.engine.runner import ModelRunner
from decoderlm.engine.sampler import SamplingState, mask_undecodable
from decoderlm.engine.scheduler import Sequence
from decoderlm.errors import DecoderLMError
from decoderlm.inference import speculative
from decoderlm.inference.options import float_probe
from decoderlm.inference.sampling import draw, greedy_tokens, token_probs
from decoderlm.inference.speculative import seen
from decoderlm.model.cache import kv_cache_bytes_per_token
from decoderlm.model.lm import DecoderLM


class Proposer(Protocol):
    """Guesses the next tokens of the engine's speculating sequences."""

    kv_bytes_per_token: int  # the bytes of its own KV pool per token (0: it has none)

    def limit(self, seq: Sequence, k: int) -> int:
        """How many of k drafts it can propose after `seq`."""
        ...

    def propose(
        self, seqs: list[Sequence], ks: list[int], states: list[SamplingState], decodable: int
    ) -> list[Proposal]:
        """Up to k_b drafts after each sequence b, none of an id from `decodable` on, each drawn
        with the sequence's own sampling parameters and generator (`states`)."""
        ...

    def accepted(self, seq: Sequence, n: int) -> None:
        """The target accepted the first n drafts of `seq`'s last proposal."""
        ...

    def forget(self, seq: Sequence) -> None:
        """`seq` finished."""
        ...


class PromptLookup:
    """Drafts by prompt lookup (see the module docstring)."""

    kv_bytes_per_token = 0

    def __init__(self) -> None:
        self.lookup = speculative.PromptLookup()

    def limit(self, seq: Sequence, k: int) -> int:
        return k

    def propose(
        self, seqs: list[Sequence], ks: list[int], states: list[SamplingState], decodable: int
    ) -> list[Proposal]:
        """Each sequence's lookup; its tokens are decodable (`InputProcessor` checks prompts), so
        are the drafts copied from them."""
        return [
            Proposal(self.lookup.propose(s.tokens, k)[0]) for s, k in zip(seqs, ks, strict=True)
        ]

    def accepted(self, seq: Sequence, n: int) -> None:
        pass

    def forget(self, seq: Sequence) -> None:
        pass


# A catch-up of more tokens than this (a prompt) runs in a pass of its own, not padded into the
# ragged pass of the others' 1 or 2.
SHORT_CATCH_UP = 2


@dataclass(eq=False)
class _Held:
    """The draft's K/V of one sequence: its first n tokens, in the blocks of table `blocks`."""

    n: int
    blocks: list[int]  # the sequence's table when it was written (a new one after a preemption)
    base: int = 0  # the sequence's length at its last proposal


class DraftModel:
    """Drafts with `runner`'s draft model (see the module docstring)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.kv_bytes_per_token = runner.bytes_per_token
        self.held: dict[Sequence, _Held] = {}

    def propose(
        self, seqs: list[Sequence], ks: list[int], states: list[SamplingState], decodable: int
    ) -> list[Proposal]:
        """Each sequence's k_b drafts and their distributions q (k_b, V) float64 (None for a
        greedy sequence: its drafts are the draft's argmax, q one-hot)."""
        with self.runner.running():
            return self._propose(seqs, ks, states, decodable)

    def limit(self, seq: Sequence, k: int) -> int:
        """How many of k drafts the draft can propose after `seq`: d_k's position is the
        sequence's length + k − 1, d_{k−1} the last one whose K/V it writes, inside its context."""
        return min(k, self.runner.model.config.context_length + 1 - len(seq.tokens))

    def _propose(
        self, seqs: list[Sequence], ks: list[int], states: list[SamplingState], decodable: int
    ) -> list[Proposal]:
        rows = [seq.tokens.copy() for seq in seqs]  # each grows by its drafts
        logits = self._catch_up(seqs)  # (B, V): the next token's, after each row
        qs: list[list[Tensor]] = [[] for _ in seqs]
        for step in range(max(ks)):
            drafting = [i for i, k in enumerate(ks) if k > step]
            mask_undecodable(logits, decodable)
            greedy = [i for i in drafting if states[i].greedy]
            best = greedy_tokens(logits[greedy]).tolist() if greedy else []  # (B',)
            for i, token in zip(greedy, best, strict=True):
                rows[i].append(token)
            for i in drafting:
                if not states[i].greedy:
                    row, params = rows[i], states[i].params
                    q = token_probs(logits[i][None], params, seen(row, params, logits))  # (1, V)
                    rows[i].append(int(draw(q, states[i].generator)))
                    qs[i].append(q[0])
            more = [i for i in drafting if ks[i] > step + 1]
            if more:  # d_{step+1} of the rows that draft more: (B', V)
                last = [Row(seqs[i].blocks, len(rows[i]) - 1, rows[i][-1:]) for i in more]
                out = self.runner.forward(last)
                for j, i in enumerate(more):
                    logits[i] = out[j]
        proposals = []
        for seq, row, q in zip(seqs, rows, qs, strict=True):
            held = self.held[seq]
            held.base, held.n = len(seq.tokens), len(row) - 1  # d_k's K/V is not written
            proposals.append(Proposal(row[len(seq.tokens) :], torch.stack(q) if q else None))
        return proposals

    def accepted(self, seq: Sequence, n: int) -> None:
        """The target accepted the first n drafts of `seq`'s last proposal: the draft keeps their
        K/V, and forgets the rest."""
        held = self.held[seq]
        held.n = min(held.n, held.base + n)

    def forget(self, seq: Sequence) -> None:
        """`seq` finished."""
        self.held.pop(seq, None)

    def _catch_up(self, seqs: list[Sequence]) -> Tensor:
        """Run the draft over each sequence's tokens it has not seen; the logits (B, V) after
        each sequence's last token."""
        starts = []
        for seq in seqs:
            held = self.held.get(seq)
            if held is None or held.blocks is not seq.blocks:  # new, or preempted since
                held = self.held[seq] = _Held(0, seq.blocks)
            starts.append(held.n)
        rows = [Row(seq.blocks, n, seq.tokens[n:]) for seq, n in zip(seqs, starts, strict=True)]
        logits: list[Tensor | None] = [None] * len(seqs)
        short = [i for i, row in enumerate(rows) if len(row.tokens) <= SHORT_CATCH_UP]
        if short:  # one pass, rows of 1 or 2 tokens: (B', V)
            out = self.runner.forward([rows[i] for i in short])
            for i, row_logits in zip(short, out, strict=True):
                logits[i] = row_logits
        for i, row in enumerate(rows):
            if logits[i] is None:  # a long catch-up: alone
                logits[i] = self.runner.forward([row])[0]
        return torch.stack(logits)  # (B, V)


def split_kv_budget(
    model: DecoderLM,
    draft: DecoderLM,
    kv_cache_memory: int | str,
    block_size: int,
    kv_cache_dtype: str | None,
) -> tuple[int, int]:
    """The bytes of the target's pool and of the draft's, out of `kv_cache_memory`: N blocks each,
    N = ⌊budget / (block_size · (bytes per token of the target + of the draft))⌋."""
    per_token = [
        kv_cache_bytes_per_token(m.config, kv_cache_dtype or float_probe(m).dtype)
        for m in (model, draft)
    ]
    n_blocks = parse_bytes(kv_cache_memory) // (block_size * sum(per_token))
    if n_blocks <= 1:
        raise DecoderLMError(
            f"kv_cache_memory={kv_cache_memory!r} holds {n_blocks} KV block(s) for the target and "
            f"its draft together; speculative decoding needs at least 2 (one of "
            f"{block_size * sum(per_token)} bytes)"
        )
    return n_blocks * block_size * per_token[0], n_blocks * block_size * per_token[1]


def check_draft(model: DecoderLM, draft: DecoderLM) -> None:
    """DecoderLMError unless `draft` can propose for `model`: another model, with the same
    vocabulary, on the same device."""
    if draft is model:
        raise DecoderLMError(
            "the draft model is the target itself: give a smaller model (or 'prompt-lookup')"
        )
    if draft.config.vocab_size != model.config.vocab_size:
        raise DecoderLMError(
            f"the draft model's vocab_size={draft.config.vocab_size} differs from the target's "
            f"{model.config.vocab_size}: they must share a vocabulary"
        )
    if draft.config.has_recurrent_layers:
        raise DecoderLMError(
            f"the draft model has recurrent layers (layer_types {draft.config.layer_types}): "
            "its state cannot be rolled back past a rejected proposal; give an attention-only draft"
        )
    if float_probe(draft).device != float_probe(model).device:
        raise DecoderLMError("the draft model must be on the target model's device")
