"""The test-time compute study at micro scale (a one-layer policy trained 2 steps, 2 problems,
N ∈ {1, 2}, 2 seeds), end to end: the policy is the checkpoint whose greedy accuracy is nearest
the target; results.json holds every strategy at every N and seed within its budget (a guided
search's: the tokens the pooled strategies spent), oracle best-of-N equals pass@N, the report's
rows are results.json's numbers, the plots are PNGs, and a second invocation reuses the trained
policy and refits the same verifier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decoderlm.cli import main
from decoderlm.errors import DecoderLMError
from decoderlm.lab import test_time, test_time_report
from decoderlm.lab.test_time_conclusions import ttc_accuracy, ttc_comparisons

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
POOLED = ("self-consistency", "best-of-N (mean log-prob)", "best-of-N (learned)")
POOLED += ("best-of-N (oracle)", "pass@N")
GUIDED = ("beam", "step-beam (learned)", "MCTS (learned)", "step-beam (oracle)", "MCTS (oracle)")


def micro_spec() -> test_time.TestTimeSpec:
    return test_time.TestTimeSpec(
        difficulty=2,
        corpus_problems=200,
        model={"preset": "llama-tiny", "context_length": 64, "d_model": 16, "n_layers": 1,
               "n_heads": 2, "n_kv_heads": 2},
        train={"batch_size": 4, "max_steps": 2, "eval_iters": 1, "eval_interval": 1,
               "checkpoint_interval": 1, "sample_tokens": 2, "dtype": "fp32", "threads": 1},
        select_problems=3,
        verifier_problems=10,  # the 10th is the verifier's validation problem
        verifier_samples=2,
        verifier_layers=(1,),
        head_steps=2,
        verifier_within=False,  # a 2-step policy samples no problem both right and wrong
        problems=2,
        seeds=2,
        ns=(1, 2),
        beam_max=1,
        max_tokens=24,
        step_tokens=8,
        expand=2,
        probe_problems=1,
    )  # fmt: skip


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("ttc")
    results = test_time.run_study(micro_spec(), out, progress=False)
    test_time_report.write_report(results, out)
    return out, results


def test_every_strategy_runs_at_every_n_and_seed_within_its_budget(study) -> None:
    _, results = study
    spec = micro_spec()
    runs = {(r["strategy"], r["n"], r["seed"]): r for r in results["runs"]}
    for name in test_time.STRATEGIES:
        ns = (1,) if name == "greedy" else [n for n in spec.ns if name != "beam" or n <= 1]
        for n in ns:
            rows = [r for r in results["runs"] if r["strategy"] == name and r["n"] == n]
            assert sorted(r["seed"] for r in rows) == [0, 1], (name, n)
            for r in rows:
                assert r["accuracy"] == r["correct"] / spec.problems
                pooled = runs[("pass@N", n, r["seed"])][
                    "tokens"
                ]  # the first N samples, all problems
                if name in POOLED:
                    assert r["tokens"] == pooled and r["tokens_per_problem"] <= n * spec.max_tokens
                if name in GUIDED:
                    assert 0 < r["tokens"] <= pooled


def test_the_policy_is_the_checkpoint_nearest_the_target_accuracy(study) -> None:
    out, results = study
    policy, target = results["policy"], micro_spec().target_accuracy
    assert [c["step"] for c in policy["curve"]] == [1, 2]  # every checkpoint kept and judged
    assert all(c["accuracy"] in (0, 1 / 3, 2 / 3, 1) for c in policy["curve"])
    nearest = min(abs(c["accuracy"] - target) for c in policy["curve"])
    assert policy["chosen"] in policy["curve"]
    assert abs(policy["chosen"]["accuracy"] - target) == nearest
    assert (test_time.policy_dir(out, policy) / "model.safetensors").is_file()


def test_a_policy_recorded_without_a_chosen_checkpoint_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(DecoderLMError, match=r"earlier version of the study.*--overwrite"):
        test_time.policy_dir(tmp_path, {"steps": 525, "val_loss": 0.37})


def test_oracle_best_of_n_equals_pass_at_n_and_bounds_every_verifier(study) -> None:
    _, results = study
    by = {(r["strategy"], r["n"], r["seed"]): r["correct"] for r in results["runs"]}
    for (name, n, seed), correct in by.items():
        if name.startswith("best-of-N") or name == "self-consistency":
            assert correct <= by[("pass@N", n, seed)]
        if name == "best-of-N (oracle)":
            assert correct == by[("pass@N", n, seed)]


def test_summary_is_the_mean_over_seeds_and_the_report_prints_it(study) -> None:
    out, results = study
    report = (out / "report.md").read_text()
    for name in test_time.STRATEGIES:
        for n in (1,) if name == "greedy" else (1, 2) if name != "beam" else (1,):
            rows = [r for r in results["runs"] if r["strategy"] == name and r["n"] == n]
            acc = ttc_accuracy(results, name, n)
            assert acc is not None
            assert acc.mean == pytest.approx(sum(r["accuracy"] for r in rows) / len(rows))
            tokens = ttc_accuracy(results, name, n, "tokens_per_problem")
            assert f"{acc.mean:.1%} ± {acc.spread:.1%} ({tokens.mean:,.0f})" in report
    assert "## What this shows" in report and "## Comparisons at equal tokens" in report
    for row in ttc_comparisons(results):
        assert row["tokens"][0] <= row["tokens"][1] + 1e-9  # a never spends more than b
    for png in ("accuracy_vs_tokens.png", "engine.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC


def test_the_verifier_is_judged_on_every_pooled_sample_and_engine_rows_are_recorded(study) -> None:
    _, results = study
    spec, verifier = micro_spec(), results["verifier"]
    assert verifier["test_samples"] == spec.seeds * spec.problems * max(spec.ns)
    assert 0 <= verifier["test_accuracy"] <= 1 and verifier["layer"] == 1
    assert verifier["train_examples"] == 9 * spec.verifier_samples  # the 10th problem validates
    assert verifier["val_examples"] == spec.verifier_samples
    assert [r["n"] for r in results["engine"]] == [1, 2]
    assert all(r["generated"] > 0 and r["reuse"] >= 0 for r in results["engine"])


def test_a_second_invocation_reuses_the_trained_policy_and_refits_the_same_verifier(study) -> None:
    out, results = study
    again = test_time.run_study(micro_spec(), out, progress=False)
    assert again["policy"] == results["policy"]
    wall = {"wall_s": None}  # the fit's time varies; what it fit does not
    assert {**again["verifier"], **wall} == {**results["verifier"], **wall}
    assert json.loads((out / "results.json").read_text())["runs"] == again["runs"]


def test_the_cli_refuses_a_corpus_for_the_test_time_study(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["lab", "test-time-compute", "--data", "x", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "decoderlm: error: test-time-compute trains its own policy on its task: drop --data\n"
    )


def test_an_interrupted_policy_ends_the_study_and_is_not_recorded_as_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(test_time, "train", lambda *args, **kwargs: {"stopped": "interrupted"})
    with pytest.raises(KeyboardInterrupt):
        test_time.run_study(micro_spec(), tmp_path, progress=False)
    assert not (tmp_path / "policy" / test_time.DONE_FILE).exists()
