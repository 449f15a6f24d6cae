"""The micro-study: two variants of a tiny model, a few steps, 2 seeds, end to end (< 60 s).

Checks what the lab promises: results.json holds every run, report.md's rows are the runs' own
metrics, the KV column is the closed form, every plot is a PNG, the header says when, how and
where without the machine's paths, a stuck or NaN run enters no mean, and an interrupted study
resumes without retraining the runs it had finished.
"""

import dataclasses
import json
import math
import random
import re
import shutil
from pathlib import Path

import pytest

from decoderlm.lab import measure, report, runner
from decoderlm.lab.spec import StudySpec, Variant

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COMMAND = "decoderlm lab --spec micro.toml --input words.txt --out micro"


def micro_spec() -> StudySpec:
    return StudySpec(
        name="micro",
        description="two attention variants of a one-layer model",
        model=dict(
            context_length=16,
            d_model=16,
            n_layers=1,
            n_heads=4,
            mlp="swiglu",
            norm="rmsnorm",
            position="rope",
            bias=False,
        ),
        train=dict(
            batch_size=4,
            lr=3e-2,  # 8 steps from a tiny model beat the unigram baseline: healthy runs
            min_lr=3e-3,
            eval_iters=1,
            sample_tokens=2,
            dtype="fp32",
            checkpoint_interval=0,
            peak_flops=1e12,
            threads=1,
        ),
        variants=[
            Variant("MHA", model={"n_kv_heads": 4}),
            Variant("MQA", model={"n_kv_heads": 1}, match_params=True),
        ],
        budget_tokens=4 * 16 * 8,  # 8 steps
        reference="MHA",
        measures=("decode", "extrapolation", "attention"),
        seeds=2,
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rng = random.Random(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis"]
    path = tmp_path_factory.mktemp("corpus") / "words.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(3000)))
    return path


@pytest.fixture(scope="module")
def study(tmp_path_factory, corpus) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("micro")
    results = runner.run_study(micro_spec(), out, inputs=[corpus], progress=False, command=COMMAND)
    report.write_report(results, out)
    return out, results


def report_rows(path: Path, section: str) -> list[list[str]]:
    """The cells of the table under `## {section}` of a report."""
    text = path.read_text().split(f"## {section}")[1].split("\n## ")[0]
    lines = [line for line in text.splitlines() if line.startswith("|")][2:]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_results_json_holds_every_run(study):
    out, _ = study
    results = json.loads((out / runner.RESULTS_FILE).read_text())
    assert sorted((r["variant"], r["seed"]) for r in results["runs"]) == [
        ("MHA", 0),
        ("MHA", 1),
        ("MQA", 0),
        ("MQA", 1),
    ]
    for run in results["runs"]:
        assert run["steps"] == 8
        assert len(run["curves"]["val_loss"]) == 8  # eval_interval = 8 steps // 10 → 1
        assert run["val_loss"] > 0 and run["decode_tps_b16"] > 0
        assert run["health"] == "healthy"  # below the unigram baseline by the margin
        assert run["val_loss"] < results["data"]["unigram_loss"] - measure.STUCK_MARGIN


def test_the_header_says_when_how_and_where_without_machine_paths(study):
    out, results = study
    text = (out / report.REPORT_FILE).read_text()
    head = text.split("## Variants")[0]
    env = results["environment"]
    for line in (
        f"- date: {env['date']}",
        f"- command: `{COMMAND}`",
        "- seeds: 2 ",
        "- budget: 512 training tokens per run; 8 optimizer steps",
        f"- code: decoderlm {env['decoderlm']}, git commit {env['git_commit']}",
        f"- CPU: {env['cpu']} ({env['cores']} cores)",
        f"- versions: Python {env['python']}, torch {env['torch']}",
        "- data: words.txt, char-level",
    ):
        assert line in head
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", env["date"])
    assert str(out) not in text and "/tmp/" not in text and "/work/" not in text


def test_report_rows_equal_the_runs_own_metrics(study):
    out, results = study
    rows = report_rows(out / report.REPORT_FILE, "Runs")
    assert len(rows) == len(results["runs"]) == 4
    for cells, run in zip(rows, results["runs"], strict=True):
        assert cells[:2] == [run["variant"], str(run["seed"])]
        assert cells[2] == str(run["steps"])
        assert int(cells[3].replace(",", "")) == run["params"]
        assert float(cells[5]) == pytest.approx(run["val_loss"], abs=5e-5)
        assert float(cells[6]) == pytest.approx(run["val_bpb"], abs=5e-5)
        assert cells[8] == run["health"]


def test_summary_row_is_the_mean_and_t_interval_of_its_runs(study):
    out, results = study
    rows = {cells[0]: cells for cells in report_rows(out / report.REPORT_FILE, "Results")}
    for name in ("MHA", "MQA"):
        losses = [r["val_loss"] for r in results["runs"] if r["variant"] == name]
        mean, half = (float(x) for x in rows[name][1].split("±"))
        assert mean == pytest.approx(sum(losses) / 2, abs=5e-5)
        # two seeds: t₀.₉₇₅,₁ = 12.706 times the standard error
        assert half == pytest.approx(12.706 * abs(losses[0] - losses[1]) / 2, abs=5e-5)
        assert rows[name][-1] == "2 / 0 / 0 / 0"  # healthy / stuck / diverged / NaN


def test_kv_bytes_column_equals_the_closed_form(study):
    out, results = study
    rows = report_rows(out / report.REPORT_FILE, "Runs")
    for cells, run in zip(rows, results["runs"], strict=True):
        m = run["model"]
        closed = 2 * m["n_layers"] * m["n_kv_heads"] * m["head_dim"] * 4  # K and V, fp32
        assert int(cells[4].replace(",", "")) == run["kv_bytes_per_token"] == closed
    assert {r["variant"]: r["kv_bytes_per_token"] for r in results["runs"]} == {
        "MHA": 2 * 1 * 4 * 4 * 4,
        "MQA": 2 * 1 * 1 * 4 * 4,
    }


def test_matched_variant_is_within_two_percent_of_the_reference(study):
    _, results = study
    params = {name: row["params"] for name, row in results["summary"].items()}
    assert abs(params["MQA"] - params["MHA"]) <= 0.02 * params["MHA"]


def test_every_plot_is_a_non_empty_png(study):
    out, _ = study
    names = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", (out / report.REPORT_FILE).read_text())
    assert {"val_loss.png", "loss_vs_kv.png", "positions.png", "attention_layer0.png"} <= set(names)
    for name in names:
        data = (out / name).read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_MAGIC)


def test_attention_maps_are_the_best_runs_and_the_entropy_table_is_the_runs_mean(study):
    out, results = study
    finite = [r for r in results["runs"] if r["val_loss"] == r["val_loss"]]
    best = min(finite, key=lambda r: r["val_loss"])
    attention = results["attention"]
    assert (attention["variant"], attention["seed"]) == (best["variant"], best["seed"])
    assert attention["files"] == ["attention_layer0.png"]  # one layer
    t = attention["tokens"]
    # Query i spreads over i + 1 keys: its entropy lies in [0, log(i + 1)].
    upper = sum(math.log(i + 1) for i in range(t)) / t
    for run in results["runs"]:
        (entropy,) = run["attention_entropy"]
        assert 0.0 <= entropy <= upper
    rows = {r[0]: r[1:] for r in report_rows(out / report.REPORT_FILE, "Attention maps")}
    for name in ("MHA", "MQA"):
        mine = [r["attention_entropy"][0] for r in results["runs"] if r["variant"] == name]
        assert rows[name] == [f"{sum(mine) / len(mine):.3f}"]


def test_an_interrupted_study_resumes_without_retraining_finished_runs(
    tmp_path, corpus, monkeypatch
):
    calls = []
    real_train = runner.train

    def interrupting_train(*args, **kwargs):
        calls.append(kwargs.get("resume"))
        if len(calls) == 3:  # Ctrl-C during the third run
            raise KeyboardInterrupt
        return real_train(*args, **kwargs)

    monkeypatch.setattr(runner, "train", interrupting_train)
    with pytest.raises(KeyboardInterrupt):
        runner.run_study(micro_spec(), tmp_path, inputs=[corpus], progress=False)
    finished = sorted(p.parent for p in (tmp_path / "runs").glob("*/*/lab.json"))
    assert [p.relative_to(tmp_path / "runs").as_posix() for p in finished] == [
        "MHA/seed0",
        "MHA/seed1",
    ]
    weights = {p: (p / "model.safetensors").stat().st_mtime_ns for p in finished}

    calls.clear()
    results = runner.run_study(micro_spec(), tmp_path, inputs=[corpus], progress=False)
    assert len(calls) == 2  # only the two MQA runs were trained
    assert len(results["runs"]) == 4
    assert {p: (p / "model.safetensors").stat().st_mtime_ns for p in finished} == weights


def test_a_run_with_other_settings_is_refused_not_reused(tmp_path, corpus, study):
    out, _ = study
    shutil.copytree(out / "runs", tmp_path / "runs")
    shutil.copytree(out / "data", tmp_path / "data")
    changed = micro_spec().with_budget(tokens=4 * 16 * 5)
    with pytest.raises(Exception, match="other settings than variant 'MHA'"):
        runner.run_study(changed, tmp_path, inputs=[corpus], progress=False)


def test_nan_and_stuck_runs_are_classified_and_enter_no_mean(tmp_path, corpus):
    spec = dataclasses.replace(
        micro_spec(),
        variants=[
            Variant("calm", model={"n_kv_heads": 4}),
            Variant("hot", model={"n_kv_heads": 4}, train={"lr": 1e30, "warmup_steps": 0}),
            Variant("frozen", model={"n_kv_heads": 4}, train={"lr": 1e-9, "min_lr": 0.0}),
        ],
        measures=("attention",),  # the maps come from the healthy run
        seeds=1,
    )
    results = runner.run_study(spec, tmp_path, inputs=[corpus], progress=False)
    calm, hot, frozen = results["runs"]
    assert calm["health"] == "healthy" and math.isfinite(calm["val_loss"])
    # lr 1e30: after the first update the gradients are NaN (step 2), the weights then too and
    # step 3's loss is not finite; the run has no val loss (NaN, null in results.json).
    assert hot["health"] == "NaN" and hot["val_loss"] is None and hot["steps"] == 2
    # lr 1e-9: the loss stays at its initial value, above the unigram baseline
    assert frozen["health"] == "stuck"
    assert frozen["val_loss"] > results["data"]["unigram_loss"]
    summary = results["summary"]
    assert summary["frozen"]["health"] == {"healthy": 0, "stuck": 1, "diverged": 0, "NaN": 0}
    assert "val_loss" not in summary["frozen"]  # a finite loss, but not a healthy run's
    assert summary["frozen"]["train_tokens_per_s"]["n"] == 1  # its speed still counts
    assert summary["hot"]["health"]["NaN"] == 1
    assert results["attention"]["variant"] == "calm"


def test_runs_finished_before_attention_was_asked_get_it_without_retraining(
    tmp_path, corpus, monkeypatch
):
    without = dataclasses.replace(micro_spec(), measures=(), seeds=1)
    runner.run_study(without, tmp_path, inputs=[corpus], progress=False)
    monkeypatch.setattr(runner, "train", lambda *a, **k: pytest.fail("retrained a finished run"))
    again = dataclasses.replace(without, measures=("attention",))
    results = runner.run_study(again, tmp_path, inputs=[corpus], progress=False)
    assert all(len(r["attention_entropy"]) == 1 for r in results["runs"])
    assert results["attention"]["files"] == ["attention_layer0.png"]
