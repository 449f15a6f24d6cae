"""The trainer: learning, exact resume, crash-safe checkpoints, non-finite stop, optimizer setup."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from decoderlm import ModelConfig, checkpoint, data, trainer_state
from decoderlm.errors import DecoderLMError
from decoderlm.model.lm import DecoderLM
from decoderlm.training.distributed import DistInfo
from decoderlm.training.optim import clip_and_step, learning_rate, param_groups
from decoderlm.training.run import resolve_run
from decoderlm.training.runtime import resolve_dtype
from decoderlm.training.stopping import stop_reason
from decoderlm.training.train_config import TrainConfig
from decoderlm.training.trainer import Trainer, train

WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "log", "and", "then"]


def tiny_model(**overrides: object) -> ModelConfig:
    # RoPE + GQA (4 query heads, 2 K/V heads) + RMSNorm + SwiGLU; dropout so that exact resume
    # also needs the torch RNG state restored.
    values = dict(context_length=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=None)
    return ModelConfig.from_preset("llama-tiny", **{**values, "dropout": 0.1, **overrides})


def tiny_train(**overrides: object) -> TrainConfig:
    values = dict(
        batch_size=4,
        max_steps=8,
        max_time=0.0,
        warmup_steps=2,
        lr=1e-2,
        min_lr=1e-3,
        eval_interval=4,
        eval_iters=2,
        checkpoint_interval=4,
        log_interval=1,
        sample_tokens=8,
        dtype="fp32",
        threads=1,  # runs compared bit for bit must sum in the same order
        peak_flops=1e12,  # stated, so no matmul is timed
    )
    return TrainConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A char-level corpus of simple sentences: learnable within a few dozen steps."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(8)) + "." for _ in range(2000))
    (root / "corpus.txt").write_text(text)
    data.prepare([root / "corpus.txt"], root / "data", tokenizer="char", progress=False)
    return root / "data"


def losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(row["step"], row["train_loss"]) for row in map(json.loads, lines)]


@pytest.fixture(scope="module")
def reference_run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 steps without interruption, a checkpoint every 2."""
    out = tmp_path_factory.mktemp("reference") / "run"
    train(tiny_model(), tiny_train(checkpoint_interval=2), data_dir, out, progress=False)
    return out


def test_a_few_steps_lower_the_loss(data_dir: Path, tmp_path: Path) -> None:
    cfg = tiny_train(max_steps=40, eval_interval=0, checkpoint_interval=0)
    summary = train(tiny_model(dropout=0.0), cfg, data_dir, tmp_path / "run", progress=False)
    first = losses(tmp_path / "run")[0][1]
    vocab = data.read_meta(data_dir)["vocab_size"]
    # At initialisation the loss is ≈ ln V (uniform over V tokens); 40 steps of lr 1e-2 learn at
    # least the character frequencies of this corpus (entropy ≈ 2.6 nats), well below ln 15 ≈ 2.7.
    assert abs(first - math.log(vocab)) < 0.3
    assert summary["val_loss"] < first - 0.5
    assert summary["step"] == 40 and summary["stopped"] == "max_steps"
    assert len(summary["samples"]) == 3 and all(isinstance(s, str) for s in summary["samples"])


def test_resume_gives_bit_identical_losses(
    data_dir: Path, reference_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    first = tiny_train(max_steps=4, decay_steps=8, checkpoint_interval=2)
    train(tiny_model(), first, data_dir, out, progress=False)
    train(None, dataclasses.replace(first, max_steps=8), None, out, resume=True, progress=False)
    assert losses(out) == losses(reference_run)  # exact float equality, steps 1..8
    a, b = checkpoint.load_model(out), checkpoint.load_model(reference_run)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


KILL_DURING_SAVE = """
import json, sys, time
from pathlib import Path
from decoderlm import checkpoint
from decoderlm.training.run import resolve_run
from decoderlm.training.trainer import Trainer, train
sys.path.insert(0, {tests!r})
from test_train import tiny_model, tiny_train

original = checkpoint.save_trainer_state

def save_then_hang(directory, state):  # the kill lands inside the save of step 4
    original(directory, state)
    if state["step"] == 4:
        Path({marker!r}).write_text("in the middle of a save")
        time.sleep(600)

checkpoint.save_trainer_state = save_then_hang
train(tiny_model(), tiny_train(checkpoint_interval=2), {data!r}, {out!r}, progress=False)
"""


def test_kill_during_save_keeps_previous_checkpoint_and_resume_is_exact(
    data_dir: Path, reference_run: Path, tmp_path: Path
) -> None:
    out, marker = tmp_path / "run", tmp_path / "marker"
    script = KILL_DURING_SAVE.format(
        tests=str(Path(__file__).parent), marker=str(marker), data=str(data_dir), out=str(out)
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), proc.communicate()[1]
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    # The half-written step 4 is invisible; step 2 is complete and loads.
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["step_00000002"]
    assert any(p.name.startswith(".tmp-step_00000004") for p in (out / "checkpoints").iterdir())
    model = checkpoint.load_model(out)
    assert isinstance(model, DecoderLM)
    assert trainer_state.load_trainer_state(checkpoint.latest_checkpoint(out))["step"] == 2

    train(None, None, None, out, resume=True, progress=False)
    assert losses(out) == losses(reference_run)
    assert not any(p.name.startswith(".") for p in (out / "checkpoints").iterdir())


def test_non_finite_loss_stops_naming_the_step_and_keeps_last_checkpoint(
    data_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    # lr 1e30: the first updates make the weights ~1e30 and the logits overflow within a few steps.
    cfg = tiny_train(lr=1e30, warmup_steps=0, checkpoint_interval=1, eval_interval=0)
    with pytest.raises(DecoderLMError) as error:
        train(tiny_model(), cfg, data_dir, out, progress=False)
    found = re.search(
        r"loss is nan at step (\d+): stopped; the last good checkpoint is (\S+)", str(error.value)
    )
    assert found and "\n" not in str(error.value), str(error.value)
    bad_step, last_good = int(found.group(1)), Path(found.group(2))
    assert bad_step >= 2  # step 1 starts from the finite initial weights
    # Nothing is saved after the bad step; the previous step's checkpoint is the latest and loads.
    assert checkpoint.latest_checkpoint(out) == last_good
    assert trainer_state.load_trainer_state(last_good)["step"] == bad_step - 1
    checkpoint.load_model(out)


def test_init_from_starts_from_the_runs_weights(
    data_dir: Path, reference_run: Path, tmp_path: Path
) -> None:
    # One step at lr 1e-12 moves each weight by ~1e-12 (Adam's first step has size ≈ lr), so the
    # result must equal the run's weights to well within 1e-9: the weights were loaded.
    cfg = tiny_train(max_steps=1, lr=1e-12, min_lr=0.0, warmup_steps=0, eval_interval=0)
    train(None, cfg, data_dir, tmp_path / "ft", init_from=reference_run, progress=False)
    tuned, source = checkpoint.load_model(tmp_path / "ft"), checkpoint.load_model(reference_run)
    assert tuned.config == source.config
    for (name, p), q in zip(tuned.state_dict().items(), source.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-9, msg=name)


def test_compiled_training_saves_plain_parameter_names(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The eager backend keeps the OptimizedModule wrapper (the source of `_orig_mod.`) without
    # spending a minute in Inductor.
    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend="eager"))
    out = tmp_path / "run"
    train(tiny_model(), tiny_train(max_steps=2, compile=True), data_dir, out, progress=False)
    ckpt = checkpoint.latest_checkpoint(out)
    names = [
        *load_file(str(ckpt / "model.safetensors")),
        *load_file(str(out / "model.safetensors")),
    ]
    names += list(load_file(str(ckpt / trainer_state.STATE_TENSORS_FILE)))
    assert names and not [n for n in names if "_orig_mod" in n]
    assert set(load_file(str(out / "model.safetensors"))) == set(
        checkpoint.model_state_dict(DecoderLM(tiny_model(vocab_size=15)))
    )


@pytest.mark.parametrize("enabled", [True, False])
def test_cpu_kernels_switch_the_cpu_paths_and_the_heap_setting(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, enabled: bool
) -> None:
    from decoderlm.cpu.embedding import CPUEmbedding

    heap_calls = []
    monkeypatch.setattr("decoderlm.cpu.heap.keep_freed_memory", lambda: heap_calls.append(1))
    cfg = tiny_train(cpu_kernels=enabled)
    run = resolve_run(tmp_path / "run", model=tiny_model(), train=cfg, data_dir=data_dir)
    trainer = Trainer(run, progress=False)
    try:
        assert isinstance(trainer.model.tok_emb, CPUEmbedding) == enabled
        assert len(heap_calls) == int(enabled)
    finally:
        trainer.close()


def test_cpu_kernels_leave_the_losses_as_they_are(data_dir: Path, tmp_path: Path) -> None:
    cfg = tiny_train(max_steps=4, eval_interval=0, checkpoint_interval=0)
    for enabled in (True, False):
        out = tmp_path / str(enabled)
        train(
            tiny_model(),
            dataclasses.replace(cfg, cpu_kernels=enabled),
            data_dir,
            out,
            progress=False,
        )
    fast, plain = losses(tmp_path / "True"), losses(tmp_path / "False")
    assert [s for s, _ in fast] == [s for s, _ in plain] == [1, 2, 3, 4]
    # Only the order of float32 sums differs: after 4 AdamW steps the losses agree to 1e-5.
    for (_, a), (_, b) in zip(fast, plain, strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def test_run_directory_holds_config_tokenizer_metrics_and_loads(
    data_dir: Path, reference_run: Path
) -> None:
    config = checkpoint.read_run_config(reference_run)
    assert config["train"]["max_steps"] == 8 and config["model"]["n_kv_heads"] == 2
    assert (reference_run / "tokenizer.json").is_file()
    rows = [json.loads(line) for line in (reference_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all("train_loss" in r and "lr" in r and "tokens_per_s" in r for r in rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [4, 8]
    # keep_last=2 plus the best (lowest val loss): the newest two are step 6 and 8.
    kept = [p.name for p in checkpoint.list_checkpoints(reference_run)]
    assert kept[-2:] == ["step_00000006", "step_00000008"]
    model = checkpoint.load_model(reference_run)  # the run directory itself: latest weights
    latest = load_file(str(checkpoint.latest_checkpoint(reference_run) / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in latest.items())


def test_every_checkpoint_holds_the_runs_tokenizer_and_stop_ids(reference_run: Path) -> None:
    for saved in checkpoint.list_checkpoints(reference_run):
        for name in ("tokenizer.json", "generation_config.json"):
            assert (saved / name).read_bytes() == (reference_run / name).read_bytes(), name


def test_starting_over_an_existing_run_is_refused(data_dir: Path, reference_run: Path) -> None:
    with pytest.raises(DecoderLMError, match=r"already holds a run .* pass --resume"):
        train(tiny_model(), tiny_train(), data_dir, reference_run, progress=False)


def test_resume_without_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DecoderLMError, match=r"cannot resume: .* has no checkpoint"):
        train(None, None, None, tmp_path, resume=True, progress=False)


def test_resume_with_a_different_model_is_refused(data_dir: Path, reference_run: Path) -> None:
    with pytest.raises(DecoderLMError, match="model field d_model=64 differs"):
        train(tiny_model(d_model=64), None, None, reference_run, resume=True, progress=False)


def test_checkpoint_rotation_keeps_last_k_and_the_best(tmp_path: Path) -> None:
    config = ModelConfig.from_preset("llama-tiny", d_model=16, n_layers=1, vocab_size=10)
    weights = DecoderLM(config).state_dict()
    for step, val_loss in enumerate([3.0, 1.0, 2.0, None, 5.0], start=1):
        state = {"step": step, "val_loss": val_loss}
        checkpoint.save_checkpoint(tmp_path, step, config, weights, state, keep_last=2)
    names = [p.name for p in checkpoint.list_checkpoints(tmp_path)]
    assert names == ["step_00000002", "step_00000004", "step_00000005"]
    assert checkpoint.best_checkpoint(tmp_path).name == "step_00000002"


def test_trainer_state_round_trips_types_and_tensors(tmp_path: Path) -> None:
    state = {
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0)}},
            "param_groups": [{"betas": (0.9, 0.95)}],
        },
        "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
        "best_val_loss": None,
    }
    trainer_state.save_trainer_state(tmp_path, state)
    back = trainer_state.load_trainer_state(tmp_path)
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert list(back["optimizer"]["state"]) == [0]  # int keys stay ints
    assert torch.equal(back["optimizer"]["state"][0]["step"], torch.tensor(3.0))
    assert back["rng"]["python"] == random.getstate()
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    assert back["best_val_loss"] is None


def test_weight_decay_applies_to_linear_weights_only() -> None:
    untied = DecoderLM(ModelConfig.from_preset("llama-tiny", d_model=32, n_layers=1))
    decay, no_decay = param_groups(untied, 0.1)
    names = {id(p): n for n, p in untied.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {names[id(p)] for p in no_decay["params"]} == {
        "tok_emb.weight",
        "blocks.0.norm1.weight",
        "blocks.0.norm2.weight",
        "norm.weight",
    }
    assert all(p.dim() == 2 for p in decay["params"]) and len(decay["params"]) == 6
    # GPT-2: tied head (the embedding is a matmul weight: decayed), biases and LayerNorms not.
    tied = DecoderLM(ModelConfig.from_preset("gpt2", d_model=32, n_layers=1, n_heads=2))
    decay, no_decay = param_groups(tied, 0.1)
    assert any(p is tied.tok_emb.weight for p in decay["params"])
    assert any(p is tied.pos_emb.weight for p in no_decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"] if p is not tied.pos_emb.weight)


@pytest.mark.parametrize("max_norm", [0.05, 1e3])  # clipped, and norm below the threshold
@pytest.mark.parametrize("fused", [True, False])
def test_clip_and_step_equals_clip_grad_norm_then_step(max_norm: float, fused: bool) -> None:
    # Fused: the clip is folded into AdamW's grad_scale; unfused: clip_grad_norm_ then step.
    def run(clip_in_step: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        torch.manual_seed(0)
        model = DecoderLM(ModelConfig.from_preset("llama-tiny", d_model=32, n_layers=1))
        opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, fused=fused)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        for _ in range(3):
            model(torch.arange(16).view(2, 8)).square().mean().backward()
            if clip_in_step:
                norm = clip_and_step(opt, scaler, max_norm)
            else:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                opt.step()
            opt.zero_grad()
        assert not hasattr(opt, "grad_scale")
        return [p.detach().clone() for p in model.parameters()], norm

    ours, our_norm = run(True)
    reference, reference_norm = run(False)
    torch.testing.assert_close(our_norm, reference_norm, rtol=1e-6, atol=0)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # x/c and x·(1/c) round apart


def test_learning_rate_warms_up_linearly_then_decays_by_cosine_to_the_floor() -> None:
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110, max_time=0)
    assert learning_rate(cfg, 0, 0.0) == pytest.approx(0.1)
    assert learning_rate(cfg, 9, 0.0) == pytest.approx(1.0)
    assert learning_rate(cfg, 10, 0.0) == pytest.approx(1.0)
    assert learning_rate(cfg, 60, 0.0) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert learning_rate(cfg, 110, 0.0) == pytest.approx(0.1)
    assert learning_rate(cfg, 500, 0.0) == pytest.approx(0.1)  # floor after the end
    by_time = TrainConfig(lr=1.0, min_lr=0.0, warmup_steps=0, max_time=100.0)
    assert learning_rate(by_time, 5, 50.0) == pytest.approx(0.5)  # decay by elapsed time


def test_fp16_on_cpu_is_refused_and_auto_picks_native_bf16() -> None:
    with pytest.raises(DecoderLMError, match="fp16' needs a CUDA device"):
        resolve_dtype("fp16", torch.device("cpu"))
    auto = resolve_dtype("auto", torch.device("cpu"))
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert auto == (torch.bfloat16 if native else torch.float32)


@pytest.mark.parametrize("native", [True, False])
def test_bf16_on_a_cpu_is_taken_only_where_native(monkeypatch, native: bool) -> None:
    monkeypatch.setattr("decoderlm.cpu.features.has_native_bf16", lambda: native)
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if native else torch.float32)
    if native:
        assert resolve_dtype("bf16", cpu) == torch.bfloat16
    else:
        with pytest.raises(DecoderLMError, match="bf16' needs a CPU with native bf16"):
            resolve_dtype("bf16", cpu)
    assert resolve_dtype("fp32", cpu) == torch.float32


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("batch_size", 0, "batch_size=0 must be ≥ 1"),
        ("lr", -1.0, "lr=-1.0 must be > 0"),
        ("min_lr", 1.0, r"min_lr=1.0 must be in \[0, lr="),
        ("dtype", "fp8", "dtype='fp8' must be one of auto, fp32, bf16, fp16"),
        ("max_steps", "10", "max_steps='10' must be of type int"),
        ("grad_accum", 3, "batch_size=16 must be divisible by grad_accum=3"),
    ],
)
def test_bad_train_config_values_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(DecoderLMError, match=message):
        TrainConfig(**{field: value})


def test_unknown_train_field_lists_the_allowed_ones() -> None:
    with pytest.raises(DecoderLMError, match="unknown train config field 'lr_max'; allowed: "):
        TrainConfig.from_dict({"lr_max": 1.0})


def test_auto_threads_leave_out_the_cores_busy_right_now(monkeypatch):
    import decoderlm.training.runtime as runtime

    samples = iter([(100, 400), (150, 500)])  # (busy, total) jiffies: half the machine busy
    monkeypatch.setattr(runtime, "_cpu_jiffies", lambda: next(samples))
    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(runtime, "TORCH_DEFAULT_THREADS", 4)
    assert runtime.busy_cores(window_s=0) == 2.0
    monkeypatch.setattr(runtime, "busy_cores", lambda: 3.7)
    assert runtime.cpu_threads() == 1  # never fewer than one
    monkeypatch.setattr(runtime, "busy_cores", lambda: 0.0)
    assert runtime.cpu_threads() == 4


def test_a_run_stops_at_its_step_limit_its_time_limit_or_on_request_which_wins() -> None:
    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    cfg = TrainConfig(max_steps=10, max_time=60.0)
    assert stop_reason(cfg, 9, 59.9, False, one) is None
    assert stop_reason(cfg, 10, 0.0, False, one) == "max_steps"
    assert stop_reason(cfg, 3, 60.0, False, one) == "max_time"
    assert stop_reason(cfg, 10, 60.0, True, one) == "interrupted"  # saved as a stop, not a limit
    steps_only = TrainConfig(max_steps=10, max_time=0.0)
    assert steps_only.time_limit == 0  # no time limit: the clock never stops it
    assert stop_reason(steps_only, 9, 1e9, False, one) is None
    time_only = TrainConfig(max_steps=0, max_time=60.0)
    assert stop_reason(time_only, 10**9, 59.9, False, one) is None
    assert stop_reason(time_only, 10**9, 60.0, False, one) == "max_time"
