"""Failures that used to end in a traceback: each is one line `decoderlm: error: …`, exit status 2
(or, for 0 new tokens, what a user expects: the prompt back, exit 0)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from decoderlm import DecoderLM, ModelConfig, checkpoint, trainer_state
from decoderlm.cli import main
from decoderlm.tokenizer import Tokenizer

TEXT = "to be or not to be that is the question\n" * 60
CONTEXT = 16
TINY_TRAIN = [
    *("--context-length", str(CONTEXT), "--d-model", "16", "--n-layers", "1", "--n-heads", "2"),
    *("--batch-size", "2", "--eval-iters", "1", "--sample-tokens", "2", "--dtype", "fp32"),
    *("--peak-flops", "1e12", "--threads", "1", "--tokenizer", "char", "--quiet"),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny untrained run with a char tokenizer."""
    tokenizer = Tokenizer.train_char([TEXT])
    config = ModelConfig.from_preset(
        "llama-tiny",
        vocab_size=tokenizer.vocab_size,
        d_model=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=2,
        context_length=CONTEXT,
    )
    torch.manual_seed(0)
    return checkpoint.save_model(
        tmp_path_factory.mktemp("run") / "run", DecoderLM(config), tokenizer
    )


def _error_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("decoderlm: error: "), err
    assert "Traceback" not in err
    return err.strip()


def test_an_unwritable_run_directory_mid_run_is_one_line_and_keeps_the_last_checkpoint(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    real_save_file = checkpoint.save_file

    def read_only_from_step_2(tensors: dict, path: str, *args: object) -> None:
        if "step_00000001" not in path:  # the first checkpoint is written, then the disk is RO
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        real_save_file(tensors, path, *args)

    monkeypatch.setattr(checkpoint, "save_file", read_only_from_step_2)
    out = tmp_path / "run"
    argv = ["train", *TINY_TRAIN, "--input", str(corpus), "--out", str(out)]
    assert main([*argv, "--max-steps", "3", "--checkpoint-interval", "1"]) == 2
    first = out / "checkpoints" / "step_00000001"
    assert _error_line(capsys) == (
        f"decoderlm: error: cannot save the checkpoint of step 2 in {out}: Read-only file "
        f"system; the previous checkpoint is intact ({first})"
    )
    assert checkpoint.list_checkpoints(out) == [first]
    assert trainer_state.load_trainer_state(first)["step"] == 1
    checkpoint.load_model(out)  # RUN/model.safetensors is still step 1's


@pytest.mark.parametrize(
    ("prompt", "flags"),
    [
        ("to be or not", ["--max-new-tokens", "0"]),
        ("to be or not to ", []),  # as long as the context: the default leaves no room
    ],
)
def test_zero_new_tokens_print_the_prompt_unchanged(
    run: Path, prompt: str, flags: list[str], capsys: pytest.CaptureFixture
) -> None:
    assert main(["generate", "--checkpoint", str(run), "--prompt", prompt, *flags]) == 0
    assert capsys.readouterr().out == prompt + "\n"


def test_a_model_too_big_for_memory_is_refused_before_allocating(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--input", str(corpus), "--tokenizer", "char", "--quiet"]
    assert main([*argv, "--d-model", "1000000", "--max-steps", "1", "--out", str(out)]) == 2
    line = _error_line(capsys)
    assert line.startswith("decoderlm: error: the model has "), line
    assert "parameters: training needs at least" in line and "choose a smaller model" in line
    assert not (out / checkpoint.WEIGHTS_FILE).exists()


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe.txt"
    os.mkfifo(path)
    return path


INPUT_FILE_FLAGS = {
    "generate --prompt-file": ["generate", "--checkpoint", "{run}", "--prompt-file", "{path}"],
    "eval --input": ["eval", "--checkpoint", "{run}", "--input", "{path}"],
    "train --config": ["train", "--config", "{path}", "--quiet"],
}


@pytest.mark.parametrize("flag", sorted(INPUT_FILE_FLAGS))
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_an_input_file_that_is_not_a_regular_file_is_named_for_what_it_is(
    kind: str,
    flag: str,
    run: Path,
    fifo: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    path = fifo if kind == "fifo" else tmp_path
    what = "is not a regular file (a FIFO" if kind == "fifo" else "is a directory, not a file"
    assert main([a.format(run=run, path=path) for a in INPUT_FILE_FLAGS[flag]]) == 2
    assert _error_line(capsys).startswith(f"decoderlm: error: {path} {what}")


def test_a_fifo_among_the_inputs_to_prepare_is_named_for_what_it_is(
    fifo: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = ["prepare", "--input", str(fifo), "--tokenizer", "char", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "data")]) == 2
    line = _error_line(capsys)
    assert line == f"decoderlm: error: {fifo} is not a regular file (a FIFO, socket or device)"
