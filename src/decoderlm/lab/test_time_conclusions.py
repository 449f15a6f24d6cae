"""The conclusions of the test-time compute study (`decoderlm.lab.test_time`): the targets at
N = TTC_N and the "What this shows" paragraph, from results.json."""

from __future__ import annotations

import math
from typing import Any

from decoderlm.lab.stats import RULE, Summary, compare

TTC_N = 16  # the targets' N (the largest N ≤ 16 a study has, for --quick)


def ttc_accuracy(
    results: dict[str, Any], strategy: str, n: int, key: str = "accuracy"
) -> Summary | None:
    """The strategy's accuracy (or tokens_per_problem) at N over seeds; None if not run."""
    row = results["summary"].get(strategy, {}).get(str(n))
    return Summary(**row[key]) if row is not None and row[key]["n"] else None


def ttc_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The study's targets at N = TTC_N: what was measured, the target, and whether it is met."""
    n = max((m for m in results["spec"]["ns"] if m <= TTC_N), default=min(results["spec"]["ns"]))
    greedy = ttc_accuracy(results, "greedy", 1)
    sc, learned, oracle = (
        ttc_accuracy(results, name, n)
        for name in ("self-consistency", "best-of-N (learned)", "best-of-N (oracle)")
    )
    rows = []
    if greedy is not None and sc is not None:
        gain = 100 * (sc.mean - greedy.mean)
        rows.append({"target": f"self-consistency@{n} ≥ greedy + 15 points",
                     "measured": f"{gain:+.1f} points ({sc.mean:.1%} vs {greedy.mean:.1%})",
                     "met": gain >= 15})  # fmt: skip
    if oracle is not None:
        rows.append({"target": f"oracle best-of-{n} ≥ 90%", "measured": f"{oracle.mean:.1%}",
                     "met": oracle.mean >= 0.9})  # fmt: skip
    if sc is not None and learned is not None and oracle is not None:
        gap = oracle.mean - sc.mean
        closed = (learned.mean - sc.mean) / gap if gap > 0 else math.nan
        target = f"learned verifier closes ≥ half of the majority→oracle gap at {n}"
        rows.append({"target": target,
                     "measured": f"{closed:.0%} of {100 * gap:.1f} points" if gap > 0
                     else f"no gap ({sc.mean:.1%} vs {oracle.mean:.1%})",
                     "met": gap > 0 and closed >= 0.5})  # fmt: skip
    for kind in ("learned", "oracle"):
        row = _mcts_against_best_of_n(results, kind)
        if row is not None:
            rows.append(row)
    return rows


def _mcts_against_best_of_n(results: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """MCTS guided by the `kind` verifier at its largest N against best-of-N scored by the same
    kind at the largest N that spends no more tokens a problem."""
    name, peer = f"MCTS ({kind})", f"best-of-N ({kind})"
    mcts_n = max((m for m in results["spec"]["ns"] if ttc_accuracy(results, name, m)),
                 default=None)  # fmt: skip
    if mcts_n is None:
        return None
    mcts = ttc_accuracy(results, name, mcts_n)
    spent = ttc_accuracy(results, name, mcts_n, "tokens_per_problem")
    within = [
        (acc, n, tokens.mean)
        for n in results["spec"]["ns"]
        if (acc := ttc_accuracy(results, peer, n)) is not None
        and (tokens := ttc_accuracy(results, peer, n, "tokens_per_problem")) is not None
        and tokens.mean <= (spent.mean if spent else 0.0)
    ]
    if mcts is None or not within:
        return None
    bon, bon_n, bon_tokens = within[-1]
    return {"target": f"MCTS ≥ best-of-N at equal tokens ({kind} verifier)",
            "measured": f"MCTS {mcts.mean:.1%} at {spent.mean:,.0f} tokens (budget N={mcts_n}) "
            f"vs best-of-{bon_n} {bon.mean:.1%} at {bon_tokens:,.0f}",
            "met": mcts.mean >= bon.mean}  # fmt: skip


def ttc_study(results: dict[str, Any]) -> str:
    ns = results["spec"]["ns"]
    top = max(ns)
    greedy = ttc_accuracy(results, "greedy", 1)
    lines = [
        "Expected (Wang et al., 2022; Cobbe et al., 2021; Snell et al., 2024): accuracy grows with "
        "N for every sampling strategy, below pass@N (the ceiling of any verifier); an exact "
        "verifier approaches pass@N, a learned one falls between majority voting and it."
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
    learned, sc = (
        {
            r["seed"]: r["accuracy"]
            for r in results["runs"]
            if (r["strategy"], r["n"]) == (name, top)
        }
        for name in ("best-of-N (learned)", "self-consistency")
    )
    if learned and sc:
        phrase = compare(learned, sc).phrase("best-of-N (learned)", "self-consistency", 3)
        lines.append(f"At N = {top} (accuracy; {RULE}): {phrase}.")
    for row in ttc_targets(results):
        lines.append(
            f"Target '{row['target']}': {row['measured']} ({'met' if row['met'] else 'not met'})."
        )
    classifier = [c["accuracy"] for c in results["classifier"]]
    if classifier:
        accuracy = sum(classifier) / len(classifier)
        share = sum(c["correct_share"] for c in results["classifier"]) / len(classifier)
        baseline = max(share, 1 - share)  # always answering the majority class
        lines.append(
            f"The learned verifier classifies the pooled test samples at {accuracy:.1%} accuracy "
            f"({share:.1%} of them are correct, so always answering the majority class scores "
            f"{baseline:.1%}): it {'beats' if accuracy - baseline >= 0.0005 else 'does not beat'} "
            "that baseline."
        )
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


def _step_searches_spent(results: dict[str, Any]) -> list[str]:
    """A sentence on what step-level beam search and MCTS spent at the largest N, against the
    budget: they stop once every step of their tree is expanded, whatever the budget left."""
    top = max(results["spec"]["ns"])
    budget = top * results["spec"]["max_tokens"]
    spent = {
        name: tokens.mean
        for name in ("step-beam (learned)", "MCTS (learned)", "step-beam (oracle)", "MCTS (oracle)")
        if (tokens := ttc_accuracy(results, name, top, "tokens_per_problem")) is not None
    }
    if not spent:
        return []
    most = max(spent.values())
    return [
        f"At N = {top} step-level beam search and MCTS spent at most {most:,.0f} generated tokens "
        f"a problem of a budget of {budget:,} ({most / budget:.0%}): they stop when no step of "
        "their tree is left to expand (each node is expanded once, and equal samples merge), so "
        "their accuracy stops growing with the budget."
    ]
