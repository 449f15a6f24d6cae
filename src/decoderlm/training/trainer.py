"""Training a DecoderLM: AdamW, warmup + cosine schedule, mixed precision, evaluation, exact resume.

One optimizer step sees `batch_size` sequences: `grad_accum` micro-steps on each of `world_size`
processes, the gradients averaged; clipping, AdamW and the schedule are in `decoderlm.training.optim`.

Mixed precision: parameters and optimizer state stay float32; the forward pass runs under bf16
autocast on CPUs with native bf16 (avx512_bf16/AMX) and on CUDA; fp16 only on CUDA, with a
GradScaler; never fp16 on the CPU (no fast kernels: ~700× slower than bf16 here).

Exact resume: a checkpoint holds the weights, the optimizer moments, the step, the data sampler's
position, the RNG states, the elapsed time and the CPU thread count, so on the CPU in float32 a run
stopped at step s and resumed computes bit for bit the same losses as one that never stopped.

The loop goes through `decoderlm.training.distributed` (init → wrap → grad_sync → full_state_dicts), which
is a no-op for one process, so the single-process and the torchrun paths are the same code.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import signal
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from decoderlm import checkpoint, data
from decoderlm.cpu import heap
from decoderlm.errors import DecoderLMError
from decoderlm.inference.evaluate import bits_per_byte
from decoderlm.inference.generate import generate
from decoderlm.model.config import ModelConfig
from decoderlm.model.lm import DecoderLM, next_token_loss
from decoderlm.tokenizer import Tokenizer
from decoderlm.training import distributed
from decoderlm.training.optim import clip_and_step, learning_rate, make_optimizer
from decoderlm.training.train_config import DEFAULT_PRESET, TrainConfig

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# What the main job's samples continue (its corpus is Python source). No trailing space: byte-level
# BPE joins a space to the word after it (" foo"), so "def " would make the model start a new word.
MAIN_JOB_PROMPT = "def"
RUNS_DIR = Path("runs")  # where runs go without --out: runs/<date-time>
FINAL_SAMPLES = 3
TORCH_DEFAULT_THREADS = torch.get_num_threads()  # one per core this process may use (at import)


# ---- precision, threads, RNG ------------------------------------------------------------------


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions (AVX512-BF16 or AMX), used by oneDNN."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe is not None and probe())


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype for `name` on `device` ("auto": bf16 where it is fast, else fp32); fp16
    only on CUDA and bf16 on a CPU only where native, the others having no fast kernels."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "cpu" and cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if name == "fp16" and device.type != "cuda":
        raise DecoderLMError(
            f"dtype='fp16' needs a CUDA device (this run is on {device.type}, where fp16 has no "
            "fast kernels): use bf16 or fp32"
        )
    if name == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
        raise DecoderLMError(  # oneDNN's fallback: 0.3 against 183 GFLOP/s fp32 on 2 AVX2 cores
            "dtype='bf16' needs a CPU with native bf16 (AVX512-BF16 or AMX); on this one a bf16 "
            "matmul is hundreds of times slower than fp32: use fp32 or auto"
        )
    return TORCH_DTYPES[name]


def measure_peak_flops(
    device: torch.device, dtype: torch.dtype, size: int = 0, repeats: int = 4
) -> float:
    """Achievable dense matmul FLOP/s on `device` in `dtype`: the best of `repeats` n×n products."""
    n = size or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best  # an n×n×n matmul is n³ multiply-adds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from (dropout: torch; user code: numpy, random)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def cpu_threads() -> int:
    """Threads for torch's CPU kernels: one per core that other processes are not using right now.

    torch's OpenMP threads spin-wait for each other at every parallel region; on an oversubscribed
    CPU a thread is often descheduled while its partner spins, and 2 threads on 2 busy cores ran
    ~5× slower than 1 here. So: cores minus the cores busy now, at least 1.
    """
    cores = TORCH_DEFAULT_THREADS
    return max(1, min(cores, round(cores - busy_cores())))


def busy_cores(window_s: float = 0.25) -> float:
    """Cores busy over the next `window_s` seconds (Linux /proc/stat), else the 1-minute load average.

    The load average lags by minutes: right after a heavy job (say a `pip install`) it would take
    cores from a run that has the machine to itself.
    """
    try:
        before = _cpu_jiffies()
        time.sleep(window_s)
        after = _cpu_jiffies()
    except (OSError, ValueError):
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    busy, total = after[0] - before[0], after[1] - before[1]
    return (os.cpu_count() or 1) * busy / total if total > 0 else 0.0


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine from the first line of /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


# ---- the run ----------------------------------------------------------------------------------


def default_run_dir() -> Path:
    return RUNS_DIR / datetime.now().strftime("%Y%m%d-%H%M%S")


def latest_run(runs_dir: str | Path = RUNS_DIR) -> Path:
    """The most recently checkpointed run under `runs_dir` (for `--resume` without `--out`)."""
    runs = [p for p in Path(runs_dir).glob("*") if checkpoint.latest_checkpoint(p) is not None]
    if not runs:
        raise DecoderLMError(f"no run with a checkpoint in {runs_dir}/: give --out RUN to resume")
    return max(runs, key=lambda p: checkpoint.latest_checkpoint(p).stat().st_mtime)


def train(
    model_config: ModelConfig | None = None,
    train_config: TrainConfig | None = None,
    data_dir: str | Path | None = None,
    out_dir: str | Path | None = None,
    resume: bool = False,
    init_from: str | Path | None = None,
    *,
    inputs: list[str | Path] | None = None,
    tokenizer: str = "bpe",
    vocab_size: int = 8192,
    progress: bool = True,
) -> dict[str, Any]:
    """Train a model and write its run directory; returns a summary (final losses, samples, ...).

    Data: `data_dir` (made by `decoderlm prepare`); or `inputs`, text files prepared on the fly into
    OUT/data with `tokenizer` ("bpe", "char" or a tokenizer.json) and `vocab_size`; or neither: the
    Python standard library, BPE, cached (the main job). The model's vocab_size follows the data.
    Model: `model_config`, or the "llama-tiny" preset; with `init_from` (a run directory) its
    weights are loaded first (fine-tuning). `resume` continues OUT's latest checkpoint exactly; the
    model and data then default to the run's own and `train_config` to the saved one.
    """
    if out_dir is None:
        out_dir = latest_run() if resume else default_run_dir()
    trainer = Trainer(
        model_config,
        train_config,
        Path(out_dir),
        resume=resume,
        init_from=init_from,
        data_dir=data_dir,
        inputs=inputs,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        progress=progress,
    )
    try:
        return trainer.fit()
    finally:
        trainer.close()


class Trainer:
    """The state of one training run and the loop over it; `train()` is the usual entry point."""

    def __init__(
        self,
        model_config: ModelConfig | None,
        train_config: TrainConfig | None,
        out_dir: Path,
        *,
        resume: bool = False,
        init_from: str | Path | None = None,
        data_dir: str | Path | None = None,
        inputs: list[str | Path] | None = None,
        tokenizer: str = "bpe",
        vocab_size: int = 8192,
        progress: bool = True,
    ) -> None:
        self.out = out_dir
        resume_ckpt = self._find_resume_checkpoint(resume)
        saved: dict[str, Any] = {}
        if resume_ckpt is not None:
            saved = checkpoint.load_trainer_state(resume_ckpt)
            if train_config is None:
                train_config = TrainConfig.from_dict(
                    checkpoint.read_run_config(resume_ckpt).get("train", {})
                )
            data_dir = data_dir or saved["data_dir"]
        self.cfg = cfg = train_config or TrainConfig()
        self.info = distributed.init_distributed(cfg.device)
        self.device = self.info.device
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.threads or cpu_threads())
            heap.keep_freed_memory()  # each step's activations reuse the last step's pages
        self.is_main = self.info.is_main
        self.progress = progress and self.is_main
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.data_dir = self._prepare_data(data_dir, inputs, tokenizer, vocab_size)
        self.meta = data.read_meta(self.data_dir)
        self.tokenizer = Tokenizer.from_file(self.data_dir / checkpoint.TOKENIZER_FILE)
        if cfg.sample_prompt == "" and data_dir is None and inputs is None:
            self.cfg = cfg = dataclasses.replace(cfg, sample_prompt=MAIN_JOB_PROMPT)
        self.model_config = self._model_config(model_config, resume_ckpt, init_from)

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

        seed_everything(cfg.seed)  # identical on every rank: same initial weights
        model = DecoderLM(self.model_config)
        if init_from is not None:
            checkpoint.load_weights(model, Path(init_from) / checkpoint.WEIGHTS_FILE)
        self.model = model.to(self.device).train()
        self.wrapped = distributed.wrap_model(self.model, cfg.strategy, self.info)
        self.optimizer = make_optimizer(self.wrapped, cfg, self.device)
        # Checkpoints come from self.wrapped (uncompiled): no `_orig_mod.` in any name.
        self.forward = torch.compile(self.wrapped) if cfg.compile else self.wrapped
        self.autocast = torch.autocast(
            self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)
        self.train_tokens = data.load_split(self.data_dir, "train")
        self.val_tokens = data.load_split(self.data_dir, "val")
        data.check_context_length(self.val_tokens, self.seq_len)
        self.sampler = self._sampler(self.train_tokens)

        self.step = 0
        self.tokens_seen = 0
        self.elapsed_before = 0.0  # seconds of training in earlier sessions of this run
        self.best_val_loss: float | None = None
        self.last_checkpoint: Path | None = None
        if resume_ckpt is not None:
            self._restore(resume_ckpt, saved)
        self.flops_per_token = self.model.flops_per_token(self.seq_len)
        self.peak_flops = cfg.peak_flops or measure_peak_flops(self.device, self.dtype)
        self.metrics = MetricsLog(self.out, self.step, enabled=self.is_main)
        if self.is_main:
            self._write_run_files()

    # -- setup --

    def _find_resume_checkpoint(self, resume: bool) -> Path | None:
        latest = checkpoint.latest_checkpoint(self.out)
        if resume and latest is None:
            raise DecoderLMError(
                f"cannot resume: {self.out} has no checkpoint (start without --resume)"
            )
        if not resume and latest is not None:
            raise DecoderLMError(
                f"{self.out} already holds a run (checkpoint {latest.name}): pass --resume to "
                "continue it, or choose another --out"
            )
        return latest

    def _prepare_data(
        self,
        data_dir: str | Path | None,
        inputs: list[str | Path] | None,
        tokenizer: str,
        vocab_size: int,
    ) -> Path:
        """The prepared data directory; rank 0 prepares (or finds it cached) before the others."""
        if data_dir is not None:
            if inputs is not None:
                raise DecoderLMError("give either a data directory or inputs to prepare, not both")
            return Path(data_dir)
        # Rank 0 prepares; if that fails, every rank stops with its error (no rank left waiting).
        prepared = distributed.run_on_main(
            lambda: self._prepare(inputs, tokenizer, vocab_size), self.info
        )
        if not self.is_main:  # rank 0 has prepared it: this only finds it
            prepared = self._prepare(inputs, tokenizer, vocab_size)
        return prepared

    def _prepare(self, inputs: list[str | Path] | None, tokenizer: str, vocab_size: int) -> Path:
        if inputs is None:
            return data.prepare_default_corpus(tokenizer, vocab_size, progress=self.progress)
        out = self.out / "data"
        if not (out / data.META_FILE).is_file():  # meta.json is written last
            data.prepare(inputs, out, tokenizer, vocab_size, progress=self.progress)
        return out

    def _model_config(
        self,
        requested: ModelConfig | None,
        resume_ckpt: Path | None,
        init_from: str | Path | None,
    ) -> ModelConfig:
        """The model to train: the checkpoint's when resuming or initialising from a run (a given
        config must then agree), else the requested one or the default preset, with the data's
        vocabulary size."""
        vocab = self.meta["vocab_size"]
        if requested is not None:
            requested = dataclasses.replace(requested, vocab_size=vocab)
        source = resume_ckpt if resume_ckpt is not None else init_from
        if source is None:
            config = requested or ModelConfig.from_preset(DEFAULT_PRESET)
            return dataclasses.replace(config, vocab_size=vocab)
        saved = ModelConfig.from_dict(checkpoint.read_run_config(source)["model"])
        if saved.vocab_size != vocab:
            raise DecoderLMError(
                f"the model in {source} has vocab_size={saved.vocab_size}, the data in "
                f"{self.data_dir} has {vocab}: use data made with the run's tokenizer.json"
            )
        if requested is not None:
            mine, theirs = requested.to_dict(), saved.to_dict()
            for name in mine:
                if name != "extra" and mine[name] != theirs[name]:
                    raise DecoderLMError(
                        f"model field {name}={mine[name]!r} differs from {source}'s "
                        f"{name}={theirs[name]!r}; the model of a resumed/initialised run is fixed"
                    )
        return saved

    def _sampler(self, tokens: np.ndarray) -> data.BatchSampler:
        return data.BatchSampler(
            tokens,
            self.micro_batch,
            self.seq_len,
            seed=self.cfg.seed,
            without_replacement=self.cfg.without_replacement,
            rank=self.info.rank,
            world_size=self.info.world_size,
        )

    def _restore(self, ckpt: Path, state: dict[str, Any]) -> None:
        """Continue from `ckpt`: weights, optimizer, counters, data position and RNG states."""
        weights = checkpoint.load_file(str(ckpt / checkpoint.WEIGHTS_FILE))
        if self.model_config.tie_embeddings:
            weights["head.weight"] = weights["tok_emb.weight"]
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

    def _write_run_files(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        config = {"model": self.model_config.to_dict(), "train": self.cfg.to_dict()}
        checkpoint.write_json(self.out / checkpoint.CONFIG_FILE, config)
        tokenizer_file = self.data_dir / checkpoint.TOKENIZER_FILE
        checkpoint.atomic_write(
            self.out / checkpoint.TOKENIZER_FILE, lambda tmp: shutil.copyfile(tokenizer_file, tmp)
        )

    # -- the loop --

    def fit(self) -> dict[str, Any]:
        """Train until max_steps/max_time (or Ctrl-C/SIGTERM); evaluate, checkpoint, sample."""
        cfg = self.cfg
        self._say(self._banner())
        self._start = start = time.perf_counter()
        session_step0 = self.step
        self._done0 = self._progress(self.elapsed_before)
        last_log = (start, self.step)
        val: dict[str, float] = {}
        with _StopRequests() as stop_requests, self._bar() as bar:
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
                if evaluate or self.step % cfg.log_interval == 0:
                    now = time.perf_counter()
                    steps = self.step - last_log[1]
                    tokens_per_s = steps * self.tokens_per_step / (now - last_log[0])
                    row.update(self._speed(lr, grad_norm, tokens_per_s, elapsed))
                    bar.set_postfix_str(self._postfix(row, elapsed))
                bar.update(self._progress(self._elapsed_now()) - bar.n)
                if evaluate:
                    val = self.evaluate()
                    row.update(val)
                    sample = self.sample(cfg.sample_tokens)[0].split("\n")
                    self._say(self._eval_line(row), *(f"  │ {line}" for line in sample))
                if evaluate or self.step % cfg.log_interval == 0:
                    self.metrics.write(row)  # rank 0 only
                scheduled = _every(cfg.checkpoint_interval, self.step)
                if scheduled or stopped:
                    self.save(row.get("val_loss"))
                if evaluate or scheduled or self.step % cfg.log_interval == 0:
                    last_log = (time.perf_counter(), self.step)  # speed excludes eval and saving
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
        if cfg.max_time and distributed.all_reduce_mean(elapsed, self.info) >= cfg.max_time:
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
                    logits = self.forward(x)  # (B_micro, T, V)
                loss = next_token_loss(logits, y) / cfg.grad_accum
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
        loss_value = distributed.all_reduce_mean(loss_sum, self.info)
        if not math.isfinite(loss_value):
            saved = (
                f"the last good checkpoint is {self.last_checkpoint}"
                if self.last_checkpoint
                else "no checkpoint was saved"
            )
            raise DecoderLMError(
                f"training loss is {loss_value} at step {self.step + 1}: stopped; {saved} "
                "(try a lower --lr, more --warmup-steps or --dtype fp32)"
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
        sampler = self._sampler(self.val_tokens)
        total = torch.zeros((), device=self.device)
        for _ in range(self.cfg.eval_iters):
            x, y = sampler.next_batch()
            with self.autocast:
                logits = self.forward(x.to(self.device))
            total += next_token_loss(logits, y.to(self.device))
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
            sliding_window=True,
        )
        start = 1 if prompt == [eot] else 0
        return [self.tokenizer.decode(_strip(row[start:], eot)) for row in rows]

    def save(self, val_loss: float | None) -> None:
        """Write a checkpoint (rank 0; every rank gathers its shards) and rotate old ones."""
        model_sd, optim_sd = distributed.full_state_dicts(self.wrapped, self.optimizer, self.info)

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

        # Rank 0 writes while the others wait; a failed write stops every rank with its error.
        self.last_checkpoint = distributed.run_on_main(write, self.info)

    def close(self) -> None:
        self.metrics.close()
        distributed.shutdown(self.info)

    # -- reporting --

    def _elapsed_now(self) -> float:
        return self.elapsed_before + time.perf_counter() - self._start

    def _speed(
        self, lr: float, grad_norm: torch.Tensor | None, tokens_per_s: float, elapsed: float
    ) -> dict[str, Any]:
        # MFU = achieved FLOP/s / peak: 6N(+attention) FLOPs per token (`flops_per_token`).
        mfu = self.flops_per_token * tokens_per_s / (self.peak_flops * self.info.world_size)
        speed = {"lr": lr, "tokens_per_s": tokens_per_s, "mfu": mfu, "time": elapsed}
        speed["tokens"] = self.tokens_seen
        if grad_norm is not None:
            speed["grad_norm"] = float(grad_norm)
        return speed

    def _progress(self, elapsed: float) -> float:
        """Percent of the run done: by steps or by time, whichever ends it first."""
        done = 0.0
        if self.cfg.max_steps:
            done = self.step / self.cfg.max_steps
        if self.cfg.max_time:
            done = max(done, elapsed / self.cfg.max_time)
        return 100 * min(done, 1.0)

    def _postfix(self, row: dict[str, Any], elapsed: float) -> str:
        done = self._progress(elapsed)
        session = time.perf_counter() - self._start  # ETA at this session's rate so far
        eta = session * (100 - done) / max(done - self._done0, 1e-9)
        return (
            f"step {row['step']} | loss {row['train_loss']:.4f} | lr {row['lr']:.2e} | "
            f"{row['tokens_per_s']:,.0f} tok/s | MFU {100 * row['mfu']:.1f}% | "
            f"ETA {_duration(eta)}"
        )

    def _bar(self) -> tqdm:
        return tqdm(
            total=100.0,
            initial=0.0,
            disable=not (self.progress and sys.stderr.isatty()),  # no \r-spam in log files
            bar_format="{l_bar}{bar}| {elapsed} {postfix}",
            desc="train",
            dynamic_ncols=True,
            file=sys.stderr,
        )

    def _banner(self) -> str:
        cfg, mc = self.cfg, self.model_config
        limits = [f"{cfg.max_steps} steps"] if cfg.max_steps else []
        limits += [_duration(cfg.max_time)] if cfg.max_time else []
        where = f"{str(self.dtype).removeprefix('torch.')} on {self.device}"
        if self.device.type == "cpu":
            n = torch.get_num_threads()
            where += f" ({n} thread{'s' if n > 1 else ''})"
        return (
            f"run {self.out} | model {self.model.num_params() / 1e6:.2f}M params "
            f"(d_model {mc.d_model}, {mc.n_layers} layers, {mc.n_heads}/{mc.n_kv_heads} heads, "
            f"vocab {mc.vocab_size}, context {mc.context_length}) | data {self.data_dir} "
            f"({self.meta['train_tokens']:,} train tokens) | {cfg.batch_size}×{self.seq_len} "
            f"tokens/step | {where}{' (compiled)' if cfg.compile else ''} | "
            f"until {' or '.join(limits)}"
            + (f" | resumed at step {self.step}" if self.step else "")
        )

    @staticmethod
    def _eval_line(row: dict[str, Any]) -> str:
        return (
            f"step {row['step']}: val loss {row['val_loss']:.4f} | ppl {row['val_ppl']:.2f} | "
            f"{row['val_bpb']:.3f} bits/byte | train loss {row['train_loss']:.4f} | "
            f"{row['tokens_per_s']:,.0f} tok/s | MFU {100 * row['mfu']:.1f}% | "
            f"{_duration(row['time'])}"
        )

    def _say(self, *lines: str) -> None:
        if self.is_main and self.progress:
            for line in lines:
                tqdm.write(line, file=sys.stderr)


def _every(interval: int, step: int) -> bool:
    """Whether `step` is a multiple of `interval` (0 = never)."""
    return interval > 0 and step % interval == 0


def _strip(ids: list[int], eot: int | None) -> list[int]:
    """ids without a final end-of-text token (where a sample stopped)."""
    return ids[:-1] if ids and ids[-1] == eot else ids


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class MetricsLog:
    """metrics.jsonl (one JSON object per line: step, train_loss, ...; val_* at evaluations) and,
    if `tensorboard` is installed, TensorBoard event files in RUN/tensorboard."""

    def __init__(self, run_dir: Path, resume_step: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self.file = None
        self.writer = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / checkpoint.METRICS_FILE
        # Lines past the checkpoint we resume from were written by a run that died: drop them.
        kept = []
        if resume_step and path.is_file():
            kept = [
                line for line in path.read_text().splitlines() if _line_step(line) <= resume_step
            ]
        checkpoint.atomic_write(
            path, lambda tmp: tmp.write_text("".join(f"{line}\n" for line in kept))
        )
        self.file = open(path, "a")  # noqa: SIM115  (kept open for the run, closed in close())
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # optional: `pip install tensorboard`
            return
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1)

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in row.items():
                if key != "step":
                    self.writer.add_scalar(key, value, row["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()


def _line_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # a torn last line: drop it


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
