"""Fine-tuning on chat data (`decoderlm.training.finetune`), full and LoRA, on a tiny random model:
only the adapters train and the optimizer holds only theirs; the run is the merged model, which
loads and computes what base + adapters compute; a run stopped mid-epoch and resumed is bit for
bit the uninterrupted one; 2 processes under torchrun train the adapters one process trains with
the same global batch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import decoderlm
from decoderlm import checkpoint, trainer_state
from decoderlm.chat_template import load_chat_template
from decoderlm.cli import main
from decoderlm.lora import ADAPTER_FILE, load_adapters

pytest_plugins = ["chat_fixtures"]  # the fixtures chat_base and chat_file

# 54 train conversations, 4 a step: step 3 is mid-epoch. Dropout on the adapters, so the resume
# must restore the RNG too.
FLAGS = [
    *("--max-steps", "6", "--batch-size", "4", "--lr", "1e-2", "--warmup-steps", "2"),
    *("--eval-interval", "3", "--checkpoint-interval", "3", "--sample-tokens", "2"),
    *("--dtype", "fp32", "--peak-flops", "1e12", "--threads", "1", "--device", "cpu"),
    "--quiet",
]
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.1"]
# The merged float32 weights W + (α/r)·B·A against the adapted forward's two extra matmuls:
# roundings of the same sums, ~1e-7 on logits of O(1).
MERGED_ATOL = 1e-5
# float32 logits of the same weights in transformers' Llama: the same operations in another
# order, ~1e-6 here.
EXPORT_ATOL = 1e-4
# 2 ranks vs 1 process: the same sums in another order (see test_distributed.py's bounds).
LOSS_ATOL = 1e-5
WEIGHT_RTOL = 1e-5


def _train(base: Path, chat: Path, out: Path, *extra: str) -> None:
    argv = ["train", "--init-from", str(base), "--data", str(chat), "--out", str(out)]
    assert main([*argv, *FLAGS, *extra]) == 0


@pytest.fixture(scope="module")
def lora_run(chat_base: Path, chat_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "run"
    _train(chat_base, chat_file, out, *LORA)
    return out


@pytest.fixture(scope="module")
def full_run(chat_base: Path, chat_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("full") / "run"
    _train(chat_base, chat_file, out)
    return out


def test_the_optimizer_state_holds_only_the_adapters(lora_run: Path) -> None:
    state = json.loads(
        (checkpoint.latest_checkpoint(lora_run) / trainer_state.STATE_FILE).read_text()
    )
    names = set(state["optimizer"]["state"])
    adapters = set(load_file(str(lora_run / ADAPTER_FILE)))
    assert names == adapters and len(adapters) == 2 * 5 * 2  # A, B × 5 linears × 2 layers


def test_the_lora_run_is_the_merged_model_of_base_and_adapters(
    chat_base: Path, lora_run: Path
) -> None:
    merged, _ = decoderlm.load(lora_run)
    adapted, _ = decoderlm.load(chat_base)
    load_adapters(adapted, lora_run).eval()
    ids = torch.randint(
        0, merged.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)
    )
    assert (merged(ids) - adapted(ids)).abs().max() <= MERGED_ATOL
    base, _ = decoderlm.load(chat_base)
    assert (merged(ids) - base(ids)).abs().max() > 1e-3  # the adapters did train
    # The run chats with the base's template.
    assert load_chat_template(lora_run) == load_chat_template(chat_base)


def test_the_lora_run_exports_to_transformers_with_its_logits(
    lora_run: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    assert main(["convert", "--to-hf", str(lora_run), "--out", str(tmp_path / "hf")]) == 0
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    mine, _ = decoderlm.load(lora_run)
    ids = torch.randint(
        0, mine.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        assert (mine(ids) - theirs(input_ids=ids).logits).abs().max() <= EXPORT_ATOL


def test_full_fine_tuning_trains_every_weight(chat_base: Path, full_run: Path) -> None:
    state = json.loads(
        (checkpoint.latest_checkpoint(full_run) / trainer_state.STATE_FILE).read_text()
    )
    base = load_file(str(chat_base / checkpoint.WEIGHTS_FILE))
    tuned = load_file(str(full_run / checkpoint.WEIGHTS_FILE))
    assert set(state["optimizer"]["state"]) == set(base)  # tied head: stored once
    assert all(not torch.equal(base[name], tuned[name]) for name in base if "norm" not in name)
    assert not (full_run / ADAPTER_FILE).exists()


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_run_stopped_mid_epoch_and_resumed_is_the_uninterrupted_one(
    kind: str,
    chat_base: Path,
    chat_file: Path,
    lora_run: Path,
    full_run: Path,
    tmp_path: Path,
) -> None:
    reference = lora_run if kind == "lora" else full_run
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "checkpoints" / "step_00000006")  # killed after step 3's checkpoint
    extra = LORA if kind == "lora" else []
    _train(chat_base, chat_file, run, *extra, "--resume")
    for name in (checkpoint.WEIGHTS_FILE, *([ADAPTER_FILE] if kind == "lora" else [])):
        mine, theirs = load_file(str(run / name)), load_file(str(reference / name))
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs), name
    rows = [json.loads(line) for line in (run / checkpoint.METRICS_FILE).read_text().splitlines()]
    ref = [
        json.loads(line) for line in (reference / checkpoint.METRICS_FILE).read_text().splitlines()
    ]
    assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in ref]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def test_two_processes_train_the_adapters_of_one_with_the_same_global_batch(
    chat_base: Path, chat_file: Path, tmp_path: Path
) -> None:
    runs = {"one": tmp_path / "one", "two": tmp_path / "two"}
    # 8 conversations a step in 2 micro-steps: each rank's rows are padded to their own longest,
    # and the loss is normalised by the whole step's assistant tokens.
    flags = [*FLAGS, *LORA, "--lora-dropout", "0", "--batch-size", "8", "--grad-accum", "2"]
    flags += ["--log-interval", "1", "--threads", "0"]
    for name, launcher in (("one", [sys.executable]), ("two", TORCHRUN)):
        cmd = [*launcher, "-m", "decoderlm", "train", "--init-from", str(chat_base)]
        cmd += ["--data", str(chat_file), "--out", str(runs[name]), *flags]
        if name == "two":
            cmd += ["--strategy", "ddp"]
        done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    metrics = {
        name: [
            json.loads(line) for line in (run / checkpoint.METRICS_FILE).read_text().splitlines()
        ]
        for name, run in runs.items()
    }
    assert [r["step"] for r in metrics["two"]] == [r["step"] for r in metrics["one"]]
    for mine, theirs in zip(metrics["two"], metrics["one"], strict=True):
        assert mine["train_loss"] == pytest.approx(theirs["train_loss"], abs=LOSS_ATOL)
    two, one = (load_file(str(runs[name] / ADAPTER_FILE)) for name in ("two", "one"))
    assert two.keys() == one.keys()
    for name, w in two.items():
        error = (w - one[name]).norm() / one[name].norm()
        assert error <= WEIGHT_RTOL, f"{name}: ‖Δw‖/‖w‖ = {error:.2e}"


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (
            ["--lora-targets", "q_proj"],
            "LoRA target 'q_proj' is not a linear layer of this model; valid: down, gate, proj, "
            "qkv, up",
        ),
        (["--lora-rank", "-1"], "lora_rank=-1 must be ≥ 0"),
        (["--strategy", "fsdp"], "LoRA trains with --strategy ddp under torchrun"),
    ],
)
def test_bad_lora_settings_are_one_line(
    chat_base: Path,
    chat_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    extra: list[str],
    error: str,
) -> None:
    argv = ["train", "--init-from", str(chat_base), "--data", str(chat_file)]
    assert main([*argv, "--out", str(tmp_path / "run"), *FLAGS, *LORA, *extra]) == 2
    *_, line = capsys.readouterr().err.splitlines()  # after the chat data's line, if prepared
    assert line.startswith(f"decoderlm: error: {error}"), line


def test_lora_without_a_model_to_adapt_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    corpus = tmp_path / "text.txt"
    corpus.write_text("to be or not to be " * 200)
    argv = ["train", "--input", str(corpus), "--tokenizer", "char", "--out", str(tmp_path / "r")]
    assert main([*argv, *FLAGS, *LORA]) == 2
    assert capsys.readouterr().err.startswith(
        "decoderlm: error: --lora-rank adapts a trained model: give it with --init-from"
    )
