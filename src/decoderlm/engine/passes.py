"""One engine step's forward passes, typed: what `EngineCore.schedule` builds from the scheduler's
plan, `ModelRunner.forward` runs, and `EngineCore.outputs` turns into tokens.

- `PrefillPass`: a chunk of prompt tokens of each of its sequences (`sizes`: how many of each;
  one uniform pass where all are alike, else one row of segments); a row that reaches its
  prompt's end samples its first token.
- `DecodePass`: the last token of each decoding sequence; every row samples its next token.
- `VerifyPass`: the decoding sequences when some speculate (speculative decoding: Leviathan et
  al., 2023; Chen et al., 2023). Each speculating sequence's proposer gives up to k drafts
  (`decoderlm.engine.proposers`), and one pass runs its last token and its drafts (k + 1 tokens)
  beside the other rows' last token; `decoderlm.engine.sampler.verify` accepts a prefix of the
  drafts and chooses the next token.

A pass's rows are `Row`s: the tokens a sequence runs, where they start and the blocks its K/V
lives in (and its recurrent state's pages); the draft model's catch-up runs rows of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from decoderlm.engine.scheduler import Sequence


@dataclass(frozen=True)
class Row:
    """One row of a forward pass: `tokens` written at positions start, start + 1, … of the
    sequence whose block table is `blocks` (and whose recurrent state lies in `state_pages`)."""

    blocks: list[int]
    start: int
    tokens: list[int]
    state_pages: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, seq: Sequence, n: int) -> Row:
        """The next n tokens of `seq` not yet computed."""
        start = seq.n_computed
        return cls(seq.blocks, start, seq.tokens[start : start + n], seq.state_pages)


@dataclass(eq=False)
class PrefillPass:
    """sizes[i] prompt tokens of seqs[i], from where it stands."""

    seqs: list[Sequence]
    sizes: list[int]

    def rows(self) -> list[Row]:
        return [Row.of(seq, n) for seq, n in zip(self.seqs, self.sizes, strict=True)]


@dataclass(eq=False)
class DecodePass:
    """One token of each decoding sequence: its last."""

    seqs: list[Sequence]

    @property
    def sizes(self) -> list[int]:
        return [1] * len(self.seqs)

    def rows(self) -> list[Row]:
        return [Row.of(seq, 1) for seq in self.seqs]


@dataclass(frozen=True)
class Proposal:
    """A proposer's drafts d_1 … d_k for one sequence and the distributions q (k, V) float64 they
    were drawn from; q None: chosen deterministically (q one-hot at each draft)."""

    tokens: list[int]
    q: Tensor | None = None


@dataclass(eq=False)
class VerifyPass:
    """The decoding sequences of a step in which some speculate: `room` holds how many drafts
    each speculating sequence may take (its blocks are made), `proposals` what its proposer gave
    (appended to its tokens by `propose`). Each row runs a sequence's tokens not yet computed:
    its last token, and its drafts if it has some."""

    seqs: list[Sequence]
    room: dict[Sequence, int]
    proposals: dict[Sequence, Proposal] = field(default_factory=dict)

    def propose(self, proposals: dict[Sequence, Proposal]) -> None:
        """Append each sequence's drafts to its tokens (one with none runs as a plain row)."""
        for seq, proposal in proposals.items():
            if proposal.tokens:
                seq.tokens += proposal.tokens
                self.proposals[seq] = proposal

    def rows(self) -> list[Row]:
        return [Row.of(seq, len(seq.tokens) - seq.n_computed) for seq in self.seqs]


Pass = PrefillPass | DecodePass | VerifyPass
