"""The PNG plots of a study's report (matplotlib's Agg canvas: no display needed).

Every curve of a panel has its own colour (`palette`: tab10, tab20, then evenly spaced hues);
studies with more variants than a panel reads well are drawn as small multiples, one panel per
variant group. Where there are seeds, a line is the mean over seeds and its band the 95%
t-interval of that mean (`decoderlm.lab.stats`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from decoderlm.lab.conclusions import MEMORY_CONTEXTS, recall_mean, sequence_bytes
from decoderlm.lab.recall import RecallTask
from decoderlm.lab.stats import Summary, summarise

MEMORY_PLOT_CONTEXT = 32768  # the memory axis of loss_vs_memory.png
BAND = "band = 95% t-interval over seeds"


def palette(n: int) -> list[Any]:
    """n distinct colours: tab10 up to 10, tab20 up to 20, else n hues of hsv."""
    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        return [colormaps["tab20"](i) for i in range(n)]
    return [colormaps["hsv"](i / n) for i in range(n)]


def legend(ax: Axes) -> None:
    """The panel's legend, if anything in it is labelled."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def save_figure(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    return path


def summary_of(row: dict[str, Any], key: str) -> Summary | None:
    return Summary(**row[key]) if key in row else None


def by_variant(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for run in results["runs"]:
        groups.setdefault(run["variant"], []).append(run)
    return groups


def band(
    ax: Axes, series: list[list[list[float]]], color: Any, label: str, offset: float = 0.0
) -> None:
    """Mean line and 95% band over seeds of [step, value] series, on the steps all share (a run
    that stopped early ends the line there); x shifted by `offset`."""
    common = set.intersection(*({s for s, v in one if v is not None} for one in series))
    steps = sorted(common)
    if not steps:
        return
    summaries = [summarise([dict(map(tuple, one))[step] for one in series]) for step in steps]
    xs = [offset + s for s in steps]
    ax.plot(xs, [s.mean for s in summaries], color=color, label=label)
    if len(series) > 1:
        low, high = zip(*(s.interval for s in summaries), strict=True)
        low = [max(0.0, v) for v in low]  # every quantity drawn is ≥ 0 (losses, norms, shares)
        ax.fill_between(xs, low, high, color=color, alpha=0.2, lw=0)


def _panels(results: dict[str, Any]) -> dict[str, list[str]]:
    """Variant names per plot panel: by the spec's groups where it has several, else one."""
    panels: dict[str, list[str]] = {}
    for v in results["spec"]["variants"]:
        panels.setdefault(v["group"], []).append(v["name"])
    return panels if len(panels) > 1 else {"": [v["name"] for v in results["spec"]["variants"]]}


def _grid(n: int) -> tuple[Figure, list[Axes]]:
    """A figure of n panels: one, or 2 (up to 4 panels) or 3 columns."""
    cols = 1 if n == 1 else 2 if n <= 4 else 3
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(7 if cols == 1 else 5.5 * cols, 4.5 * rows + 0.5), layout="constrained")
    return fig, [fig.add_subplot(rows, cols, i + 1) for i in range(n)]


def _offsets(results: dict[str, Any]) -> dict[tuple[str, int], int]:
    """(variant, seed) → the steps of the run it continues (init_from), 0 for the others."""
    steps = {(r["variant"], r["seed"]): r["steps"] for r in results["runs"]}
    origin = {v["name"]: v["init_from"] for v in results["spec"]["variants"]}
    return {
        (r["variant"], r["seed"]): steps[(origin[r["variant"]], r["seed"])]
        if origin[r["variant"]]
        else 0
        for r in results["runs"]
    }


def curves(results: dict[str, Any], out: Path, key: str, name: str, ylabel: str) -> Path:
    """`key` ("val_loss", "grad_norm") against the step, one panel per group; a run that
    continues another (up-training) is drawn after it, with the run it continues."""
    panels = _panels(results)
    runs, offsets = by_variant(results), _offsets(results)
    origin = {v["name"]: v["init_from"] for v in results["spec"]["variants"]}
    fig, axes = _grid(len(panels))
    for ax, (title, names) in zip(axes, panels.items(), strict=True):
        shown = list(dict.fromkeys([origin[n] for n in names if origin[n]] + names))
        for color, variant in zip(palette(len(shown)), shown, strict=True):
            mine = runs[variant]
            offset = offsets[(variant, mine[0]["seed"])]
            band(ax, [r["curves"][key] for r in mine], color, variant, offset)
        ax.set(xlabel="optimizer step", ylabel=ylabel, title=title or None)
        ax.set_yscale("log" if key == "grad_norm" else "linear")
        ax.grid(alpha=0.3)
        legend(ax)
    fig.suptitle(f"{ylabel} of every run (healthy or not): mean over seeds, {BAND}", fontsize=10)
    return save_figure(fig, out / name)


def continuation(results: dict[str, Any], out: Path) -> Path | None:
    """Runs that continue another (up-training), zoomed on their steps: each after the last tenth
    of the run it continues, its pooled start (val loss before up-training) marked."""
    spec = {v["name"]: v for v in results["spec"]["variants"]}
    later = [n for n, v in spec.items() if v["init_from"]]
    if not later:
        return None
    runs, offsets = by_variant(results), _offsets(results)
    origins = sorted({spec[n]["init_from"] for n in later})
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.add_subplot()
    shown = origins + later
    for color, variant in zip(palette(len(shown)), shown, strict=True):
        mine = runs[variant]
        offset = offsets[(variant, mine[0]["seed"])]
        series = [r["curves"]["val_loss"] for r in mine]
        if variant in origins:  # the last tenth of the original
            end = max(s for one in series for s, _ in one)
            series = [[p for p in one if p[0] >= 0.9 * end] for one in series]
        band(ax, series, color, variant, offset)
        pooled = summarise([r.get("val_loss_pooled") for r in mine])
        if pooled.n:
            ax.plot([offset], [pooled.mean], "x", color=color, ms=8)
    ax.plot([], [], "kx", label="pooled, before up-training")
    ax.set(xlabel="optimizer step (up-training after pre-training)", ylabel="val loss (nats)")
    ax.set_title(f"up-training as a continuation: mean over seeds, {BAND}", fontsize=10)
    ax.grid(alpha=0.3)
    legend(ax)
    return save_figure(fig, out / "uptraining.png")


def has_state(results: dict[str, Any]) -> bool:
    """Whether some variant keeps a recurrent state (its memory grows slower than its context)."""
    return any(row.get("state_bytes", 0) for row in results["summary"].values())


def loss_vs_memory(results: dict[str, Any], out: Path) -> Path:
    """Val loss against KV bytes per token; with recurrent states (no KV in a pure recurrent
    model) against the bytes of one sequence at MEMORY_PLOT_CONTEXT instead."""
    state = has_state(results)
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.add_subplot()
    table = results["summary"]
    for color, (name, row) in zip(palette(len(table)), table.items(), strict=True):
        s = summary_of(row, "val_loss")
        if s is None or not s.n:
            continue
        x = sequence_bytes(row, MEMORY_PLOT_CONTEXT) if state else row["kv_bytes_per_token"]
        error = [s.half_width] if s.n > 1 else None
        ax.errorbar([x], [s.mean], yerr=error, fmt="o", color=color, capsize=3, label=name)
    ax.set_xscale("log", base=2)
    xlabel = (
        f"bytes per sequence at {MEMORY_PLOT_CONTEXT // 1024}k tokens (KV + state, fp32, log₂)"
        if state
        else "KV cache bytes per token (fp32, log₂)"
    )
    ax.set(xlabel=xlabel, ylabel="final val loss (nats/token)")
    ax.set_title("quality vs memory (error bar = 95% t-interval over seeds)", fontsize=10)
    ax.grid(alpha=0.3)
    legend(ax)
    return save_figure(fig, out / ("loss_vs_memory.png" if state else "loss_vs_kv.png"))


def memory_vs_context(results: dict[str, Any], out: Path) -> Path | None:
    if not has_state(results):
        return None
    contexts = [2**k for k in range(10, 18)]  # 1k … 128k
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.add_subplot()
    table = results["summary"]
    for i, (color, (name, row)) in enumerate(zip(palette(len(table)), table.items(), strict=True)):
        ys = [sequence_bytes(row, n) for n in contexts]
        style = ("-", "--", ":", "-.")[i % 4]  # equal states draw one line: tell them apart
        ax.plot(contexts, ys, marker="o", ls=style, color=color, label=name, ms=3)
    ax.axvline(MEMORY_CONTEXTS[-1], color="k", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set(xlabel="context (tokens, log₂)", ylabel="bytes per sequence (KV + state, fp32, log₂)")
    ax.set_title("inference memory of one sequence")
    ax.grid(alpha=0.3)
    legend(ax)
    return save_figure(fig, out / "memory.png")


def recall(results: dict[str, Any], out: Path) -> Path | None:
    """Recall accuracy against the number of key-value pairs, one panel per head count (the
    recurrent state grows as the heads get fewer), one line per mix: mean over seeds, 95% band."""
    if not results.get("recall"):
        return None
    task = RecallTask(**results["recall"]["task"])
    names = list(task.mixes)
    fig = Figure(figsize=(5 * len(task.heads) + 1, 4.5), layout="constrained")
    axes = [fig.add_subplot(1, len(task.heads), i + 1) for i in range(len(task.heads))]
    for ax, heads in zip(axes, task.heads, strict=True):
        for color, name in zip(palette(len(names)), names, strict=True):
            per_seed: dict[int, list[list[float]]] = {}
            for r in results["recall"]["runs"]:
                if r["variant"] == name and r["heads"] == heads:
                    per_seed[r["seed"]] = [[n, r["accuracy"][str(n)]] for n in task.pairs]
            band(ax, list(per_seed.values()), color, name)
            means = [recall_mean(results, name, heads, n) for n in task.pairs]
            ax.plot(task.pairs, means, "o", color=color, ms=3)
        ax.plot(task.pairs, [1 / n for n in task.pairs], "k:", lw=1, label="a shown value (1/N)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(task.pairs, [str(n) for n in task.pairs])
        ax.set(xlabel="key-value pairs N", ylabel="recall accuracy", ylim=(-0.02, 1.02))
        state = task.d_model**2 // heads
        ax.set_title(f"{heads} head(s) of {task.d_model // heads}: state {state:,} a layer")
        ax.grid(alpha=0.3)
    legend(axes[0])
    fig.suptitle(f"multi-query associative recall: mean over seeds, {BAND}", fontsize=10)
    return save_figure(fig, out / "recall.png")


def positions(results: dict[str, Any], out: Path) -> Path | None:
    groups = {n: [r for r in runs if r.get("positions")] for n, runs in by_variant(results).items()}
    groups = {n: runs for n, runs in groups.items() if runs}
    if not groups:
        return None
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    context = next(iter(groups.values()))[0]["model"]["context_length"]
    for color, (name, runs) in zip(palette(len(groups)), groups.items(), strict=True):
        factor = max(f for f in (1, 2, 4) if runs[0]["positions"][f"{f}x"] is not None)
        width = runs[0]["positions"]["bucket"]
        series = [
            [[(j + 0.5) * width, v] for j, v in enumerate(r["positions"][f"{factor}x"])]
            for r in runs
        ]
        band(ax, series, color, f"{name} ({factor}× context)")
    ax.axvline(context, color="k", ls="--", lw=1, label="training context")
    ax.set(xlabel="position in the window", ylabel="val loss (nats/token)")
    ax.set_title(f"loss per position bucket past the training context ({BAND})", fontsize=10)
    ax.grid(alpha=0.3)
    legend(ax)
    return save_figure(fig, out / "positions.png")


def init_stats(results: dict[str, Any], out: Path) -> Path | None:
    stats = results.get("init_stats")
    if not stats:
        return None
    d_ks = [row["d_k"] for row in stats[0]]
    fig = Figure(figsize=(11, 4), layout="constrained")
    panels = (
        (("var_qk", "var(q·k)"), ("var_qk_scaled", "var(q·k/√d_k)")),
        (("entropy_raw", "QKᵀ"), ("entropy_scaled", "QKᵀ/√d_k")),
        (("grad_norm_raw", "QKᵀ"), ("grad_norm_scaled", "QKᵀ/√d_k")),
    )
    ylabels = ("variance", "softmax entropy (nats)", "‖∂softmax/∂s‖_F")
    for j, (panel, ylabel) in enumerate(zip(panels, ylabels, strict=True)):
        ax = fig.add_subplot(1, 3, j + 1)
        for color, (key, label) in zip(palette(3), panel, strict=False):
            mean = [sum(seed[i][key] for seed in stats) / len(stats) for i in range(len(d_ks))]
            ax.plot(d_ks, mean, "o-", color=color, label=label)
        if j == 0:
            ax.plot(d_ks, d_ks, "k--", lw=1, label="d_k")
            ax.set_yscale("log", base=2)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="d_k", ylabel=ylabel)
        ax.grid(alpha=0.3)
        legend(ax)
    fig.suptitle(f"attention logits at initialisation (mean over {len(stats)} seeds)")
    return save_figure(fig, out / "init_stats.png")


def write_plots(results: dict[str, Any], out: Path) -> list[Path]:
    """Every plot the study's results have, in the report's order."""
    plots = [
        curves(results, out, "val_loss", "val_loss.png", "val loss (nats/token)"),
        continuation(results, out),
        loss_vs_memory(results, out),
        memory_vs_context(results, out),
        recall(results, out),
        positions(results, out),
        init_stats(results, out),
    ]
    if "divergence" in results["spec"]["measures"]:
        ylabel = "gradient norm (before clipping)"
        plots.append(curves(results, out, "grad_norm", "grad_norm.png", ylabel))
    return [p for p in plots if p is not None]
