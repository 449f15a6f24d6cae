"""The test-time compute study (`decoderlm lab test-time-compute`): accuracy against generated
tokens for the search strategies of `decoderlm.search`, on a policy the study trains itself.

1. Policy: the README recipe (`decoderlm prepare --task arithmetic --difficulty 5`, llama-tiny,
   context 128, batch 32) into OUT/policy, a checkpoint every 25 steps; of those, the one whose
   greedy accuracy on held-out train-split problems is nearest 50% (`select_checkpoint`): this
   model learns the scratchpad abruptly, at a step that moves with the machine and the schedule,
   so a fixed step count lands anywhere on that edge. `--quick`: a smaller one.
2. Learned verifier: a head on the policy's frozen hidden states (`decoderlm.lab.test_time_verifier`),
   fit on its samples of train problems labelled by the checker (`decoderlm.search.labelling`),
   at the candidate layer with the lowest validation loss.
3. Per seed (the sampling seed; the policy, the verifier and the test problems are fixed), on
   every test problem: greedy decoding; a pool of max(N) samples, from whose first N
   self-consistency, best-of-N (mean log-probability, learned verifier, oracle) and pass@N (some
   sample correct: the ceiling of any verifier) are computed for each N, by the strategies' own
   code over the recorded samples (`_Pool`); token-level beam search of width N (N ≤
   beam_max); step-level beam search (width N / STEP_BEAM_SHARE) and MCTS with progressive
   widening (each new step valued by the verifier, no rollouts), each guided once by the learned
   verifier and once by the exact process verifier (`process_oracle`: the searches' ceiling, as
   the oracle is best-of-N's), with a budget of the tokens the pool's first N samples of the
   problem spent: never more than the pooled strategies at that N.
4. Engine: generated tokens/s and the prefix cache's reuse (prompt tokens whose KV blocks a
   sequence found cached, per prompt token submitted) of sampling N solutions of the first
   problems, and over each search.
5. The learned verifier as a classifier of the pooled test samples (AUC; σ(s_T) > 0.5 against
   the checker).

Resume: the policy is reused when OUT holds it (its summary file); the verifier is refit (from
the same seeded samples, in seconds).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from decoderlm import checkpoint, data
from decoderlm.errors import DecoderLMError
from decoderlm.files import write_json
from decoderlm.lab.runner import RESULTS_FILE, environment, json_safe
from decoderlm.lab.stats import summarise
from decoderlm.lab.test_time_verifier import classifier, fit_head_verifier
from decoderlm.model.config import ModelConfig
from decoderlm.search.head_verifier import HeadVerifier
from decoderlm.search.labelling import label_samples
from decoderlm.search.lm import EngineLM, Sample, load_engine
from decoderlm.search.strategies import (
    SOLUTION_END,
    SearchResult,
    beam_search,
    best_of_n,
    mcts,
    mean_logprob,
    process_oracle,
    self_consistency,
    step_beam_search,
)
from decoderlm.tasks import Problem, Task, corpus, get_task
from decoderlm.training.train_config import TrainConfig
from decoderlm.training.trainer import train

STUDY = "test-time-compute"
STEP_BEAM_SHARE = 8  # step-level beam width = N / 8 (at least 1): its rounds fit the pool's tokens
DONE_FILE = "lab.json"  # in OUT/policy: the finished training's summary
POOLED = ("self-consistency", "best-of-N (mean log-prob)", "best-of-N (learned)")
POOLED += ("best-of-N (oracle)", "pass@N")
GUIDED = ("step-beam (learned)", "MCTS (learned)", "step-beam (oracle)", "MCTS (oracle)")
STRATEGIES = ("greedy", *POOLED, "beam", *GUIDED)


@dataclass(frozen=True)
class TestTimeSpec:
    """What the study trains and searches; the defaults are the full study."""

    task: str = "arithmetic"
    difficulty: int = 5
    corpus_problems: int = 20_000
    model: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"preset": "llama-tiny", "context_length": 128}
    )
    train: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {
            "batch_size": 32,
            "max_steps": 800,
            "checkpoint_interval": 25,
            "eval_interval": 25,
        }
    )
    select_problems: int = 40  # held-out train-split problems that choose the checkpoint
    target_accuracy: float = 0.5  # the greedy accuracy the chosen checkpoint is nearest
    verifier_problems: int = 300
    verifier_samples: int = 8
    verifier_layers: tuple[int, ...] = (2, 3, 4)  # the head reads one of these blocks' output
    head_steps: int = 300
    verifier_within: bool = True  # fit on what tells a problem's samples apart (`within_weights`)
    problems: int = 50
    seeds: int = 3
    ns: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    beam_max: int = 16
    max_tokens: int = 128
    temperature: float = 0.7  # of every sampling strategy (Cobbe et al., 2021, sample at 0.7)
    step_tokens: int = 24
    expand: int = 4
    # MCTS's progressive widening exponent α (Couëtoux et al., 2011): a node is expanded again
    # while it has had < ⌈visits^α⌉ expansions, its visits counting every sampled child; at 0.5
    # the quick study's tree widened so fast that at ≤ 8 samples' tokens it reached no solution
    widening: float = 0.25
    probe_problems: int = 4
    builtin: bool = True


def quick_spec() -> TestTimeSpec:
    """≤ 3 minutes on 2 quiet cores: 2-digit sums, a small policy, few problems, N ≤ 8."""
    return TestTimeSpec(
        difficulty=2,
        corpus_problems=5_000,
        model={"preset": "llama-tiny", "context_length": 64},
        train={"batch_size": 16, "max_steps": 600, "eval_interval": 50, "checkpoint_interval": 50},
        select_problems=16,
        verifier_problems=40,
        verifier_samples=4,
        head_steps=100,
        problems=8,
        seeds=2,
        ns=(1, 2, 8),
        beam_max=2,
        max_tokens=64,
        step_tokens=16,
        expand=2,
        probe_problems=2,
    )


def run_study(
    spec: TestTimeSpec, out: str | Path, progress: bool = True, command: str = ""
) -> dict[str, Any]:
    """Train the policy (unless OUT holds it) and fit the verifier, search, write results.json."""
    start = time.perf_counter()
    ran_at = environment()  # the commit whose code runs, not the one checked out at the end
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    task = get_task(spec.task)
    policy = _policy(spec, task, out, progress)
    engine = load_engine(str(policy_dir(out, policy)))
    fitting = time.perf_counter()
    verifier, verifier_info = fit_study_verifier(spec, task, EngineLM(engine, seed=0), progress)
    verifier_info["wall_s"] = time.perf_counter() - fitting
    problems = task.problems(spec.problems, spec.difficulty, seed=0, split="test")
    runs, judged, searches = [], [], []
    total = spec.seeds * len(problems)
    with tqdm(total=total, desc=STUDY, unit="problem", disable=not progress) as bar:
        for seed in range(spec.seeds):
            lm = EngineLM(engine, seed=1_000_003 * seed)
            counts: dict[tuple[str, int], list[int]] = {}
            for problem in problems:
                outcomes, verdicts, measured = _search(spec, task, problem, lm, verifier)
                for name, n, correct, tokens in outcomes:
                    got = counts.setdefault((name, n), [0, 0])
                    got[0], got[1] = got[0] + correct, got[1] + tokens
                searches += [{**row, "seed": seed} for row in measured]
                judged.append(verdicts)
                bar.update(1)
            runs += [
                {"strategy": name, "n": n, "seed": seed, "correct": c, "tokens": t,
                 "accuracy": c / len(problems), "tokens_per_problem": t / len(problems)}
                for (name, n), (c, t) in counts.items()
            ]  # fmt: skip
    results = {
        "study": STUDY,
        "description": (
            "Accuracy against generated tokens of test-time search (Wang et al., 2022; Cobbe et "
            "al., 2021; Snell et al., 2024; MCTS over steps) on a small policy trained on "
            f"{spec.task} at difficulty {spec.difficulty}, with exact and learned verifiers."
        ),
        "spec": dataclasses.asdict(spec),
        "command": command or " ".join(sys.argv),
        "environment": ran_at,
        "policy": policy,
        "verifier": {**verifier_info, **classifier(judged)},
        "problems": len(problems),
        "runs": runs,
        "summary": summary(runs),
        "engine": _probe(spec, problems, EngineLM(engine, seed=0)),
        "searches": searches,
        "wall_s": time.perf_counter() - start,
    }
    results = json_safe(results)  # NaN → null: strict JSON
    write_json(out / RESULTS_FILE, results)
    return results


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per strategy, per N: mean/spread/n over seeds of the accuracy and tokens a problem."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for name in STRATEGIES:
        for n in sorted({r["n"] for r in runs if r["strategy"] == name}):
            mine = [r for r in runs if r["strategy"] == name and r["n"] == n]
            table.setdefault(name, {})[str(n)] = {
                key: dataclasses.asdict(summarise([r[key] for r in mine]))
                for key in ("accuracy", "tokens_per_problem")
            }
    return table


def _policy(spec: TestTimeSpec, task: Task, out: Path, progress: bool) -> dict[str, Any]:
    """OUT/policy: the task's corpus prepared (char-level), the policy trained on it with a
    checkpoint every `checkpoint_interval` steps, and the checkpoint chosen (`select_checkpoint`)."""

    def make() -> dict[str, Any]:
        text = out / "task.txt"
        text.write_text(corpus(task, spec.corpus_problems, spec.difficulty))
        data_dir = out / "data"
        data.prepare([text], data_dir, tokenizer="char", progress=False)
        fields = dict(spec.model)
        model = ModelConfig.from_preset(fields.pop("preset"), **fields)
        config = TrainConfig(**{"peak_flops": 1e12, **spec.train})
        config = dataclasses.replace(config, keep_last=config.max_steps)  # keep every checkpoint
        result = _finished(
            train(model, config, data_dir, out / "policy", overwrite=True, progress=progress)
        )
        problems = task.problems(spec.select_problems, spec.difficulty, seed=2, split="train")
        curve = select_checkpoint(task, problems, out / "policy", spec.max_tokens)
        chosen = min(curve, key=lambda c: (abs(c["accuracy"] - spec.target_accuracy), -c["step"]))
        return {"steps": result["step"], "val_loss": result["val_loss"], "chosen": chosen,
                "curve": curve}  # fmt: skip

    return _trained_once(out / "policy", make)


def select_checkpoint(
    task: Task, problems: list[Problem], run_dir: Path, max_tokens: int
) -> list[dict[str, Any]]:
    """Greedy accuracy on `problems` of every checkpoint of run_dir, oldest first: its step, its
    directory relative to run_dir, its validation loss and accuracy."""
    curve = []
    for path in checkpoint.list_checkpoints(run_dir):
        lm = EngineLM(load_engine(str(path)), seed=0)
        done = lm.sample([p.prompt for p in problems], 1, max_tokens, SOLUTION_END, 0.0)
        right = sum(task.check(p, s.text) for p, (s,) in zip(problems, done, strict=True))
        state = json.loads((path / checkpoint.STATE_FILE).read_text())
        curve.append({"step": state["step"], "dir": str(path.relative_to(run_dir)),
                      "val_loss": state.get("val_loss"), "accuracy": right / len(problems)})  # fmt: skip
    return curve


def policy_dir(out: Path, policy: dict[str, Any]) -> Path:
    """The chosen checkpoint's directory (a run directory of its own)."""
    if "chosen" not in policy:
        raise DecoderLMError(
            f"{out / 'policy'} was trained by an earlier version of the study, which chose no "
            "checkpoint: run again with --overwrite"
        )
    return out / "policy" / policy["chosen"]["dir"]


def fit_study_verifier(
    spec: TestTimeSpec, task: Task, lm: EngineLM, progress: bool
) -> tuple[HeadVerifier, dict[str, Any]]:
    """The head verifier fit on the policy's labelled samples of train-split problems."""
    problems = task.problems(spec.verifier_problems, spec.difficulty, seed=1, split="train")
    labelled = label_samples(lm, task, problems, spec.verifier_samples,
                             max_tokens=spec.max_tokens, temperature=spec.temperature,
                             progress=progress)  # fmt: skip
    model, tokenizer = lm.engine.model, lm.engine.tokenizer
    layers, steps = spec.verifier_layers, spec.head_steps
    return fit_head_verifier(model, tokenizer, labelled, layers, steps, spec.verifier_within)


def _finished(result: dict[str, Any]) -> dict[str, Any]:
    """A trainer's `result`; KeyboardInterrupt if Ctrl-C or SIGTERM stopped it: the study ends
    instead of recording a half-trained run as finished."""
    if result["stopped"] == "interrupted":
        raise KeyboardInterrupt
    return result


def _trained_once(run_dir: Path, make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """RUN_DIR's record of a finished training, read back on a rerun, else made by `make` (which
    trains into run_dir and returns what to record) and written to
    RUN_DIR/DONE_FILE with run_dir and the wall time."""
    done = run_dir / DONE_FILE
    if done.is_file():
        return json.loads(done.read_text())
    start = time.perf_counter()
    info = json_safe({"run_dir": str(run_dir), **make(), "wall_s": time.perf_counter() - start})
    write_json(done, info)
    return info


class _Pool:
    """A `SearchLM` that hands out the recorded samples of one prompt in order, so that the
    strategies' own code chooses among the first N of a pool."""

    def __init__(self, lm: EngineLM, samples: list[Sample]) -> None:
        self.lm, self.samples, self.used = lm, samples, 0
        self.encode, self.decode, self.stop_ids = lm.encode, lm.decode, lm.stop_ids

    def sample(self, prompts: Sequence[str], n: int, *args: Any) -> list[list[Sample]]:
        drawn, self.used = self.samples[self.used : self.used + n], self.used + n
        return [drawn]


Outcome = tuple[str, int, int, int]  # strategy, N, correct (0 or 1), generated tokens


def _search(
    spec: TestTimeSpec, task: Task, problem: Problem, lm: EngineLM, verifier: HeadVerifier
) -> tuple[list[Outcome], list[tuple[float, bool]], list[dict[str, Any]]]:
    """Every strategy at every N on one problem; (the verifier's score, the checker's verdict) of
    every pooled sample; the engine's counters over each call to it."""
    prompt, extract, cap = problem.prompt, task.extract_answer, spec.max_tokens
    found: list[Outcome] = []
    measured: list[dict[str, Any]] = []

    def record(name: str, n: int, result: SearchResult, stats: dict[str, Any] | None) -> None:
        found.append((name, n, int(task.check(problem, result.text)), result.tokens))
        if stats is not None:
            measured.append({"strategy": name, "n": n, **stats})

    greedy, stats = _measured(
        lm, partial(self_consistency, lm, prompt, cap, n=1, max_tokens=cap, temperature=0.0,
                    extract=extract),
    )  # fmt: skip
    record("greedy", 1, greedy, stats)
    temperature = spec.temperature
    drawn, stats = _measured(
        lm, partial(lm.sample, [prompt], max(spec.ns), cap, SOLUTION_END, temperature)
    )
    pool: list[Sample] = drawn[0]
    measured.append({"strategy": "sampling (the pool)", "n": max(spec.ns), **stats})
    correct = [task.check(problem, s.text) for s in pool]
    probabilities = verifier.scores([prompt + s.text for s in pool])
    scores = {s.text: p for s, p in zip(pool, probabilities, strict=True)}
    scorers: dict[str, Callable[[str, Sample], float]] = {
        "best-of-N (mean log-prob)": mean_logprob,
        "best-of-N (learned)": lambda p, s: scores[s.text],
        "best-of-N (oracle)": lambda p, s: float(task.check(problem, s.text)),
    }
    exact = process_oracle(task, problem)
    for n in spec.ns:
        budget = n * cap  # the pooled strategies' first N samples fit it whatever their length
        spent = sum(s.tokens for s in pool[:n])  # what they spend: the searches' budget
        sampled = partial(_Pool, lm, pool)
        majority = self_consistency(
            sampled(), prompt, budget, n=n, max_tokens=cap, temperature=temperature, extract=extract
        )
        record("self-consistency", n, majority, None)
        for name, scorer in scorers.items():
            best = best_of_n(
                sampled(), prompt, budget, scorer=scorer, n=n, max_tokens=cap, extract=extract
            )
            record(name, n, best, None)
        found.append(("pass@N", n, int(any(correct[:n])), spent))
        steps = {"expand": spec.expand, "step_tokens": spec.step_tokens, "extract": extract,
                 "temperature": temperature}  # fmt: skip
        width = max(1, n // STEP_BEAM_SHARE)
        runs = {}
        for kind, guide in (("learned", verifier), ("oracle", exact)):
            runs[f"step-beam ({kind})"] = partial(
                step_beam_search, lm, prompt, spent, guide, width=width, **steps
            )
            runs[f"MCTS ({kind})"] = partial(
                mcts, lm, prompt, spent, guide, widening=spec.widening, **steps
            )
        if n <= spec.beam_max:
            runs["beam"] = partial(
                beam_search, lm, prompt, spent, width=n, max_tokens=cap, extract=extract
            )
        for name, strategy in runs.items():
            result, stats = _measured(lm, strategy)
            record(name, n, result, stats)
    return found, list(zip(probabilities, correct, strict=True)), measured


def _measured(lm: EngineLM, call: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """call()'s result and the engine's counters over it: generated and prompt tokens, prompt
    tokens whose KV blocks were reused, seconds."""
    before, start = lm.engine.stats(), time.perf_counter()
    result = call()
    after = lm.engine.stats()
    return result, {
        "generated": after.generated_tokens - before.generated_tokens,
        "prompt": after.prompt_tokens - before.prompt_tokens,
        "prefix_hits": after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens,
        "seconds": time.perf_counter() - start,
    }


def _probe(spec: TestTimeSpec, problems: list[Problem], lm: EngineLM) -> list[dict[str, Any]]:
    """Tokens/s and prefix-cache hit rate of sampling N solutions of the first problems."""
    prompts = [p.prompt for p in problems[: spec.probe_problems]]
    rows = []
    for n in spec.ns:
        call = partial(lm.sample, prompts, n, spec.max_tokens, SOLUTION_END, spec.temperature)
        _, stats = _measured(lm, call)
        rows.append({"n": n, **stats, "tokens_per_s": stats["generated"] / stats["seconds"],
                     "reuse": stats["prefix_hits"] / max(stats["prompt"], 1)})  # fmt: skip
    return rows
