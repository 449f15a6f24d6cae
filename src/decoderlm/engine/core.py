"""One engine step over the requests in flight, after vLLM's EngineCore: schedule → run → sample →
output.

- `schedule` (under the engine's lock): the `Scheduler`'s plan becomes this step's typed passes
  (`passes`): a `DecodePass` of the decoding sequences, or a `VerifyPass` when some of them
  speculate (their proposer's room made in their blocks), and a `PrefillPass` of the prefill
  chunks (with recurrent states, one per start and length: their rows run uniform only). Where
  every layer attends in place, the decoding sequences' rows join the chunks' pass instead (one
  token each, attended by the in-place kernel beside the chunks: the weights read once a step).
- `run` (outside the lock, inside `runner.running()`): a `VerifyPass` first gets its proposals
  (`proposers.Proposer.propose`: where a token is proposed), then every pass runs through the one
  `ModelRunner.forward` (where a token is verified: the target's logits at each draft).
- `outputs` (under the lock): the logits become tokens in `sampler.sample`, or for a speculating
  sequence in `sampler.verify` (where a draft is accepted, into `SamplingState.accept`), and
  tokens become `TokenEvent`s in `output.SequenceOutput`.

A pass that raises ends the sequences it was for with finish_reason "error" (logged), as does a
row whose sampling or detokenizing raises; the other sequences go on.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from decoderlm.engine.inputs import decodable_ids
from decoderlm.engine.kv_pool import BlockPool
from decoderlm.engine.output import SequenceOutput, prompt_events
from decoderlm.engine.passes import DecodePass, Pass, PrefillPass, VerifyPass
from decoderlm.engine.proposers import Proposer
from decoderlm.engine.runner import ModelRunner
from decoderlm.engine.sampler import Sampled, SamplingState, sample, verify
from decoderlm.engine.scheduler import Scheduler, Sequence
from decoderlm.engine.types import EngineStats, RequestParams, Sink, TokenEvent
from decoderlm.inference.speculative import AdaptiveK
from decoderlm.inference.structured import StructuredGrammar

log = logging.getLogger(__name__)
RATE_WINDOW_S = 5.0  # EngineStats.tokens_per_s averages over this many seconds

Logits = Tensor | list[Tensor] | None  # a pass's: (B, V), each row's (n_b, V), or None (it raised)


@dataclass(eq=False)
class Request:
    """A request in flight: where its events go and its sequences (n of them)."""

    id: str
    sink: Sink
    seqs: list[Sequence] = field(default_factory=list)
    n_open: int = 0


@dataclass(eq=False)
class _Live:
    """A sequence that has not finished: its request, its sampler and its detokenizer."""

    request: Request
    sampling: SamplingState
    output: SequenceOutput
    speculation: AdaptiveK | None  # how many tokens to propose next; None: no speculation


class _Counters:
    """What `EngineCore.stats` counts since the start, and the generated tokens of the last
    RATE_WINDOW_S seconds."""

    def __init__(self) -> None:
        self.prompt_tokens = self.generated = self.max_running = 0
        self.proposed = self.accepted = self.verifications = 0  # speculative decoding's
        self._rate: deque[tuple[float, int]] = deque()  # (time, generated tokens so far)

    def mark(self) -> None:
        """A step ended: a sample of the rate."""
        self._rate.append((self._prune(), self.generated))

    def tokens_per_s(self) -> float:
        now = self._prune()
        t0, g0 = self._rate[0] if self._rate else (now, self.generated)
        return (self.generated - g0) / (now - t0) if now > t0 else 0.0

    def _prune(self) -> float:
        """Forget the rate samples older than the window; returns the time now."""
        now = time.monotonic()
        while self._rate and now - self._rate[0][0] > RATE_WINDOW_S:
            self._rate.popleft()
        return now


class EngineCore:
    """The requests in flight and one step over them (see the module docstring). Not
    thread-safe: `Engine` calls it under its lock, except `run`."""

    def __init__(
        self,
        tokenizer: Any,
        runner: ModelRunner,
        block_size: int,
        prefill_chunk: int,
        prefix_caching: bool,
        max_batched_tokens: int | None = None,
        proposer: Proposer | None = None,
        num_speculative_tokens: int | None = None,
    ) -> None:
        """proposer: speculative decoding's (`proposers`), each decoding sequence proposing up to
        `num_speculative_tokens` per step (`AdaptiveK`); None: no speculation."""
        self.tokenizer, self.runner = tokenizer, runner
        self.vocab_size = runner.model.config.vocab_size
        self.proposer, self.num_speculative_tokens = proposer, num_speculative_tokens
        self.decodable = decodable_ids(tokenizer, self.vocab_size)
        states = runner.states  # recurrent layers' (`state_pool`): no prefix sharing over them
        self.pool = BlockPool(runner.pool_blocks, block_size, prefix_caching and states is None)
        pages = None if states is None else states.pages(self.pool)
        self.scheduler = Scheduler(self.pool, prefill_chunk, pages, max_batched_tokens)
        self.requests: dict[str, Request] = {}
        self.live: dict[Sequence, _Live] = {}  # the sequences that have not finished
        self.counters = _Counters()

    def add(
        self,
        request: Request,
        params: RequestParams,
        ids: list[int],
        max_len: int,
        grammar: StructuredGrammar | None = None,
    ) -> list[tuple[Request, TokenEvent]]:
        """Queue the request's `params.n` sequences of prompt `ids`, to end at `max_len` tokens,
        each with its own matcher of `grammar`; the last events of those with nothing to generate
        (max_tokens 0 or a full context)."""
        self.requests[request.id] = request
        self.counters.prompt_tokens += len(ids)
        events = []
        for index in range(params.n):
            seq = Sequence(list(ids), len(ids), max_len)
            output = SequenceOutput.create(self.tokenizer, params, index, ids)
            sampling = SamplingState.create(
                params, index, ids, self.vocab_size, self.runner.device, grammar, output.stop_ids
            )
            k = self.num_speculative_tokens  # a constrained sequence does not speculate: `verify`
            speculation = None if k is None or grammar is not None else AdaptiveK(k)  # has no mask
            self.live[seq] = _Live(request, sampling, output, speculation)
            request.seqs.append(seq)
            if max_len == len(ids):
                events.append(self.end(seq, "length"))
            else:
                self.scheduler.add(seq)
        return events

    # Schedule → run → sample → output.

    def schedule(self) -> list[Pass]:
        """This step's passes: the decoding sequences', then the prefill chunks'."""
        plan = self.scheduler.schedule()
        counters = self.counters
        counters.max_running = max(counters.max_running, len(self.scheduler.running))
        passes: list[Pass] = []
        room = {seq: k for seq in plan.decode if (k := self._room(seq))}
        if room:
            passes.append(VerifyPass(plan.decode, room))
        elif plan.decode:
            passes.append(DecodePass(self._in_kept_order(plan.decode)))
        if not plan.prefill:
            return passes
        if self.runner.states is None:  # every chunk in one pass: the weights read once
            chunks = PrefillPass(*map(list, zip(*plan.prefill, strict=True)))
            if not room and self.runner.cache.packable:  # the decode rows among them, in place
                return [
                    PrefillPass(plan.decode + chunks.seqs, [1] * len(plan.decode) + chunks.sizes)
                ]
            return [*passes, chunks]
        chunks: dict[tuple[int, int], list[Sequence]] = {}  # recurrent states: one pass per
        for seq, n in plan.prefill:  # (start, n), of uniform rows
            chunks.setdefault((seq.n_computed, n), []).append(seq)
        return passes + [PrefillPass(seqs, [n] * len(seqs)) for (_, n), seqs in chunks.items()]

    def _in_kept_order(self, seqs: list[Sequence]) -> list[Sequence]:
        """The decoding sequences in the order that moves the fewest of the recurrent states
        their last pass kept (`StatePool.order`); as they are without recurrent layers."""
        if self.runner.states is None:
            return seqs
        order = self.runner.states.order([tuple(seq.state_pages) for seq in seqs])
        return [seqs[i] for i in order]

    def _room(self, seq: Sequence) -> int:
        """How many drafts decoding `seq` may take this step: what its schedule asks for, what
        its proposer can give and what its blocks (or free ones, which it takes) can hold."""
        schedule = self.live[seq].speculation
        k = 0 if schedule is None else schedule.next()
        return self.scheduler.room(seq, self.proposer.limit(seq, k)) if k else 0

    def run(self, passes: list[Pass]) -> list[Logits]:
        """Each pass's logits: (B, V) of each row's last token, or for a `VerifyPass` each row's
        (n_b, V); None for a pass that raised (logged). Proposals are made here."""
        return [self._run(p) for p in passes]

    def _run(self, p: Pass) -> Logits:
        if not isinstance(p, VerifyPass):
            return _isolated(self.runner.forward, p.rows())
        seqs = list(p.room)
        states = [self.live[seq].sampling for seq in seqs]
        ks = [p.room[seq] for seq in seqs]
        proposals = _isolated(self.proposer.propose, seqs, ks, states, self.decodable)
        if proposals is None:
            return None
        p.propose(dict(zip(seqs, proposals, strict=True)))
        if not p.proposals:  # nothing proposed: a decode pass, each row's logits (1, V)
            last = _isolated(self.runner.forward, p.rows())  # (B, V)
            return None if last is None else list(last[:, None])
        return _isolated(self.runner.forward_tokens, p.rows())

    def outputs(self, passes: list[Pass], logits: list[Logits]) -> list[tuple[Request, TokenEvent]]:
        """The events of the passes `run` ran."""
        events = []
        for p, pass_logits in zip(passes, logits, strict=True):
            if pass_logits is None:  # it raised: its sequences end, the other passes go on
                events += [self.end(seq, "error") for seq in p.seqs if seq in self.live]
            elif isinstance(p, VerifyPass):
                events += self._verify_events(p, pass_logits)
            else:
                events += self._sampled(p.seqs, p.sizes, pass_logits)
        self.counters.mark()
        return events

    def _sampled(
        self, seqs: list[Sequence], sizes: list[int], logits: Tensor
    ) -> list[tuple[Request, TokenEvent]]:
        """The events of a pass that ran sizes[i] tokens of seqs[i], logits (B, V) of their
        last: a sequence at its last token samples its next."""
        ready = [s in self.live and s.n_pending == n for s, n in zip(seqs, sizes, strict=True)]
        states = [self.live[s].sampling if r else None for s, r in zip(seqs, ready, strict=True)]
        events = []
        for seq, n, is_ready, sampled in zip(
            seqs, sizes, ready, sample(logits, states, self.decodable), strict=True
        ):
            self.scheduler.computed(seq, n)
            if is_ready:
                events.append(self._emit(seq, sampled))
        return events

    def _verify_events(
        self, p: VerifyPass, logits: list[Tensor]
    ) -> list[tuple[Request, TokenEvent]]:
        """The events of a `VerifyPass`: the plain rows sampled as a `DecodePass`'s, then each
        speculating row's accepted drafts and next token."""
        plain = [i for i, seq in enumerate(p.seqs) if seq not in p.proposals]
        for seq in p.room:
            if seq not in p.proposals:  # nothing proposed counts as a proposal rejected
                self.live[seq].speculation.update(p.room[seq], 0)
        events = []
        if plain:  # their one token's logits: (B', V)
            last = torch.stack([logits[i][-1] for i in plain])
            events += self._sampled([p.seqs[i] for i in plain], [1] * len(plain), last)
        for seq, rows in zip(p.seqs, logits, strict=True):
            if seq in p.proposals:
                events += self._verified(seq, rows, p.proposals[seq].q)
        return events

    def _verified(
        self, seq: Sequence, logits: Tensor, q: Tensor | None
    ) -> list[tuple[Request, TokenEvent]]:
        """The events of `seq`'s last token and k drafts, logits (k + 1, V): the accepted drafts
        and the next token, one event each, until one finishes it."""
        live = self.live[seq]
        k = len(logits) - 1
        drafts = seq.tokens[-k:]
        self.scheduler.reject(seq, k)  # they come back as they are accepted
        chosen = _isolated(verify, logits, live.sampling, seq.tokens, drafts, self.decodable, q)
        if chosen is None:
            return [self.end(seq, "error")]
        n = len(chosen) - 1
        live.speculation.update(k, n)
        self.proposer.accepted(seq, n)
        self.counters.proposed += k
        self.counters.accepted += n
        self.counters.verifications += 1
        events = []
        for sampled in chosen:
            events.append(self._emit(seq, sampled))
            if seq not in self.live:
                return events
        self.scheduler.computed(seq, n + 1)  # the last token and the accepted drafts
        return events

    def _emit(self, seq: Sequence, sampled: Sampled | None) -> tuple[Request, TokenEvent]:
        """`seq` takes its sampled token (None: its sampling failed); the event that reports it."""
        event = None if sampled is None else _isolated(self._take, seq, sampled)
        return self.end(seq, "error") if event is None else event

    def _take(self, seq: Sequence, sampled: Sampled) -> tuple[Request, TokenEvent]:
        seq.tokens.append(sampled.token)
        self.counters.generated += 1
        live = self.live[seq]
        event = live.output.event(sampled.token, sampled.logprobs, len(seq.tokens) >= seq.max_len)
        return self._finish(seq, event) if event.finish_reason else (live.request, event)

    def end(self, seq: Sequence, reason: str) -> tuple[Request, TokenEvent]:
        """Take `seq` out with a last event that carries no token, finish_reason `reason`."""
        return self._finish(seq, self.live[seq].output.ended(reason))

    def _finish(self, seq: Sequence, event: TokenEvent) -> tuple[Request, TokenEvent]:
        """Take `seq` out (its blocks are freed); `event` is its last."""
        self.scheduler.remove(seq)
        if self.proposer is not None:
            self.proposer.forget(seq)
        request = self.live.pop(seq).request
        request.n_open -= 1
        if request.n_open == 0:
            del self.requests[request.id]
        return request, event

    def prompt_events(self, ids: list[int], top: int) -> list[TokenEvent]:
        """`Engine.score`'s events for prompt `ids`."""
        lp = self.runner.prompt_logprobs(ids)[:, : self.decodable].log_softmax(-1)  # as `sample`
        return prompt_events(self.tokenizer, ids, lp, top)

    def stats(self) -> EngineStats:
        """`Engine.stats`."""
        counters, runner = self.counters, self.runner
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.pool.num_used,
            kv_blocks_total=self.pool.num_blocks,
            kv_block_size=self.pool.block_size,
            kv_bytes_per_token=runner.bytes_per_token  # a draft model's pool's too, if any
            + (0 if self.proposer is None else self.proposer.kv_bytes_per_token),
            prompt_tokens=counters.prompt_tokens,
            generated_tokens=counters.generated,
            prefix_cache_hit_tokens=self.scheduler.prefix_hit_tokens,
            max_running_seen=counters.max_running,
            tokens_per_s=counters.tokens_per_s(),
            preemptions=self.scheduler.preemptions,
            speculative_proposed=counters.proposed,
            speculative_accepted=counters.accepted,
            speculative_verifications=counters.verifications,
            **self._state_stats(),
        )

    def _state_stats(self) -> dict[str, int]:
        """`EngineStats`' recurrent state fields (`state_pool`)."""
        pages = self.scheduler.states
        if pages is None:
            return {}
        return {
            "state_bytes_per_sequence": self.runner.budget.state_bytes,
            "state_pages_per_sequence": pages.per_sequence,
            "state_pages_used": pages.per_sequence * len(self.scheduler.running),
            "state_pages_total": pages.pool.num_blocks,
        }


def _isolated(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), or None (logged) if it raised: one request's failure ends that request only."""
    try:
        return fn(*args)
    except Exception:
        log.exception("decoderlm engine: %s failed; its sequences end with 'error'", fn.__name__)
        return None
