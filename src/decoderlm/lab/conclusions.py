"""The "what this shows" paragraph of each study, filled from results.json.

Each built-in study states the claim the literature expects and then says, from the measured
numbers and the seed rule of `decoderlm.lab.stats`, whether the data support it; a study of the
user's own (`--spec`) gets the ranking against the best variant.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from decoderlm.lab.recall import RecallTask
from decoderlm.lab.stats import Summary, distinguishable, verdict


def _loss(results: dict[str, Any], name: str, key: str = "val_loss") -> Summary | None:
    row = results["summary"].get(name, {})
    return Summary(**row[key]) if key in row and row[key]["n"] else None


def _compare(
    results: dict[str, Any], a: str, b: str, key: str = "val_loss", lower_is_better: bool = True
) -> str:
    sa, sb = _loss(results, a, key), _loss(results, b, key)
    if sa is None or sb is None:
        return f"{a} vs {b}: no finite {key} to compare"
    return verdict(a, sa, b, sb, lower_is_better)


def ranking(results: dict[str, Any]) -> list[str]:
    """Each variant against the one with the lowest mean val loss."""
    scored = {n: s for n in results["summary"] if (s := _loss(results, n)) is not None}
    if len(scored) < 2:
        return []
    best = min(scored, key=lambda n: scored[n].mean)
    return [_compare(results, best, n) for n in scored if n != best]


def recall_ranking(results: dict[str, Any]) -> list[str]:
    """Each variant's recall accuracy against the one with the highest mean."""
    key = "recall_accuracy"
    scored = {n: s for n in results["summary"] if (s := _loss(results, n, key)) is not None}
    if not scored:
        return []
    best = max(scored, key=lambda n: scored[n].mean)
    lines = [f"{n}: {s.mean:.3f} ± {s.spread:.3f}" for n, s in scored.items()]
    lines += [_compare(results, best, n, key, lower_is_better=False) for n in scored if n != best]
    return lines


def _worse(
    results: dict[str, Any], a: str, b: str, key: str = "val_loss", lower_is_better: bool = True
) -> bool:
    """a's mean is distinguishably worse than b's (above it, where lower is better)."""
    sa, sb = _loss(results, a, key), _loss(results, b, key)
    if sa is None or sb is None or not distinguishable(sa, sb):
        return False
    return sa.mean > sb.mean if lower_is_better else sa.mean < sb.mean


def _supported(ok: bool) -> str:
    if ok:
        return "The data are consistent with this (no difference against it at these seeds)."
    return "The data do not support this at these seeds."


def attention_variants(results: dict[str, Any]) -> str:
    table = results["summary"]
    mha, mqa = table["MHA"], table["MQA"]
    ratio = mha["kv_bytes_per_token"] / mqa["kv_bytes_per_token"]
    lines = [
        "Expected: grouped-query attention keeps multi-head quality at a fraction of the KV cache; "
        "MQA saves the most memory at some cost in quality.",
        f"Measured: {'; '.join(_compare(results, 'MHA', n) for n in ('GQA-4', 'GQA-2', 'MQA'))}.",
        f"The cache per token falls {ratio:g}× from MHA to MQA, so the longest context in the "
        f"budget grows from {mha['kv_max_context']:,} to {mqa['kv_max_context']:,} tokens.",
        _supported(not any(_worse(results, n, "MHA") for n in ("GQA-4", "GQA-2"))),
    ]
    return " ".join(lines)


def positions(results: dict[str, Any]) -> str:
    parts = []
    for name in results["summary"]:
        at1, at4 = _loss(results, name, "loss_1x"), _loss(results, name, "loss_4x")
        if at1 is not None and at4 is not None:
            parts.append(f"{name} {at1.mean:.3f} → {at4.mean:.3f}")
        elif at1 is not None:
            parts.append(f"{name} {at1.mean:.3f} → n/a (no positions past the table)")
    degrades = [n for n in ("sinusoidal", "rope") if _rises(results, n)]
    return " ".join(
        [
            "Expected: the models rank close at the training context; past it, sinusoidal and "
            "RoPE degrade (they never saw those positions), learned positions cannot run at all.",
            f"At the training context: {'; '.join(ranking(results)) or 'one variant'}.",
            f"Loss at 1× → 4× the training context: {', '.join(parts)}.",
            _supported(len(degrades) == 2),
        ]
    )


def _rises(results: dict[str, Any], name: str) -> bool:
    """loss_4x distinguishably above loss_1x for this variant."""
    a, b = _loss(results, name, "loss_4x"), _loss(results, name, "loss_1x")
    return a is not None and b is not None and distinguishable(a, b) and a.mean > b.mean


def scaling(results: dict[str, Any]) -> str:
    stats = results["init_stats"]
    first, last = stats[0][0], stats[0][-1]
    lines = [
        "Expected: var(q·k) grows as d_k while var(q·k/√d_k) stays at 1, so without the scale "
        "the softmax saturates (entropy → 0) and its gradient vanishes as d_k grows.",
        f"Measured (seed 0): var(q·k) = {first['var_qk']:.1f} at d_k = {first['d_k']} and "
        f"{last['var_qk']:.1f} at d_k = {last['d_k']}; scaled {first['var_qk_scaled']:.2f} and "
        f"{last['var_qk_scaled']:.2f}; entropy unscaled {first['entropy_raw']:.2f} → "
        f"{last['entropy_raw']:.2f} nats, scaled {first['entropy_scaled']:.2f} → "
        f"{last['entropy_scaled']:.2f}.",
    ]
    ok = (
        last["entropy_raw"] < last["entropy_scaled"]
        and last["grad_norm_raw"] < last["grad_norm_scaled"]
    )
    lines.append(_supported(ok))
    names = list(results["summary"])
    if names:
        pairs = [(a, b) for a in names for b in names if a.split()[0] == b.split()[0] and a < b]
        lines.append("Trained: " + "; ".join(_compare(results, a, b) for a, b in pairs) + ".")
    return " ".join(lines)


def norm_placement(results: dict[str, Any]) -> str:
    table = results["summary"]
    k = results["spec"]["seeds"]
    pre = {n: r for n, r in table.items() if n.startswith("pre")}
    post = {n: r for n, r in table.items() if n.startswith("post")}
    post_div = sum(r["diverged"] for r in post.values())
    pre_div = sum(r["diverged"] for r in pre.values())
    pairs = [(n, "post" + n[3:]) for n in pre if "post" + n[3:] in post]
    without = [p for p in pairs if "no-warmup" in p[0]]
    post_hurt = [p for p in without if _worse(results, p[1], p[0]) or table[p[1]]["diverged"]]
    return " ".join(
        [
            "Expected (Xiong et al., 2020): Post-LN needs warmup and diverges or lags at large "
            "learning rates and depth; Pre-LN trains without warmup.",
            f"Diverged runs: Pre-LN {pre_div}/{len(pre) * k}, Post-LN {post_div}/{len(post) * k}.",
            f"Without warmup, Post-LN is worse or diverged in {len(post_hurt)} of {len(without)} "
            "settings: " + "; ".join(_compare(results, a, b) for a, b in without) + ".",
            _supported(bool(without) and len(post_hurt) > len(without) / 2),
        ]
    )


def uptrain_gqa(results: dict[str, Any]) -> str:
    names = ("GQA-4", "GQA-2", "MQA")
    control_ok = not _worse(results, "MHA-continued", "MHA")
    up_ok = not any(_worse(results, f"{n} up-trained", f"{n} scratch") for n in names)
    return " ".join(
        [
            "Expected (Ainslie et al., 2023): mean-pooled, briefly up-trained GQA/MQA match or beat "
            "the same shapes trained from scratch, and the up-training schedule does not harm "
            "the MHA original (the control).",
            f"Control: {_compare(results, 'MHA-continued', 'MHA')}.",
            "Up-trained vs scratch: "
            + "; ".join(_compare(results, f"{n} up-trained", f"{n} scratch") for n in names)
            + ".",
            _supported(control_ok and up_ok),
        ]
    )


RECURRENT = ("linear attention", "Gated DeltaNet", "Mamba-2")  # the hybrid study's pure variants
HYBRIDS = ("hybrid 3:1", "hybrid 1:1")


MEMORY_CONTEXTS = (4096, 32768, 131072)  # the contexts of `decoderlm info`'s cache table


def sequence_bytes(row: dict[str, Any], context: int) -> int:
    """One sequence's inference memory at `context` tokens, from a summary row: its KV cache
    (`decoderlm.model.cache.kv_cache_bytes`: KV bytes per token × tokens) plus its recurrent state
    (`recurrent_state_bytes`, fixed)."""
    return row["kv_bytes_per_token"] * context + row.get("state_bytes", 0)


def hybrid(results: dict[str, Any]) -> str:
    table, ref = results["summary"], "attention"
    others = [n for n in table if n != ref]
    at = MEMORY_CONTEXTS[-1]
    memory = ", ".join(
        f"{n} {sequence_bytes(table[n], at) / sequence_bytes(table[ref], at):.3g}" for n in others
    )
    speed = _loss(results, ref, "train_tokens_per_s")
    speeds = ", ".join(
        f"{n} {s.mean / speed.mean:.2f}×"
        for n in others
        if speed is not None and (s := _loss(results, n, "train_tokens_per_s")) is not None
    )
    recall = "recall_accuracy"
    copying = 1 / RecallTask(**results["spec"]["recall"]).n_pairs  # a shown value, no lookup
    lookup = [n for n in table if (s := _loss(results, n, recall)) and s.mean - s.spread > copying]
    short = [n for n in RECURRENT if _worse(results, n, ref, recall, lower_is_better=False)]
    recovered = [n for n in HYBRIDS if not _worse(results, n, ref, recall, lower_is_better=False)]
    return " ".join(
        [
            "Expected (Arora et al., 2023; Yang et al., 2024): at matched size the recurrent "
            "layers come close to attention in language-model loss but fall short on "
            "associative recall, which a few attention layers recover; their memory per sequence "
            "does not grow with the context.",
            f"Val loss against attention: {'; '.join(_compare(results, ref, n) for n in others)}.",
            "Recall accuracy against attention: "
            + "; ".join(_compare(results, ref, n, recall, False) for n in others)
            + ".",
            f"Recall above {copying:.3f} (copying one of the shown values, no lookup) by more "
            f"than its spread: {', '.join(lookup) or 'none'}.",
            f"Pure recurrent variants below attention in recall: {', '.join(short) or 'none'}; "
            f"hybrids not below it: {', '.join(recovered) or 'none'}.",
            f"Memory of one sequence at {at // 1024}k tokens ÷ attention's: {memory}.",
            f"Training tokens/s ÷ attention's (this CPU, noisy on a shared machine): {speeds}.",
            _supported(len(short) == len(RECURRENT) and len(recovered) == len(HYBRIDS))
            if ref in lookup
            else "Attention did not learn the lookup in the recall budget, so the recall numbers "
            "do not test the claim: give the recall task more steps (`recall` of the spec).",
        ]
    )


# ---- test-time compute (decoderlm.lab.test_time) ----------------------------------------------

TTC_N = 16  # the targets' N (the largest N ≤ 16 a study has, for --quick)


def ttc_accuracy(
    results: dict[str, Any], strategy: str, n: int, key: str = "accuracy"
) -> Summary | None:
    """The strategy's accuracy (or tokens_per_problem) at N over seeds; None if not run."""
    row = results["summary"].get(strategy, {}).get(str(n))
    return Summary(**row[key]) if row is not None and row[key]["n"] else None


def ttc_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 30's targets at N = TTC_N: what was measured, the target, and whether it is met."""
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
        ttc_accuracy(results, "best-of-N (learned)", top),
        ttc_accuracy(results, "self-consistency", top),
    )
    if learned is not None and sc is not None:
        lines.append(f"At N = {top}: " + verdict("best-of-N (learned)", learned,
                     "self-consistency", sc, lower_is_better=False) + ".")  # fmt: skip
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


CONCLUSIONS: dict[str, Callable[[dict[str, Any]], str]] = {
    "test-time-compute": ttc_study,
    "attention-variants": attention_variants,
    "positions": positions,
    "scaling": scaling,
    "norm-placement": norm_placement,
    "uptrain-gqa": uptrain_gqa,
    "hybrid": hybrid,
}


def conclude(results: dict[str, Any]) -> str:
    study = CONCLUSIONS.get(results["study"])
    if study is not None and results["spec"]["builtin"]:
        return study(results)
    lines = ranking(results)
    if not lines:
        return "Fewer than two variants with a finite val loss: nothing to compare."
    return "Val loss against the best variant: " + "; ".join(lines) + "."
