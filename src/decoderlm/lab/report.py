"""results.json → report.md and its PNG plots (matplotlib's Agg canvas: no display needed).

Every number in the report is read from results.json; the per-run table prints each run's own
metrics, so a reader can check any summary row against the runs it summarises.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from decoderlm.lab import conclusions
from decoderlm.lab.conclusions import MEMORY_CONTEXTS, sequence_bytes
from decoderlm.lab.recall import RecallTask
from decoderlm.lab.stats import Summary

REPORT_FILE = "report.md"
RUN_COLUMNS = (  # (header, key, format) of the per-run table
    ("steps", "steps", "{:d}"),
    ("params", "params", "{:,}"),
    ("KV bytes/token", "kv_bytes_per_token", "{:,}"),
    ("val loss", "val_loss", "{:.4f}"),
    ("bits/byte", "val_bpb", "{:.4f}"),
    ("train tok/s", "train_tokens_per_s", "{:,.0f}"),
)
OPTIONAL_COLUMNS = (  # (header, summary key, digits): shown when some variant has the metric
    ("decode tok/s b1", "decode_tps_b1", 0),
    ("decode tok/s b16", "decode_tps_b16", 0),
    ("loss @1× ctx", "loss_1x", 4),
    ("loss @2× ctx", "loss_2x", 4),
    ("loss @4× ctx", "loss_4x", 4),
    ("val loss before up-training", "val_loss_pooled", 4),
    ("recall accuracy", "recall_accuracy", 3),
)
MEMORY_PLOT_CONTEXT = 32768  # the memory axis of loss_vs_memory.png


def write_report(results: dict[str, Any], out: str | Path) -> Path:
    """Write OUT/report.md and the plots it embeds; returns the report's path."""
    out = Path(out)
    plots = [p for p in (_val_curves(results, out), _loss_vs_kv(results, out)) if p]
    plots += [p for p in (_memory_vs_context(results, out), _recall(results, out)) if p]
    plots += [p for p in (_positions(results, out), _grad_norms(results, out)) if p]
    plots += [p for p in (_init_stats(results, out),) if p]
    spec = results["spec"]
    budget = (
        f"{spec['budget_tokens']:,} training tokens per run"
        if spec["budget_tokens"] is not None
        else f"{spec['budget_seconds']:g} s of training per run"
    )
    lines = [
        *header(results),
        f"- wall time: {results['runs_wall_s']:.0f} s over all runs "
        f"({results['wall_s']:.0f} s in the last invocation)",
        f"- data: {results['data']['dir']} ({results['data']['train_tokens']:,} train tokens, "
        f"vocabulary {results['data']['vocab_size']}); val loss over the first "
        f"{results['eval_tokens']:,} val tokens",
        f"- protocol: {budget}, {spec['seeds']} seeds (the same seeds, so the same batches, for "
        "every variant); spread = standard deviation over seeds",
        *(f"- {note}" for note in spec["notes"]),
        "",
        *_variants_table(results),
        *_summary_table(results),
        *_comparisons(results),
        *_memory_table(results),
        *_recall_section(results),
        *_init_table(results),
        *_runs_table(results),
    ]
    return write_lines(out, lines, plots, results, _attention_section(results))


def header(results: dict[str, Any]) -> list[str]:
    """A report's title, description, command and environment lines."""
    env = results["environment"]
    return [
        f"# Study: {results['study']}",
        "",
        results["description"],
        "",
        f"- command: `{results['command']}`",
        f"- git commit {env['git_commit']} · {env['cpu']} ({env['cores']} cores) · "
        f"torch {env['torch']} · Python {env['python']}",
    ]


def write_lines(
    out: Path,
    lines: list[str],
    plots: list[Path],
    results: dict[str, Any],
    after_plots: list[str] | None = None,
) -> Path:
    """Write OUT/report.md: `lines`, the plots, `after_plots`, then "What this shows" (the study's
    conclusions); returns its path."""
    lines = [
        *lines,
        "## Plots",
        "",
        *(f"![{p.stem}]({p.name})" for p in plots),
        "",
        *(after_plots or []),
        "## What this shows",
        "",
        conclusions.conclude(results),
        "",
    ]
    path = out / REPORT_FILE
    path.write_text("\n".join(lines))
    return path


def fmt(value: Any, spec: str) -> str:
    """`value` formatted, or "n/a" for a missing or non-finite number."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return spec.format(value)


def summary_of(row: dict[str, Any], key: str) -> Summary | None:
    return Summary(**row[key]) if key in row else None


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
    ]


def _variants_table(results: dict[str, Any]) -> list[str]:
    spec, table = results["spec"], results["summary"]
    reference = spec["reference"]
    rows = []
    for v in spec["variants"]:
        row = table[v["name"]]
        delta = "—"
        if reference is not None:
            ref = table[reference]["params"]
            delta = f"{100 * (row['params'] - ref) / ref:+.2f}%"
        changes = ", ".join(f"{k}={val}" for k, val in {**v["model"], **v["train"]}.items())
        if v["init_from"]:
            pooled = f" pooled to {v['pool_kv_heads']} K/V heads" if v["pool_kv_heads"] else ""
            changes += f"; from {v['init_from']}{pooled}, budget ×{v['budget_scale']:g}"
        if v["match_params"]:
            d_ff = next(r["model"]["d_ff"] for r in results["runs"] if r["variant"] == v["name"])
            changes += f"; d_ff={d_ff} (matched)"
        rows.append(
            [
                v["name"],
                f"{row['params']:,}",
                delta,
                f"{row['kv_bytes_per_token']:,}",
                fmt(row["kv_max_context"], "{:,}") if row["kv_max_context"] is not None else "∞",
                changes or "(base)",
            ]
        )
    sizing = (
        f"Sizes matched to {reference!r}: d_ff of each matched variant solves "
        "N(d_ff) = N(reference) (N is affine in d_ff), rounded; |Δparams| ≤ 2%."
        if reference is not None
        else "Parameter counts as configured (no size matching in this study)."
    )
    budget_gib = spec["kv_budget_bytes"] / 2**30
    header = ["variant", "params", "Δparams", "KV bytes/token (fp32)"]
    header += [f"max context in {budget_gib:g} GiB of KV", "settings"]
    return ["## Variants", "", sizing, "", *markdown_table(header, rows)]


def _summary_table(results: dict[str, Any]) -> list[str]:
    table = results["summary"]
    k = results["spec"]["seeds"]
    optional = [c for c in OPTIONAL_COLUMNS if any(c[1] in row for row in table.values())]
    header = ["variant", "val loss", "bits/byte", "train tok/s"]
    header += [c[0] for c in optional] + ["diverged runs"]
    rows = []
    for name, row in table.items():
        cells = [name, str(summary_of(row, "val_loss")), str(summary_of(row, "val_bpb"))]
        cells.append(_mean_spread(summary_of(row, "train_tokens_per_s"), 0))
        cells += [_mean_spread(summary_of(row, key), digits) for _, key, digits in optional]
        cells.append(f"{row['diverged']}/{k}")
        rows.append(cells)
    return [f"## Results (mean ± spread over {k} seeds)", "", *markdown_table(header, rows)]


def _mean_spread(s: Summary | None, digits: int) -> str:
    if s is None or not s.n:
        return "n/a"
    return f"{s.mean:,.{digits}f} ± {s.spread:,.{digits}f}"


def _comparisons(results: dict[str, Any]) -> list[str]:
    lines = conclusions.ranking(results)
    return ["## Comparisons (val loss)", "", *(f"- {line}" for line in lines), ""] if lines else []


def has_state(results: dict[str, Any]) -> bool:
    """Whether some variant keeps a recurrent state (its memory grows slower than its context)."""
    return any(row.get("state_bytes", 0) for row in results["summary"].values())


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def _memory_table(results: dict[str, Any]) -> list[str]:
    if not has_state(results):
        return []
    reference = results["spec"]["reference"]
    rows = []
    for name, row in results["summary"].items():
        cells = [name, f"{row['state_bytes']:,}", f"{row['kv_bytes_per_token']:,}"]
        for n in MEMORY_CONTEXTS:
            cells.append(_bytes(sequence_bytes(row, n)))
        if reference is not None:
            at = MEMORY_CONTEXTS[-1]
            share = sequence_bytes(row, at) / sequence_bytes(results["summary"][reference], at)
            cells.append(f"{share:.3g}")
        rows.append(cells)
    header = ["variant", "recurrent state bytes", "KV bytes/token"]
    header += [f"bytes/sequence at {n // 1024}k" for n in MEMORY_CONTEXTS]
    header += [f"÷ {reference} at {MEMORY_CONTEXTS[-1] // 1024}k"] if reference is not None else []
    return [
        "## Inference memory per sequence",
        "",
        "KV cache (fp32 K and V of the attention layers, growing with the context) plus the "
        "recurrent layers' conv and matrix states (fixed): `decoderlm.model.cache.sizes` and "
        "`recurrent_state_bytes`, the numbers `decoderlm info` prints; batch 1.",
        "",
        *markdown_table(header, rows),
    ]


def _recall_section(results: dict[str, Any]) -> list[str]:
    if "recall" not in results["spec"]["measures"]:
        return []
    task = RecallTask(**results["spec"]["recall"])
    lines = conclusions.recall_ranking(results)
    return [
        "## Associative recall",
        "",
        "Multi-query associative recall (Arora et al., 2023, `decoderlm.lab.recall`): "
        f"{task.n_pairs} key-value pairs (keys from {task.n_keys} tokens, values "
        f"from {task.n_values} others), then the same keys in a random order, each to be "
        "answered with its value. A fresh model of each variant's shape (vocabulary and context "
        f"the task's) is trained {task.steps} steps of {task.batch_size} sequences on fresh examples from the run's "
        "seed; accuracy = share of a fixed test set's answers whose argmax is the value. "
        f"Chance among the values: {1 / task.n_values:.3f}; copying one of the {task.n_pairs} "
        f"values shown, without the lookup: about {1 / task.n_pairs:.3f} — above that, the model "
        "looks keys up.",
        "",
        *(f"- {line}" for line in lines),
        "",
    ]


def _init_table(results: dict[str, Any]) -> list[str]:
    stats = results.get("init_stats")
    if not stats:
        return []
    rows = []
    for i, first in enumerate(stats[0]):
        cells = [str(first["d_k"])]
        for key in ("var_qk", "var_qk_scaled", "entropy_raw", "entropy_scaled"):
            cells.append(fmt(_seed_mean(stats, i, key), "{:.3f}"))
        for key in ("grad_norm_raw", "grad_norm_scaled"):
            cells.append(fmt(_seed_mean(stats, i, key), "{:.4f}"))
        rows.append(cells)
    header = ["d_k", "var(q·k)", "var(q·k/√d_k)", "entropy QKᵀ (nats)", "entropy QKᵀ/√d_k"]
    header += ["‖∂softmax‖ QKᵀ", "‖∂softmax‖ QKᵀ/√d_k"]
    return [
        "## Attention at initialisation (mean over seeds)",
        "",
        "q, k: unit-variance components (LeCun-initialised projections of N(0, I) inputs); "
        "each query attends 64 keys, so the entropy is at most ln 64 = 4.159 nats.",
        "",
        *markdown_table(header, rows),
    ]


def _seed_mean(stats: list[list[dict[str, float]]], i: int, key: str) -> float:
    return sum(seed[i][key] for seed in stats) / len(stats)


def _runs_table(results: dict[str, Any]) -> list[str]:
    header = ["variant", "seed", *(c[0] for c in RUN_COLUMNS), "diverged at step"]
    rows = [
        [r["variant"], str(r["seed"])]
        + [fmt(r.get(key), spec) for _, key, spec in RUN_COLUMNS]
        + [fmt(r["diverged_step"], "{:d}")]
        for r in results["runs"]
    ]
    return ["## Runs (every run's own metrics)", "", *markdown_table(header, rows)]


# ---- plots ------------------------------------------------------------------------------------


def _by_variant(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for run in results["runs"]:
        groups.setdefault(run["variant"], []).append(run)
    return groups


def _band(ax: Any, series: list[list[list[float]]], color: str, label: str) -> None:
    """Mean line and min–max band over seeds of [step, value] series, on the steps all share."""
    common = set.intersection(*({s for s, v in one if v is not None} for one in series))
    steps = sorted(common)
    if not steps:
        return
    values = [[dict((s, v) for s, v in one)[step] for one in series] for step in steps]
    mean = [sum(v) / len(v) for v in values]
    ax.plot(steps, mean, color=color, label=label)
    ax.fill_between(
        steps, [min(v) for v in values], [max(v) for v in values], color=color, alpha=0.2
    )


def _attention_section(results: dict[str, Any]) -> list[str]:
    """The best run's heat-maps and, per variant, the mean attention entropy of each layer."""
    attention = results.get("attention")
    if not attention:
        return []
    by_variant = _by_variant(results)
    n_layers = max(len(r.get("attention_entropy") or []) for rs in by_variant.values() for r in rs)
    rows = []
    for name, runs in by_variant.items():
        entropies = [r["attention_entropy"] for r in runs if r.get("attention_entropy")]
        cells = [f"{sum(e[i] for e in entropies) / len(entropies):.3f}" if entropies else "—"
                 for i in range(n_layers)]  # fmt: skip
        rows.append([name, *cells])
    best = results["summary"][attention["variant"]]
    return [
        "## Attention maps",
        "",
        f"Every head of each layer of the best run ({attention['variant']} seed "
        f"{attention['seed']}; its variant's val loss {_mean_spread(summary_of(best, 'val_loss'), 4)}) "
        f"on the first {attention['tokens']} val tokens: row i is what query i attends.",
        "",
        *(f"![{Path(f).stem}]({f})" for f in attention["files"]),
        "",
        "Mean attention entropy per layer (nats, over heads and query rows; mean over seeds):",
        "",
        *markdown_table(["variant", *(f"layer {i}" for i in range(n_layers))], rows),
    ]


def save_figure(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    return path


def _val_curves(results: dict[str, Any], out: Path) -> Path | None:
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    for i, (name, runs) in enumerate(_by_variant(results).items()):
        _band(ax, [r["curves"]["val_loss"] for r in runs], f"C{i % 10}", name)
    ax.set(xlabel="optimizer step", ylabel="val loss (nats/token)")
    ax.set_title("validation loss: mean over seeds, band = min–max")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, out / "val_loss.png")


def _loss_vs_kv(results: dict[str, Any], out: Path) -> Path | None:
    """Val loss against KV bytes per token; with recurrent states (no KV in a pure recurrent
    model) against the bytes of one sequence at MEMORY_PLOT_CONTEXT instead."""
    state = has_state(results)
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.add_subplot()
    for i, (name, row) in enumerate(results["summary"].items()):
        s = summary_of(row, "val_loss")
        if s is None or not s.n:
            continue
        x = sequence_bytes(row, MEMORY_PLOT_CONTEXT) if state else row["kv_bytes_per_token"]
        ax.errorbar([x], [s.mean], yerr=[s.spread], fmt="o", color=f"C{i % 10}", capsize=3)
        ax.annotate(name, (x, s.mean), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_xscale("log", base=2)
    xlabel = (
        f"bytes per sequence at {MEMORY_PLOT_CONTEXT // 1024}k tokens (KV + state, fp32, log₂)"
        if state
        else "KV cache bytes per token (fp32, log₂)"
    )
    ax.set(xlabel=xlabel, ylabel="final val loss (nats/token)")
    ax.set_title("quality vs memory (error bar = spread over seeds)")
    ax.grid(alpha=0.3)
    return save_figure(fig, out / ("loss_vs_memory.png" if state else "loss_vs_kv.png"))


def _memory_vs_context(results: dict[str, Any], out: Path) -> Path | None:
    if not has_state(results):
        return None
    contexts = [2**k for k in range(10, 18)]  # 1k … 128k
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.add_subplot()
    for i, (name, row) in enumerate(results["summary"].items()):
        ys = [sequence_bytes(row, n) for n in contexts]
        style = ("-", "--", ":", "-.")[i % 4]  # equal states draw one line: tell them apart
        ax.plot(contexts, ys, marker="o", ls=style, color=f"C{i % 10}", label=name, ms=3)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set(xlabel="context (tokens, log₂)", ylabel="bytes per sequence (KV + state, fp32, log₂)")
    ax.set_title("inference memory of one sequence")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, out / "memory.png")


def _recall(results: dict[str, Any], out: Path) -> Path | None:
    rows = {
        n: s for n, row in results["summary"].items() if (s := summary_of(row, "recall_accuracy"))
    }
    if not rows:
        return None
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    names = list(rows)
    means = [rows[n].mean for n in names]
    ax.bar(names, means, yerr=[rows[n].spread for n in names], capsize=3,
           color=[f"C{i % 10}" for i in range(len(names))])  # fmt: skip
    task = RecallTask(**results["spec"]["recall"])
    ax.axhline(1 / task.n_values, color="k", ls="--", lw=1, label="chance")
    ax.axhline(1 / task.n_pairs, color="k", ls=":", lw=1, label="a shown value, no lookup")
    ax.set(ylabel="recall accuracy", ylim=(0, 1))
    ax.set_title("associative recall: mean over seeds, error bar = spread")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7)
    return save_figure(fig, out / "recall.png")


def _positions(results: dict[str, Any], out: Path) -> Path | None:
    groups = {
        n: [r for r in runs if r.get("positions")] for n, runs in _by_variant(results).items()
    }
    groups = {n: runs for n, runs in groups.items() if runs}
    if not groups:
        return None
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    context = next(iter(groups.values()))[0]["model"]["context_length"]
    for i, (name, runs) in enumerate(groups.items()):
        factor = max(f for f in (1, 2, 4) if runs[0]["positions"][f"{f}x"] is not None)
        width = runs[0]["positions"]["bucket"]
        series = [
            [[(j + 0.5) * width, v] for j, v in enumerate(r["positions"][f"{factor}x"])]
            for r in runs
        ]
        _band(ax, series, f"C{i % 10}", f"{name} ({factor}× context)")
    ax.axvline(context, color="k", ls="--", lw=1, label="training context")
    ax.set(xlabel="position in the window", ylabel="val loss (nats/token)")
    ax.set_title("loss per position bucket: extrapolation past the training context")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, out / "positions.png")


def _grad_norms(results: dict[str, Any], out: Path) -> Path | None:
    if "divergence" not in results["spec"]["measures"]:
        return None
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    for i, (name, runs) in enumerate(_by_variant(results).items()):
        _band(ax, [r["curves"]["grad_norm"] for r in runs], f"C{i % 10}", name)
    ax.set_yscale("log")
    ax.set(xlabel="optimizer step", ylabel="global gradient norm (before clipping)")
    ax.set_title("gradient norm: mean over seeds, band = min–max")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    return save_figure(fig, out / "grad_norm.png")


def _init_stats(results: dict[str, Any], out: Path) -> Path | None:
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
        for key, label in panel:
            ax.plot(d_ks, [_seed_mean(stats, i, key) for i in range(len(d_ks))], "o-", label=label)
        if j == 0:
            ax.plot(d_ks, d_ks, "k--", lw=1, label="d_k")
            ax.set_yscale("log", base=2)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="d_k", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("attention logits at initialisation")
    return save_figure(fig, out / "init_stats.png")
