"""results.json → report.md (its plots: `decoderlm.lab.plots`).

Every number in the report is read from results.json; the per-run table prints each run's own
metrics and health, so a reader can check any summary row against the runs it summarises. The
header says when, by which command and code, on which CPU and package versions, with how many
seeds and what budget the numbers were made; no path of the machine that made them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from decoderlm.lab import conclusions, plots
from decoderlm.lab.conclusions import MEMORY_CONTEXTS, SOLVED, recall_series, sequence_bytes
from decoderlm.lab.measure import HEALTH_CLASSES
from decoderlm.lab.plots import by_variant, has_state, save_figure, summary_of
from decoderlm.lab.recall import RecallTask
from decoderlm.lab.stats import Summary, summarise

__all__ = ["REPORT_FILE", "fmt", "header", "markdown_table", "save_figure", "write_lines"]

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
)


def write_report(results: dict[str, Any], out: str | Path) -> Path:
    """Write OUT/report.md and the plots it embeds; returns the report's path."""
    out = Path(out)
    spec, data = results["spec"], results["data"]
    lines = [
        *header(results),
        f"- data: {data['source']}, char-level ({data['train_tokens']:,} train tokens, "
        f"vocabulary {data['vocab_size']}); val loss over the first {results['eval_tokens']:,} "
        f"val tokens; unigram baseline {data['unigram_loss']:.4f} nats",
        f"- wall time: {results['runs_wall_s']:.0f} s over all runs "
        f"({results['wall_s']:.0f} s in the last invocation)",
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
    return write_lines(
        out, lines, plots.write_plots(results, out), results, _attention_section(results)
    )


def header(results: dict[str, Any]) -> list[str]:
    """A report's title, description, then when, how and where it was made: date, command, seeds,
    budget, code, CPU and package versions."""
    env, spec = results["environment"], results["spec"]
    return [
        f"# Study: {results['study']}",
        "",
        results["description"],
        "",
        f"- date: {env.get('date', 'not recorded')}",
        f"- command: `{results['command']}`",
        f"- seeds: {spec['seeds']}"
        + (
            " (the same seeds, so the same batches, for every variant)"
            if "variants" in spec
            else ""
        ),
        f"- budget: {_budget(results)}",
        f"- code: decoderlm {env.get('decoderlm', '?')}, git commit {env['git_commit']}",
        f"- CPU: {env['cpu']} ({env['cores']} cores)",
        f"- versions: Python {env['python']}, torch {env['torch']}",
    ]


def _budget(results: dict[str, Any]) -> str:
    spec = results["spec"]
    if "budget_tokens" not in spec:  # a study with its own protocol (test-time compute)
        return "see the protocol below"
    if spec["budget_tokens"] is None:
        return f"{spec['budget_seconds']:g} s of training per run"
    steps = sorted({r["steps"] for r in results["runs"]})
    span = f"{steps[0]:,}" if len(steps) == 1 else f"{steps[0]:,}–{steps[-1]:,}"
    scaled = any(v["budget_scale"] != 1 for v in spec["variants"])
    return (
        f"{spec['budget_tokens']:,} training tokens per run"
        + (" (× the variant's budget scale)" if scaled else "")
        + f"; {span} optimizer steps"
    )


def write_lines(
    out: Path,
    lines: list[str],
    figures: list[Path],
    results: dict[str, Any],
    after_plots: list[str] | None = None,
) -> Path:
    """Write OUT/report.md: `lines`, the plots, `after_plots`, then "What this shows" (the study's
    conclusions); returns its path."""
    lines = [
        *lines,
        "## Plots",
        "",
        *(f"![{p.stem}]({p.name})" for p in figures),
        "",
        *(after_plots or []),
        "## What this shows",
        "",
        *conclusions.conclude(results),
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


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
    ]


def _settings(variant: dict[str, Any], results: dict[str, Any]) -> str:
    """A variant's overrides as it ran: a pooled variant by the K/V heads it has."""
    model = dict(variant["model"])
    if variant["pool_kv_heads"]:
        model["n_kv_heads"] = variant["pool_kv_heads"]
    changes = ", ".join(f"{k}={val}" for k, val in {**model, **variant["train"]}.items())
    if variant["init_from"]:
        pooled = (
            f", its {variant['model']['n_kv_heads']} K/V heads mean-pooled to "
            f"{variant['pool_kv_heads']}"
            if variant["pool_kv_heads"]
            else ""
        )
        changes += f"; from {variant['init_from']}{pooled}, budget ×{variant['budget_scale']:g}"
    elif variant["budget_scale"] != 1:
        changes += f"; budget ×{variant['budget_scale']:g}"
    if variant["match_params"]:
        d_ff = next(r["model"]["d_ff"] for r in results["runs"] if r["variant"] == variant["name"])
        changes += f"; d_ff={d_ff} (matched)"
    return changes or "(base)"


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
        context = row["kv_max_context"]
        rows.append(
            [
                v["name"],
                f"{row['params']:,}",
                delta,
                f"{row['kv_bytes_per_token']:,}",
                fmt(context, "{:,}") if context is not None else "∞",
                _settings(v, results),
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
    optional = [c for c in OPTIONAL_COLUMNS if any(c[1] in row for row in table.values())]
    header = ["variant", "val loss", "bits/byte", "train tok/s"]
    header += [c[0] for c in optional] + ["runs: " + " / ".join(HEALTH_CLASSES)]
    rows = []
    for name, row in table.items():
        cells = [name]
        for key, digits in (("val_loss", 4), ("val_bpb", 4), ("train_tokens_per_s", 0)):
            cells.append(_cell(summary_of(row, key), digits))
        cells += [_cell(summary_of(row, key), digits) for _, key, digits in optional]
        cells.append(" / ".join(str(row["health"][c]) for c in HEALTH_CLASSES))
        rows.append(cells)
    return [
        f"## Results (mean ± 95% t-interval over the healthy runs of {results['spec']['seeds']} "
        "seeds)",
        "",
        "A run that is stuck, diverged or NaN (`decoderlm.lab.measure.classify`, the rule under "
        '"What this shows") enters no mean; n/a: no healthy run. Speeds are of every run, timed '
        "on a CPU shared with other jobs: their spread is the machine's load as much as the "
        "variants'.",
        "",
        *markdown_table(header, rows),
    ]


def _cell(s: Summary | None, digits: int) -> str:
    return "n/a" if s is None else s.format(digits)


def _comparisons(results: dict[str, Any]) -> list[str]:
    """A built-in study's ranking (a study of one's own has it as its conclusion)."""
    lines = conclusions.ranking(results) if results["spec"]["builtin"] else []
    if not lines:
        return []
    return [
        "## Comparisons (val loss, each variant against the lowest; paired by seed)",
        "",
        *(f"- {line}" for line in lines),
        "",
    ]


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
    recall = results.get("recall")
    if not recall:
        return []
    task = RecallTask(**recall["task"])
    rows = []
    for heads in task.heads:
        for name in task.mixes:
            mine = [r for r in recall["runs"] if r["variant"] == name and r["heads"] == heads]
            cells = [name, str(heads), f"{mine[0]['params']:,}", f"{mine[0]['state_bytes']:,}"]
            for n in task.pairs:
                values = list(recall_series(results, name, heads, n).values())
                cells.append(summarise(values).format(3))
            rows.append(cells)
    header = ["model", "heads", "params", "recurrent state bytes"]
    header += [f"accuracy N = {n}" for n in task.pairs]
    mixes = "; ".join(f"{name}: {', '.join(mix)}" for name, mix in task.mixes.items())
    return [
        "## Multi-query associative recall",
        "",
        "MQAR (Arora et al., 2023, `decoderlm.lab.recall`): sequences of "
        f"{task.length} tokens open with N key-value pairs (keys and values distinct, from "
        f"{task.n_keys} tokens each), then each key once more as a query at a power-law gap, "
        "noise elsewhere; the answer at a query is its value, and only answers count. The models "
        f"are two layers deep, d_model {task.d_model}, at {', '.join(map(str, task.heads))} "
        f"head(s) ({mixes}); d_ff matched to attention's size at each head count. Each trains "
        f"{task.steps:,} steps of {task.batch_size} sequences, N = "
        f"{', '.join(map(str, task.pairs))} in turn, at one learning rate for every mix, "
        f"{task.lr:g} (Zoology reports each model at the best of a learning-rate sweep); "
        "accuracy = share of "
        f"{task.test_examples} test sequences' answers whose argmax is the value (chance "
        f"{1 / task.n_keys:.3f}; copying one of the N values shown without the lookup: 1/N). "
        f"Attention solves the task at a head count where its mean is ≥ {SOLVED:g} at every N; "
        "recall conclusions are drawn only there. Mean ± 95% t-interval over "
        f"{results['spec']['seeds']} seeds.",
        "",
        *markdown_table(header, rows),
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
    header = ["variant", "seed", *(c[0] for c in RUN_COLUMNS), "health"]
    rows = []
    for r in results["runs"]:
        health = r["health"]
        if r.get("lowest_step") is not None:
            health += f" (lowest loss at step {r['lowest_step']})"
        cells = [fmt(r.get(key), spec) for _, key, spec in RUN_COLUMNS]
        rows.append([r["variant"], str(r["seed"]), *cells, health])
    return ["## Runs (every run's own metrics)", "", *markdown_table(header, rows)]


def _attention_section(results: dict[str, Any]) -> list[str]:
    """The best run's heat-maps and, per variant, the mean attention entropy of each layer."""
    attention = results.get("attention")
    if not attention:
        return []
    runs = by_variant(results)
    n_layers = max(len(r.get("attention_entropy") or []) for rs in runs.values() for r in rs)
    rows = []
    for name, mine in runs.items():
        entropies = [r["attention_entropy"] for r in mine if r.get("attention_entropy")]
        cells = [
            f"{sum(e[i] for e in entropies) / len(entropies):.3f}" if entropies else "—"
            for i in range(n_layers)
        ]
        rows.append([name, *cells])
    best = results["summary"][attention["variant"]]
    return [
        "## Attention maps",
        "",
        f"Every head of each layer of the best healthy run ({attention['variant']} seed "
        f"{attention['seed']}; its variant's val loss {_cell(summary_of(best, 'val_loss'), 4)}) "
        f"on the first {attention['tokens']} val tokens: row i is what query i attends.",
        "",
        *(f"![{Path(f).stem}]({f})" for f in attention["files"]),
        "",
        "Mean attention entropy per layer (nats, over heads and query rows; mean over seeds):",
        "",
        *markdown_table(["variant", *(f"layer {i}" for i in range(n_layers))], rows),
    ]
