"""`decoderlm search` runs every strategy on a tiny run trained on a task corpus and prints the
accuracy and the tokens spent, within the budget; bad flags are one-line errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from decoderlm.cli import main
from decoderlm.search import STRATEGY_NAMES

TINY_TRAIN = [
    *("--context-length", "64", "--d-model", "16", "--n-layers", "1", "--n-heads", "2"),
    *("--n-kv-heads", "2", "--batch-size", "2", "--max-steps", "1", "--eval-iters", "1"),
    *("--sample-tokens", "2", "--dtype", "fp32", "--peak-flops", "1e12", "--threads", "1"),
    "--quiet",
]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("search")
    data, run = root / "data", root / "run"
    prepare = ["prepare", "--task", "arithmetic", "--difficulty", "2", "--n", "300", "--quiet"]
    assert main([*prepare, "--out", str(data)]) == 0
    assert main(["train", "--data", str(data), "--out", str(run), *TINY_TRAIN]) == 0
    return run


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_search_prints_accuracy_and_tokens_within_the_budget(
    tiny_run: Path, strategy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["search", "--checkpoint", str(tiny_run), "--task", "arithmetic", "--difficulty", "2"]
    flags = ["--strategy", strategy, "--budget", "96", "--problems", "2", "--max-tokens", "24"]
    assert main([*argv, *flags, "--n", "2", "--expand", "2", "--quiet"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    match = re.fullmatch(
        rf"{strategy} on 2 arithmetic problems \(difficulty 2\): accuracy \d+\.\d% \(\d/2\) · "
        r"(\d+) generated tokens \(\d+ a problem, budget 96\)",
        line,
    )
    assert match is not None, line
    assert 0 < int(match.group(1)) <= 2 * 96


def test_search_refuses_a_budget_below_one_token(
    tiny_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["search", "--checkpoint", str(tiny_run), "--task", "countdown"]
    assert main([*argv, "--strategy", "beam", "--budget", "0", "--quiet"]) == 2
    assert capsys.readouterr().err == (
        "decoderlm: error: budget=0 must be an integer ≥ 1 (generated tokens)\n"
    )


def test_mcts_with_widening_spends_within_the_budget_and_refuses_a_negative_exponent(
    tiny_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["search", "--checkpoint", str(tiny_run), "--task", "arithmetic", "--difficulty", "2"]
    flags = ["--strategy", "mcts", "--budget", "96", "--problems", "2", "--max-tokens", "24"]
    assert main([*argv, *flags, "--expand", "2", "--widening", "0.5", "--quiet"]) == 0
    spent = re.search(r"(\d+) generated tokens", capsys.readouterr().out)
    assert spent is not None and 0 < int(spent.group(1)) <= 2 * 96
    assert main([*argv, *flags, "--widening", "-1", "--quiet"]) == 2
    assert capsys.readouterr().err == (
        "decoderlm: error: widening=-1.0 must be ≥ 0 (0: each node expanded once)\n"
    )


@pytest.fixture(scope="module")
def tiny_verifier(tiny_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("verifier")
    argv = ["verifier", "--policy", str(tiny_run), "--task", "arithmetic", "--difficulty", "2"]
    flags = ["--problems", "10", "--samples", "2", "--max-tokens", "24", "--steps", "2"]
    assert (
        main([*argv, *flags, "--batch-size", "4", "--out", str(out), "--overwrite", "--quiet"]) == 0
    )
    return out


def test_verifier_writes_a_run_and_splits_its_texts_by_problem(tiny_verifier: Path) -> None:
    assert (tiny_verifier / "model.safetensors").is_file()
    texts = (tiny_verifier / "data" / "train.jsonl").read_text().splitlines()
    assert len(texts) == 9 * 2  # problems 1-9 train, the 10th validates; 2 samples each


@pytest.mark.parametrize("strategy", ["best-of-n", "step-beam", "mcts"])
def test_search_with_a_learned_verifier_stays_within_the_budget(
    tiny_run: Path, tiny_verifier: Path, strategy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["search", "--checkpoint", str(tiny_run), "--task", "arithmetic", "--difficulty", "2"]
    flags = ["--strategy", strategy, "--budget", "96", "--problems", "2", "--max-tokens", "24"]
    assert main([*argv, *flags, "--verifier", str(tiny_verifier), "--n", "2", "--quiet"]) == 0
    tokens = re.search(r"(\d+) generated tokens", capsys.readouterr().out)
    assert tokens is not None and 0 < int(tokens.group(1)) <= 2 * 96


def test_search_refuses_a_language_model_as_its_verifier(
    tiny_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["search", "--checkpoint", str(tiny_run), "--task", "arithmetic"]
    assert main([*argv, "--strategy", "best-of-n", "--verifier", str(tiny_run), "--quiet"]) == 2
    assert capsys.readouterr().err == (
        f"decoderlm: error: {tiny_run} holds a language model, not a verifier\n"
    )
