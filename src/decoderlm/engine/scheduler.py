"""Continuous batching with chunked prefill over a block pool, after vLLM's scheduler (Kwon et al.,
2023, "Efficient Memory Management for LLM Serving with PagedAttention"; Yu et al., 2022, Orca, for
iteration-level scheduling; Agrawal et al., 2024, Sarathi-Serve, for chunked prefill).

Every step runs at most `max_batched_tokens` tokens, as vLLM's chunked-prefill scheduler
(vllm/v1/core/sched/scheduler.py, `max_num_batched_tokens`) does, decodes first: each running
sequence whose K/V is computed up to its last token decodes one token; the rest of the budget, and
never less than one chunk (so that prefills progress however many sequences decode), goes to the
sequences still prefilling, oldest first, each at most `prefill_chunk` tokens per step while any
sequence decodes. So a long prompt delays the running streams by at most one chunk per step, and
new requests share the budget: while D sequences decode, a request whose prompt needs c chunks,
admitted behind q prompt tokens still to prefill, has its first token within
⌈q / max(budget − D, prefill_chunk)⌉ + c steps (at worst ⌈q / prefill_chunk⌉ + c, however many
decode). In a step where none decodes, no stream waits on the prompts: they take the whole budget,
as vLLM's chunks do, so a long prompt sent to an idle engine is prefilled in passes of up to
`max_batched_tokens` tokens, not of one chunk each (its first token sooner: benchmarks/README.md,
prompt_ttft.py).

Admission is FIFO: the head of the waiting queue is admitted when the pool has blocks for its
tokens plus one more token (the K/V of its first generated token), so a new sequence reaches its
first decode step without preempting anyone. A running sequence that needs a block when the pool
is full preempts the newest running sequence: its blocks are freed and it goes back to the front
of the queue, to be recomputed (prompt and tokens so far) when blocks free up. A model with
recurrent layers keeps each sequence's state in pages (`decoderlm.engine.state_pool.StatePages`:
KV blocks of the same pool, or slots of their own): admission also takes them, and a sequence
leaving the running batch frees them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from decoderlm.engine.kv_pool import BlockPool, blocks_for, prefix_keys
from decoderlm.engine.state_pool import StatePages


@dataclass(eq=False)
class Sequence:
    """One stream of tokens: the prompt, then what was generated; and where its K/V lives."""

    tokens: list[int]  # prompt + generated so far
    n_prompt: int
    max_len: int  # the sequence ends at this many tokens (prompt + max_tokens, or the context)
    blocks: list[int] = field(default_factory=list)  # block table
    n_computed: int = 0  # tokens whose K/V is in the pool
    n_registered: int = 0  # leading blocks offered to the prefix cache
    state_pages: list[int] = field(default_factory=list)  # its recurrent state's, while running

    @property
    def n_pending(self) -> int:
        """Tokens to run through the model before the next one can be sampled."""
        return len(self.tokens) - self.n_computed


@dataclass
class Plan:
    """One step's work: sequences decoding one token, and (sequence, n tokens) prefill chunks."""

    decode: list[Sequence]
    prefill: list[tuple[Sequence, int]]


class Scheduler:
    """The waiting queue and the running batch over one `BlockPool` (and the recurrent states'
    pages, if any); `schedule()` plans a step."""

    def __init__(
        self,
        pool: BlockPool,
        prefill_chunk: int,
        states: StatePages | None = None,
        max_batched_tokens: int | None = None,
    ) -> None:
        """states: where the recurrent layers' state pages are taken (`state_pool`), if any;
        max_batched_tokens: a step's budget (None: `prefill_chunk`, a chunk beside the decodes)."""
        self.pool, self.prefill_chunk, self.states = pool, prefill_chunk, states
        self.max_batched_tokens = (
            prefill_chunk if max_batched_tokens is None else max_batched_tokens
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.prefix_hit_tokens = 0
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or cancelled sequence out, freeing its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> Plan:
        """The running sequences grow first (preempting if they must), then the queue is admitted."""
        decode = [s for s in self.running if s.n_pending == 1]
        for seq in list(decode):
            if seq in self.running and not self._make_room(seq):
                decode.remove(seq)  # preempted itself
        decode = [s for s in decode if s in self.running]  # minus those preempted for others
        self._admit()
        budget = max(self.max_batched_tokens - len(decode), self.prefill_chunk)
        chunk = self.prefill_chunk if decode else budget  # alone, the prompts hold up no stream
        prefill, decoding = [], set(decode)
        for seq in self.running:
            if budget == 0:
                break
            if seq not in decoding and seq.n_pending > 0:
                n = min(seq.n_pending, budget, chunk)
                prefill.append((seq, n))
                budget -= n
        return Plan(decode, prefill)

    def computed(self, seq: Sequence, n: int) -> None:
        """n more tokens of `seq` have their K/V in the pool; its new full blocks join the cache."""
        seq.n_computed += n
        full = seq.n_computed // self.pool.block_size
        if full > seq.n_registered:
            keys = prefix_keys(seq.tokens[: full * self.pool.block_size], self.pool.block_size)
            for i in range(seq.n_registered, full):
                self.pool.register(seq.blocks[i], keys[i])
            seq.n_registered = full

    def room(self, seq: Sequence, k: int) -> int:
        """How many of k draft tokens fit after decoding `seq`'s tokens: before its max_len and in
        its blocks or free ones, which it takes (no one is preempted for them)."""
        size = self.pool.block_size
        k = max(0, min(k, seq.max_len - len(seq.tokens) - 1))
        while blocks_for(len(seq.tokens) + k, size) > len(seq.blocks):
            block = self.pool.grow()
            if block is None:
                return len(seq.blocks) * size - len(seq.tokens)
            seq.blocks.append(block)
        return k

    def reject(self, seq: Sequence, n: int) -> None:
        """Take the last n tokens off `seq` (drafts after their pass): its n_computed never counted
        them, and the next pass writes over their K/V."""
        del seq.tokens[len(seq.tokens) - n :]

    def _admit(self) -> None:
        size = self.pool.block_size
        while self.waiting:
            seq = self.waiting[0]
            # At least the last token is run, for its logits: reuse at most ⌊(n − 1)/bs⌋ blocks.
            keys = prefix_keys(seq.tokens[: len(seq.tokens) - 1], size)
            got = self.pool.allocate(keys, blocks_for(len(seq.tokens) + 1, size))
            if got is None:
                return
            if self.states is not None:
                pages = self.states.pool.allocate((), self.states.per_sequence)
                if pages is None:
                    self.pool.free(got[0])
                    return
                seq.state_pages = pages[0]
            seq.blocks, reused = got
            seq.n_registered, seq.n_computed = reused, reused * size
            self.prefix_hit_tokens += seq.n_computed
            self.running.append(self.waiting.popleft())

    def _make_room(self, seq: Sequence) -> bool:
        """A block for `seq`'s next token, preempting the newest sequences while the pool is full.

        False if `seq` itself was the newest and was preempted.
        """
        if seq.n_computed // self.pool.block_size < len(seq.blocks):
            return True
        while (block := self.pool.grow()) is None:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        seq.blocks.append(block)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.blocks)
        if seq.state_pages:
            self.states.release(seq.state_pages)
        seq.blocks, seq.n_computed, seq.n_registered, seq.state_pages = [], 0, 0, []
