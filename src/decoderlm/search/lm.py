"""The language model as the search strategies see it (`SearchLM`), and `EngineLM`, which runs it on
the serving engine's batched generation.

Why the engine and not `decoderlm.generate(num_samples=...)`: `Engine.generate` runs the N
samples of a prompt as N sequences that share the prompt's KV blocks (prefix caching), and a
step-level search that resubmits a prompt with a longer partial solution reuses the blocks of what
was already computed; it also stops at text stop strings (a step ends at its line's newline) and
reports each token's log-probability and the top-k next tokens, which best-of-N's mean
log-probability and token-level beam search need. `generate` has neither stop strings nor
log-probabilities, and recomputes each sample's prompt.

`ClientLM` is the same model through an `EngineClient`'s submit API (an `Engine` whose thread
runs, or an `EngineProcess`): what the server's beam search runs on, between other requests.

The budget counts generated tokens: every token a sample generated (its stop string and its
end-of-text token included), and one token per prefix whose next-token distribution is asked for.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from decoderlm.engine.engine import Engine
from decoderlm.engine.inputs import decodable_ids
from decoderlm.engine.streams import Collector
from decoderlm.engine.types import (
    Completion,
    EngineClient,
    EngineStoppedError,
    QueueFullError,
    RequestParams,
)
from decoderlm.errors import DecoderLMError
from decoderlm.inference.sampling import SamplingParams


@dataclass(frozen=True)
class Sample:
    """One sampled continuation: its text (without the stop string), every token it generated
    with its log-probability, and why it ended: "stop" (a stop string), "eot" (end-of-text) or
    "length" (max_tokens or the context)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish: str

    @property
    def tokens(self) -> int:
        """Generated tokens: what this sample cost."""
        return len(self.token_ids)


class SearchLM(Protocol):
    """What the strategies call: text in, samples out, and next-token log-probabilities."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids."""
        ...

    @property
    def stop_ids(self) -> frozenset[int]:
        """The ids that end a sample: the model's end-of-sequence (and end-of-turn) tokens."""
        ...

    def sample(
        self,
        prompts: Sequence[str],
        n: int,
        max_tokens: int,
        stop: tuple[str, ...],
        temperature: float,
    ) -> list[list[Sample]]:
        """n samples of each prompt, each of at most `max_tokens` tokens, ending at a stop string
        or end-of-text; in prompt order."""
        ...

    def next_token_logprobs(
        self, prefixes: Sequence[Sequence[int]], k: int
    ) -> list[list[tuple[int, float]]]:
        """The k likeliest next tokens of each prefix of token ids, (id, log-probability), likeliest
        first; none for a prefix that fills the model's context."""
        ...


class EngineLM:
    """A `SearchLM` over an `Engine`: each call is one batched `Engine.generate`. Sample j of a
    call draws from seed + j, and each call advances the seed past its samples, so a search is
    reproducible and no two calls draw the same stream."""

    def __init__(self, engine: Engine, seed: int = 0) -> None:
        self.engine, self.tokenizer, self.seed = engine, engine.tokenizer, seed
        self.max_queue = engine.max_queue
        self.vocab = decodable_ids(self.tokenizer, engine.model.config.vocab_size)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer.stop_ids)

    def sample(
        self,
        prompts: Sequence[str],
        n: int,
        max_tokens: int,
        stop: tuple[str, ...],
        temperature: float,
    ) -> list[list[Sample]]:
        out: list[list[Sample]] = [[] for _ in prompts]
        while len(out[0]) < n:  # at most max_queue sequences a request
            batch = min(n - len(out[0]), self.max_queue)
            params = RequestParams(
                max_tokens=max_tokens,
                sampling=SamplingParams(temperature=temperature),
                stop=stop,
                seed=self._seeds(batch),
                logprobs=0,
                n=batch,
            )
            done = self._generate(list(prompts), params)
            for i, samples in enumerate(out):
                samples += [self._sample(c) for c in done[i * batch : (i + 1) * batch]]
        return out

    def next_token_logprobs(
        self, prefixes: Sequence[Sequence[int]], k: int
    ) -> list[list[tuple[int, float]]]:
        params = RequestParams(
            max_tokens=1,
            sampling=SamplingParams(temperature=0),
            logprobs=min(k, self.vocab),
            ignore_eos=True,
        )
        done = self._generate([list(p) for p in prefixes], params)
        return [[(t.token_id, t.logprob) for t in c.top_logprobs[0]] if c.top_logprobs else []
                for c in done]  # fmt: skip

    def _generate(self, prompts: list[Any], params: RequestParams) -> list[Completion]:
        return self.engine.generate(prompts, params)

    def _seeds(self, n: int) -> int:
        seed, self.seed = self.seed, self.seed + n
        return seed

    def _sample(self, completion: Completion) -> Sample:
        ids = tuple(completion.token_ids)
        finish = completion.finish_reason
        if finish == "stop" and ids and ids[-1] in self.stop_ids:
            finish = "eot"
        return Sample(completion.text, ids, tuple(completion.logprobs or ()), finish)


class ClientLM(EngineLM):
    """`EngineLM` over an `EngineClient`: each call submits one request per prompt and waits for
    them on this thread, while the engine's own thread (or process) steps them together with
    everyone else's requests. A request the engine refuses for a full queue is submitted again
    once one of this call's requests has finished; QueueFullError if none is running. `cancel`
    (from any thread) ends the requests running and refuses later calls: the search calling it
    stops with EngineStoppedError."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer: Any,
        vocab_size: int,
        *,
        max_queue: int = 16,
        seed: int = 0,
    ) -> None:
        """vocab_size: the model's; max_queue: the most sequences one request asks for."""
        self.client, self.tokenizer, self.seed, self.max_queue = client, tokenizer, seed, max_queue
        self.vocab = decodable_ids(tokenizer, vocab_size)
        self.lock = threading.Lock()
        self.cancelled = False
        self.running: set[str] = set()  # ids of the requests submitted and not yet waited for

    def cancel(self) -> None:
        """End the running requests (their calls raise EngineStoppedError) and refuse new ones."""
        with self.lock:
            self.cancelled = True
            running = list(self.running)
        for request_id in running:
            self.client.cancel(request_id)

    def _submit(self, prompt: Any, params: RequestParams, collector: Collector) -> str:
        with self.lock:  # a cancel either comes first and refuses it, or sees its id
            if self.cancelled:
                raise EngineStoppedError("the search was cancelled")
            request_id = self.client.submit(prompt, params, on_event=collector.add)
            self.running.add(request_id)
        return request_id

    def _generate(self, prompts: list[Any], params: RequestParams) -> list[Completion]:
        done: queue.SimpleQueue[None] = queue.SimpleQueue()
        collectors = [Collector(params, done) for _ in prompts]
        running, submitted = 0, []
        try:
            for prompt, collector in zip(prompts, collectors, strict=True):
                while True:
                    try:
                        submitted.append(self._submit(prompt, params, collector))
                        running += 1
                        break
                    except QueueFullError:
                        if running == 0:
                            raise
                        done.get()
                        running -= 1
            for _ in range(running):
                done.get()
        finally:
            with self.lock:
                self.running.difference_update(submitted)
        completions = [c for collector in collectors for c in collector.completions()]
        ended = {c.finish_reason for c in completions} & {"cancelled", "error"}
        if ended:
            raise EngineStoppedError(f"the engine ended a request of the search: {ended.pop()}")
        return completions


def load_engine(run: str, cpu_kernels: bool = True, device: str = "cpu") -> Engine:
    """An `Engine` over the model and tokenizer of a run directory (the tokenizer is required)."""
    from decoderlm.loading import load

    model, tokenizer = load(run, device=device)
    if tokenizer is None:
        raise DecoderLMError(f"{run} has no tokenizer.json, so prompts cannot be encoded")
    return Engine(model, tokenizer, cpu_kernels=cpu_kernels)
