"""What a training run shows and records: the banner, the progress bar, a line per evaluation, and
metrics.jsonl (plus TensorBoard), with the speed figures tokens/s and MFU.

MFU, model FLOPs utilisation (Chowdhery et al., 2022): the FLOP/s the model's matmuls achieve over
the devices' peak, flops_per_token (6N + attention, `DecoderLM.flops_per_token`) × tokens/s / peak.
Only rank 0 shows or writes anything.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from decoderlm import checkpoint
from decoderlm.files import atomic_write
from decoderlm.training.run import Run


class Report:
    """The run's presentation: what the loop hands it is shown (rank 0, `progress`) and logged."""

    def __init__(
        self,
        run: Run,
        *,
        resume_step: int,
        progress: bool,
        tokens_per_step: int,
        flops_per_token: float,
        peak_flops: float,
    ) -> None:
        self.cfg = run.train_config
        self.show = progress and run.info.is_main
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops * run.info.world_size  # of all the devices together
        self.metrics = MetricsLog(run.out, resume_step, enabled=run.info.is_main)
        self._bar: tqdm | None = None
        self._start = time.perf_counter()  # of this session
        self._done0 = 0.0  # percent of the run done when this session started
        self._mark = (self._start, resume_step)  # (time, step) the speed is measured from

    def say(self, *lines: str) -> None:
        """Lines above the progress bar."""
        if self.show:
            for line in lines:
                tqdm.write(line, file=sys.stderr)

    @contextlib.contextmanager
    def session(self, step: int, elapsed: float) -> Iterator[None]:
        """The progress bar of this session, which starts at `step` after `elapsed` seconds."""
        self._start = time.perf_counter()
        self._done0 = self._progress(step, elapsed)
        self._mark = (self._start, step)
        with tqdm(
            total=100.0,
            initial=0.0,
            disable=not (self.show and sys.stderr.isatty()),  # no \r-spam in log files
            bar_format="{l_bar}{bar}| {elapsed} {postfix}",
            desc="train",
            dynamic_ncols=True,
            file=sys.stderr,
        ) as self._bar:
            yield
        self._bar = None

    def speed(
        self, step: int, tokens: int, lr: float, grad_norm: torch.Tensor | None, elapsed: float
    ) -> dict[str, Any]:
        """The row's speed figures, over the steps since the last `mark`."""
        now, since = time.perf_counter(), self._mark
        tokens_per_s = (step - since[1]) * self.tokens_per_step / (now - since[0])
        mfu = self.flops_per_token * tokens_per_s / self.peak_flops
        speed = {"lr": lr, "tokens_per_s": tokens_per_s, "mfu": mfu, "time": elapsed}
        speed["tokens"] = tokens
        if grad_norm is not None:
            speed["grad_norm"] = float(grad_norm)
        return speed

    def mark(self, step: int) -> None:
        """Measure the speed from here (so that it leaves out evaluating and saving)."""
        self._mark = (time.perf_counter(), step)

    def update(self, row: dict[str, Any], elapsed: float) -> None:
        """Move the progress bar to the row's step; show its figures if it has speed figures."""
        done = self._progress(row["step"], elapsed)
        if "tokens_per_s" in row:
            session = time.perf_counter() - self._start  # ETA at this session's rate so far
            eta = session * (100 - done) / max(done - self._done0, 1e-9)
            self._bar.set_postfix_str(
                f"step {row['step']} | loss {row['train_loss']:.4f} | lr {row['lr']:.2e} | "
                f"{row['tokens_per_s']:,.0f} tok/s | MFU {100 * row['mfu']:.1f}% | "
                f"ETA {duration(eta)}"
            )
        self._bar.update(done - self._bar.n)

    def evaluation(self, row: dict[str, Any], sample: str) -> None:
        """The evaluation line of the row, then the sample, indented."""
        figures = [f"val loss {row['val_loss']:.4f}"]  # then those the objective measures
        figures += [f"ppl {row['val_ppl']:.2f}"] if "val_ppl" in row else []
        figures += [f"{row['val_bpb']:.3f} bits/byte"] if "val_bpb" in row else []
        figures += [f"val accuracy {row['val_accuracy']:.1%}"] if "val_accuracy" in row else []
        self.say(
            f"step {row['step']}: {' | '.join(figures)} | train loss {row['train_loss']:.4f} | "
            f"{row['tokens_per_s']:,.0f} tok/s | MFU {100 * row['mfu']:.1f}% | "
            f"{duration(row['time'])}",
            *(f"  │ {line}" for line in sample.split("\n")),
        )

    def close(self) -> None:
        self.metrics.close()

    def _progress(self, step: int, elapsed: float) -> float:
        """Percent of the run done: by steps or by time, whichever ends it first."""
        done = 0.0
        if self.cfg.max_steps:
            done = step / self.cfg.max_steps
        if self.cfg.time_limit:
            done = max(done, elapsed / self.cfg.time_limit)
        return 100 * min(done, 1.0)


def banner(run: Run, parameters: int, dtype: torch.dtype, step: int) -> str:
    """One line: the run, its model, data, batch, precision and device, limits and start step."""
    cfg, mc, device = run.train_config, run.model_config, run.info.device
    limits = [f"{cfg.max_steps} steps"] if cfg.max_steps else []
    limits += [duration(cfg.time_limit)] if cfg.time_limit else []
    where = f"{str(dtype).removeprefix('torch.')} on {device}"
    if device.type == "cpu":
        n = torch.get_num_threads()
        where += f" ({n} thread{'s' if n > 1 else ''})"
    return (
        f"run {run.out} | model {parameters / 1e6:.2f}M params "
        f"(d_model {mc.d_model}, {mc.n_layers} layers, {mc.n_heads}/{mc.n_kv_heads} heads, "
        f"vocab {mc.vocab_size}, context {mc.context_length}) | data {run.data_dir} "
        f"({run.meta['train_tokens']:,} train tokens) | {cfg.batch_size}×{mc.context_length} "
        f"tokens/step | {where}{' (compiled)' if cfg.compile else ''} | "
        f"until {' or '.join(limits)}" + (f" | resumed at step {step}" if step else "")
    )


def duration(seconds: float) -> str:
    """h:mm:ss."""
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
        atomic_write(path, lambda tmp: tmp.write_text("".join(f"{line}\n" for line in kept)))
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
