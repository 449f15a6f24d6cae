"""The training loop: AdamW steps, evaluation, checkpoints and stopping, with exact resume.

One optimizer step sees `batch_size` sequences: `grad_accum` micro-steps on each of `world_size`
processes, the gradients averaged; clipping, AdamW and the schedule are in `decoderlm.training.optim`.
What the run is (directory, checkpoint, data, configs) is resolved by `decoderlm.training.run`; what
it shows and logs is `decoderlm.training.report`; precision, threads and RNGs are
`decoderlm.training.runtime`; the checkpoints and the exact resume from them are
`decoderlm.training.resume`; when to stop is `decoderlm.training.stopping`.

The loop goes through `decoderlm.training.distributed` (init → wrap → grad_sync → full_state_dicts), which
is a no-op for one process, so the single-process and the torchrun paths are the same code.

What is trained is language modelling: a `DecoderLM`, next-token cross-entropy on windows of the
data's token splits, judged by `decoderlm.training.evaluation`. A subclass trains another
objective on the same loop by overriding its hooks, `build_model`, `batches`, `step_tokens`,
`batch_loss`, `evaluate` and `sample` (the learned verifier of `decoderlm.training.verifier` does: a
scalar head, binary cross-entropy on labelled texts; so does chat fine-tuning,
`decoderlm.training.finetune`: the assistant's tokens of conversations).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from decoderlm import checkpoint, data
from decoderlm.cpu.paths import SpeedPaths
from decoderlm.errors import DecoderLMError, NonFiniteLossError
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM, next_token_loss
from decoderlm.tokenizer import Tokenizer
from decoderlm.training import distributed
from decoderlm.training.evaluation import lm_metrics, mean_batch_loss, sample_texts
from decoderlm.training.model_init import base_of, initial_model
from decoderlm.training.optim import clip_and_step, learning_rate, make_optimizer
from decoderlm.training.report import Report, banner
from decoderlm.training.resume import restore_checkpoint, save_checkpoint, write_run_files
from decoderlm.training.run import Run, resolve_run
from decoderlm.training.runtime import (
    check_training_memory,
    cpu_threads,
    measure_peak_flops,
    resolve_dtype,
    seed_everything,
)
from decoderlm.training.stopping import StopRequests, stop_reason
from decoderlm.training.train_config import TrainConfig

FINAL_SAMPLES = 3


def train(
    model_config: ModelConfig | None = None,
    train_config: TrainConfig | None = None,
    data_dir: str | Path | None = None,
    out_dir: str | Path | None = None,
    resume: bool = False,
    init_from: str | Path | None = None,
    *,
    overwrite: bool = False,
    inputs: Sequence[str | Path] | None = None,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train a model and write its run directory; returns a summary (final losses, samples, ...).

    Data: `data_dir` (made by `decoderlm prepare`); or `inputs`, text files prepared on the fly into
    OUT/data with `tokenizer` ("bpe", the default, "char" or a tokenizer.json) and `vocab_size`
    (default 8192); or neither: the Python standard library, BPE, cached (the main job). The
    model's vocab_size follows the data. Model: `model_config`, or the "llama-tiny" preset; with
    `init_from` (a run directory) its weights are loaded first (fine-tuning). `resume` continues
    OUT's latest checkpoint exactly; the model and data then default to the run's own and
    `train_config` to the saved one (see `decoderlm.training.run.resolve_run`). A new run refuses
    to write over what OUT holds unless `overwrite`.
    """
    run = resolve_run(
        out_dir,
        resume=resume,
        overwrite=overwrite,
        init_from=init_from,
        model=model_config,
        train=train_config,
        data_dir=data_dir,
        inputs=inputs,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        progress=progress,
    )
    return train_run(run, progress=progress)


def train_run(
    run: Run, progress: bool = True, trainer_class: type[Trainer] | None = None
) -> dict[str, Any]:
    """Train the resolved `run` until it stops, with `trainer_class` (a `Trainer`, the default, or
    a subclass training another objective); returns `Trainer.fit`'s summary."""
    trainer = (trainer_class or Trainer)(run, progress=progress)
    try:
        return trainer.fit()
    finally:
        trainer.close()


class Trainer:
    """The state of one training run and the loop over it; `train()` is the usual entry point."""

    def __init__(self, run: Run, progress: bool = True) -> None:
        self.run = run
        self.out = run.out
        self.cfg = cfg = run.train_config
        self.info = run.info
        self.device = self.info.device
        self.is_main = self.info.is_main
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.data_dir = run.data_dir
        self.meta = run.meta
        self.tokenizer = Tokenizer.from_file(self.data_dir / checkpoint.TOKENIZER_FILE)
        self.model_config = run.model_config
        self.micro_batch = _micro_batch(cfg, self.info.world_size)  # sequences per process
        self.seq_len = self.model_config.context_length
        self.base = base_of(run)  # where the starting weights come from (None: random)

        if self.device.type == "cpu":
            torch.set_num_threads(cfg.threads or cpu_threads())
        shards = self.info.world_size if cfg.strategy == "fsdp" else 1
        check_training_memory(self.model_config, self.device, shards)
        seed_everything(cfg.seed)  # identical on every rank: same initial weights
        self.model = self.build_model().to(self.device).train()
        # The CPU paths (embedding gradient, blockwise attention, the heap), before DDP/FSDP wrap.
        SpeedPaths.for_training(cfg.cpu_kernels).apply(self.model)
        self.wrapped = distributed.wrap_model(self.model, cfg.strategy, self.info)
        self.optimizer = make_optimizer(self.wrapped, cfg, self.device)
        # Checkpoints come from self.wrapped (uncompiled): no `_orig_mod.` in any name.
        self.forward = torch.compile(self.wrapped) if cfg.compile else self.wrapped
        self.autocast = torch.autocast(
            self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)
        self.sampler = self.batches("train")
        self.tokens_per_step = self.step_tokens()

        # The counters a checkpoint saves (`decoderlm.training.resume`).
        self.step = 0
        self.tokens_seen = 0
        self.elapsed_before = 0.0  # seconds of training in earlier sessions of this run
        self.best_val_loss: float | None = None
        self.last_checkpoint: Path | None = None
        if run.checkpoint is not None:
            restore_checkpoint(self, run.checkpoint, run.state)
        self.report = Report(
            run,
            resume_step=self.step,
            progress=progress,
            tokens_per_step=self.tokens_per_step,
            flops_per_token=self.model.flops_per_token(self.seq_len),
            peak_flops=cfg.peak_flops or measure_peak_flops(self.device, self.dtype),
        )
        if self.is_main:
            write_run_files(self.out, self.model_config, cfg, self.data_dir)

    # -- the objective (hooks a subclass may override) --

    def build_model(self) -> DecoderLM:
        """The model to train (a `DecoderLM`), with `init_from`'s weights when the run has one,
        and LoRA adapters over them when the config asks (`decoderlm.training.model_init`)."""
        return initial_model(self.run)

    def step_tokens(self) -> int:
        """Tokens an optimizer step trains on (the speed figures count them): batch_size windows."""
        return self.cfg.batch_size * self.seq_len

    def batches(self, split: str) -> data.BatchSampler:
        """The batches of `split` ("train" or "val"): (x, y) windows, y the next tokens of x."""
        tokens = data.load_split(self.data_dir, split)
        if split == "val":
            data.check_context_length(tokens, self.seq_len)
        return data.BatchSampler(
            tokens,
            self.micro_batch,
            self.seq_len,
            seed=self.cfg.seed,
            without_replacement=self.cfg.without_replacement,
            rank=self.info.rank,
            world_size=self.info.world_size,
        )

    def batch_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of a batch: next-token cross-entropy of logits (B, T, V), targets (B, T)."""
        return next_token_loss(outputs, targets)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The validation metrics, "val_loss" among them: the mean loss on eval_iters val batches
        (the same batches every time), its perplexity and bits per byte."""
        self.wrapped.eval()  # the wrapper too: DDP must not prepare a backward pass
        loss = mean_batch_loss(
            self.forward,
            self.batch_loss,
            self.batches("val"),
            self.cfg.eval_iters,
            self.autocast,
            self.device,
        )
        self.wrapped.train()
        return lm_metrics(distributed.all_reduce_mean(loss, self.info), self.meta)

    def sample(self, max_new_tokens: int, n: int = 1) -> list[str]:
        """`n` continuations of sample_prompt (every rank generates: FSDP needs them all)."""
        return sample_texts(self.model, self.tokenizer, self.cfg, max_new_tokens, n)

    # -- the loop --

    def fit(self) -> dict[str, Any]:
        """Train until max_steps/max_time (or Ctrl-C/SIGTERM); evaluate, checkpoint, sample."""
        cfg, report = self.cfg, self.report
        report.say(banner(self.run, self.model.num_params(), self.dtype, self.step))
        self._start = start = time.perf_counter()
        session_step0 = self.step
        val: dict[str, float] = {}
        with StopRequests() as stop_requests, report.session(self.step, self.elapsed_before):
            stopped = self._stop_reason(stop_requests)
            if stopped and self.step > 0:  # nothing left to train: just report where it is
                val = self._validate()
            while not stopped:
                elapsed = self.elapsed()
                lr = learning_rate(cfg, self.step, elapsed)
                loss, grad_norm = self._train_step(lr)
                self.step += 1
                self.tokens_seen += self.tokens_per_step
                stopped = self._stop_reason(stop_requests)
                evaluated = self._after_step(loss, lr, grad_norm, elapsed, stopped)
                val = val if evaluated is None else evaluated
        session = time.perf_counter() - start
        return self._summary(stopped, session, self.step - session_step0, val)

    def _stop_reason(self, requests: StopRequests) -> str | None:
        return stop_reason(self.cfg, self.step, self.elapsed(), requests.requested, self.info)

    def _train_step(self, lr: float) -> tuple[float, torch.Tensor | None]:
        """One optimizer step over grad_accum micro-batches; (global mean loss, grad norm)."""
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum):
            x, y = self.sampler.next_batch()  # (B_micro, T) each
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with distributed.grad_sync(self.wrapped, enabled=micro == cfg.grad_accum - 1):
                with self.autocast:
                    outputs = self.forward(x)  # (B_micro, T, V)
                loss = self.batch_loss(outputs, y) / cfg.grad_accum
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
        loss_value = distributed.all_reduce_mean(loss_sum, self.info)
        if not math.isfinite(loss_value):
            self._stop_on_non_finite(loss_value)
        self.scaler.unscale_(self.optimizer)  # so that clipping sees the true gradient
        grad_norm = clip_and_step(self.optimizer, self.scaler, cfg.grad_clip)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_value, grad_norm

    def _stop_on_non_finite(self, loss: float) -> NoReturn:
        """Raise the error of a non-finite training loss at the next step, naming what is saved."""
        saved = (
            f"the last good checkpoint is {self.last_checkpoint}"
            if self.last_checkpoint
            else "no checkpoint was saved"
        )
        raise NonFiniteLossError(
            f"training loss is {loss} at step {self.step + 1}: stopped; {saved} "
            "(try a lower --lr, more --warmup-steps or --dtype fp32)",
            step=self.step + 1,
            loss=loss,
        )

    def _after_step(
        self,
        loss: float,
        lr: float,
        grad_norm: torch.Tensor | None,
        elapsed: float,
        stopped: str | None,
    ) -> dict[str, float] | None:
        """Report the step just taken; when due (or at a final stop) evaluate and sample, log the
        metrics row and save a checkpoint. Returns the validation metrics, or None if not due."""
        cfg, report = self.cfg, self.report
        final = stopped is not None and stopped != "interrupted"
        row: dict[str, Any] = {"step": self.step, "train_loss": loss}
        evaluate = final or _every(cfg.eval_interval, self.step)
        logged = evaluate or self.step % cfg.log_interval == 0
        if logged:
            row.update(report.speed(self.step, self.tokens_seen, lr, grad_norm, elapsed))
        report.update(row, self.elapsed())
        val = None
        if evaluate:
            val = self._validate()
            row.update(val)
            finite = math.isfinite(val["val_loss"])  # else the next step stops the run
            sample = self.sample(cfg.sample_tokens)[0] if finite else "(no sample: NaN)"
            report.evaluation(row, sample)
        if logged:
            report.metrics.write(row)  # rank 0 only
        scheduled = _every(cfg.checkpoint_interval, self.step)
        if scheduled or stopped:
            self.save(row.get("val_loss"))
        if logged or scheduled:
            report.mark(self.step)  # speed excludes evaluation and saving
        return val

    def _validate(self) -> dict[str, float]:
        """`evaluate`'s metrics, keeping the best finite validation loss so far."""
        val = self.evaluate()
        loss = val["val_loss"]
        if math.isfinite(loss) and (self.best_val_loss is None or loss < self.best_val_loss):
            self.best_val_loss = loss
        return val

    def _summary(
        self, stopped: str | None, session: float, steps: int, val: dict[str, float]
    ) -> dict[str, Any]:
        """What `fit` returns: where the run stopped and why, its speed over this session's
        `steps` in `session` seconds, the last validation metrics and the final samples."""
        cfg = self.cfg
        samples = (
            [] if stopped == "interrupted" else self.sample(2 * cfg.sample_tokens, FINAL_SAMPLES)
        )
        return {
            "run_dir": str(self.out),
            "stopped": stopped,
            "step": self.step,
            "tokens": self.tokens_seen,
            "time": self.elapsed_before + session,
            "tokens_per_s": steps * self.tokens_per_step / max(session, 1e-9),
            "parameters": self.model.num_params(),
            **val,
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "samples": samples,
            "sample_prompt": cfg.sample_prompt,
            "rank": self.info.rank,  # only rank 0 reports (under torchrun)
        }

    def save(self, val_loss: float | None) -> None:
        """Write a checkpoint (rank 0; every rank gathers its shards) and rotate old ones."""
        self.last_checkpoint = save_checkpoint(self, val_loss)

    def close(self) -> None:
        self.report.close()
        distributed.shutdown(self.info)

    def elapsed(self) -> float:
        """Seconds of training in this run: earlier sessions' and this one's (from `fit`'s start)."""
        return self.elapsed_before + time.perf_counter() - self._start


def _micro_batch(cfg: TrainConfig, world: int) -> int:
    """Sequences per micro-step and process: batch_size = grad_accum × world × micro."""
    if cfg.batch_size % (cfg.grad_accum * world):
        raise DecoderLMError(
            f"batch_size={cfg.batch_size} must be divisible by grad_accum × processes = "
            f"{cfg.grad_accum} × {world}"
        )
    return cfg.batch_size // (cfg.grad_accum * world)


def _every(interval: int, step: int) -> bool:
    """Whether `step` is a multiple of `interval` (0 = never)."""
    return interval > 0 and step % interval == 0
