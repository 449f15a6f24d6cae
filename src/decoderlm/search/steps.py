"""Search over reasoning steps (a step is a line), guided by a verifier of partial solutions.

- `step_beam_search`: beam search over steps guided by a process verifier (Yao et al., 2023,
  "Tree of Thoughts"; Snell et al., 2024, "Scaling LLM Test-Time Compute Optimally can be More
  Effective than Scaling Model Parameters").
- `mcts`: Monte Carlo tree search over steps with UCT (Kocsis & Szepesvári, 2006), as in RAP (Hao
  et al., 2023, "Reasoning with Language Model is Planning with World Model"): selection by UCT,
  expansion by sampling k next steps, evaluation by the verifier's score of the partial solution
  or of a rollout to the end, backpropagation of that value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from decoderlm.errors import DecoderLMError
from decoderlm.search.base import (
    SOLUTION_END,
    STEP_END,
    Budget,
    Candidate,
    Extract,
    SearchResult,
    Verifier,
    best_result,
    check_positive,
    cut_at_stop,
)
from decoderlm.search.lm import Sample, SearchLM
from decoderlm.tasks import answer_line


def _step(partial: str, sample: Sample, stop: tuple[str, ...], cut: bool) -> tuple[str, bool]:
    """The partial solution after a sampled step, and whether the solution is complete. A line
    continues it; end-of-text, or a step cut at the step's full max_tokens, ends it, and so does
    an empty line where the solution ends at one (`SOLUTION_END` in `stop`; with `stop` = (), a
    chat model's, it is a blank line of the solution). `cut`: the budget shortened this step's
    max_tokens, so a step cut at it is a partial line, not the model's failure."""
    if sample.finish == "stop" and (sample.text or SOLUTION_END[0] not in stop):
        return partial + sample.text + STEP_END[0], False
    return partial + sample.text, not (cut and sample.finish == "length")


def _step_cap(spend: Budget, sequences: int, step_tokens: int) -> int:
    """The max_tokens of a step when `sequences` steps are sampled at once: `step_tokens`, or what
    the budget has left for each (0: none fits)."""
    return min(step_tokens, spend.left // sequences)


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
    stop: tuple[str, ...] = SOLUTION_END,
) -> SearchResult:
    """Beam search over steps: each round samples `expand` next lines of every live partial
    solution, scores every new partial solution with the process `verifier`, and keeps the
    `width` best live ones; complete solutions leave the beam (a solution ends as `_step` says:
    `stop` is what ends it besides end-of-text). A round's steps have at most `step_tokens`
    tokens, fewer when that is all the budget has left, so the search spends its whole budget.
    The result is the best complete solution (or, if none completed, the best partial one)."""
    check_positive(width=width, expand=expand, max_steps=max_steps, step_tokens=step_tokens)
    spend = Budget(budget)
    beams: list[tuple[str, float]] = [("", 0.0)]
    done: list[Candidate] = []
    tokens: dict[str, int] = {"": 0}  # generated tokens along each partial solution's path
    for _ in range(max_steps):
        cap = _step_cap(spend, len(beams) * expand, step_tokens) if beams else 0
        if cap < 1:
            break
        groups = spend.sample(
            lm, [prompt + b for b, _ in beams], expand, cap, STEP_END, temperature
        )
        assert groups is not None  # cap fits the budget
        live: dict[str, float] = {}
        for (partial, _), group in zip(beams, groups, strict=True):
            for sample in group:
                text, complete = _step(partial, sample, stop, cap < step_tokens)
                tokens[text] = tokens[partial] + sample.tokens
                value = verifier(prompt, text)
                if complete:
                    done.append(Candidate(text, extract(text), value, tokens[text]))
                else:
                    live[text] = value
        beams = sorted(live.items(), key=lambda item: item[1], reverse=True)[:width]
    partial = tuple(Candidate(t, extract(t), v, tokens[t]) for t, v in beams)
    return best_result("step-beam", tuple(done) or partial, spend)


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

    def select(self, widening: float, c: float) -> _Node:
        """The node to expand: down from this one by UCT (exploration `c`) to a node that may be
        expanded, or whose children are all complete (widened: reached only with widening)."""
        node = self
        while not node.can_expand(widening):
            live = [child for child in node.children if child.open(widening)]
            if not live:
                break
            node = max(live, key=lambda child: child.uct(c))
        return node

    def grow(
        self, samples: list[Sample], tokens: dict[str, int], stop: tuple[str, ...], cut: bool
    ) -> tuple[list[_Node], list[_Node]]:
        """Expand it by sampled next steps, a repeated line one child: (the new children, the
        child each sample reached, repeats included); `tokens` gets each new child's generated
        tokens along its path; `stop` and `cut` as `_step` takes them."""
        self.expansions += 1
        known = {child.text: child for child in self.children}
        new: list[_Node] = []
        sampled: list[_Node] = []
        for sample in samples:
            text, complete = _step(self.text, sample, stop, cut)
            if text not in known:
                tokens[text] = tokens[self.text] + sample.tokens
                known[text] = _Node(text, self, complete)
                new.append(known[text])
            sampled.append(known[text])
        self.children = list(known.values())
        if not any(s.tokens for s in samples):  # at the model's context: nothing follows it
            self.complete = True
        return new, sampled

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
    stop: tuple[str, ...] = SOLUTION_END,
) -> SearchResult:
    """MCTS over steps: select a node by UCT (`exploration` c), expand it by sampling `expand`
    next lines, evaluate each new child by the verifier, on the partial solution or, with
    `rollout_tokens` > 0, on a rollout sampled to the end of the solution, and back the value up.
    With `widening` α > 0 a node is expanded again (new lines join its children, and a line
    equal to an existing child adds a visit to it with its value) while it has had fewer than
    ⌈visits^α⌉ expansions, or when all its children are complete (progressive widening); with 0
    each node is expanded once, repeats merge, and the search ends when nothing is left to
    expand. A solution ends as `_step` says (`stop`: what ends it besides end-of-text). Runs
    while an expansion and its rollouts fit the budget, its steps shortened to what the budget has
    left when `step_tokens` no longer fit; the result is the best-valued complete solution
    (rollouts included)."""
    check_positive(expand=expand, step_tokens=step_tokens)
    if not widening >= 0:
        raise DecoderLMError(f"widening={widening!r} must be ≥ 0 (0: each node expanded once)")
    spend = Budget(budget)
    root = _Node("", None, complete=False)
    found: list[Candidate] = []
    tokens: dict[str, int] = {"": 0}
    values: dict[str, float] = {}  # each child's value, by its text
    while root.open(widening):
        cap = min(step_tokens, spend.left // expand - rollout_tokens)  # rollouts: ≤ 1 a child
        if cap < 1:
            break
        node = root.select(widening, exploration)
        group = spend.sample(lm, [prompt + node.text], expand, cap, STEP_END, temperature)
        assert group is not None  # cap fits the budget
        new, sampled = node.grow(group[0], tokens, stop, cap < step_tokens)
        solutions = {c.text: c.text for c in new}
        unfinished = [c.text for c in new if not c.complete] if rollout_tokens else []
        if unfinished:  # one batched call: a rollout of each unfinished child
            rollouts = spend.sample(
                lm, [prompt + t for t in unfinished], 1, rollout_tokens, stop, temperature
            )
            assert rollouts is not None  # cap left room for them
            for text, (rollout,) in zip(unfinished, rollouts, strict=True):
                solutions[text] = cut_at_stop(text + rollout.text, stop)
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
    return best_result("mcts", tuple(found), spend)
