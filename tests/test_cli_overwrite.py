"""No command writes over a file it did not create unless told (--overwrite, or --resume).

Every command that takes --out runs against an output that already holds a file it would write:
it must exit 2 with one line naming that file and the flag, and leave the file byte for byte as it
was; with --overwrite it goes through.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from decoderlm import DecoderLM, ModelConfig, checkpoint
from decoderlm.cli import main
from decoderlm.tokenizer import Tokenizer

TEXT = "to be or not to be that is the question\n" * 60
TINY_TRAIN = [
    *("--context-length", "16", "--d-model", "16", "--n-layers", "1", "--n-heads", "2"),
    *("--n-kv-heads", "2", "--batch-size", "2", "--max-steps", "1", "--eval-iters", "1"),
    *("--sample-tokens", "2", "--dtype", "fp32", "--peak-flops", "1e12", "--threads", "1"),
    "--quiet",
]
STUDY = """
budget_tokens = 32
seeds = 1
[model]
context_length = 8
d_model = 16
n_layers = 1
n_heads = 2
[train]
batch_size = 2
eval_iters = 1
sample_tokens = 2
dtype = "fp32"
peak_flops = 1e12
threads = 1
checkpoint_interval = 0
[[variants]]
name = "base"
"""


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A corpus, a study spec and a tiny untrained run (with a metrics.jsonl to plot)."""
    root = tmp_path_factory.mktemp("sources")
    (root / "corpus.txt").write_text(TEXT)
    (root / "study.toml").write_text(STUDY)
    tokenizer = Tokenizer.train_char([TEXT])
    config = ModelConfig.from_preset(
        "llama-tiny",
        vocab_size=tokenizer.vocab_size,
        d_model=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=2,
        context_length=16,
    )
    torch.manual_seed(0)
    checkpoint.save_model(root / "run", DecoderLM(config), tokenizer)
    rows = [{"step": 1, "train_loss": 3.0}, {"step": 2, "train_loss": 2.5, "val_loss": 2.6}]
    (root / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = ["prepare", "--task", "arithmetic", "--difficulty", "2", "--n", "50", "--quiet"]
    assert main([*task, "--out", str(root / "task")]) == 0
    policy = ["train", *TINY_TRAIN, "--context-length", "64", "--data", str(root / "task")]
    assert main([*policy, "--out", str(root / "policy")]) == 0  # a policy that spells the task
    return {
        "corpus": root / "corpus.txt",
        "study": root / "study.toml",
        "run": root / "run",
        "policy": root / "policy",
    }


def _run_copy(sources: dict[str, Path], target: Path) -> Path:
    """An existing run without checkpoints, as `quantize` and `convert` leave them."""
    shutil.copytree(sources["run"], target)
    return target / checkpoint.CONFIG_FILE


def _file(name: str, content: bytes = b"precious\n") -> Callable[[dict[str, Path], Path], Path]:
    def make(sources: dict[str, Path], target: Path) -> Path:
        target.mkdir()
        (target / name).write_bytes(content)
        return target / name

    return make


def _png(sources: dict[str, Path], target: Path) -> Path:
    target.write_bytes(b"\x89PNG\r\n\x1a\nprecious")
    return target


# (command, argv with {out} and the sources, what `out` holds before the command runs)
CASES = {
    "prepare": (
        ["prepare", "--input", "{corpus}", "--tokenizer", "char", "--quiet", "--out", "{out}"],
        _file("tokenizer.json", b'{"precious": 66}'),
    ),
    "train": (
        ["train", *TINY_TRAIN, "--input", "{corpus}", "--tokenizer", "char", "--out", "{out}"],
        _run_copy,
    ),
    "convert": (["convert", "--to-hf", "{run}", "--out", "{out}"], _file("config.json")),
    "quantize": (
        ["quantize", "{run}", "--to", "int8", "--out", "{out}"],
        _file("model.safetensors"),
    ),
    "lab": (
        ["lab", "--spec", "{study}", "--input", "{corpus}", "--quiet", "--out", "{out}"],
        _file("results.json"),
    ),
    "attention": (
        ["attention", "--checkpoint", "{run}", "--prompt", "to be", "--out", "{out}"],
        _png,
    ),
    "plot": (["plot", "{run}", "--out", "{out}"], _png),
    "verifier": (
        [
            *("verifier", "--policy", "{policy}", "--task", "arithmetic", "--difficulty", "2"),
            *("--problems", "4", "--samples", "2", "--max-tokens", "8", "--steps", "1"),
            *("--batch-size", "2", "--quiet", "--out", "{out}"),
        ],
        _file("model.safetensors"),
    ),
}


def _snapshot(path: Path) -> dict[str, bytes]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): p.read_bytes() for p in files}


def _argv(command: str, sources: dict[str, Path], out: Path) -> list[str]:
    argv, _ = CASES[command]
    return [a.format(out=out, **sources) for a in argv]


def test_every_command_with_out_is_covered() -> None:
    from decoderlm.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices
    with_out = {name for name, p in sub.items() if "--out" in p._option_string_actions}
    assert with_out == set(CASES)


@pytest.mark.parametrize("command", sorted(CASES))
def test_a_command_refuses_to_write_over_a_file_it_did_not_create(
    command: str,
    sources: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    out = tmp_path / ("out.png" if command in ("attention", "plot") else "out")
    existing = CASES[command][1](sources, out)
    before = _snapshot(out)
    assert main(_argv(command, sources, out)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("decoderlm: error: "), err
    assert str(existing) in err and "--overwrite" in err, err
    assert _snapshot(out) == before


@pytest.mark.parametrize("command", sorted(CASES))
def test_overwrite_lets_a_command_write_over_what_out_holds(
    command: str, sources: dict[str, Path], tmp_path: Path, one_thread: None
) -> None:
    out = tmp_path / ("out.png" if command in ("attention", "plot") else "out")
    existing = CASES[command][1](sources, out)
    before = existing.read_bytes()
    assert main([*_argv(command, sources, out), "--overwrite"]) == 0
    assert existing.read_bytes() != before


def test_train_refusal_offers_resume_too(
    sources: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    _run_copy(sources, out)
    assert main(_argv("train", sources, out)) == 2
    assert "--resume" in capsys.readouterr().err
