"""Test-time compute: search strategies that spend a budget of generated tokens on one prompt.

- `self_consistency`: Wang et al. (2022), "Self-Consistency Improves Chain of Thought Reasoning in
  Language Models": sample N solutions, extract their answers, majority vote.
- `best_of_n`: sample N, keep the best by a scorer: the mean log-probability, or a verifier
  (an exact checker, the oracle, as in Cobbe et al., 2021, "Training Verifiers to Solve Math Word
  Problems", or any user verifier).
- `beam_search`: beam search over tokens, length-normalised (Wu et al., 2016, GNMT), by the
  generated tokens or, as vLLM's `length_penalty` (what the server uses), by the whole sequence.
- `step_beam_search`: beam search over reasoning steps (lines) guided by a process verifier
  (Yao et al., 2023, "Tree of Thoughts"; Snell et al., 2024, "Scaling LLM Test-Time Compute
  Optimally can be More Effective than Scaling Model Parameters").
- `mcts`: Monte Carlo tree search over reasoning steps with UCT (Kocsis & Szepesvári, 2006), as in
  RAP (Hao et al., 2023, "Reasoning with Language Model is Planning with World Model"): selection
  by UCT, expansion by sampling k next steps, evaluation by the verifier's score of the partial
  solution or of a rollout to the end, backpropagation of that value.

Every strategy takes a `budget` of generated tokens and never spends more: a call to the model
is made only if its most expensive outcome still fits (`Budget`), and `SearchResult.tokens` is
what was spent, exactly, so strategies compare at equal compute. A solution is lines of text
ending at an empty line (`SOLUTION_END`), the format of `decoderlm.tasks`; a step is one line.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from decoderlm.errors import DecoderLMError
from decoderlm.search.lm import Sample, SearchLM
from decoderlm.tasks import Problem, Task, answer_line

SOLUTION_END = ("\n\n",)  # a worked solution ends at an empty line
STEP_END = ("\n",)  # a step is a line
Extract = Callable[[str], "str | None"]  # a completion's answer (None: it gives none)


class Verifier(Protocol):
    """Scores a partial or full solution of a prompt, higher is better (e.g. 0 to 1).

    Any function `def verifier(prompt: str, solution: str) -> float` is one."""

    def __call__(self, prompt: str, solution: str) -> float: ...


Scorer = Callable[[str, Sample], float]  # best-of-N's score of a sample of a prompt


def mean_logprob(prompt: str, sample: Sample) -> float:
    """The sample's mean token log-probability under the model (−∞ for an empty sample)."""
    return sum(sample.logprobs) / len(sample.logprobs) if sample.logprobs else -math.inf


def by_verifier(verifier: Verifier) -> Scorer:
    """Best-of-N's scorer that asks `verifier` about the sample's text."""
    return lambda prompt, sample: verifier(prompt, sample.text)


def oracle(task: Task, problem: Problem) -> Verifier:
    """The exact outcome verifier: 1.0 if the task's checker accepts the solution, else 0.0."""
    return lambda prompt, solution: float(task.check(problem, solution))


def process_oracle(task: Task, problem: Problem) -> Verifier:
    """An exact process verifier for tasks with one solution path (arithmetic): 1.0 while the
    partial solution's lines are the worked solution's first lines or the checker accepts it."""
    reference = problem.solution.splitlines(keepends=True)

    def verify(prompt: str, solution: str) -> float:
        lines = solution.splitlines(keepends=True)
        on_path = lines == reference[: len(lines)]
        return float(on_path or task.check(problem, solution))

    return verify


Top = tuple[tuple[int, float], ...]  # a step's likeliest next tokens, (id, log-probability)


@dataclass(frozen=True)
class Candidate:
    """A solution a strategy considered: its text, answer, score and the tokens generated for it.
    Beam search also says why it ended ("stop": end-of-text or a stop string; "length"), and gives
    each generated token with its log-probability and the likeliest tokens of its step."""

    text: str
    answer: str | None
    score: float
    tokens: int
    finish: str | None = None
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    tops: tuple[Top, ...] = ()


@dataclass(frozen=True)
class SearchResult:
    """What a strategy chose (`answer`, `text`), every candidate with its score, and the generated
    tokens spent (≤ the budget)."""

    strategy: str
    answer: str | None
    text: str
    candidates: tuple[Candidate, ...]
    tokens: int


class Budget:
    """Generated tokens: the most a search may spend, and what it has spent."""

    def __init__(self, tokens: int) -> None:
        if not (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 1):
            raise DecoderLMError(f"budget={tokens!r} must be an integer ≥ 1 (generated tokens)")
        self.total, self.spent = tokens, 0

    @property
    def left(self) -> int:
        return self.total - self.spent

    def charge(self, tokens: int) -> None:
        self.spent += tokens
        if self.spent > self.total:
            raise AssertionError(f"spent {self.spent} tokens of a budget of {self.total}")

    def sample(
        self,
        lm: SearchLM,
        prompts: list[str],
        n: int,
        max_tokens: int,
        stop: tuple[str, ...],
        temperature: float,
    ) -> list[list[Sample]] | None:
        """`lm.sample`, charged; None (and nothing spent) if its longest outcome would not fit."""
        if len(prompts) * n * max_tokens > self.left:
            return None
        samples = lm.sample(prompts, n, max_tokens, stop, temperature)
        self.charge(sum(s.tokens for group in samples for s in group))
        return samples


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise DecoderLMError(f"{name}={value!r} must be an integer ≥ 1")


def sample_solutions(
    lm: SearchLM,
    prompt: str,
    budget: Budget,
    n: int | None,
    max_tokens: int,
    temperature: float,
) -> list[Sample]:
    """Up to n solutions (None: as many as the budget allows), in batches, sampling while a
    whole solution of `max_tokens` still fits."""
    if n is not None:
        _check_positive(n=n)
    wanted = math.inf if n is None else n
    samples: list[Sample] = []
    while (batch := int(min(wanted - len(samples), budget.left // max_tokens))) > 0:
        drawn = budget.sample(lm, [prompt], batch, max_tokens, SOLUTION_END, temperature)
        assert drawn is not None  # batch · max_tokens fits
        samples += drawn[0]
    return samples


def self_consistency(
    lm: SearchLM,
    prompt: str,
    budget: int,
    *,
    n: int | None = None,
    max_tokens: int = 256,
    temperature: float = 1.0,
    extract: Extract = answer_line,
) -> SearchResult:
    """Sample n solutions (default: as many as fit), take the answer most of them give."""
    _check_positive(max_tokens=max_tokens)
    spend = Budget(budget)
    samples = sample_solutions(lm, prompt, spend, n, max_tokens, temperature)
    answers = [extract(s.text) for s in samples]
    votes = Counter(a for a in answers if a is not None)
    winner = votes.most_common(1)[0][0] if votes else None
    candidates = tuple(
        Candidate(s.text, a, float(votes[a]) if a is not None else 0.0, s.tokens)
        for s, a in zip(samples, answers, strict=True)
    )
    text = next((c.text for c in candidates if c.answer == winner), "")
    return SearchResult("self-consistency", winner, text, candidates, spend.spent)


def best_of_n(
    lm: SearchLM,
    prompt: str,
    budget: int,
    *,
    scorer: Scorer = mean_logprob,
    n: int | None = None,
    max_tokens: int = 256,
    temperature: float = 1.0,
    extract: Extract = answer_line,
) -> SearchResult:
    """Sample n solutions (default: as many as fit), keep the one `scorer` rates highest."""
    _check_positive(max_tokens=max_tokens)
    spend = Budget(budget)
    samples = sample_solutions(lm, prompt, spend, n, max_tokens, temperature)
    candidates = tuple(
        Candidate(s.text, extract(s.text), scorer(prompt, s), s.tokens) for s in samples
    )
    return _best("best-of-n", candidates, spend)


def _best(strategy: str, candidates: tuple[Candidate, ...], spend: Budget) -> SearchResult:
    """The result whose choice is the highest-scored candidate (the first of equals)."""
    best = max(candidates, key=lambda c: c.score, default=None)
    if best is None:
        return SearchResult(strategy, None, "", candidates, spend.spent)
    return SearchResult(strategy, best.answer, best.text, candidates, spend.spent)


@dataclass(frozen=True)
class _Beam:
    ids: tuple[int, ...]
    logprob: float  # Σ logprobs, summed in order
    logprobs: tuple[float, ...] = ()
    tops: tuple[Top, ...] = ()


def beam_search(
    lm: SearchLM,
    prompt: str | Sequence[int],
    budget: int,
    *,
    width: int = 4,
    max_tokens: int = 256,
    alpha: float = 1.0,
    length: Literal["generated", "sequence"] = "generated",
    stop: tuple[str, ...] = SOLUTION_END,
    top: int = 0,
    extract: Extract = answer_line,
) -> SearchResult:
    """Token-level beam search: each step extends every live beam by its `width` likeliest next
    tokens (one generated token per beam) and keeps the `width` best by length-normalised
    log-probability, logprob / L^alpha, where `length` says what L counts:

    - "generated" (the default, GNMT's length normalisation): the beam's generated tokens,
      end-of-text included;
    - "sequence" (vLLM's `get_beam_search_score`, vllm/beam_search.py, what its `length_penalty`
      means and the server's `use_beam_search` uses): prompt and generated tokens, less one if the
      last is end-of-text.

    A beam ends at end-of-text or a `stop` string (by default the solution's end), or with
    "length" when it fills the model's context; the result is the best ended or live beam. Each candidate carries its tokens' log-probabilities and, with
    `top` > 0, each step's `top` likeliest tokens (the steps then ask for max(width, top) of them
    and extend a beam by the first `width`). `prompt`: text, or its token ids."""
    _check_positive(width=width, max_tokens=max_tokens)
    if length not in ("generated", "sequence"):
        raise DecoderLMError(f"length={length!r} must be 'generated' or 'sequence'")
    spend = Budget(budget)
    prompt_ids = lm.encode(prompt) if isinstance(prompt, str) else list(prompt)
    beams, ended, full = [_Beam((), 0.0)], [], []  # full: at the model's context, no next token

    def score(beam: _Beam) -> float:
        counted = len(beam.ids)
        if length == "sequence":  # an empty prompt's lone end-of-text counts one, not zero
            counted = max(len(prompt_ids) + counted - (beam.ids[-1] == lm.eot_id), 1)
        return beam.logprob / counted**alpha

    for _ in range(max_tokens):
        if not beams or len(beams) > spend.left:
            break
        tops = lm.next_token_logprobs([prompt_ids + list(b.ids) for b in beams], max(width, top))
        spend.charge(sum(1 for step in tops if step))
        full += [b for b, step in zip(beams, tops, strict=True) if not step]
        grown = [
            _Beam((*b.ids, t), b.logprob + lp, (*b.logprobs, lp), (*b.tops, tuple(step[:top])))
            for b, step in zip(beams, tops, strict=True)
            for t, lp in step[:width]
        ]
        grown.sort(key=score, reverse=True)
        beams = []
        for beam in grown[:width]:
            (ended if _ends(lm, beam.ids, stop) else beams).append(beam)
    candidates = []
    for b, finish in [(b, "stop") for b in ended] + [(b, "length") for b in full + beams]:
        text = _solution_text(lm, b.ids, stop)
        candidates.append(
            Candidate(text, extract(text), score(b), len(b.ids), finish, b.ids, b.logprobs, b.tops)
        )
    return _best("beam", tuple(candidates), spend)


def _ends(lm: SearchLM, ids: tuple[int, ...], stop: tuple[str, ...]) -> bool:
    return ids[-1] == lm.eot_id or any(end in lm.decode(ids) for end in stop)


def _solution_text(lm: SearchLM, ids: tuple[int, ...], stop: tuple[str, ...]) -> str:
    """The text of generated ids, without end-of-text and cut before the first stop string."""
    return _cut(lm.decode([t for t in ids if t != lm.eot_id]), stop)


def _cut(text: str, stop: tuple[str, ...] = SOLUTION_END) -> str:
    """`text` up to its first stop string (which a stop string misses when it straddles the prompt)."""
    for end in stop:
        text = text.split(end)[0]
    return text


def _step(partial: str, sample: Sample) -> tuple[str, bool]:
    """The partial solution after a sampled step, and whether the solution is complete: an empty
    line, end-of-text or a step cut at max_tokens end it."""
    if sample.finish == "stop" and sample.text:
        return partial + sample.text + STEP_END[0], False
    return partial + sample.text, True


def step_beam_search(
    lm: SearchLM,
    prompt: str,
    budget: int,
    verifier: Verifier,
    *,
    width: int = 4,
    expand: int = 4,
    max_steps: int = 32,
    step_tokens: int = 64,
    temperature: float = 1.0,
    extract: Extract = answer_line,
) -> SearchResult:
    """Beam search over steps: each round samples `expand` next lines of every live partial
    solution, scores every new partial solution with the process `verifier`, and keeps the
    `width` best live ones; complete solutions leave the beam. The result is the best complete
    solution (or, if none completed, the best partial one)."""
    _check_positive(width=width, expand=expand, max_steps=max_steps, step_tokens=step_tokens)
    spend = Budget(budget)
    beams: list[tuple[str, float]] = [("", 0.0)]
    done: list[Candidate] = []
    tokens: dict[str, int] = {"": 0}  # generated tokens along each partial solution's path
    for _ in range(max_steps):
        groups = (
            spend.sample(
                lm, [prompt + b for b, _ in beams], expand, step_tokens, STEP_END, temperature
            )
            if beams
            else None
        )
        if groups is None:
            break
        live: dict[str, float] = {}
        for (partial, _), group in zip(beams, groups, strict=True):
            for sample in group:
                text, complete = _step(partial, sample)
                tokens[text] = tokens[partial] + sample.tokens
                value = verifier(prompt, text)
                if complete:
                    done.append(Candidate(text, extract(text), value, tokens[text]))
                else:
                    live[text] = value
        beams = sorted(live.items(), key=lambda item: item[1], reverse=True)[:width]
    partial = tuple(Candidate(t, extract(t), v, tokens[t]) for t, v in beams)
    return _best("step-beam", tuple(done) or partial, spend)


@dataclass(eq=False)
class _Node:
    """A partial solution in the search tree, with its visits and the values backed up to it."""

    text: str
    parent: _Node | None
    complete: bool
    visits: int = 0
    value: float = 0.0  # the sum of the values backed up through it
    children: list[_Node] = field(default_factory=list)
    expansions: int = 0  # times `expand` next steps were sampled from it

    def can_expand(self, widening: float) -> bool:
        """Whether it may sample more next steps now: progressive widening (Couëtoux et al., 2011,
        "Continuous Upper Confidence Trees") allows ⌈visits^widening⌉ expansions; 0: one."""
        return not self.complete and self.expansions < math.ceil(max(self.visits, 1) ** widening)

    def open(self, widening: float) -> bool:
        """Whether some step below it may still be expanded (with widening, below any node that
        is not complete)."""
        if self.complete:
            return False
        return widening > 0 or not self.expansions or any(c.open(widening) for c in self.children)

    def uct(self, c: float) -> float:
        parent = self.parent.visits if self.parent is not None else self.visits
        return self.value / self.visits + c * math.sqrt(math.log(parent) / self.visits)

    def backup(self, value: float) -> None:
        node: _Node | None = self
        while node is not None:
            node.visits += 1
            node.value += value
            node = node.parent


def mcts(
    lm: SearchLM,
    prompt: str,
    budget: int,
    verifier: Verifier,
    *,
    expand: int = 4,
    step_tokens: int = 64,
    rollout_tokens: int = 0,
    exploration: float = 1.0,
    widening: float = 0.0,
    temperature: float = 1.0,
    extract: Extract = answer_line,
) -> SearchResult:
    """MCTS over steps: select a node by UCT (`exploration` c), expand it by sampling `expand`
    next lines, evaluate each new child by the verifier, on the partial solution or, with
    `rollout_tokens` > 0, on a rollout sampled to the end of the solution, and back the value up.
    With `widening` α > 0 a node is expanded again (new lines join its children, and a line
    equal to an existing child adds a visit to it with its value) while it has had fewer than
    ⌈visits^α⌉ expansions, or when all its children are complete (progressive widening); with 0
    each node is expanded once, repeats merge, and the search ends when nothing is left to
    expand. Runs while an expansion (and its rollouts) fits the budget; the result is
    the best-valued complete solution (rollouts included)."""
    _check_positive(expand=expand, step_tokens=step_tokens)
    if not widening >= 0:
        raise DecoderLMError(f"widening={widening!r} must be ≥ 0 (0: each node expanded once)")
    spend = Budget(budget)
    root = _Node("", None, complete=False)
    found: list[Candidate] = []
    tokens: dict[str, int] = {"": 0}
    values: dict[str, float] = {}  # each child's value, by its text
    while root.open(widening) and expand * (step_tokens + rollout_tokens) <= spend.left:
        node = root
        while not node.can_expand(widening):
            live = [c for c in node.children if c.open(widening)]
            if not live:  # every child complete: widen this node (only reached with widening)
                break
            node = max(live, key=lambda c: c.uct(exploration))
        group = spend.sample(lm, [prompt + node.text], expand, step_tokens, STEP_END, temperature)
        assert group is not None  # the loop's condition left room for it
        node.expansions += 1
        known = {c.text: c for c in node.children}
        new: list[_Node] = []
        sampled: list[_Node] = []  # the child each sample reached, repeats included
        for sample in group[0]:
            text, complete = _step(node.text, sample)
            if text not in known:
                tokens[text] = tokens[node.text] + sample.tokens
                known[text] = _Node(text, node, complete)
                new.append(known[text])
            sampled.append(known[text])
        node.children = list(known.values())
        if not any(s.tokens for s in group[0]):  # at the model's context: nothing follows it
            node.complete = True
        solutions = {c.text: c.text for c in new}
        unfinished = [c.text for c in new if not c.complete] if rollout_tokens else []
        if unfinished:  # one batched call: a rollout of each unfinished child
            rollouts = spend.sample(
                lm, [prompt + t for t in unfinished], 1, rollout_tokens, SOLUTION_END, temperature
            )
            assert rollouts is not None  # the loop's condition left room for them
            for text, (rollout,) in zip(unfinished, rollouts, strict=True):
                solutions[text] = _cut(text + rollout.text)
                tokens[solutions[text]] = tokens[text] + rollout.tokens
        for child in new:
            solution = solutions[child.text]
            values[child.text] = verifier(prompt, solution)
            if child.complete or rollout_tokens:
                found.append(
                    Candidate(solution, extract(solution), values[child.text], tokens[solution])
                )
        for child in sampled if widening else new:  # widening: a repeat is a visit like any other
            child.backup(values[child.text])
    return _best("mcts", tuple(found), spend)
