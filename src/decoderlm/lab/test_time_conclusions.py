"""The conclusions of the test-time compute study (`decoderlm.lab.test_time`): paired comparisons
of strategies at equal tokens (`decoderlm.lab.stats`'s verdict rule over the sampling seeds) and
the "What this shows" paragraph, from results.json."""

from __future__ import annotations

from typing import Any

from decoderlm.lab.stats import RULE, Summary, compare

# (a, b) compared at every N, a spending no more tokens than b: the pooled strategies share one
# pool's first N samples; a guided search's budget is what those samples spent
PAIRS = (
    ("best-of-N (learned)", "self-consistency"),
    ("best-of-N (learned)", "best-of-N (mean log-prob)"),
    ("step-beam (learned)", "best-of-N (learned)"),
    ("MCTS (learned)", "best-of-N (learned)"),
    ("step-beam (oracle)", "best-of-N (oracle)"),
    ("MCTS (oracle)", "best-of-N (oracle)"),
)


def ttc_accuracy(
    results: dict[str, Any], strategy: str, n: int, key: str = "accuracy"
) -> Summary | None:
    """The strategy's accuracy (or tokens_per_problem) at N over seeds; None if not run."""
    row = results["summary"].get(strategy, {}).get(str(n))
    return Summary(**row[key]) if row is not None and row[key]["n"] else None


def by_seed(results: dict[str, Any], strategy: str, n: int) -> dict[int, float]:
    """{seed: accuracy} of the strategy at N."""
    return {
        r["seed"]: r["accuracy"]
        for r in results["runs"]
        if (r["strategy"], r["n"]) == (strategy, n)
    }


def ttc_comparisons(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each pair of PAIRS at each N both ran at: N, the names, their mean tokens a problem, and
    the paired comparison of their accuracy by seed (`decoderlm.lab.stats.compare`)."""
    rows = []
    for n in results["spec"]["ns"]:
        for a, b in PAIRS:
            tokens = [ttc_accuracy(results, name, n, "tokens_per_problem") for name in (a, b)]
            if None in tokens:
                continue
            rows.append({"n": n, "a": a, "b": b, "tokens": [t.mean for t in tokens],
                         "comparison": compare(by_seed(results, a, n), by_seed(results, b, n))})  # fmt: skip
    return rows


def ttc_study(results: dict[str, Any]) -> str:
    ns = results["spec"]["ns"]
    top = max(ns)
    greedy = ttc_accuracy(results, "greedy", 1)
    lines = [
        "Expected (Wang et al., 2022; Cobbe et al., 2021; Snell et al., 2024): accuracy grows with "
        "N for every sampling strategy, below pass@N (the ceiling of any verifier); an exact "
        "verifier approaches pass@N, a learned one falls between majority voting and it; at a "
        "small budget, search over steps guided by a process verifier beats best-of-N (Snell et "
        f"al., 2024). Each comparison below is paired by seed at equal tokens. {RULE}"
    ]
    parts = []
    for name in ("self-consistency", "best-of-N (mean log-prob)", "best-of-N (learned)",
                 "best-of-N (oracle)", "pass@N"):  # fmt: skip
        low, high = ttc_accuracy(results, name, min(ns)), ttc_accuracy(results, name, top)
        if low is not None and high is not None:
            parts.append(f"{name} {low.mean:.1%} → {high.mean:.1%}")
    if greedy is not None:
        lines.append(f"Measured: greedy {greedy.mean:.1%}; from N = {min(ns)} to {top}: "
                     + "; ".join(parts) + ".")  # fmt: skip
    rows = ttc_comparisons(results)
    for a, b in PAIRS:
        mine = [r for r in rows if (r["a"], r["b"]) == (a, b)]
        if not mine:
            continue
        outcomes = [r["comparison"].outcome for r in mine]
        counts = ", ".join(
            f"{outcome} at {outcomes.count(outcome)}" for outcome in dict.fromkeys(outcomes)
        )
        last = mine[-1]
        lines.append(
            f"{a} against {b} over {len(mine)} values of N: "
            f"{counts}; at N = {last['n']}: "
            f"{last['comparison'].phrase(a, b, 3)}, spending {last['tokens'][0]:,.0f} against "
            f"{last['tokens'][1]:,.0f} tokens a problem."
        )
    lines += _verifier_reading(results)
    lines += _step_searches_spent(results)
    ok = all(
        (a := ttc_accuracy(results, "pass@N", n)) is None
        or (b := ttc_accuracy(results, "best-of-N (oracle)", n)) is None
        or abs(a.mean - b.mean) < 1e-9
        for n in ns
    )
    lines.append("Oracle best-of-N equals pass@N at every N, as it must (it picks a correct "
                 "sample whenever there is one)." if ok else
                 "Oracle best-of-N differs from pass@N somewhere: a bug to look into.")  # fmt: skip
    return " ".join(lines)


def _verifier_reading(results: dict[str, Any]) -> list[str]:
    """What the verifier's AUC on the test samples means for best-of-N with it."""
    v, ns = results["verifier"], results["spec"]["ns"]
    low, high = (ttc_accuracy(results, "best-of-N (learned)", n) for n in (min(ns), max(ns)))
    if v.get("test_auc_within") is None or low is None or high is None:
        return []
    return [
        f"Among one problem's samples the learned verifier ranks a correct one above a wrong one "
        f"with probability {v['test_auc_within']:.3f} (AUC within problems, {v['test_auc']:.3f} "
        "over all samples; 0.5 ranks at random); best-of-N with it goes from "
        f"{low.mean:.1%} at N = {min(ns)} to {high.mean:.1%} at N = {max(ns)}. Identical samples "
        "score alike, so a verifier near 0.5 picks about uniformly among the distinct texts of "
        "the N samples: below one sample's accuracy, and falling with N, where the right "
        "samples repeat one text and the wrong ones differ (benchmarks/verifier_picks.py)."
    ]


def _step_searches_spent(results: dict[str, Any]) -> list[str]:
    """A sentence on what the guided searches spent at the largest N, against their budget (the
    tokens the pool's first N samples spent)."""
    top = max(results["spec"]["ns"])
    budget = ttc_accuracy(results, "pass@N", top, "tokens_per_problem")
    spent = {
        name: tokens.mean
        for name in ("step-beam (learned)", "MCTS (learned)", "step-beam (oracle)", "MCTS (oracle)")
        if (tokens := ttc_accuracy(results, name, top, "tokens_per_problem")) is not None
    }
    if not spent or budget is None:
        return []
    parts = ", ".join(f"{name} {tokens / budget.mean:.0%}" for name, tokens in spent.items())
    return [
        f"At N = {top} the guided searches spent, of their budget of {budget.mean:,.0f} tokens a "
        f"problem: {parts}."
    ]
