"""The training loop: AdamW steps, evaluation, checkpoints and stopping, with exact resume.

One optimizer step sees `batch_size` sequences: `grad_accum` micro-steps on each of `world_size`
processes, the gradients averaged; clipping, AdamW and the schedule are in `decoderlm.training.optim`.
What the run is (directory, checkpoint, data, configs) is resolved by `decoderlm.training.run`; what
it shows and logs is `decoderlm.training.report`; precision, threads and RNGs are
`decoderlm.training.runtime`.

Exact resume: a checkpoint holds the weights, the optimizer moments, the step, the data sampler's
position, the RNG states, the elapsed time and the CPU thread count, so on the CPU in float32 a run
stopped at step s and resumed computes bit for bit the same losses as one that never stopped.

The loop goes through `decoderlm.training.distributed` (init → wrap → grad_sync → full_state_dicts), which
is a no-op for one process, so the single-process and the torchrun paths are the same code.

What is trained is language modelling: a `DecoderLM`, next-token cross-entropy on windows of the
data's token splits. A subclass trains another objective on the same loop by overriding its hooks,
`build_model`, `batches`, `batch_loss`, `evaluate` and `sample` (the learned verifier of
`decoderlm.training.verifier` does: a scalar head, binary cross-entropy on labelled texts).
"""

from __future__ import annotations

import math
import shutil
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from decoderlm import checkpoint, data
from decoderlm.cpu.paths import SpeedPaths
from decoderlm.errors import DecoderLMError, NonFiniteLossError
from decoderlm.files import atomic_write, write_json
from decoderlm.inference.evaluate import bits_per_byte
from decoderlm.inference.generate import generate
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM, next_token_loss
from decoderlm.tokenizer import Tokenizer
from decoderlm.training import distributed
from decoderlm.training.optim import clip_and_step, learning_rate, make_optimizer
from decoderlm.training.report import Report, banner
from decoderlm.training.run import Run, resolve_run
from decoderlm.training.runtime import (
    check_training_memory,
    cpu_threads,
    measure_peak_flops,
    resolve_dtype,
    rng_state,
    seed_everything,
    set_rng_state,
)
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


def train_run(run: Run, progress: bool = True) -> dict[str, Any]:
    """Train the resolved `run` until it stops; returns `Trainer.fit`'s summary."""
    trainer = Trainer(run, progress=progress)
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

        # Batch geometry: batch_size sequences per step = grad_accum × world_size × micro.
        world = self.info.world_size
        if cfg.batch_size % (cfg.grad_accum * world):
            raise DecoderLMError(
                f"batch_size={cfg.batch_size} must be divisible by grad_accum × processes = "
                f"{cfg.grad_accum} × {world}"
            )
        self.micro_batch = cfg.batch_size // (cfg.grad_accum * world)  # per process
        self.seq_len = self.model_config.context_length
        self.tokens_per_step = cfg.batch_size * self.seq_len

        if self.device.type == "cpu":
            torch.set_num_threads(cfg.threads or cpu_threads())
        shards = world if cfg.strategy == "fsdp" else 1
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

        self.step = 0
        self.tokens_seen = 0
        self.elapsed_before = 0.0  # seconds of training in earlier sessions of this run
        self.best_val_loss: float | None = None
        self.last_checkpoint: Path | None = None
        if run.checkpoint is not None:
            self._restore(run.checkpoint, run.state)
        self.report = Report(
            run,
            resume_step=self.step,
            progress=progress,
            tokens_per_step=self.tokens_per_step,
            flops_per_token=self.model.flops_per_token(self.seq_len),
            peak_flops=cfg.peak_flops or measure_peak_flops(self.device, self.dtype),
        )
        if self.is_main:
            self._write_run_files()

    # -- the objective (hooks a subclass may override) --

    def build_model(self) -> DecoderLM:
        """The model to train (a `DecoderLM`), with `init_from`'s weights when the run has one."""
        model = DecoderLM(self.model_config)
        if self.run.init_from is not None:
            checkpoint.load_weights(model, self.run.init_from / checkpoint.WEIGHTS_FILE)
        return model

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

    # -- setup --

    def _restore(self, ckpt: Path, state: dict[str, Any]) -> None:
        """Continue from `ckpt`: weights, optimizer, counters, data position and RNG states."""
        weights = checkpoint.read_weights(ckpt / checkpoint.WEIGHTS_FILE)
        if self.model_config.tie_embeddings:
            weights["head.weight"] = weights["tok_emb.weight"]
        self._check_optimizer_state(ckpt, state["optimizer"])
        distributed.load_full_state_dicts(
            self.wrapped, self.optimizer, weights, state["optimizer"], self.info
        )
        cfg = self.cfg
        decay, no_decay = self.optimizer.param_groups  # the config, not the file, is the truth
        decay["weight_decay"], no_decay["weight_decay"] = cfg.weight_decay, 0.0
        for group in self.optimizer.param_groups:
            group["betas"], group["eps"] = (cfg.beta1, cfg.beta2), cfg.eps
        if self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        self.sampler.load_state_dict(state["sampler"])
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        self.elapsed_before = state["elapsed"]
        self.best_val_loss = state["best_val_loss"]
        self.last_checkpoint = ckpt
        set_rng_state(state["rng"])
        if self.device.type == "cpu" and not cfg.threads and "threads" in state:
            torch.set_num_threads(state["threads"])  # same summation order as before the stop

    def _check_optimizer_state(self, ckpt: Path, saved: dict[str, Any]) -> None:
        """A one-line error naming the first saved optimizer tensor whose shape is not its
        parameter's (torch would load it and train into NaN)."""
        moments = saved.get("state", {})
        for name, param in self.wrapped.named_parameters():
            for key, value in moments.get(name, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() and value.shape != param.shape:
                    raise DecoderLMError(
                        f"optimizer tensor 'optimizer/state/{name}/{key}' in {ckpt} has shape "
                        f"{tuple(value.shape)}, its parameter {tuple(param.shape)}: the trainer "
                        "state does not fit this model"
                    )

    def _write_run_files(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        config = {"model": self.model_config.to_dict(), "train": self.cfg.to_dict()}
        write_json(self.out / checkpoint.CONFIG_FILE, config)
        tokenizer_file = self.data_dir / checkpoint.TOKENIZER_FILE
        atomic_write(
            self.out / checkpoint.TOKENIZER_FILE, lambda tmp: shutil.copyfile(tokenizer_file, tmp)
        )

    # -- the loop --

    def fit(self) -> dict[str, Any]:
        """Train until max_steps/max_time (or Ctrl-C/SIGTERM); evaluate, checkpoint, sample."""
        cfg, report = self.cfg, self.report
        report.say(banner(self.run, self.model.num_params(), self.dtype, self.step))
        self._start = start = time.perf_counter()
        session_step0 = self.step
        val: dict[str, float] = {}
        with _StopRequests() as stop_requests, report.session(self.step, self.elapsed_before):
            stopped = self._should_stop(self._elapsed_now(), stop_requests.requested)
            if stopped and self.step > 0:  # nothing left to train: just report where it is
                val = self.evaluate()
            while not stopped:
                elapsed = self._elapsed_now()
                lr = learning_rate(cfg, self.step, elapsed)
                loss, grad_norm = self._train_step(lr)
                self.step += 1
                self.tokens_seen += self.tokens_per_step
                stopped = self._should_stop(self._elapsed_now(), stop_requests.requested)
                final = stopped is not None and stopped != "interrupted"
                row: dict[str, Any] = {"step": self.step, "train_loss": loss}
                evaluate = final or _every(cfg.eval_interval, self.step)
                logged = evaluate or self.step % cfg.log_interval == 0
                if logged:
                    row.update(report.speed(self.step, self.tokens_seen, lr, grad_norm, elapsed))
                report.update(row, self._elapsed_now())
                if evaluate:
                    val = self.evaluate()
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
        interrupted = stopped == "interrupted"
        session = time.perf_counter() - start
        samples = [] if interrupted else self.sample(2 * cfg.sample_tokens, FINAL_SAMPLES)
        return {
            "run_dir": str(self.out),
            "stopped": stopped,
            "step": self.step,
            "tokens": self.tokens_seen,
            "time": self.elapsed_before + session,
            "tokens_per_s": (self.step - session_step0) * self.tokens_per_step / max(session, 1e-9),
            "parameters": self.model.num_params(),
            **val,
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "samples": samples,
            "sample_prompt": cfg.sample_prompt,
            "rank": self.info.rank,  # only rank 0 reports (under torchrun)
        }

    def _should_stop(self, elapsed: float, interrupted: bool) -> str | None:
        """Why to stop before the next step, or None; every rank reaches the same answer."""
        cfg = self.cfg
        if distributed.all_reduce_mean(float(interrupted), self.info) > 0:
            return "interrupted"
        if cfg.max_steps and self.step >= cfg.max_steps:
            return "max_steps"
        if cfg.time_limit and distributed.all_reduce_mean(elapsed, self.info) >= cfg.time_limit:
            return "max_time"
        return None

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
            saved = (
                f"the last good checkpoint is {self.last_checkpoint}"
                if self.last_checkpoint
                else "no checkpoint was saved"
            )
            raise NonFiniteLossError(
                f"training loss is {loss_value} at step {self.step + 1}: stopped; {saved} "
                "(try a lower --lr, more --warmup-steps or --dtype fp32)",
                step=self.step + 1,
                loss=loss_value,
            )
        self.scaler.unscale_(self.optimizer)  # so that clipping sees the true gradient
        grad_norm = clip_and_step(self.optimizer, self.scaler, cfg.grad_clip)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_value, grad_norm

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss on eval_iters val batches (the same batches every time), its perplexity and
        bits per byte."""
        self.wrapped.eval()  # the wrapper too: DDP must not prepare a backward pass
        sampler = self.batches("val")
        total = torch.zeros((), device=self.device)
        for _ in range(self.cfg.eval_iters):
            x, y = sampler.next_batch()
            with self.autocast:
                outputs = self.forward(x.to(self.device))
            total += self.batch_loss(outputs, y.to(self.device))
        self.wrapped.train()
        loss = distributed.all_reduce_mean(total / self.cfg.eval_iters, self.info)
        if math.isfinite(loss) and (self.best_val_loss is None or loss < self.best_val_loss):
            self.best_val_loss = loss
        bpb = bits_per_byte(loss, self.meta["val_tokens"], self.meta["val_bytes"])
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_bpb": bpb}

    def sample(self, max_new_tokens: int, n: int = 1) -> list[str]:
        """`n` continuations of sample_prompt (every rank generates: FSDP needs them all)."""
        cfg = self.cfg
        eot = self.tokenizer.eot_id
        prompt = self.tokenizer.encode(cfg.sample_prompt) if cfg.sample_prompt else []
        if not prompt:
            prompt = [eot] if eot is not None else self.tokenizer.encode("\n")
        rows = generate(  # in the weights' float32: the KV cache takes the model's dtype
            self.model,
            [prompt],
            max_new_tokens,
            temperature=cfg.temperature,
            top_k=cfg.top_k or None,
            seed=cfg.seed,
            eos_id=eot,
            num_samples=n,
            refill_past_context=True,
        )
        start = 1 if prompt == [eot] else 0
        return [self.tokenizer.decode(_strip(row[start:], eot)) for row in rows]

    def save(self, val_loss: float | None) -> None:
        """Write a checkpoint (rank 0; every rank gathers its shards) and rotate old ones."""
        model_sd, optim_sd = distributed.full_state_dicts(self.wrapped, self.optimizer)

        def write() -> Path:
            state = {
                "step": self.step,
                "val_loss": val_loss,
                "best_val_loss": self.best_val_loss,
                "tokens_seen": self.tokens_seen,
                "elapsed": self._elapsed_now(),
                "data_dir": str(self.data_dir.resolve()),
                "optimizer": optim_sd,
                "scaler": self.scaler.state_dict(),
                "sampler": self.sampler.state_dict(),
                "rng": rng_state(),
                "threads": torch.get_num_threads(),  # reductions' order, for exact resume
            }
            try:
                return checkpoint.save_checkpoint(
                    self.out,
                    self.step,
                    self.model_config,
                    model_sd,
                    state,
                    train_config=self.cfg.to_dict(),
                    tokenizer_file=self.out / checkpoint.TOKENIZER_FILE,
                    keep_last=self.cfg.keep_last,
                )
            except OSError as exc:  # e.g. a read-only or full disk
                kept = self.last_checkpoint or "there is none"
                raise DecoderLMError(
                    f"cannot save the checkpoint of step {self.step} in {self.out}: "
                    f"{exc.strerror or exc}; the previous checkpoint is intact ({kept})"
                ) from None

        # Rank 0 writes while the others wait; a failed write stops every rank with its error.
        self.last_checkpoint = distributed.run_on_main(write, self.info)

    def close(self) -> None:
        self.report.close()
        distributed.shutdown(self.info)

    def _elapsed_now(self) -> float:
        return self.elapsed_before + time.perf_counter() - self._start


def _every(interval: int, step: int) -> bool:
    """Whether `step` is a multiple of `interval` (0 = never)."""
    return interval > 0 and step % interval == 0


def _strip(ids: list[int], eot: int | None) -> list[int]:
    """ids without a final end-of-text token (where a sample stopped)."""
    return ids[:-1] if ids and ids[-1] == eot else ids


class _StopRequests:
    """While active, Ctrl-C and SIGTERM ask the loop to stop after the current step (and save);
    a second Ctrl-C interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopRequests:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
