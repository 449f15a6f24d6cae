"""The "What this shows" section of each study, from results.json.

A built-in study lists what its papers lead one to expect, each expectation a comparison of two
per-seed series (a variant's metric against another's, or against its own at another setting).
`stats.compare` decides each by the verdict rule (`stats.RULE`), which the section prints beside
the table with the run-health rule (`measure.HEALTH_RULE`); the verdict counts the expectations
the numbers bear out, contradict, or cannot tell apart. A study of one's own (`--spec`) gets each
variant against the best.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from decoderlm.lab.measure import HEALTH_RULE, HEALTHY
from decoderlm.lab.recall import RecallTask
from decoderlm.lab.stats import (
    A_FAILS,
    B_FAILS,
    BOTH_FAIL,
    HIGHER,
    LOWER,
    MIN_SEEDS,
    RULE,
    SAME,
    TOO_FEW,
    Comparison,
    Summary,
    compare,
)
from decoderlm.lab.test_time_conclusions import ttc_study

# What an expectation says of a against b
EXPECT_LOWER, EXPECT_HIGHER, EXPECT_EQUAL, EXPECT_NOT_HIGHER = LOWER, HIGHER, "equal", "not higher"
AS_EXPECTED, CONTRADICTS = "as expected", "contradicts"
NO_VERDICT = "too few seeds for a verdict"

Series = dict[int, float | None]  # {seed: value}, None for a run that failed
EQUALITY = (
    ' An expectation of no difference is met by "not distinguishable", which does not prove '
    "equality: the interval bounds the difference these seeds leave possible."
)


@dataclass(frozen=True)
class Expectation:
    claim: str  # what the paper leads one to expect, in words
    a: tuple[str, Series]  # (label, values)
    b: tuple[str, Series]
    expect: str  # EXPECT_*: a against b
    lower_is_better: bool = True  # how a failed run ranks: worse


def judge(e: Expectation) -> tuple[Comparison, str]:
    """The comparison of e's series and its verdict: AS_EXPECTED, CONTRADICTS, "not
    distinguishable", NO_VERDICT or "both fail"."""
    c = compare(e.a[1], e.b[1])
    worse_a, worse_b = (HIGHER, LOWER) if e.lower_is_better else (LOWER, HIGHER)
    found = {A_FAILS: worse_a, B_FAILS: worse_b}.get(c.outcome, c.outcome)
    if found == TOO_FEW:
        return c, NO_VERDICT
    if found == BOTH_FAIL:
        return c, "both fail: no verdict"
    if e.expect in (EXPECT_EQUAL, EXPECT_NOT_HIGHER) and found == SAME:
        return c, f"{AS_EXPECTED} (not distinguishable)"
    if e.expect == EXPECT_EQUAL:
        return c, CONTRADICTS
    if e.expect == EXPECT_NOT_HIGHER:
        return c, CONTRADICTS if found == HIGHER else AS_EXPECTED
    if found == SAME:
        return c, SAME
    return c, AS_EXPECTED if found == e.expect else CONTRADICTS


def verdict_section(
    results: dict[str, Any], expected: str, expectations: list[Expectation], facts: list[str]
) -> list[str]:
    """The section's lines: what the papers lead one to expect, the table of expectations with
    their measured differences and verdicts, the count, the rules, and facts that need no seeds."""
    rows, verdicts = [], []
    for e in expectations:
        c, v = judge(e)
        rows.append(f"| {e.claim} | {c.phrase(e.a[0], e.b[0])} | {v} |")
        verdicts.append(v)
    lines = [f"Expected: {expected}", ""]
    if rows:
        lines += ["| expectation (a against b) | measured | verdict |", "|---|---|---|", *rows, ""]
        lines += [f"**Verdict**: {_tally(results, verdicts)}", ""]
    lines += [*(f"- {fact}" for fact in facts), "" if facts else None]
    lines += [RULE + EQUALITY, "", HEALTH_RULE]
    return [line for line in lines if line is not None]


def _tally(results: dict[str, Any], verdicts: list[str]) -> str:
    seeds = results["spec"]["seeds"]
    if all(v == NO_VERDICT for v in verdicts):
        return f"{NO_VERDICT} ({seeds} seeds; a verdict needs {MIN_SEEDS} healthy seeds a variant)."
    counts = {
        "as expected": sum(v.startswith(AS_EXPECTED) for v in verdicts),
        "contradicted": sum(v == CONTRADICTS for v in verdicts),
        "not distinguishable": sum(v == SAME for v in verdicts),
        "too few seeds for a verdict": sum(v == NO_VERDICT for v in verdicts),
        "both variants failed": sum(v.startswith("both fail") for v in verdicts),
    }
    parts = [f"{n} {what}" for what, n in counts.items() if n]
    return f"of {len(verdicts)} expectations, " + ", ".join(parts) + "."


def series(results: dict[str, Any], variant: str, key: str = "val_loss") -> Series:
    """{seed: the run's `key`} of a variant, None where the run is not healthy."""
    return {
        r["seed"]: r.get(key) if r["health"] == HEALTHY else None
        for r in results["runs"]
        if r["variant"] == variant
    }


def _summary(results: dict[str, Any], name: str, key: str = "val_loss") -> Summary | None:
    row = results["summary"].get(name, {})
    return Summary(**row[key]) if key in row and row[key]["n"] else None


def ranking(results: dict[str, Any]) -> list[str]:
    """Each variant's val loss against the variant with the lowest mean, by the verdict rule."""
    scored = {n: s for n in results["summary"] if (s := _summary(results, n)) is not None}
    if len(scored) < 2:
        return []
    best = min(scored, key=lambda n: scored[n].mean)
    return [
        compare(series(results, n), series(results, best)).phrase(n, best)
        for n in results["summary"]
        if n != best
    ]


def _vs(
    results: dict[str, Any], claim: str, a: str, b: str, expect: str, key: str = "val_loss"
) -> Expectation:
    return Expectation(claim, (a, series(results, a, key)), (b, series(results, b, key)), expect)


def attention_variants(results: dict[str, Any]) -> list[str]:
    table, mha = results["summary"], results["spec"]["reference"]
    mqa = "MQA"
    ratio = table[mha]["kv_bytes_per_token"] / table[mqa]["kv_bytes_per_token"]
    expectations = [
        _vs(results, f"{g} matches {mha}'s val loss", g, mha, EXPECT_EQUAL)
        for g in table
        if g.startswith("GQA")
    ]
    expectations.append(_vs(results, f"MQA's val loss is above {mha}'s", mqa, mha, EXPECT_HIGHER))
    facts = [
        f"The KV cache per token falls {ratio:g}× from {mha} to MQA, so the longest context in "
        f"the budget grows from {table[mha]['kv_max_context']:,} to "
        f"{table[mqa]['kv_max_context']:,} tokens."
    ]
    expected = (
        "grouped-query attention keeps multi-head quality at a fraction of the KV cache; MQA "
        "saves the most memory at some cost in quality (Shazeer, 2019; Ainslie et al., 2023)."
    )
    return verdict_section(results, expected, expectations, facts)


def positions(results: dict[str, Any]) -> list[str]:
    names = results["summary"]
    expectations = [
        Expectation(
            f"{n}: the loss at 4× the training context is above the loss at 1×",
            (f"{n} @4×", series(results, n, "loss_4x")),
            (f"{n} @1×", series(results, n, "loss_1x")),
            EXPECT_HIGHER,
        )
        for n in ("sinusoidal", "rope")
        if n in names
    ]
    if "none" in names and "rope" in names:
        expectations.append(
            _vs(
                results,
                "NoPE's rise from 1× to 4× is below RoPE's (Kazemnejad et al., 2023)",
                "none",
                "rope",
                EXPECT_LOWER,
                "loss_rise_4x",
            )
        )
    for other in ("sinusoidal", "learned"):
        if other in names and "rope" in names:
            expectations.append(
                _vs(
                    results,
                    f"RoPE's val loss is below {other}'s (Su et al., 2021)",
                    "rope",
                    other,
                    EXPECT_LOWER,
                )
            )
    parts = []
    for name in names:
        at1, at4 = _summary(results, name, "loss_1x"), _summary(results, name, "loss_4x")
        if at1 is not None:
            parts.append(
                f"{name} {at1.mean:.3f} → {at4.mean:.3f}"
                if at4 is not None
                else f"{name} {at1.mean:.3f} → n/a (no positions past the table)"
            )
    facts = [f"Mean loss at 1× → 4× the training context: {', '.join(parts)}."] if parts else []
    expected = (
        "sinusoidal and RoPE degrade past the training context (they never saw those positions), "
        "NoPE degrades less (Kazemnejad et al., 2023), learned positions cannot run past their "
        "table at all; at the training context RoPE trains to a lower loss (Su et al., 2021)."
    )
    return verdict_section(results, expected, expectations, facts)


def scaling(results: dict[str, Any]) -> list[str]:
    stats = results["init_stats"]
    first, last = stats[0][0], stats[0][-1]

    def at_init(key: str) -> Series:  # the largest d_k's statistic, per seed
        return {seed: rows[-1][key] for seed, rows in enumerate(stats)}

    expectations = [
        Expectation(
            f"at d_k = {last['d_k']} and initialisation, the softmax of QKᵀ has lower "
            "entropy than that of QKᵀ/√d_k",
            ("QKᵀ", at_init("entropy_raw")),
            ("QKᵀ/√d_k", at_init("entropy_scaled")),
            EXPECT_LOWER,
        ),
        Expectation(
            f"… and a smaller gradient ‖∂softmax/∂s‖ (d_k = {last['d_k']})",
            ("QKᵀ", at_init("grad_norm_raw")),
            ("QKᵀ/√d_k", at_init("grad_norm_scaled")),
            EXPECT_LOWER,
        ),
    ]
    for group in sorted({n.split()[0] for n in results["summary"]}, key=_d_k):
        scaled, unscaled = f"{group} scaled", f"{group} unscaled"
        if scaled in results["summary"] and unscaled in results["summary"]:
            expectations.append(
                _vs(
                    results,
                    f"{group}: trained without the scale, the val loss is higher",
                    unscaled,
                    scaled,
                    EXPECT_HIGHER,
                )
            )
    facts = [
        f"Seed 0 at initialisation: var(q·k) = {first['var_qk']:.1f} at d_k = {first['d_k']} and "
        f"{last['var_qk']:.1f} at d_k = {last['d_k']}; scaled {first['var_qk_scaled']:.2f} and "
        f"{last['var_qk_scaled']:.2f}; entropy unscaled {first['entropy_raw']:.2f} → "
        f"{last['entropy_raw']:.2f} nats, scaled {first['entropy_scaled']:.2f} → "
        f"{last['entropy_scaled']:.2f}."
    ]
    expected = (
        "var(q·k) grows as d_k while var(q·k/√d_k) stays at 1, so without the scale the softmax "
        "saturates (entropy → 0), its gradient vanishes as d_k grows, and training suffers "
        "(Vaswani et al., 2017, §3.2.1)."
    )
    return verdict_section(results, expected, expectations, facts)


def _d_k(group: str) -> int:
    return int(group.split("=")[1])


def norm_placement(results: dict[str, Any]) -> list[str]:
    table = results["summary"]
    expectations = []
    for name in table:
        if not name.startswith("post-LN") or not name.endswith(" no-warmup"):
            continue
        setting = name.removeprefix("post-LN ").removesuffix(" no-warmup")
        pre, warm = f"pre-LN {setting} no-warmup", f"post-LN {setting} warmup"
        if pre in table:
            expectations.append(
                _vs(
                    results,
                    f"{setting}, no warmup: Post-LN's val loss is above Pre-LN's (or it fails)",
                    name,
                    pre,
                    EXPECT_HIGHER,
                )
            )
        if warm in table:
            expectations.append(
                _vs(
                    results,
                    f"{setting}: Post-LN without warmup is above Post-LN with it (or fails)",
                    name,
                    warm,
                    EXPECT_HIGHER,
                )
            )
    facts = []
    for placement in ("pre-LN", "post-LN"):
        rows = [row["health"] for n, row in table.items() if n.startswith(placement)]
        counts = {c: sum(h[c] for h in rows) for c in rows[0]} if rows else {}
        total = sum(counts.values())
        facts.append(
            f"{placement} runs: " + ", ".join(f"{k} {v}/{total}" for k, v in counts.items())
        )
    expected = (
        "Post-LN needs warmup, and without it lags or fails at large learning rates and depth; "
        "Pre-LN trains without warmup (Xiong et al., 2020)."
    )
    return verdict_section(results, expected, expectations, facts)


def uptrain_gqa(results: dict[str, Any]) -> list[str]:
    table = results["summary"]
    mha = next(n for n in table if n.startswith("MHA") and "continued" not in n)
    control = f"{mha} continued"
    expectations = [
        _vs(
            results,
            "the up-training recipe does not raise the MHA original's val loss (the control)",
            control,
            mha,
            EXPECT_NOT_HIGHER,
        )
    ]
    for name in table:
        if not name.endswith(" up-trained"):
            continue
        shape = name.removesuffix(" up-trained")
        expect = EXPECT_HIGHER if shape == "MQA" else EXPECT_EQUAL
        words = "is above" if shape == "MQA" else "matches"
        expectations.append(
            _vs(
                results,
                f"{shape} up-trained {words} {control}'s val loss",
                name,
                control,
                expect,
            )
        )
        if f"{shape} scratch" in table:
            expectations.append(
                _vs(
                    results,
                    f"{shape} up-trained is no higher than {shape} "
                    "trained from scratch on 1 + α of the budget",
                    name,
                    f"{shape} scratch",
                    EXPECT_NOT_HIGHER,
                )
            )
    pooled = [
        f"{n.removesuffix(' up-trained')} {s.mean:.3f}"
        for n in table
        if (s := _summary(results, n, "val_loss_pooled")) is not None
    ]
    facts = [f"Val loss right after mean-pooling, before up-training: {', '.join(pooled)}."]
    alpha = next(v["budget_scale"] for v in results["spec"]["variants"] if v["init_from"])
    expected = (
        f"mean-pooled GQA up-trained for α = {alpha:.0%} of the pre-training steps with the same "
        "recipe comes close to MHA trained as long (the original continued), MQA a little "
        "below it; the up-training recipe itself "
        "does not harm MHA (Ainslie et al., 2023, §2.1 and Fig. 6); and the up-trained model is "
        "no worse than the same shape trained from scratch on the same total steps."
    )
    return verdict_section(results, expected, expectations, facts)


RECURRENT = ("linear attention", "Gated DeltaNet", "Mamba-2")  # the hybrid study's pure variants
HYBRIDS = ("hybrid 3:1", "hybrid 1:1")
SOLVED = 0.9  # attention "solves" recall at a head count: mean accuracy ≥ this at every N
MEMORY_CONTEXTS = (4096, 32768, 131072)  # the contexts of `decoderlm info`'s cache table


def sequence_bytes(row: dict[str, Any], context: int) -> int:
    """One sequence's inference memory at `context` tokens, from a summary row: its KV cache
    (`decoderlm.model.cache.kv_cache_bytes`: KV bytes per token × tokens) plus its recurrent state
    (`recurrent_state_bytes`, fixed)."""
    return row["kv_bytes_per_token"] * context + row.get("state_bytes", 0)


def recall_series(results: dict[str, Any], variant: str, heads: int, pairs: int) -> Series:
    """{seed: recall accuracy} of a mix's recall runs at this head count and pair count."""
    return {
        r["seed"]: r["accuracy"][str(pairs)]
        for r in results["recall"]["runs"]
        if r["variant"] == variant and r["heads"] == heads
    }


def recall_mean(results: dict[str, Any], variant: str, heads: int, pairs: int) -> float:
    values = list(recall_series(results, variant, heads, pairs).values())
    return sum(values) / len(values) if values else math.nan


def solved_heads(results: dict[str, Any]) -> list[int]:
    """The head counts at which attention's mean accuracy is ≥ SOLVED at every pair count."""
    task = RecallTask(**results["recall"]["task"])
    reference = next(iter(task.mixes))
    return [
        h
        for h in task.heads
        if all(recall_mean(results, reference, h, n) >= SOLVED for n in task.pairs)
    ]


def _recall_expectations(results: dict[str, Any]) -> tuple[list[Expectation], str]:
    """The recall expectations at the head counts where attention solved the task, and a sentence
    on which those are."""
    task = RecallTask(**results["recall"]["task"])
    ref = next(iter(task.mixes))
    solved = solved_heads(results)
    if not solved:
        return [], (
            f"Attention did not solve the recall task (mean accuracy ≥ {SOLVED:g} at every pair "
            "count) at any head count in this run, so the recall numbers test no claim: no "
            "recall conclusion is drawn."
        )
    most, fewest = max(task.pairs), min(task.pairs)

    def at(variant: str, heads: int, pairs: int) -> tuple[str, Series]:
        return f"{variant} H={heads} N={pairs}", recall_series(results, variant, heads, pairs)

    found = []
    for h in solved:
        for name in (n for n in RECURRENT if n in task.mixes):
            found.append(Expectation(f"{h} head(s): {name} recalls less than attention at {most} "
                                     "pairs", at(name, h, most), at(ref, h, most), EXPECT_LOWER,
                                     lower_is_better=False))  # fmt: skip
            found.append(Expectation(f"{h} head(s): {name} recalls less at {most} pairs than at "
                                     f"{fewest}", at(name, h, most), at(name, h, fewest),
                                     EXPECT_LOWER, lower_is_better=False))  # fmt: skip
        for name in (n for n in HYBRIDS if n in task.mixes):
            found.append(Expectation(f"{h} head(s): {name} recalls as well as attention at "
                                     f"{most} pairs", at(name, h, most), at(ref, h, most),
                                     EXPECT_EQUAL, lower_is_better=False))  # fmt: skip
    if len(solved) > 1:
        large, small = min(solved), max(solved)  # fewer, wider heads: the larger state
        for name in (n for n in RECURRENT if n in task.mixes):
            found.append(Expectation(f"{name} recalls more at {most} pairs with the larger state "
                                     f"({large} head(s) against {small})", at(name, large, most),
                                     at(name, small, most), EXPECT_HIGHER,
                                     lower_is_better=False))  # fmt: skip
    unsolved = [h for h in task.heads if h not in solved]
    note = f"Attention solved the recall task at {', '.join(map(str, solved))} head(s)" + (
        f" but not at {', '.join(map(str, unsolved))}, where no recall conclusion is drawn."
        if unsolved
        else "."
    )
    return found, note


def hybrid(results: dict[str, Any]) -> list[str]:
    table, ref = results["summary"], "attention"
    others = [n for n in table if n != ref]
    expectations = [
        _vs(
            results,
            f"{n}'s val loss is {'above' if n == 'linear attention' else 'close to'} attention's",
            n,
            ref,
            EXPECT_HIGHER if n == "linear attention" else EXPECT_EQUAL,
        )
        for n in others
    ]
    found, solved = _recall_expectations(results) if results.get("recall") else ([], "")
    at = MEMORY_CONTEXTS[-1]
    memory = ", ".join(
        f"{n} {sequence_bytes(table[n], at) / sequence_bytes(table[ref], at):.3g}" for n in others
    )
    speed = _summary(results, ref, "train_tokens_per_s")
    speeds = ", ".join(
        f"{n} {s.mean / speed.mean:.2f}×"
        for n in others
        if speed is not None and (s := _summary(results, n, "train_tokens_per_s")) is not None
    )
    facts = [solved] if solved else []
    facts += [
        f"Memory of one sequence at {at // 1024}k tokens ÷ attention's: {memory}.",
        f"Training tokens/s ÷ attention's (this CPU, noisy on a shared machine): {speeds}.",
    ]
    expected = (
        "at matched size the recurrent layers come close to attention in language-model loss "
        "(linear attention lags: Katharopoulos et al., 2020) but recall fewer key-value pairs, "
        "the fewer the smaller their state and the more pairs there are, while attention solves "
        "the task (Arora et al., 2023, Zoology); a few attention layers recover recall (hybrids); "
        "their memory per sequence does not grow with the context."
    )
    return verdict_section(results, expected, expectations + found, facts)


CONCLUSIONS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "test-time-compute": lambda results: [ttc_study(results)],
    "attention-variants": attention_variants,
    "positions": positions,
    "scaling": scaling,
    "norm-placement": norm_placement,
    "uptrain-gqa": uptrain_gqa,
    "hybrid": hybrid,
}


def conclude(results: dict[str, Any]) -> list[str]:
    """The lines of the "What this shows" section."""
    study = CONCLUSIONS.get(results["study"])
    if study is not None and results["spec"]["builtin"]:
        return study(results)
    lines = ranking(results)
    found = (
        ["Val loss against the best variant:", "", *(f"- {line}" for line in lines)]
        if lines
        else ["Fewer than two variants with a healthy run: nothing to compare."]
    )
    return [*found, "", RULE, "", HEALTH_RULE]
