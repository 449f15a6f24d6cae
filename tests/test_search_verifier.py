"""The learned verifier (`decoderlm.search.verifier`, `decoderlm.training.verifier`): on a planted
separable toy set (a solution "yes" is correct, "no" wrong) the project's trainer drives its
binary cross-entropy from ln 2 to near 0, and, labelled at every solution token, it values a
partial solution by its first token; as best-of-N's scorer it picks the planted correct sample
that mean log-probability passes over; saved and loaded, its weights and scores are exact; its
texts are labelled by the checker, step prefixes by the share of correct rollouts."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from scripted_lm import ScriptedLM

from decoderlm import checkpoint
from decoderlm.errors import DecoderLMError
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM
from decoderlm.search.labelling import label_samples
from decoderlm.search.strategies import best_of_n, by_verifier, mean_logprob
from decoderlm.search.verifier import Example, LearnedVerifier, load_verifier, scalar_head_model
from decoderlm.tasks import Problem, Task
from decoderlm.tokenizer import Tokenizer
from decoderlm.training.train_config import TrainConfig
from decoderlm.training.verifier import encode_example, train_verifier

PROMPT = "Q\n"  # after a problem's digits: where ScriptedLM starts writing
STEPS = 40


def toy_set(n_problems: int = 30) -> list[list[Example]]:
    """Per problem: its digits and PROMPT, then "yes" (target 1) or "no" (target 0)."""
    rng = random.Random(0)
    problems = []
    for _ in range(n_problems):
        prompt = f"{rng.randint(0, 999)}{PROMPT}"
        start = len(prompt)
        problems.append([Example(prompt + "yes", 1.0, start), Example(prompt + "no", 0.0, start)])
    return problems


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny untrained char model saved as a run: the verifier's initialisation."""
    tokenizer = Tokenizer.train_char(["0123456789Q\nokyesn"])
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        context_length=32,
        d_model=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=2,
    )
    torch.manual_seed(0)
    return checkpoint.save_model(tmp_path_factory.mktemp("policy"), DecoderLM(config), tokenizer)


@pytest.fixture(scope="module")
def trained(policy: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("verifier")
    config = TrainConfig(
        batch_size=8,
        lr=1e-2,
        min_lr=1e-3,
        warmup_steps=5,
        max_steps=STEPS,
        eval_interval=STEPS,
        log_interval=1,
        checkpoint_interval=0,
        dtype="fp32",
        peak_flops=1e12,
        threads=1,
    )
    summary = train_verifier(policy, toy_set(), out, config, overwrite=True, progress=False)
    return out, summary


def test_training_drives_the_binary_cross_entropy_from_ln2_to_near_zero(trained) -> None:
    out, summary = trained
    rows = [json.loads(line) for line in (out / checkpoint.METRICS_FILE).read_text().splitlines()]
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    assert len(losses) == STEPS
    assert losses[0] == pytest.approx(math.log(2), abs=0.05)  # a head initialised near 0
    assert max(losses[-5:]) < 0.1
    assert summary["val_loss"] < 0.1  # held-out problems (every 10th)
    assert summary["val_accuracy"] == 1.0


def test_every_solution_token_is_labelled_so_a_partial_solution_is_valued(trained) -> None:
    verifier = load_verifier(trained[0])
    prompts = [f"{digits}{PROMPT}" for digits in (5, 38, 417, 999)]
    right = verifier.scores([p + partial for p in prompts for partial in ("y", "ye")])
    wrong = verifier.scores([p + "n" for p in prompts])
    assert min(right) > 0.9 and max(wrong) < 0.1  # trained on final tokens only: 0.83, 0.95


def test_labelled_positions_start_at_the_solution_and_survive_truncation() -> None:
    tokenizer = Tokenizer.train_char(["0123456789Q\nokn"])
    text = f"12{PROMPT}ok"  # the solution "ok" starts at character 4
    row, first = encode_example(tokenizer, Example(text, 1.0, 4), context=32)
    assert tokenizer.decode(row) == text and tokenizer.decode(row[first:]) == "ok"
    row, first = encode_example(tokenizer, Example(text, 1.0, 4), context=3)  # "\nok" kept
    assert tokenizer.decode(row) == "\nok" and first == 1
    row, first = encode_example(tokenizer, Example(text, 1.0, 4), context=1)  # "k" kept
    assert first == 0
    row, first = encode_example(tokenizer, Example(text, 0.5), context=32)  # a step prefix
    assert first == len(row) - 1


def test_as_best_of_n_scorer_it_picks_the_planted_correct_sample(trained) -> None:
    verifier = load_verifier(trained[0])
    prompt = f"417{PROMPT}"
    lm = ScriptedLM({"no": 0.8, "yes": 0.2}, prompt_chars=prompt, seed=0)
    picked = best_of_n(lm, prompt, 64, scorer=by_verifier(verifier), n=8, max_tokens=8)
    texts = [c.text for c in picked.candidates]
    assert "yes" in texts and "no" in texts  # the planted sample is among likelier wrong ones
    assert picked.text == "yes"
    likeliest = best_of_n(lm, prompt, 64, scorer=mean_logprob, n=8, max_tokens=8)
    assert likeliest.text == "no"


def test_save_and_load_round_trip_is_exact(policy: Path, tmp_path: Path) -> None:
    config = ModelConfig.from_dict(checkpoint.read_run_config(policy)["model"])
    torch.manual_seed(1)
    model = scalar_head_model(config, "process")
    tokenizer = Tokenizer.from_file(policy / checkpoint.TOKENIZER_FILE)
    checkpoint.save_model(tmp_path, model, tokenizer)
    loaded = load_verifier(tmp_path)
    assert loaded.kind == "process"
    saved, back = model.state_dict(), loaded.model.state_dict()
    assert saved.keys() == back.keys()
    assert all(torch.equal(saved[k], back[k]) for k in saved)
    texts = [f"12{PROMPT}ok", f"9{PROMPT}no", "Q"]
    assert torch.equal(LearnedVerifier(model.eval(), tokenizer).logits(texts), loaded.logits(texts))


def test_a_language_model_run_is_refused_as_a_verifier(policy: Path) -> None:
    with pytest.raises(DecoderLMError, match="holds a language model, not a verifier"):
        load_verifier(policy)


def test_labels_are_the_checker_and_step_labels_the_share_of_correct_rollouts() -> None:
    task = Task("toy", 1, lambda rng, d: None, lambda p, c: c.endswith("ok"), lambda c: c)
    problem = Problem(f"7{PROMPT}", "a\nok", "ok", ())
    lm = ScriptedLM({"a\nok": 0.25, "a\nno": 0.25, "b\nok": 0.5}, prompt_chars=problem.prompt)
    (examples,) = label_samples(lm, task, [problem], 8, rollouts=400, max_tokens=8)
    outcomes, steps = examples[:8], {e.text: e.target for e in examples[8:]}
    assert all(e.target == float(e.text.endswith("ok")) for e in outcomes)
    assert set(steps) <= {f"7{PROMPT}a\n", f"7{PROMPT}b\n"}
    # p(ok | "a\n") = 1/2 and p(ok | "b\n") = 1: 400 rollouts estimate 1/2 within 4 σ = 0.1
    assert steps.get(f"7{PROMPT}a\n", 0.5) == pytest.approx(0.5, abs=0.1)
    assert steps.get(f"7{PROMPT}b\n", 1.0) == 1.0
    assert len(steps) == 2  # 8 samples from three scripts reach both first steps (seed 0)
