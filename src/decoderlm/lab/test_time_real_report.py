"""results.json of the real-model test-time study (`decoderlm.lab.test_time_real`) → report.md and
its plots. Every number is read from results.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from decoderlm.lab.report import markdown_table, save_figure
from decoderlm.lab.test_time_real import GUIDED, STRATEGIES, bootstrap, per_problem
from decoderlm.lab.test_time_verifier import verifier_section

REPORT_FILE = "report.md"
SCREEN_BAND = (0.10, 0.50)  # the greedy accuracy a task should have: room above, something found
COLOURS = dict(zip(STRATEGIES, ("#000000", "#1f77b4", "#ff7f0e", "#2ca02c", "#7f7f7f",
                                "#d62728", "#9467bd"), strict=True))  # fmt: skip


def write_report(results: dict[str, Any], out: str | Path) -> Path:
    """Write OUT/report.md and the plots it shows; returns the report's path."""
    out = Path(out)
    plots = [_accuracy_plot(results, out), _screen_plot(results, out)]
    lines = [
        *_header(results),
        *_answer(results),
        *_accuracy_table(results),
        *_comparisons(results),
        *_screen(results),
        *verifier_section(results["verifier"], "the model"),
        "## Plots",
        "",
        *(f"![{p.stem}]({p.name})" for p in plots),
        "",
    ]
    path = out / REPORT_FILE
    path.write_text("\n".join(lines))
    return path


def _header(results: dict[str, Any]) -> list[str]:
    spec, env, wall = results["spec"], results["environment"], results["wall_s"]
    stages = ", ".join(f"{k} {v / 60:.1f}" for k, v in wall.items() if k != "total")
    return [
        "# Study: test-time compute on a real model",
        "",
        f"How far does search lift {results['model']}, and at what token cost? Snell et al. (2024) "
        "find that test-time search can stand in for a larger model where the base model "
        "sometimes succeeds; Beeching et al. (2024) show Llama-3.2-1B with PRM-guided search "
        "passing Llama-3.1-8B on MATH-500. Here the model has "
        f"{results['parameters'] / 1e6:.0f}M parameters, the task is a word problem it solves "
        "10–50% of the time greedily, and the verifier is a head on its own frozen hidden "
        "states.",
        "",
        f"- date: {results['date']}; command: `{results['command']}`",
        f"- git commit {env['git_commit']} · {env['cpu']} ({env['cores']} cores, shared) · torch "
        f"{env['torch']} · Python {env['python']} · decoderlm {env['decoderlm']}"
        + "".join(f" · {k} {v}" for k, v in env.items() if k.startswith("llm-")),
        f"- model: {results['model']} (Q4_1 GGUF, dequantized into {spec['dtype']} linears), chat "
        f"template, {spec['threads']} torch thread(s); a solution ends at its end-of-turn token, "
        f"at most {spec['max_tokens']} tokens",
        f"- task: {spec['task']} at difficulty {spec['difficulty']}, {results['problems']} "
        f"test-split problems; {spec['seeds']} sampling seed(s); temperature "
        f"{spec['temperature']:g}",
        f"- budget: N ∈ {list(spec['ns'])}; self-consistency, best-of-N and pass@N take disjoint "
        f"groups of N from a pool of {spec['samples']} samples a problem and seed "
        f"({spec['samples']}/N runs each, the same tokens for all four); step-level beam search "
        f"(width N/{spec['expand']}, {spec['expand']} steps sampled a beam, steps ≤ "
        f"{spec['step_tokens']} tokens, a step a line) and MCTS (expanding {spec['expand']} "
        f"steps, progressive widening α = {spec['widening']:g}, no rollouts) at N ∈ "
        f"{list(spec['step_ns'])}, each with a budget of the tokens the problem's N-groups spent "
        "on average, so a guided search never has more tokens than the pooled strategies",
        "- intervals: 95% bootstrap over problems (per-problem accuracy averaged over runs and "
        f"seeds, {spec['bootstrap']} resamples); a difference is called only when its paired "
        "interval excludes 0",
        f"- wall time: {wall['total'] / 60:.1f} min ({stages} min)",
        "",
    ]


def _cell(results: dict[str, Any], name: str, n: int) -> dict[str, float] | None:
    return results["summary"].get(name, {}).get(str(n))


def _answer(results: dict[str, Any]) -> list[str]:
    """The headline: greedy, the best non-oracle strategy at the largest N, the ceiling."""
    runs, spec = results["runs"], results["spec"]
    greedy = _cell(results, "greedy", 1)
    top = max(spec["ns"])
    searched = [s for s in STRATEGIES if s not in ("greedy", "pass@N (oracle)")]
    cells = [
        (name, n, c) for name in searched for n in spec["ns"] if (c := _cell(results, name, n))
    ]
    if greedy is None or not cells:
        return []
    name, n, best = max(cells, key=lambda item: (item[2]["accuracy"], -item[2]["tokens"]))
    lift = [
        a - g
        for a, g in zip(per_problem(runs, name, n), per_problem(runs, "greedy", 1), strict=True)
    ]
    mean, low, high = bootstrap(lift, spec["bootstrap"])
    ceiling = _cell(results, "pass@N (oracle)", top)
    lines = [
        "## Answer",
        "",
        f"Greedy decoding solves {_pct(greedy)} of the problems with {greedy['tokens']:.0f} "
        f"generated tokens a problem. The best search is {name} at N = {n}: {_pct(best)} with "
        f"{best['tokens']:.0f} tokens a problem, {best['tokens'] / greedy['tokens']:.1f}× "
        f"greedy's, a lift of {100 * mean:+.1f} points (paired 95% interval "
        f"[{100 * low:+.1f}, {100 * high:+.1f}]).",
    ]
    if ceiling is not None:
        lines[-1] += (
            f" Some sample of {top} is right on {_pct(ceiling)} of the problems (pass@{top}): "
            "what a perfect verifier would reach with the same tokens."
        )
    return [*lines, ""]


def _pct(cell: dict[str, float]) -> str:
    return f"{cell['accuracy']:.0%} [{cell['low']:.0%}, {cell['high']:.0%}]"


def _accuracy_table(results: dict[str, Any]) -> list[str]:
    ns = results["spec"]["ns"]
    rows = []
    for name in STRATEGIES:
        cells = [name]
        for n in ns:
            c = _cell(results, name, n)
            cells.append("—" if c is None else f"{_pct(c)} ({c['tokens']:.0f})")
        rows.append(cells)
    return [
        "## Accuracy [95% interval] (generated tokens a problem)",
        "",
        *markdown_table(["strategy", *(f"N = {n}" for n in ns)], rows),
    ]


def _comparisons(results: dict[str, Any]) -> list[str]:
    lines = []
    for c in results["comparisons"]:
        lines.append(
            f"- N = {c['n']}: {c['a']} ({c['tokens_a']:.0f} tokens) vs {c['b']} "
            f"({c['tokens_b']:.0f}): {100 * c['difference']:+.1f} points "
            f"[{100 * c['low']:+.1f}, {100 * c['high']:+.1f}] — {c['verdict']}"
        )
    return [
        "## Comparisons at equal tokens (paired by problem)",
        "",
        "The pooled strategies at one N choose among the same samples; a guided search at N has "
        "a budget of what those samples cost and spends at most that.",
        "",
        *lines,
        "",
    ]


def _screen(results: dict[str, Any]) -> list[str]:
    spec = results["spec"]
    rows = [
        [r["task"], f"{r['accuracy']:.0%} [{r['low']:.0%}, {r['high']:.0%}]", f"{r['tokens']:.0f}"]
        for r in results["screen"]
    ]
    return [
        "## Task screen: greedy accuracy of candidate tasks",
        "",
        f"{spec['screen_problems']} questions each, through the chat template, the answer read "
        "from free text (the number after the last answer marker, else the last number). The "
        f"study searches on {spec['task']} at difficulty {spec['difficulty']} (the word problem "
        "of the same difficulty below): inside the 10–50% band, with a solution of several lines "
        "for step-level search to branch on.",
        "",
        *markdown_table(["candidate", "greedy accuracy [95%]", "tokens a question"], rows),
    ]


def _accuracy_plot(results: dict[str, Any], out: Path) -> Path:
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    for name in STRATEGIES:
        cells = [c for n in results["spec"]["ns"] if (c := _cell(results, name, n))]
        if not cells:
            continue
        x = [c["tokens"] for c in cells]
        y = [c["accuracy"] for c in cells]
        colour, style = COLOURS[name], "--" if name.startswith("pass@") else "-"
        marker = "s" if name in GUIDED else "o"
        ax.plot(x, y, ls=style, marker=marker, color=colour, label=name, ms=4)
        ax.fill_between(x, [c["low"] for c in cells], [c["high"] for c in cells], color=colour,
                        alpha=0.12, lw=0)  # fmt: skip
        if len(cells) == 1:
            c = cells[0]
            ax.errorbar(x, y, yerr=[[c["accuracy"] - c["low"]], [c["high"] - c["accuracy"]]],
                        color=colour, capsize=3)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set(xlabel="generated tokens a problem (log₂)", ylabel="accuracy", ylim=(-0.02, 1.02))
    ax.set_title(
        f"{results['model']} on {results['spec']['task']}: accuracy against tokens "
        "(band: 95% interval over problems)",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.text(0.99, 0.01, f"{results['date']} · {results['environment']['cpu']} · "
             f"{results['command']}", ha="right", fontsize=5, color="0.4")  # fmt: skip
    return save_figure(fig, out / "accuracy_vs_tokens.png")


def _screen_plot(results: dict[str, Any], out: Path) -> Path:
    rows = results["screen"]
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.add_subplot()
    y = range(len(rows))
    means = [r["accuracy"] for r in rows]
    errors = [[r["accuracy"] - r["low"] for r in rows], [r["high"] - r["accuracy"] for r in rows]]
    ax.barh(list(y), means, xerr=errors, color="#1f77b4", capsize=3)
    ax.axvspan(*SCREEN_BAND, color="#2ca02c", alpha=0.12, label="10–50%: the band searched for")
    ax.set_yticks(list(y), [r["task"] for r in rows], fontsize=8)
    ax.set(xlabel="greedy accuracy (error bar: 95% interval)", xlim=(0, 1))
    ax.set_title(f"{results['model']}: greedy accuracy of candidate tasks", fontsize=9)
    ax.legend(fontsize=7)
    fig.text(0.99, 0.01, f"{results['date']} · {results['environment']['cpu']}", ha="right",
             fontsize=5, color="0.4")  # fmt: skip
    return save_figure(fig, out / "task_screen.png")
