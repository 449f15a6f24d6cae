"""The verdict rule (paired 95% t-intervals over ≥ 3 healthy seeds), the run-health classes, and
the built-in studies' verdicts following from them: synthetic results, no training."""

import math

import pytest

from decoderlm.lab import conclusions, measure, stats, studies

BASELINE = 3.0  # the unigram loss of the synthetic data


def test_t_interval_is_the_students_t_half_width():
    s = stats.summarise([1.0, 2.0, 3.0])  # mean 2, sd 1
    assert s.half_width == pytest.approx(4.303 / math.sqrt(3))
    assert s.interval == pytest.approx((2 - 4.303 / math.sqrt(3), 2 + 4.303 / math.sqrt(3)))
    assert stats.t_quantile(60) == pytest.approx(2.000, abs=1e-3)  # beyond the table
    assert stats.t_quantile(120) == pytest.approx(1.980, abs=1e-3)
    assert math.isnan(stats.summarise([1.0]).half_width)


def test_overlapping_intervals_with_an_inconsistent_sign_are_not_distinguishable():
    a = {0: 1.00, 1: 1.10, 2: 1.02}
    b = {0: 1.05, 1: 1.04, 2: 1.01}  # d = −0.05, +0.06, +0.01: the interval holds 0
    sa, sb = stats.summarise(list(a.values())), stats.summarise(list(b.values()))
    assert sa.interval[0] < sb.interval[1] and sb.interval[0] < sa.interval[1]  # they overlap
    c = stats.compare(a, b)
    assert c.outcome == stats.SAME
    assert c.phrase("a", "b").startswith("a vs b: not distinguishable (Δ = +0.0067 [")


def test_a_consistent_paired_difference_is_a_verdict():
    c = stats.compare({0: 2.0, 1: 2.2, 2: 2.1}, {0: 1.0, 1: 1.15, 2: 1.1})
    assert c.outcome == stats.HIGHER
    low, high = c.difference.interval
    assert 0 < low < c.difference.mean < high
    assert c.phrase("a", "b").startswith("a higher than b (Δ = +1.0167")


def test_fewer_than_three_healthy_seeds_give_no_verdict():
    assert stats.compare({0: 2.0, 1: 2.1}, {0: 1.0, 1: 1.1}).outcome == stats.TOO_FEW
    three_one_failed = stats.compare({0: 2.0, 1: None, 2: 2.1}, {0: 1.0, 1: 1.0, 2: 1.1})
    assert three_one_failed.outcome == stats.TOO_FEW  # 2 healthy pairs
    assert "a 1/3 failed" in three_one_failed.phrase("a", "b")


def test_a_variant_whose_runs_all_failed_is_worse_than_one_that_trained():
    c = stats.compare({0: None, 1: None, 2: None}, {0: 1.0, 1: 1.1, 2: 1.2})
    assert c.outcome == stats.A_FAILS
    assert (
        c.phrase("post", "pre")
        == "post fails where pre trains (0 healthy paired seeds; post 3/3 failed)"
    )
    assert stats.compare({0: None, 1: None}, {0: 1.0, 1: 1.1}).outcome == stats.TOO_FEW
    assert stats.compare({0: None, 1: None}, {0: None, 1: None}).outcome == stats.TOO_FEW
    three_failed = {0: None, 1: None, 2: None}
    assert stats.compare(three_failed, three_failed).outcome == stats.BOTH_FAIL


def rows(losses):
    return [[step, loss] for step, loss in enumerate(losses, 1)]


def test_a_run_that_stays_at_its_initial_loss_is_stuck():
    flat = rows([5.4] * 40)  # ln 220: never learned anything
    assert measure.classify(flat, 5.39, False, BASELINE) == (measure.STUCK, None)
    unigram_only = rows([5.4] + [3.02] * 39)  # learned the frequencies, not the context
    assert measure.classify(unigram_only, 2.95, False, BASELINE)[0] == measure.STUCK


def test_a_run_whose_loss_climbs_far_above_its_minimum_is_diverged():
    up = rows([5.0, 4.0, 3.0, 2.2, 2.1, 2.0, 2.6, 3.5, 4.5, 5.5])  # lowest at step 6
    assert measure.classify(up, 4.8, False, BASELINE) == (measure.DIVERGED, 6)


def test_a_non_finite_run_is_nan_and_a_learning_run_is_healthy():
    assert measure.classify(rows([5.0, math.nan]), None, True, BASELINE)[0] == measure.NAN
    learning = rows([5.0, 4.0, 3.0, 2.5, 2.2, 2.1, 2.05, 2.0, 2.0, 2.0])
    assert measure.classify(learning, 2.1, False, BASELINE) == (measure.HEALTHY, None)
    noisy = rows([5.0, 2.0, 2.3, 1.9, 2.2, 2.0, 2.3, 2.1, 2.2, 2.0])  # noise, not a climb
    assert measure.classify(noisy, 2.1, False, BASELINE)[0] == measure.HEALTHY


def test_the_unigram_loss_is_the_cross_entropy_of_the_train_frequencies():
    import numpy as np

    train = np.array([0, 0, 0, 1])  # add-one: p = (4/6, 2/6, ...) over 3 tokens... of vocab 2
    assert measure.unigram_loss(train, np.array([0, 1]), 2) == pytest.approx(
        -(math.log(4 / 6) + math.log(2 / 6)) / 2
    )


def results(runs: dict[str, list[tuple[float | None, str]]], seeds: int = 3) -> dict:
    """A results dict of the norm-placement study: runs[variant] = [(val loss, health)] by seed."""
    flat = [
        {"variant": name, "seed": seed, "val_loss": loss, "health": health}
        for name, values in runs.items()
        for seed, (loss, health) in enumerate(values)
    ]
    health = {
        name: {c: sum(h == c for _, h in values) for c in measure.HEALTH_CLASSES}
        for name, values in runs.items()
    }
    return {
        "study": "norm-placement",
        "spec": {"builtin": True, "seeds": seeds},
        "runs": flat,
        "summary": {name: {"health": health[name]} for name in runs},
    }


HEALTHY3 = [(2.0, "healthy"), (2.1, "healthy"), (2.05, "healthy")]


def test_stuck_post_ln_counts_as_failed_not_as_trained():
    text = "\n".join(
        conclusions.conclude(
            results(
                {
                    "pre-LN L6 lr0.01 warmup": HEALTHY3,
                    "pre-LN L6 lr0.01 no-warmup": HEALTHY3,
                    "post-LN L6 lr0.01 warmup": HEALTHY3,
                    "post-LN L6 lr0.01 no-warmup": [(3.34, "stuck")] * 3,
                }
            )
        )
    )
    assert "post-LN runs: healthy 3/6, stuck 3/6, diverged 0/6, NaN 0/6" in text
    assert "post-LN L6 lr0.01 no-warmup fails where pre-LN L6 lr0.01 no-warmup trains" in text
    assert text.count("| as expected |") == 2
    assert "**Verdict**: of 2 expectations, 2 as expected." in text
    assert stats.RULE in text and measure.HEALTH_RULE in text


def test_a_difference_within_the_seed_noise_is_not_called_consistent():
    close = [(2.02, "healthy"), (2.08, "healthy"), (2.06, "healthy")]  # d = +.02, −.02, +.01
    text = "\n".join(
        conclusions.conclude(
            results(
                {
                    "pre-LN L2 lr0.001 no-warmup": HEALTHY3,
                    "post-LN L2 lr0.001 no-warmup": close,
                }
            )
        )
    )
    assert "| not distinguishable |" in text
    assert "**Verdict**: of 1 expectations, 1 not distinguishable." in text
    assert "consistent" not in text


def test_an_opposite_difference_contradicts_and_two_seeds_give_no_verdict():
    better = [(1.5, "healthy"), (1.6, "healthy"), (1.55, "healthy")]
    runs = {"pre-LN L2 lr0.01 no-warmup": HEALTHY3, "post-LN L2 lr0.01 no-warmup": better}
    assert "| contradicts |" in "\n".join(conclusions.conclude(results(runs)))
    two = {name: values[:2] for name, values in runs.items()}
    text = "\n".join(conclusions.conclude(results(two, seeds=2)))
    assert "**Verdict**: too few seeds for a verdict (2 seeds;" in text


@pytest.mark.parametrize("name", [n for n in studies.STUDIES if n not in studies.TEST_TIME_STUDIES])
def test_every_builtin_studys_verdicts_render_from_its_own_variant_names(name):
    """Synthetic healthy runs of the full spec (3 seeds, every variant 0.01 apart), summarised by
    the runner: the study's verdict section finds every variant it names."""
    import dataclasses

    from decoderlm.lab import recall, runner

    spec = studies.builtin(name)
    runs = []
    for i, variant in enumerate(spec.variants):
        for seed in range(spec.seeds):
            loss = 2.0 + 0.01 * i + 0.001 * seed
            runs.append({
                "variant": variant.name, "seed": seed, "health": measure.HEALTHY,
                "val_loss": loss, "loss_1x": loss, "loss_2x": loss + 0.1, "loss_4x": loss + 0.2,
                "loss_rise_4x": 0.2, "val_loss_pooled": loss + 1 if variant.pool_kv_heads else None,
                "train_tokens_per_s": 1000.0, "params": 1000, "kv_bytes_per_token": 2 + i,
                "kv_max_context": 100, "state_bytes": i,
            })  # fmt: skip
    results = {
        "study": name,
        "spec": dataclasses.asdict(spec),
        "runs": runs,
        "summary": runner.summary(spec, runs),
        "init_stats": [measure.attention_init_stats((16, 256), seed) for seed in range(3)],
    }
    if "recall" in spec.measures:
        task = spec.recall_task()
        results["recall"] = {"task": dataclasses.asdict(task), "runs": [
            {"variant": m, "heads": h, "seed": k, "accuracy": {str(n): 0.95 for n in task.pairs}}
            for h in task.heads for m in recall.MIXES for k in range(spec.seeds)
        ]}  # fmt: skip
    text = "\n".join(conclusions.conclude(results))
    assert "**Verdict**: of " in text and stats.RULE in text


UP = {0: 2.0, 1: 2.2, 2: 2.1}  # against DOWN: higher at every seed
DOWN = {0: 1.0, 1: 1.15, 2: 1.1}
FAILED = {0: None, 1: None, 2: None}


@pytest.mark.parametrize(
    "a, b, expect, lower_is_better, verdict",
    [
        (UP, DOWN, conclusions.EXPECT_HIGHER, True, "as expected"),
        (DOWN, UP, conclusions.EXPECT_HIGHER, True, "contradicts"),
        (UP, DOWN, conclusions.EXPECT_EQUAL, True, "contradicts"),
        (DOWN, UP, conclusions.EXPECT_NOT_HIGHER, True, "as expected"),
        (UP, DOWN, conclusions.EXPECT_NOT_HIGHER, True, "contradicts"),
        (FAILED, DOWN, conclusions.EXPECT_HIGHER, True, "as expected"),  # failed: a worse loss
        (FAILED, DOWN, conclusions.EXPECT_LOWER, False, "as expected"),  # … a worse accuracy
        (FAILED, FAILED, conclusions.EXPECT_HIGHER, True, "both fail: no verdict"),
    ],
)
def test_each_outcome_is_judged_against_what_was_expected(a, b, expect, lower_is_better, verdict):
    e = conclusions.Expectation("claim", ("a", a), ("b", b), expect, lower_is_better)
    assert conclusions.judge(e)[1] == verdict
