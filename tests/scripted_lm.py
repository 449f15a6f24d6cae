"""A `SearchLM` whose distribution is set by hand: it writes one of given texts with given
probabilities, one character a token, then end-of-text; its next-character distribution is the
exact marginal of those texts (a trie), so sampling, log-probabilities and beam search all see
the same model."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from decoderlm.search.lm import Sample

EOT = "$"


class ScriptedLM:
    def __init__(self, scripts: dict[str, float], prompt_chars: str = "", seed: int = 0) -> None:
        self.scripts = scripts
        chars = sorted(set("".join(scripts) + prompt_chars) | {EOT})
        self.vocab = {c: i for i, c in enumerate(chars)}
        self.chars = chars
        self.rng = random.Random(seed)
        self.prompt_len: dict[str, int] = {}
        self.calls = 0

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset({self.vocab[EOT]})

    def encode(self, text: str) -> list[int]:
        return [self.vocab[c] for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def next_chars(self, generated: str) -> dict[str, float]:
        """The next character's distribution after `generated` (EOT at a script's end)."""
        mass: dict[str, float] = {}
        for script, p in self.scripts.items():
            if script.startswith(generated):
                c = script[len(generated)] if len(script) > len(generated) else EOT
                mass[c] = mass.get(c, 0.0) + p
        total = sum(mass.values())
        return {c: p / total for c, p in mass.items()} if total else {EOT: 1.0}

    def sample(
        self,
        prompts: Sequence[str],
        n: int,
        max_tokens: int,
        stop: tuple[str, ...],
        temperature: float,
    ) -> list[list[Sample]]:
        self.calls += 1
        return [[self._one(p, max_tokens, stop, temperature) for _ in range(n)] for p in prompts]

    def _one(
        self, prompt: str, max_tokens: int, stop: tuple[str, ...], temperature: float
    ) -> Sample:
        partial = self._generated(prompt)
        text, ids, lps = "", [], []
        while len(ids) < max_tokens:
            dist = self.next_chars(partial + text)
            chars = list(dist)
            if temperature == 0:
                c = max(chars, key=dist.get)
            else:
                weights = [dist[x] ** (1 / temperature) for x in chars]
                c = self.rng.choices(chars, weights)[0]
            ids.append(self.vocab[c])
            lps.append(math.log(dist[c]))
            if c == EOT:
                return Sample(text, tuple(ids), tuple(lps), "eot")
            text += c
            hit = [text.index(s) for s in stop if s in text]
            if hit:
                return Sample(text[: min(hit)], tuple(ids), tuple(lps), "stop")
        return Sample(text, tuple(ids), tuple(lps), "length")

    def next_token_logprobs(
        self, prefixes: Sequence[Sequence[int]], k: int
    ) -> list[list[tuple[int, float]]]:
        out = []
        for prefix in prefixes:
            dist = self.next_chars(self._generated(self.decode(prefix)))
            top = sorted(dist.items(), key=lambda item: -item[1])[:k]
            out.append([(self.vocab[c], math.log(p)) for c, p in top])
        return out

    def _generated(self, text: str) -> str:
        """What of `text` the model wrote: everything after the prompt, "Q\\n"."""
        return text.split("Q\n", 1)[1]
