"""Data parallelism under torchrun (DDP, FSDP2) on the CPU: 2 gloo processes launched by the tests.

The runs are what users type, `torchrun --standalone --nproc_per_node 2 -m decoderlm train ...
--strategy ddp|fsdp`, compared with `decoderlm train` in one process on the same global batch
(the BatchSampler hands each rank its rows of that batch). Run as a script under torchrun, this file
is also the worker of the tests that drive `decoderlm.training.distributed` directly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from decoderlm import DecoderLM, ModelConfig, checkpoint, data, next_token_loss
from decoderlm.errors import DecoderLMError
from decoderlm.training import distributed

# One thread per process: 2 workers share the machine's cores, and every run (1 or 2 processes)
# then does its arithmetic the same way, so differences come from data parallelism alone.
# PYTHONFAULTHANDLER: a worker that hangs prints its stacks when `_run` sends it SIGABRT.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONFAULTHANDLER": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
STEPS = 6
# A tiny GQA model; 8 sequences per step in 2 micro-steps, so the 2-process runs also skip the
# gradient sync on the first micro-step of each step (grad_sync). fp32: no autocast rounding.
FLAGS = [
    *("--context-length", "32", "--d-model", "32", "--n-layers", "2", "--n-heads", "4"),
    *("--n-kv-heads", "2", "--batch-size", "8", "--grad-accum", "2", "--lr", "1e-3"),
    *("--warmup-steps", "2", "--max-steps", str(STEPS), "--max-time", "0"),
    *("--eval-interval", "3", "--eval-iters", "2", "--checkpoint-interval", "3"),
    *("--log-interval", "1", "--sample-tokens", "4", "--dtype", "fp32"),
    *("--peak-flops", "1e12", "--device", "cpu", "--quiet"),
]
# Per-step training loss (the global batch mean, ~4.1 nats here): the all-reduce adds the two
# halves of the batch in another order than one process does; fp32 rounding of that is ~1e-7.
LOSS_ATOL = 1e-5
# Global gradient norm: the same sums, in fp32 (~1e-7 relative); 1e-5 leaves room for 6 steps.
GRAD_NORM_RTOL = 1e-5
# Weights, per tensor, ‖w₂ − w₁‖ / ‖w₁‖. Not elementwise: AdamW divides by √v̂ + ε, so for the rare
# coordinate whose gradient is itself at rounding level (|g| ≲ ε = 1e-8) the summation order alone
# changes that step's update by up to ~lr (seen: 1.5e-5 with lr 1e-2). A rank whose gradients were
# not averaged moves every weight by O(lr) instead: ~1e-2 on this scale, a thousand times the bound.
WEIGHT_RTOL = 1e-5


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's workers), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid ...: comm may hold spaces, so split after its closing ")".
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run cmd; on a timeout, have every worker still running print its threads' Python stacks
    (faulthandler, on SIGABRT) so that the failure shows where it waited, then stop it with SIGTERM,
    on which torchrun also stops its workers (each in a session of its own: a SIGKILL would leave
    them running), and fail showing its output."""
    with subprocess.Popen(
        cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for worker in _children(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker, signal.SIGABRT)
            time.sleep(5)  # time to write the stacks before torchrun's SIGTERM
            proc.terminate()
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            pytest.fail(f"no exit after {timeout:.0f} s: {cmd}\n{out[-2000:]}\n{err[-20000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _train(out: Path, *extra: str, nproc: int = 1) -> str:
    """`decoderlm train` in one process or under torchrun with 2; returns its stdout."""
    launcher = TORCHRUN if nproc == 2 else [sys.executable]
    result = _run([*launcher, "-m", "decoderlm", "train", *FLAGS, "--out", str(out), *extra])
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / checkpoint.METRICS_FILE).read_text().splitlines()]


def _assert_same_training(run: Path, reference: Path, first_step: int = 1) -> None:
    """Losses, gradient norms and final weights of `run` match `reference` from `first_step` on."""
    rows = [r for r in _metrics(run) if r["step"] >= first_step]
    ref = [r for r in _metrics(reference) if r["step"] >= first_step]
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == list(range(first_step, 7))
    for mine, theirs in zip(rows, ref, strict=True):
        assert mine["train_loss"] == pytest.approx(theirs["train_loss"], abs=LOSS_ATOL)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=GRAD_NORM_RTOL)
    weights = load_file(run / checkpoint.WEIGHTS_FILE)
    ref_weights = load_file(reference / checkpoint.WEIGHTS_FILE)
    assert weights.keys() == ref_weights.keys()
    for name, w in weights.items():
        error = (w - ref_weights[name]).norm() / ref_weights[name].norm()
        assert error <= WEIGHT_RTOL, f"{name}: ‖Δw‖/‖w‖ = {error:.2e}"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Characters of a standard-library module (present wherever Python is)."""
    out = tmp_path_factory.mktemp("data")
    data.prepare([argparse.__file__], out, tokenizer="char", progress=False)
    return out


@pytest.fixture(scope="module")
def runs(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same 6-step run three ways; each checkpoints at steps 3 and 6."""
    root = tmp_path_factory.mktemp("runs")
    runs = {"single": root / "single", "ddp": root / "ddp", "fsdp": root / "fsdp"}
    _train(runs["single"], "--data", str(data_dir))
    for strategy in ("ddp", "fsdp"):
        _train(runs[strategy], "--data", str(data_dir), "--strategy", strategy, nproc=2)
    return runs


def test_ddp_on_two_processes_matches_one_process_with_the_same_global_batch(
    runs: dict[str, Path],
) -> None:
    _assert_same_training(runs["ddp"], runs["single"])


def test_fsdp2_on_two_processes_matches_one_process_with_the_same_global_batch(
    runs: dict[str, Path],
) -> None:
    _assert_same_training(runs["fsdp"], runs["single"])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_process_run_writes_one_run_directory_in_the_single_process_format(
    runs: dict[str, Path], strategy: str
) -> None:
    run, single = runs[strategy], runs["single"]
    files = {p.relative_to(run) for p in run.rglob("*")}
    assert files == {p.relative_to(single) for p in single.rglob("*")}
    config, single_config = checkpoint.read_run_config(run), checkpoint.read_run_config(single)
    assert config["model"] == single_config["model"]
    assert config["train"] == {**single_config["train"], "strategy": strategy}
    assert len(_metrics(run)) == len(_metrics(single)) == STEPS  # rank 0 alone logs
    model = checkpoint.load_model(run)  # a plain DecoderLM in this (single) process
    assert isinstance(model, DecoderLM)


def test_resume_on_one_process_continues_a_two_process_run(
    runs: dict[str, Path], data_dir: Path, tmp_path: Path
) -> None:
    """DDP run stopped at step 3 (its step-6 checkpoint removed), resumed alone: same steps 4–6."""
    run = tmp_path / "run"
    shutil.copytree(runs["ddp"], run)
    shutil.rmtree(run / checkpoint.CHECKPOINTS_DIR / "step_00000006")
    _train(run, "--resume")
    _assert_same_training(run, runs["single"], first_step=4)


def test_resume_on_two_processes_continues_a_one_process_run(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """One-process run stopped at step 3, resumed by 2 FSDP2 processes: the same steps 4–6."""
    run = tmp_path / "run"
    shutil.copytree(runs["single"], run)
    shutil.rmtree(run / checkpoint.CHECKPOINTS_DIR / "step_00000006")
    _train(run, "--resume", "--strategy", "fsdp", nproc=2)
    _assert_same_training(run, runs["single"], first_step=4)


def test_error_on_rank_0_stops_every_rank_with_a_one_line_message(tmp_path: Path) -> None:
    """Rank 0 prepares the data; its failure is re-raised on rank 1 instead of leaving it waiting."""
    missing = tmp_path / "no-such-corpus.txt"
    cmd = [*TORCHRUN, "-m", "decoderlm", "train", *FLAGS, "--strategy", "ddp"]
    result = _run([*cmd, "--input", str(missing), "--out", str(tmp_path / "run")], timeout=120)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("decoderlm: error:")]
    assert sorted(lines) == [  # one line per rank, in whatever order they reach stderr
        f"decoderlm: error: no such file or directory: {missing}",
        f"decoderlm: error: stopped because rank 0 failed: no such file or directory: {missing}",
    ]
    assert "[rank1]: Traceback" not in result.stderr and "[rank0]: Traceback" not in result.stderr


# ---- the library, below the CLI -----------------------------------------------------------------

TIED = ModelConfig.from_preset(
    "llama-tiny", vocab_size=64, context_length=16, n_layers=2, tie_embeddings=True
)


def _worker(run_dir: Path) -> None:
    """Under torchrun with 2 processes: what the tests below check, written to `run_dir`.

    FSDP2 on a tied-embedding model: step 1 in two micro-steps through `grad_sync` (noting whether
    gradients were reduced after each), step 2 in one; its logits on a probe batch; the checkpoint
    written by rank 0 from the gathered full state dict. DDP: whether the ranks' gradients agree
    after a micro-step without sync and after one with it.
    """
    info = distributed.init_distributed("cpu")
    torch.manual_seed(info.rank)  # different on purpose: wrap_model copies rank 0's weights
    tokens = torch.randint(0, TIED.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    mine = tokens.chunk(info.world_size)[info.rank]  # (2, 17): this rank's half of the batch
    halves = (mine[:1], mine[1:])  # (1, 17) each: the micro-batches of gradient accumulation

    def backward(model: torch.nn.Module, batch: torch.Tensor, sync: bool) -> None:
        with distributed.grad_sync(model, enabled=sync):
            (next_token_loss(model(batch[:, :-1]), batch[:, 1:]) / 2).backward()

    # FSDP2 reduce-scatters a block's gradient into its sharded `.grad`, which is None until then.
    model = distributed.wrap_model(DecoderLM(TIED), "fsdp", info)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    backward(model, halves[0], sync=False)
    sync = {"fsdp_reduced_without_sync": any(p.grad is not None for p in model.parameters())}
    backward(model, halves[1], sync=True)
    sync["fsdp_reduced_with_sync"] = all(p.grad is not None for p in model.parameters())
    optimizer.step()
    optimizer.zero_grad()
    backward(model, mine, sync=True)
    optimizer.step()
    with torch.no_grad():
        logits = model(tokens[:, :-1])  # (4, 16, 64), the same batch on both ranks
    model_sd, optim_sd = distributed.full_state_dicts(model, optimizer)

    # DDP: the same weights on every rank; the gradients agree once they are all-reduced.
    ddp = distributed.wrap_model(DecoderLM(TIED), "ddp", info)

    def ranks_agree() -> bool:
        grad = torch.cat([p.grad.flatten() for p in ddp.parameters()])
        grads = [torch.empty_like(grad) for _ in range(info.world_size)]
        torch.distributed.all_gather(grads, grad)
        return all(torch.equal(g, grads[0]) for g in grads)

    backward(ddp, halves[0], sync=False)
    sync["ddp_agree_without_sync"] = ranks_agree()
    backward(ddp, halves[1], sync=True)
    sync["ddp_agree_with_sync"] = ranks_agree()

    def write() -> None:
        checkpoint.save_checkpoint(run_dir, 2, TIED, model_sd, {"optimizer": optim_sd})
        save_file({"logits": logits, "tokens": tokens}, str(run_dir / "probe.safetensors"))
        (run_dir / "sync.json").write_text(json.dumps(sync))

    distributed.run_on_main(write, info)
    distributed.shutdown(info)


@pytest.fixture(scope="module")
def worker_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("worker")
    result = _run([*TORCHRUN, __file__, str(run_dir)], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_grad_sync_skips_the_gradient_reduction_on_non_final_micro_steps(worker_run: Path) -> None:
    sync = json.loads((worker_run / "sync.json").read_text())
    assert sync == {
        "fsdp_reduced_without_sync": False,
        "fsdp_reduced_with_sync": True,
        "ddp_agree_without_sync": False,  # each rank holds the gradient of its own micro-batch
        "ddp_agree_with_sync": True,
    }


def test_fsdp2_checkpoint_loads_in_one_process_and_gives_identical_logits(worker_run: Path) -> None:
    probe = load_file(worker_run / "probe.safetensors")
    model = checkpoint.load_model(checkpoint.latest_checkpoint(worker_run))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: the same kernels, so equal weights → equal bits
    try:
        with torch.no_grad():
            logits = model(probe["tokens"][:, :-1])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(logits, probe["logits"])


def test_one_process_has_no_process_group_and_no_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    info = distributed.init_distributed("cpu")
    assert (info.rank, info.world_size, info.is_main) == (0, 1, True)
    model = DecoderLM(TIED)
    for strategy in distributed.STRATEGIES:
        assert distributed.wrap_model(model, strategy, info) is model
    assert not torch.distributed.is_initialized()
    assert distributed.all_reduce_mean(torch.tensor(2.5), info) == 2.5
    assert distributed.run_on_main(lambda: 7, info) == 7


def test_bad_strategy_and_launch_environment_give_one_line_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    info = distributed.DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(DecoderLMError, match="strategy 'zero3' is not one of"):
        distributed.wrap_model(DecoderLM(TIED), "zero3", info)
    two = distributed.DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(DecoderLMError, match="strategy 'none' cannot train with 2"):
        distributed.wrap_model(DecoderLM(TIED), "none", two)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(DecoderLMError, match="launch with torchrun"):
        distributed.init_distributed("cpu")
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(DecoderLMError, match="RANK='two' is not an integer"):
        distributed.init_distributed("cpu")


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
