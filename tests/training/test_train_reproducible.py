"""The documented step-budget command is reproducible: uninterrupted runs, and a run stopped and
resumed with the same command plus --resume, give bit-identical weights.

Also what `--resume` does with a run that has no usable latest checkpoint: stopped before its first
checkpoint (it starts the run), or whose latest trainer state is torn (it falls back to the one
before); and what a trainer state that does not fit is refused with.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from decoderlm import checkpoint, trainer_state
from decoderlm.cli import main
from decoderlm.training import optim, trainer
from decoderlm.training.train_config import TrainConfig

# `decoderlm train --input … --max-steps N`, as documented (no --max-time), on a tiny model; the
# warmup ends mid-run, where a wall-clock-shaped schedule would differ from run to run.
STEP_BUDGET = [
    *("--context-length", "16", "--d-model", "16", "--n-layers", "1", "--n-heads", "2"),
    *("--batch-size", "4", "--max-steps", "6", "--warmup-steps", "2", "--eval-iters", "1"),
    *("--checkpoint-interval", "3", "--eval-interval", "3", "--sample-tokens", "2"),
    *("--dtype", "fp32", "--peak-flops", "1e12", "--threads", "1", "--tokenizer", "char"),
    "--quiet",
]


SLOWER = 200  # the trainer's clock runs this much faster: each step looks as slow as a real one's


@pytest.fixture(scope="module", autouse=True)
def slow_machine() -> None:
    """Tiny steps take milliseconds, so a schedule shaped by the wall clock would hardly move; on
    the trainer's clock here they take as long as a real model's (a 6-step run: tens of seconds,
    a good part of the default 300 s time limit), so any dependence on time shows in the weights."""
    clock = SimpleNamespace(perf_counter=lambda: time.perf_counter() * SLOWER)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer, "time", clock)
        yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "words.txt"
    rng = random.Random(1)
    words = ["to", "be", "or", "not", "that", "is", "the", "question"]
    path.write_text("\n".join(" ".join(rng.choices(words, k=10)) for _ in range(300)))
    return path


def _argv(corpus: Path, out: Path) -> list[str]:
    return ["train", *STEP_BUDGET, "--input", str(corpus), "--out", str(out)]


@pytest.fixture(scope="module")
def uninterrupted(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("first") / "run"
    assert main(_argv(corpus, run)) == 0
    return run


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / checkpoint.WEIGHTS_FILE))


def _assert_identical(run: Path, reference: Path) -> None:
    mine, theirs = _weights(run), _weights(reference)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[name], theirs[name]) for name in theirs)


def _copy(run: Path, tmp_path: Path) -> Path:
    """A copy of `run` under tmp_path whose own data directory is the copy's (OUT/data)."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def test_two_uninterrupted_step_budget_runs_give_identical_weights(
    corpus: Path, uninterrupted: Path, tmp_path: Path
) -> None:
    again = tmp_path / "again"
    assert main(_argv(corpus, again)) == 0
    _assert_identical(again, uninterrupted)
    # No time limit, and config.json says so: a resume with other flags keeps it that way.
    assert checkpoint.read_run_config(again)["train"]["max_time"] == 0


def test_a_step_budget_schedule_depends_on_steps_alone() -> None:
    cfg = TrainConfig(max_steps=60, warmup_steps=5)
    assert cfg.time_limit == 0  # the default time limit is for runs without a step limit
    assert TrainConfig().time_limit == 300
    for step in (0, 5, 30, 59):
        assert optim.learning_rate(cfg, step, 0.0) == optim.learning_rate(cfg, step, 1e6)


def test_a_time_budget_schedule_continues_from_the_saved_elapsed_time() -> None:
    cfg = TrainConfig(max_time=100, warmup_steps=0)
    # The trainer passes the seconds of earlier sessions plus this one's: a resumed run that had
    # trained 60 s is 60% through its schedule, not back at the start.
    assert optim.learning_rate(cfg, 10, 60.0) < optim.learning_rate(cfg, 10, 0.0)
    assert optim.learning_rate(cfg, 10, 100.0) == pytest.approx(cfg.min_lr)


def test_a_run_stopped_after_a_checkpoint_and_resumed_equals_the_uninterrupted_run(
    corpus: Path, uninterrupted: Path, tmp_path: Path
) -> None:
    run = _copy(uninterrupted, tmp_path)
    # A crash after step 3's checkpoint: step 6's never happened.
    shutil.rmtree(run / "checkpoints" / "step_00000006")
    assert main([*_argv(corpus, run), "--resume"]) == 0
    _assert_identical(run, uninterrupted)
    assert checkpoint.latest_checkpoint(run).name == "step_00000006"


def test_resume_before_the_first_checkpoint_starts_the_run_saying_so(
    corpus: Path, uninterrupted: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _copy(uninterrupted, tmp_path)
    # Killed before its first checkpoint: OUT/data, config.json, tokenizer.json, metrics.jsonl.
    shutil.rmtree(run / "checkpoints")
    (run / checkpoint.WEIGHTS_FILE).unlink()
    capsys.readouterr()
    assert main([*_argv(corpus, run), "--resume"]) == 0
    line = _one_line(capsys.readouterr().err)
    assert line == f"decoderlm: {run} has no checkpoint yet: starting the run from step 0"
    _assert_identical(run, uninterrupted)


def test_a_torn_latest_trainer_state_falls_back_to_the_checkpoint_before_it(
    corpus: Path, uninterrupted: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _copy(uninterrupted, tmp_path)
    state = run / "checkpoints" / "step_00000006" / trainer_state.STATE_FILE
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    capsys.readouterr()
    assert main([*_argv(corpus, run), "--resume"]) == 0
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("decoderlm: warning: cannot read the trainer state in "), line
    assert "step_00000006" in line and line.endswith(
        "resuming from the checkpoint before it, step_00000003"
    )
    _assert_identical(run, uninterrupted)  # steps 4-6 trained again, to the same weights


def test_a_trainer_state_naming_a_missing_tensor_is_refused_with_one_line(
    corpus: Path, uninterrupted: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _copy(uninterrupted, tmp_path)
    state = run / "checkpoints" / "step_00000006" / trainer_state.STATE_FILE
    text = state.read_text()
    name = re.search(r'"__tensor__": "(optimizer/state/[^"]+/exp_avg)"', text).group(1)
    state.write_text(text.replace(f'"{name}"', f'"{name}_gone"'))
    before = _weights(run)
    assert main([*_argv(corpus, run), "--resume"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("decoderlm: error: the trainer state in "), line
    assert f"names tensor '{name}_gone'" in line
    assert all(torch.equal(before[k], v) for k, v in _weights(run).items())


def test_an_optimizer_state_of_the_wrong_shape_is_refused_with_one_line(
    corpus: Path, uninterrupted: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _copy(uninterrupted, tmp_path)
    ckpt = run / "checkpoints" / "step_00000006"
    tensors = load_file(str(ckpt / trainer_state.STATE_TENSORS_FILE))
    name = next(k for k in sorted(tensors) if k.endswith("/exp_avg") and tensors[k].dim() == 2)
    tensors[name] = tensors[name][:, :1].contiguous()  # broadcastable: torch would take it
    save_file(tensors, str(ckpt / trainer_state.STATE_TENSORS_FILE))
    assert main([*_argv(corpus, run), "--resume"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"decoderlm: error: optimizer tensor '{name}' in "), line
    assert "does not fit this model" in line
    assert json.loads((ckpt / trainer_state.STATE_FILE).read_text())["step"] == 6


def test_truncated_checkpoint_weights_are_refused_with_one_line(
    corpus: Path, uninterrupted: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _copy(uninterrupted, tmp_path)
    weights = run / "checkpoints" / "step_00000006" / checkpoint.WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:100])
    assert main([*_argv(corpus, run), "--resume"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"decoderlm: error: cannot read weights from {weights}: "), line
