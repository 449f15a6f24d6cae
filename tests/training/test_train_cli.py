"""`decoderlm train` and `decoderlm plot`: flags from the config fields, TOML files, resume, errors."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from decoderlm import ModelConfig, checkpoint, trainer_state
from decoderlm.cli import build_parser, main
from decoderlm.training.train_config import TrainConfig

# A tiny GQA model and a short run: every run below takes a few seconds on one core.
TINY = [
    *("--context-length", "32", "--d-model", "32", "--n-layers", "1", "--n-heads", "4"),
    *("--n-kv-heads", "2", "--batch-size", "4", "--max-time", "0", "--eval-iters", "1"),
    *("--sample-tokens", "4", "--dtype", "fp32", "--peak-flops", "1e12", "--threads", "1"),
    "--quiet",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "words.txt"
    rng = random.Random(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question"]
    path.write_text("\n".join(" ".join(rng.choices(words, k=10)) for _ in range(500)))
    return path


@pytest.fixture(scope="module")
def toml_run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run configured by a TOML file, with two of its values overridden by flags."""
    root = tmp_path_factory.mktemp("toml")
    config = root / "run.toml"
    config.write_text(
        f'preset = "llama-tiny"\ninput = ["{corpus}"]\ntokenizer = "char"\nout = "{root / "run"}"\n'
        "[model]\nd_model = 48\nn_layers = 2\nn_heads = 4\nn_kv_heads = 1\ncontext_length = 16\n"
        "[train]\nmax_steps = 50\nmax_time = 0\nlr = 0.01\nbatch_size = 2\neval_interval = 2\n"
        'eval_iters = 1\nlog_interval = 1\nsample_tokens = 4\ndtype = "fp32"\npeak_flops = 1e12\n'
    )
    assert main(["train", "--config", str(config), "--max-steps", "3", "--lr", "0.005"]) == 0
    return root / "run"


def test_config_file_then_flags_set_the_run(toml_run: Path, capsys: pytest.CaptureFixture) -> None:
    config = checkpoint.read_run_config(toml_run)
    # Flags beat the file, the file beats the preset, the preset beats the defaults.
    assert config["train"]["max_steps"] == 3 and config["train"]["lr"] == 0.005
    assert config["train"]["batch_size"] == 2 and config["train"]["eval_interval"] == 2
    model = config["model"]
    assert (model["d_model"], model["n_layers"], model["n_kv_heads"]) == (48, 2, 1)
    assert (model["mlp"], model["norm"], model["position"]) == ("swiglu", "rmsnorm", "rope")
    # The model's vocabulary follows the char tokenizer prepared on the fly into RUN/data.
    assert (
        model["vocab_size"]
        == json.loads((toml_run / "data" / "meta.json").read_text())["vocab_size"]
    )
    assert (toml_run / "tokenizer.json").read_bytes() == (
        toml_run / "data" / "tokenizer.json"
    ).read_bytes()


def test_resume_flag_continues_with_new_step_limit(toml_run: Path, tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(toml_run, run)
    assert main(["train", "--resume", "--out", str(run), "--max-steps", "5", "--quiet"]) == 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    assert checkpoint.read_run_config(run)["train"]["lr"] == 0.005  # the rest as saved
    assert checkpoint.latest_checkpoint(run).name == "step_00000005"


@pytest.fixture(scope="module")
def char_run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path]:
    """(argv, run): 6 steps on --input prepared with the char tokenizer, a checkpoint every 3."""
    run = tmp_path_factory.mktemp("char") / "run"
    argv = ["train", *TINY, "--input", str(corpus), "--tokenizer", "char", "--out", str(run)]
    argv += ["--dropout", "0.1", "--max-steps", "6", "--checkpoint-interval", "3"]
    argv += ["--log-interval", "1", "--eval-interval", "0"]
    assert main(argv) == 0
    return argv, run


def _losses(run: Path) -> list[tuple[int, float]]:
    rows = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [(row["step"], row["train_loss"]) for row in rows]


def test_the_same_command_plus_resume_continues_exactly(
    char_run: tuple[list[str], Path], tmp_path: Path
) -> None:
    import shutil

    argv, uninterrupted = char_run
    run = Path(argv[argv.index("--out") + 1])
    crashed = tmp_path / "run"
    shutil.copytree(uninterrupted, crashed)
    # A crash after step 3's checkpoint: step 6's checkpoint never happened.
    shutil.rmtree(crashed / "checkpoints" / "step_00000006")
    argv = [crashed.as_posix() if a == run.as_posix() else a for a in argv]
    assert main([*argv, "--resume"]) == 0
    assert _losses(crashed) == _losses(uninterrupted)  # exact float equality, steps 1..6
    assert [step for step, _ in _losses(crashed)] == [1, 2, 3, 4, 5, 6]
    resumed = load_file(str(crashed / "model.safetensors"))
    reference = load_file(str(uninterrupted / "model.safetensors"))
    assert resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        (
            "--input",
            "{other}",
            r"inputs \S+other.txt differ from \S+words.txt, which \S+ was prepared",
        ),
        ("--tokenizer", "bpe", r"tokenizer 'bpe' differs from 'char', which \S+ was prepared"),
    ],
)
def test_resume_with_other_inputs_or_tokenizer_is_a_one_line_error(
    char_run: tuple[list[str], Path],
    flag: str,
    value: str,
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    argv, run = char_run
    other = tmp_path / "other.txt"
    other.write_text("some other text\n" * 50)
    argv = list(argv)
    argv[argv.index(flag) + 1] = value.format(other=other)
    steps = _losses(run)
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("decoderlm: error: "), err
    assert re.search(message, err), err
    assert _losses(run) == steps  # the run is left as it was


def test_plot_writes_a_png(toml_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "curves.png"
    assert main(["plot", str(toml_run), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert str(out) in capsys.readouterr().out


def test_every_config_field_is_a_flag() -> None:
    sub = build_parser()._subparsers._group_actions[0].choices["train"]
    flags = {option for action in sub._actions for option in action.option_strings}
    fields = [
        f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("vocab_size", "extra")
    ]
    fields += [f.name for f in dataclasses.fields(TrainConfig)]
    assert {"--" + name.replace("_", "-") for name in fields} <= flags
    # Spellings that scripts outside the project rely on:
    for flag in ("--max-steps", "--max-time", "--seed", "--eval-interval", "--checkpoint-interval"):
        assert flag in flags
    for flag in ("--config", "--preset", "--data", "--input", "--out", "--resume", "--init-from"):
        assert flag in flags
    assert {"--tokenizer", "--vocab-size", "--compile", "--no-compile"} <= flags


def _bad_toml(tmp: Path) -> str:
    (tmp / "bad.toml").write_text("[train\nmax_steps = 3\n")
    return str(tmp / "bad.toml")


def _unknown_key_toml(tmp: Path) -> str:
    (tmp / "unknown.toml").write_text("[training]\nmax_steps = 3\n")
    return str(tmp / "unknown.toml")


def _unknown_field_toml(tmp: Path) -> str:
    (tmp / "field.toml").write_text("[train]\nmax_step = 3\n")
    return str(tmp / "field.toml")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-steps", "abc"], "max_steps='abc' must be an integer"),
        (["--lr", "-1"], "lr=-1.0 must be > 0"),
        (["--dtype", "fp8"], "dtype='fp8' must be one of auto, fp32, bf16, fp16"),
        (["--preset", "gpt5"], "unknown preset 'gpt5'"),
        (["--n-heads", "5"], "d_model=128 must be divisible by n_heads=5"),
        (["--data", "{tmp}/missing"], "no such data directory"),
        (["--config", "{tmp}/missing.toml"], "no such config file"),
        (["--config", "{bad_toml}"], "is not valid TOML"),
        (["--config", "{unknown_key_toml}"], "unknown key 'training'"),
        (["--config", "{unknown_field_toml}"], "unknown train config field 'max_step'"),
        (["--resume", "--out", "{tmp}"], "cannot resume: .* has no checkpoint"),
        (["--input", "{corpus}", "--out", "{tmp}/r", "--dtype", "fp16"], "needs a CUDA device"),
    ],
)
def test_user_errors_are_one_line_with_exit_status_2(
    args: list[str],
    message: str,
    corpus: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    values = {
        "tmp": tmp_path,
        "corpus": corpus,
        "bad_toml": _bad_toml(tmp_path),
        "unknown_key_toml": _unknown_key_toml(tmp_path),
        "unknown_field_toml": _unknown_field_toml(tmp_path),
    }
    argv = ["train", *(a.format(**values) for a in args), "--tokenizer", "char", "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("decoderlm: error: "), err
    assert re.search(message, err), err


def test_non_finite_loss_exits_nonzero_with_one_line_and_keeps_the_checkpoint(
    corpus: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    argv = [*TINY, "--input", str(corpus), "--tokenizer", "char", "--out", str(run)]
    argv += [
        "--lr",
        "1e30",
        "--warmup-steps",
        "0",
        "--max-steps",
        "20",
        "--checkpoint-interval",
        "1",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "decoderlm", "train", *argv], capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("decoderlm: error: training loss is nan at step "), lines[0]
    last_good = checkpoint.latest_checkpoint(run)
    assert last_good is not None and str(last_good) in lines[0]
    checkpoint.load_model(run)


def test_ctrl_c_saves_a_checkpoint_at_the_current_step_and_exits_130(
    corpus: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    argv = [*TINY, "--input", str(corpus), "--tokenizer", "char", "--out", str(run)]
    argv += ["--max-steps", "100000", "--checkpoint-interval", "0", "--log-interval", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "decoderlm", "train", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted after" in out and f"decoderlm train --resume --out {run}" in out
    # The step in flight finished, was logged and saved: nothing trained is lost.
    last_logged = json.loads(metrics.read_text().splitlines()[-1])["step"]
    state = trainer_state.load_trainer_state(checkpoint.latest_checkpoint(run))
    assert state["step"] == last_logged >= 3
