"""The verifier stage of the test-time studies: within-problem weights give a problem's correct
and wrong samples equal weight and drop one-sided problems; the classifier's within-problem AUC
counts only pairs of one pool's samples: a verifier that scores problems by difficulty, and
within a problem prefers the wrong sample, has within-problem AUC 0 whatever its AUC over all."""

from __future__ import annotations

import pytest

from decoderlm.errors import DecoderLMError
from decoderlm.lab.test_time_verifier import classifier, fit_head_verifier, within_weights
from decoderlm.search.verifier import Example


def examples(*targets: float) -> list[Example]:
    return [Example(f"Q{i}", t, 1) for i, t in enumerate(targets)]


def test_a_problems_correct_and_wrong_samples_weigh_the_same() -> None:
    weights = within_weights(examples(1, 0, 0, 0))
    assert weights == [2.0, 2 / 3, 2 / 3, 2 / 3]
    assert sum(weights) == pytest.approx(4)  # a problem weighs its samples' count
    assert weights[0] == pytest.approx(sum(weights[1:]))


def test_a_problem_with_one_kind_of_sample_is_dropped() -> None:
    assert within_weights(examples(1, 1)) == [0.0, 0.0]
    assert within_weights(examples(0, 0, 0)) == [0.0, 0.0, 0.0]


def test_fitting_within_problems_with_no_mixed_problem_is_a_one_line_error() -> None:
    labelled = [examples(1, 1), examples(0, 0)]
    with pytest.raises(DecoderLMError, match="no train problem has both correct and wrong"):
        fit_head_verifier(None, None, labelled, (1,), 1, within=True)  # type: ignore[arg-type]


def test_a_verifier_preferring_each_problems_wrong_sample_has_within_auc_zero() -> None:
    # an easy problem: scores high, its wrong sample highest; a hard one: scores low likewise
    pools = [[(0.8, True), (0.9, False)], [(0.1, True), (0.2, False)]]
    judged = classifier(pools)
    assert judged["test_auc_within"] == 0.0  # within each problem the wrong sample wins
    assert judged["test_auc"] == 0.25  # of the 4 right-wrong pairs only 0.8 > 0.2
    assert judged["test_samples"] == 4 and judged["test_correct_share"] == 0.5
    assert judged["test_accuracy"] == 0.5  # 0.8 right, 0.9 wrong, 0.1 wrong, 0.2 right


def test_ties_within_a_problem_count_one_half_and_one_sided_pools_add_no_pair() -> None:
    judged = classifier([[(0.5, True), (0.5, False)], [(0.7, True), (0.6, True)]])
    assert judged["test_auc_within"] == 0.5
