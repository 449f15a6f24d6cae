"""results.json of the test-time compute study (`decoderlm.lab.test_time`) → report.md, plots.

Every number is read from results.json: accuracy and tokens per strategy and N (mean ± spread
over seeds), comparisons at equal tokens, the learned verifier (its fit and its AUC on the test
samples), and the engine's throughput and prefix-cache reuse as N grows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.figure import Figure

from decoderlm.lab.report import fmt, header, markdown_table, save_figure, write_lines
from decoderlm.lab.stats import RULE
from decoderlm.lab.test_time import STRATEGIES
from decoderlm.lab.test_time_conclusions import ttc_accuracy, ttc_comparisons
from decoderlm.lab.test_time_verifier import verifier_section


def write_report(results: dict[str, Any], out: str | Path) -> Path:
    """Write OUT/report.md and the plots it embeds; returns the report's path."""
    out = Path(out)
    spec = results["spec"]
    policy, verifier = results["policy"], results["verifier"]
    chosen = policy["chosen"]
    plots = [_accuracy_plot(results, out), _engine_plot(results, out)]
    lines = [
        *header(results),
        f"- wall time: {results['wall_s']:.0f} s in the last invocation (policy "
        f"{policy['wall_s']:.0f} s when trained, verifier {verifier['wall_s']:.0f} s)",
        f"- policy: {spec['model']} trained {policy['steps']} steps ({spec['train']}) on "
        f"{spec['corpus_problems']:,} worked {spec['task']} problems at difficulty "
        f"{spec['difficulty']}; of its checkpoints, step {chosen['step']} (val loss "
        f"{fmt(chosen['val_loss'], '{:.4f}')}), whose greedy accuracy on "
        f"{spec['select_problems']} held-out train-split problems, {chosen['accuracy']:.0%}, is "
        f"nearest {spec['target_accuracy']:.0%} (the curve below); run {policy['run_dir']}",
        f"- learned verifier: a head on the policy's frozen states (below), fit "
        f"{spec['head_steps']} steps on its samples ({spec['verifier_samples']} each) of "
        f"{spec['verifier_problems']} train problems",
        f"- protocol: {results['problems']} test problems, {spec['seeds']} sampling seeds (the "
        "policy, the verifier and the problems are the same for every seed); spread = standard "
        "deviation over seeds; self-consistency, best-of-N and pass@N take the first N of one "
        f"pool of samples a problem (≤ {spec['max_tokens']} tokens each), temperature "
        f"{spec['temperature']:g}; token-level beam width N (N ≤ {spec['beam_max']}); step-level "
        f"beam width N/8, MCTS with progressive widening α = {spec['widening']:g}, expanding "
        f"{spec['expand']} steps of ≤ {spec['step_tokens']} tokens, each new step valued (no "
        "rollouts) by the learned verifier, and again by the exact process verifier (on the "
        "worked solution's path or accepted by the checker: the ceiling of step-level guidance); "
        "the beam and guided searches get a budget of the tokens the pool's first N samples of "
        "the problem spent",
        "",
        *_accuracy_table(results),
        *_policy_curve(results),
        *_comparisons(results),
        *verifier_section(results["verifier"], "the policy"),
        *_engine(results),
    ]
    return write_lines(out, lines, plots, results)


def _accuracy_table(results: dict[str, Any]) -> list[str]:
    ns = results["spec"]["ns"]
    rows = []
    for name in STRATEGIES:
        cells = [name]
        for n in ns:
            acc = ttc_accuracy(results, name, n)
            tokens = ttc_accuracy(results, name, n, "tokens_per_problem")
            cells.append(
                "—" if acc is None or tokens is None
                else f"{acc.mean:.1%} ± {acc.spread:.1%} ({tokens.mean:,.0f})"
            )  # fmt: skip
        rows.append(cells)
    return [
        f"## Accuracy (mean ± spread over {results['spec']['seeds']} seeds; generated tokens a "
        "problem in parentheses)",
        "",
        *markdown_table(["strategy", *(f"N = {n}" for n in ns)], rows),
    ]


def _policy_curve(results: dict[str, Any]) -> list[str]:
    policy, spec = results["policy"], results["spec"]
    rows = [
        [f"{c['step']:,}", fmt(c["val_loss"], "{:.4f}"), f"{c['accuracy']:.0%}"]
        for c in policy["curve"]
    ]
    return [
        "## The policy's checkpoints",
        "",
        f"Greedy accuracy of each checkpoint on {spec['select_problems']} held-out train-split "
        "problems (not the test problems), from which the study's policy was chosen.",
        "",
        *markdown_table(["step", "val loss", "greedy accuracy"], rows),
        "",
    ]


def _comparisons(results: dict[str, Any]) -> list[str]:
    rows = [
        [str(r["n"]), r["a"], r["b"], f"{r['tokens'][0]:,.0f} / {r['tokens'][1]:,.0f}",
         r["comparison"].phrase("a", "b", 3)]
        for r in ttc_comparisons(results)
    ]  # fmt: skip
    return [
        "## Comparisons at equal tokens",
        "",
        "Accuracy of a against b, paired by sampling seed; a spends no more generated tokens a "
        "problem than b (the pooled strategies choose among the same N samples; a guided "
        f"search's budget is what those samples spent). {RULE}",
        "",
        *markdown_table(["N", "a", "b", "tokens a problem (a / b)", "verdict"], rows),
    ]


def _engine(results: dict[str, Any]) -> list[str]:
    probe = [
        [str(r["n"]), f"{r['generated']:,}", f"{r['tokens_per_s']:,.0f}", f"{r['reuse']:.2f}"]
        for r in results["engine"]
    ]
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in results["searches"]:
        groups.setdefault((row["strategy"], row["n"]), []).append(row)
    searches = []
    for (name, n), rows in groups.items():
        generated, seconds = sum(r["generated"] for r in rows), sum(r["seconds"] for r in rows)
        prompt, hits = sum(r["prompt"] for r in rows), sum(r["prefix_hits"] for r in rows)
        searches.append([name, str(n), f"{generated / max(seconds, 1e-9):,.0f}",
                         f"{hits / max(prompt, 1):.2f}"])  # fmt: skip
    return [
        "## The engine as N grows",
        "",
        f"Sampling N solutions of each of the first {results['spec']['probe_problems']} test "
        "problems in one call: generated tokens/s, and the prefix cache's reuse: prompt tokens "
        "whose KV blocks a sequence found cached, per prompt token submitted (a request's N "
        "sequences each reuse its prompt's blocks, so it can exceed 1). A prompt shorter than "
        "a KV block (16 tokens) has no full block to share; the step-level searches resubmit "
        "longer partial solutions.",
        "",
        *markdown_table(
            ["N", "generated tokens", "tokens/s", "reused KV tokens per prompt token"], probe
        ),
        "Over each search (all seeds and problems):",
        "",
        *markdown_table(
            ["strategy", "N", "tokens/s", "reused KV tokens per prompt token"], searches
        ),
    ]


def _accuracy_plot(results: dict[str, Any], out: Path) -> Path:
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    for i, name in enumerate(STRATEGIES):
        points = []
        for n in results["spec"]["ns"]:
            acc = ttc_accuracy(results, name, n)
            tokens = ttc_accuracy(results, name, n, "tokens_per_problem")
            if acc is not None and tokens is not None and tokens.mean > 0:
                points.append((tokens.mean, acc.mean, acc.spread))
        if points:
            x, y, err = zip(*points, strict=True)
            style = "--" if name == "pass@N" else "-"
            ax.errorbar(x, y, yerr=err, fmt=f"o{style}", color=colormaps["tab20"](i), label=name,
                        capsize=2, ms=3)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set(xlabel="generated tokens a problem (log₂)", ylabel="accuracy", ylim=(-0.02, 1.02))
    ax.set_title("accuracy against test-time compute (error bar = spread over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, out / "accuracy_vs_tokens.png")


def _engine_plot(results: dict[str, Any], out: Path) -> Path:
    fig = Figure(figsize=(10, 4), layout="constrained")
    rows = results["engine"]
    ns = [r["n"] for r in rows]
    for j, (key, label) in enumerate((("tokens_per_s", "generated tokens/s"),
                                       ("reuse", "reused KV tokens per prompt token"))):  # fmt: skip
        ax = fig.add_subplot(1, 2, j + 1)
        ax.plot(ns, [r[key] for r in rows], "o-")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="N (samples of each prompt)", ylabel=label)
        ax.grid(alpha=0.3)
    fig.suptitle("the engine as N grows")
    return save_figure(fig, out / "engine.png")
