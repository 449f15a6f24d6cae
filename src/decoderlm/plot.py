"""Loss curves of training runs: metrics.jsonl → a PNG (matplotlib, no display needed).

Training loss per logged step as a thin line, validation loss at each evaluation as points joined
by a line; several runs share the axes, one colour each, so recipes can be compared.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from decoderlm.checkpoint import METRICS_FILE
from decoderlm.errors import DecoderLMError

PLOT_FILE = "loss.png"


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of RUN/metrics.jsonl (a torn last line, from a killed run, is skipped)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise DecoderLMError(f"{run_dir} has no {METRICS_FILE}: is it a training run directory?")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    if not rows:
        raise DecoderLMError(f"{path} is empty: the run has not logged a step yet")
    return rows


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Draw train/val loss against step for each run; write `out` (default RUN/loss.png)."""
    if not run_dirs:
        raise DecoderLMError("give at least one run directory to plot")
    out = Path(out) if out is not None else Path(run_dirs[0]) / PLOT_FILE
    fig = Figure(figsize=(8, 5), layout="constrained")  # Agg canvas: works without a display
    ax = fig.add_subplot()
    for i, run_dir in enumerate(run_dirs):
        rows = read_metrics(run_dir)
        color = f"C{i}"
        name = Path(run_dir).name
        train = [(r["step"], r["train_loss"]) for r in rows if "train_loss" in r]
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if train:
            ax.plot(*zip(*train, strict=True), color=color, alpha=0.45, lw=1, label=f"{name} train")
        if val:
            ax.plot(*zip(*val, strict=True), "o-", color=color, ms=4, label=f"{name} val")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out
