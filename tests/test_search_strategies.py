"""The search strategies on a model whose distribution is set by hand (`scripted_lm.ScriptedLM`)
and on the serving engine: the vote picks the mode, best-of-N with an exact verifier finds a
planted correct sample, beam search equals exhaustive search on a tiny vocabulary, step-level
beam search and MCTS with a perfect process value find an unlikely solution, and no strategy
spends a token more than its budget, whose count is exact; step-level searches spend all of it,
and keep a chat model's blank lines; `ClientLM`, the same model through an engine client's
submit API, waits out a full queue."""

from __future__ import annotations

import itertools
import math
import threading
import time
from functools import partial

import pytest
import torch
from scripted_lm import EOT, ScriptedLM

from decoderlm import DecoderLM, ModelConfig
from decoderlm.engine.engine import Engine
from decoderlm.engine.types import QueueFullError, TokenEvent
from decoderlm.errors import DecoderLMError
from decoderlm.search.lm import ClientLM, EngineLM
from decoderlm.search.strategies import (
    beam_search,
    best_of_n,
    by_verifier,
    mcts,
    mean_logprob,
    self_consistency,
    step_beam_search,
)
from decoderlm.tokenizer import Tokenizer

PROMPT = "Q\n"


def answers(probs: dict[str, float]) -> dict[str, float]:
    return {f"answer: {a}\n\n": p for a, p in probs.items()}


def tree(p: dict[str, float], depth: int = 3) -> dict[str, float]:
    """Every path of `depth` one-letter steps, then its answer line: probability the product."""
    return {
        "".join(f"{s}\n" for s in path) + f"answer: {''.join(path)}\n\n": math.prod(
            p[s] for s in path
        )
        for path in itertools.product(p, repeat=depth)
    }


STEPS = {"x": 0.4, "y": 0.4, "z": 0.2}  # the solution is zzz: probability 0.008


def on_path(prompt: str, solution: str) -> float:
    """A perfect process value: 1 while every line so far is a line of the solution zzz."""
    right = ["z", "z", "z", "answer: zzz"]
    lines = solution.split("\n")
    lines = lines[:-1] if lines[-1] == "" else lines
    return float(lines == right[: len(lines)])


def test_self_consistency_picks_the_mode() -> None:
    lm = ScriptedLM(answers({"1": 0.5, "2": 0.25, "3": 0.25}), PROMPT)
    result = self_consistency(lm, PROMPT, budget=100 * 11, max_tokens=11)
    assert len(result.candidates) == 100
    assert result.answer == "1" and result.text == "answer: 1"
    votes = {c.answer: c.score for c in result.candidates}
    assert votes["1"] == max(votes.values()) == sum(c.answer == "1" for c in result.candidates)


def test_best_of_n_with_an_exact_verifier_finds_a_planted_correct_sample() -> None:
    lm = ScriptedLM(answers({"1": 0.6, "2": 0.35, "7": 0.05}), PROMPT)
    right = best_of_n(
        lm, PROMPT, 64 * 11, scorer=by_verifier(lambda p, s: float(s == "answer: 7")), max_tokens=11
    )
    assert any(c.answer == "7" for c in right.candidates[1:])  # planted among many wrong ones
    assert right.answer == "7"
    likeliest = best_of_n(lm, PROMPT, 64 * 11, scorer=mean_logprob, max_tokens=11)
    assert likeliest.answer == "1"


def exhaustive(
    lm: ScriptedLM, max_len: int, alpha: float, prompt_len: int | None
) -> tuple[float, str]:
    """The best length-normalised score, logprob / L^alpha, over every token sequence of at most
    max_len tokens that ends at end-of-text, or has max_len tokens, by brute force. L: the
    generated tokens if prompt_len is None, else (vLLM's) prompt_len + generated tokens, less one
    if the last is end-of-text."""
    best = (-math.inf, "")
    for length in range(1, max_len + 1):
        for seq in itertools.product(lm.chars, repeat=length):
            logprob, text = 0.0, ""
            for i, c in enumerate(seq):
                p = lm.next_chars(text).get(c, 0.0)
                if p == 0 or (c == EOT and i < length - 1):
                    break
                logprob, text = logprob + math.log(p), text + (c if c != EOT else "")
            else:
                if seq[-1] == EOT or length == max_len:
                    counted = length if prompt_len is None else prompt_len + length - (c == EOT)
                    best = max(best, (logprob / counted**alpha, text))
    return best


@pytest.mark.parametrize("length", ["generated", "sequence"])
@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0])
def test_beam_search_equals_exhaustive_search_on_a_tiny_vocabulary(alpha: float, length) -> None:
    lm = ScriptedLM({"aa": 0.34, "ba": 0.22, "bb": 0.22, "b": 0.12, "abab": 0.1}, PROMPT)
    prompt_len = len(lm.encode(PROMPT)) if length == "sequence" else None
    score, text = exhaustive(lm, 5, alpha, prompt_len)
    result = beam_search(lm, PROMPT, 10_000, width=len(lm.chars) ** 5, max_tokens=5, alpha=alpha,
                         length=length, extract=str)  # fmt: skip
    assert (result.text, max(c.score for c in result.candidates)) == (text, pytest.approx(score))
    greedy = beam_search(lm, PROMPT, 10_000, width=1, max_tokens=5, alpha=alpha, length=length,
                         extract=str)  # fmt: skip
    assert greedy.text.startswith("b")  # one beam follows the likelier first letter


def test_step_beam_search_with_a_process_verifier_finds_the_unlikely_solution() -> None:
    lm = ScriptedLM(tree(STEPS), PROMPT)
    result = step_beam_search(lm, PROMPT, 4096, on_path, width=2, expand=12, step_tokens=16)
    assert result.answer == "zzz" and result.tokens <= 4096


@pytest.mark.parametrize("rollout_tokens", [0, 16])
def test_mcts_with_a_perfect_value_finds_the_solution_within_its_budget(
    rollout_tokens: int,
) -> None:
    lm = ScriptedLM(tree(STEPS), PROMPT)
    result = mcts(
        lm, PROMPT, 4096, on_path, expand=12, step_tokens=16, rollout_tokens=rollout_tokens
    )
    assert result.answer == "zzz" and result.tokens <= 4096
    assert all(c.score == (c.answer == "zzz") for c in result.candidates)


def test_mcts_with_progressive_widening_gets_past_a_step_its_first_expansion_missed() -> None:
    """Two samples a step find z (p 0.2) with probability 0.36: expanded once, a node whose two
    samples missed z is a dead end; widened, it is sampled again (and the repeats' visits move
    UCT elsewhere) until z turns up."""
    once, widened = [], []
    for seed in range(10):
        for found, widening in ((once, 0.0), (widened, 0.5)):
            lm = ScriptedLM(tree(STEPS), PROMPT, seed=seed)
            result = mcts(lm, PROMPT, 2048, on_path, expand=2, step_tokens=16, widening=widening)
            assert result.tokens <= 2048
            found.append(result.answer == "zzz")
    assert sum(once) <= 2 and sum(widened) >= 8  # measured: 0 and 9 of 10 seeds


class Counting(ScriptedLM):
    """Counts every token the model generates: each sampled token, one per prefix scored."""

    generated = 0

    def sample(self, prompts, n, max_tokens, stop, temperature):  # type: ignore[no-untyped-def]
        out = super().sample(prompts, n, max_tokens, stop, temperature)
        self.generated += sum(s.tokens for group in out for s in group)
        return out

    def next_token_logprobs(self, prefixes, k):  # type: ignore[no-untyped-def]
        self.generated += len(prefixes)
        return super().next_token_logprobs(prefixes, k)


STRATEGIES = {
    "self-consistency": lambda lm, budget: self_consistency(lm, PROMPT, budget, max_tokens=16),
    "best-of-n": lambda lm, budget: best_of_n(lm, PROMPT, budget, max_tokens=16),
    "beam": lambda lm, budget: beam_search(lm, PROMPT, budget, width=3, max_tokens=16),
    "step-beam": lambda lm, budget: step_beam_search(
        lm, PROMPT, budget, on_path, width=2, expand=3, step_tokens=16
    ),
    "mcts": lambda lm, budget: mcts(
        lm, PROMPT, budget, on_path, expand=3, step_tokens=16, rollout_tokens=16
    ),
    "mcts, widening": lambda lm, budget: mcts(
        lm, PROMPT, budget, on_path, expand=3, step_tokens=16, rollout_tokens=16, widening=0.5
    ),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("budget", [1, 47, 200, 1000])
def test_token_budgets_are_respected_and_counted_exactly(strategy: str, budget: int) -> None:
    lm = Counting(tree(STEPS), PROMPT, seed=budget)
    result = STRATEGIES[strategy](lm, budget)
    assert result.strategy == strategy.split(",")[0]
    assert result.tokens == lm.generated <= budget
    if budget >= 200:
        assert result.candidates


def test_a_budget_below_one_token_is_a_one_line_error() -> None:
    with pytest.raises(DecoderLMError, match="budget=0 must be an integer ≥ 1"):
        self_consistency(ScriptedLM(answers({"1": 1.0}), PROMPT), PROMPT, 0)


def test_an_unknown_beam_length_is_a_one_line_error() -> None:
    lm = ScriptedLM(answers({"1": 1.0}), PROMPT)
    with pytest.raises(DecoderLMError, match="length='tokens' must be 'generated' or 'sequence'"):
        beam_search(lm, PROMPT, 100, length="tokens")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine() -> Engine:
    torch.manual_seed(0)
    tokenizer = Tokenizer.train_char(["Q\nanswer: 0123456789xyz\n"])
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size, context_length=64, d_model=16, n_layers=1, n_heads=2
    )
    return Engine(DecoderLM(config).eval(), tokenizer, kv_cache_memory="1MiB")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_on_the_engine_the_budget_counts_what_the_engine_generated(
    engine: Engine, strategy: str, one_thread: None
) -> None:
    before = engine.stats().generated_tokens
    result = STRATEGIES[strategy](EngineLM(engine, seed=1), 300)
    assert result.tokens == engine.stats().generated_tokens - before <= 300
    assert result.candidates


def test_beam_search_ends_a_beam_that_fills_the_context_and_charges_what_was_generated(
    engine: Engine, one_thread: None
) -> None:
    lm, context = EngineLM(engine), engine.model.config.context_length
    before = engine.stats().generated_tokens
    result = beam_search(lm, PROMPT, 10_000, width=3, max_tokens=200, stop=("never",))
    assert result.tokens == engine.stats().generated_tokens - before
    prompt = len(lm.encode(PROMPT))
    full = [c for c in result.candidates if c.finish == "length"]
    assert full and all(prompt + c.tokens == context for c in full)  # 200 would not fit


class TwoAtATime:
    """An engine client whose queue holds two requests: a third is refused until one ends."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.open, self.refused, self.lock = engine, 0, 0, threading.Lock()

    def submit(self, prompt, params, *, request_id=None, on_event):  # type: ignore[no-untyped-def]
        with self.lock:
            if self.open == 2:
                self.refused += 1
                raise QueueFullError("full")
            self.open += 1

        def sink(event: TokenEvent) -> None:
            if event.finish_reason is not None:
                with self.lock:
                    self.open -= 1
            on_event(event)

        return self.engine.submit(prompt, params, request_id=request_id, on_event=sink)


def test_client_lm_resubmits_what_a_full_queue_refused_and_equals_engine_lm(
    engine: Engine, one_thread: None
) -> None:
    prefixes = [engine.tokenizer.encode(p) for p in ("Q", "Q\n", "answer", "answer: 1", "xyz")]
    expected = EngineLM(engine).next_token_logprobs(prefixes, 3)
    idle = Engine(engine.model, engine.tokenizer, kv_cache_memory="1MiB")  # steps once started
    client = TwoAtATime(idle)
    lm = ClientLM(client, idle.tokenizer, idle.model.config.vocab_size)  # type: ignore[arg-type]
    got: list = []
    worker = threading.Thread(target=lambda: got.extend(lm.next_token_logprobs(prefixes, 3)))
    worker.start()
    deadline = time.monotonic() + 10
    while not client.refused:  # two queued, the third refused: it waits for one of them
        assert time.monotonic() < deadline
        time.sleep(0.01)
    idle.start()
    worker.join(timeout=30)
    assert client.refused > 0 and client.open == 0
    assert [[t for t, _ in top] for top in got] == [[t for t, _ in top] for top in expected]
    assert [lp for top in got for _, lp in top] == pytest.approx(
        [lp for top in expected for _, lp in top], abs=1e-5
    )
    client.open = 2  # full of other requests: nothing of its own running to wait for
    with pytest.raises(QueueFullError):
        lm.sample(["Q"], 2, 4, (), 1.0)
    idle.shutdown(1.0)


CHAT = {"a\n\nb\nanswer: 1": 0.5, "a\n\nc\nanswer: 2": 0.5}  # blank lines, then end-of-text


@pytest.mark.parametrize("search", ["step-beam", "mcts"])
def test_with_no_stop_string_a_blank_line_is_part_of_a_chat_solution(search: str) -> None:
    """A chat model's solution ends at its end-of-turn token (stop = ()): a blank line is one of
    its lines; with the default stop (an empty line) the same model's solution ends there."""
    prefer = lambda prompt, solution: float("c" not in solution)  # noqa: E731
    run = {"step-beam": partial(step_beam_search, width=2), "mcts": partial(mcts, widening=0.5)}
    chat = run[search](ScriptedLM(CHAT, PROMPT), PROMPT, 400, prefer, expand=4, step_tokens=16,
                       stop=())  # fmt: skip
    assert (chat.text, chat.answer) == ("a\n\nb\nanswer: 1", "1")
    plain = run[search](ScriptedLM(CHAT, PROMPT), PROMPT, 400, prefer, expand=4, step_tokens=16)
    assert plain.text == "a\n" and plain.answer is None


LONG = "".join(f"step {i}\n" for i in range(40)) + "answer: 1"  # longer than any budget here


@pytest.mark.parametrize("budget", [50, 200])
def test_step_searches_spend_their_whole_budget_and_a_step_it_cuts_completes_nothing(
    budget: int,
) -> None:
    """Steps are shortened to what the budget has left, so a step-level search stops only when
    fewer tokens are left than it samples at once (3 here); a step the budget cut is a partial
    solution: MCTS, which answers with complete solutions only, has none."""
    longer = lambda prompt, solution: len(solution) / 1000  # noqa: E731
    beam = step_beam_search(Counting({LONG: 1.0}, PROMPT), PROMPT, budget, longer, width=1,
                            expand=3, step_tokens=16)  # fmt: skip
    assert budget - 3 < beam.tokens <= budget
    assert LONG.startswith(beam.text) and beam.answer is None
    tree_search = mcts(Counting({LONG: 1.0}, PROMPT), PROMPT, budget, longer, expand=3,
                       step_tokens=16, widening=0.5)  # fmt: skip
    assert budget - 3 < tree_search.tokens <= budget
    assert tree_search.candidates == () and tree_search.text == ""
