"""Study statistics against hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from loadgen.study import stats


def test_policy_means_exclude_nan_never_impute() -> None:
    m = np.array([[1.0, np.nan, np.nan], [3.0, 4.0, np.nan]])
    means = stats.policy_means(m)
    assert means[0] == 2.0 and means[1] == 4.0 and math.isnan(means[2])


def test_orient_negates_lower_is_better() -> None:
    m = np.array([[1.0, 2.0]])
    assert stats.orient(m, True) is m
    assert stats.orient(m, False).tolist() == [[-1.0, -2.0]]


def test_ranking_best_first_ties_by_name_undefined_last() -> None:
    means = np.array([0.5, np.nan, 0.9, 0.5])
    assert stats.ranking(means, ["d", "a", "c", "b"]) == ["c", "b", "d", "a"]


def test_kendall_tau_b_hand_computed() -> None:
    # one discordant pair of six: (5 - 1) / 6
    assert stats.kendall_tau_b(np.array([1, 2, 3, 4.0]), np.array([1, 3, 2, 4.0])) == (
        pytest.approx(4 / 6)
    )
    # a tie in x: C = 5, D = 0, n0 = 6, n1 = 1, n2 = 0 -> 5 / sqrt(5 * 6)
    assert stats.kendall_tau_b(np.array([1, 2, 2, 3.0]), np.array([1, 2, 3, 4.0])) == (
        pytest.approx(5 / math.sqrt(30))
    )
    # NaN pairs are dropped, a constant vector is undefined
    assert stats.kendall_tau_b(np.array([1, 2, np.nan, 3.0]), np.array([3, 2, 9, 1.0])) == -1.0
    assert math.isnan(stats.kendall_tau_b(np.ones(4), np.arange(4.0)))


def test_spearman_hand_computed() -> None:
    assert stats.spearman_rho(np.array([1, 2, 3.0]), np.array([3, 2, 1.0])) == pytest.approx(-1)
    # d = (0, 1, -1, 0): 1 - 6 * 2 / (4 * 15) = 0.8
    assert stats.spearman_rho(np.array([1, 2, 3, 4.0]), np.array([1, 3, 2, 4.0])) == (
        pytest.approx(0.8)
    )


def test_bootstrap_p_hand_computed() -> None:
    # one sample <= 0, three >= 0: 2 * (1 + 1) / (4 + 1)
    assert stats.bootstrap_p(np.array([1.0, 2.0, 3.0, -1.0])) == pytest.approx(0.8)
    assert stats.bootstrap_p(np.ones(999)) == pytest.approx(2 / 1000)
    assert stats.bootstrap_p(np.array([np.nan])) == 1.0


def test_benjamini_hochberg_hand_computed_and_against_scipy() -> None:
    # sorted 0.01, 0.03, 0.04, 0.2 vs thresholds 0.0125, 0.025, 0.0375, 0.05: only the first
    assert stats.benjamini_hochberg([0.01, 0.04, 0.03, 0.2]).tolist() == [True, False, False, False]
    # step-up: 0.04 <= 0.05 at rank 4 rejects all four even though 0.03 > 0.025 at rank 2
    assert stats.benjamini_hochberg([0.01, 0.03, 0.035, 0.04]).all()
    rng = np.random.default_rng(0)
    p = rng.uniform(0, 0.1, size=50)
    assert (stats.benjamini_hochberg(p) == (sps.false_discovery_control(p) <= 0.05)).all()
    assert stats.benjamini_hochberg([]).size == 0


def test_tau_between_identical_orders_has_unit_ci() -> None:
    # every window ranks the policies the same way, so every resample gives tau = 1
    a = np.array([[3.0, 2.0, 1.0], [6.0, 5.0, 4.0], [9.0, 8.0, 7.0]])
    est = stats.tau_between(a, a + 10, n_boot=200)
    assert (est.value, est.lo, est.hi) == (1.0, 1.0, 1.0)
    rho = stats.tau_between(a, -a, n_boot=50, spearman=True)
    assert rho.value == pytest.approx(-1.0)


def test_tau_between_is_seeded() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(10, 5)), rng.normal(size=(12, 5))
    assert stats.tau_between(a, b, n_boot=100) == stats.tau_between(a, b, n_boot=100)


def _two(values_a: list[tuple[float, float]], values_b: list[tuple[float, float]]) -> list[str]:
    tests = stats.pair_tests(np.array(values_a), np.array(values_b), ["x", "y"], n_boot=500)
    return stats.classify(tests)


def test_reversal_classes() -> None:
    same = [(1.0, 0.5), (1.1, 0.6), (0.9, 0.4)]
    assert _two(same, same) == ["stable"]
    # x wins clearly in A, y wins clearly in B, by far more than 10%: supported
    flipped = [(0.5, 1.0), (0.6, 1.1), (0.4, 0.9)]
    assert _two(same, flipped) == ["supported_practical"]
    # y wins by 2% in B: a flip inside the practical margin
    tiny = [(1.00, 1.02), (1.10, 1.12), (0.90, 0.92)]
    assert _two(same, tiny) == ["microscopic"]
    # y wins on average in B by a wide margin, but the windows disagree: the CI includes 0
    noisy = [(0.1, 1.0), (1.0, 0.2), (0.1, 1.0)]
    assert _two(same, noisy) == ["wide_ci"]


def test_pair_test_margin_uses_the_losers_value() -> None:
    a = np.array([[1.00, 0.95]])  # diff 0.05 vs 10% of 0.95: inside
    b = np.array([[0.50, 1.00]])
    (t,) = stats.pair_tests(a, b, ["x", "y"], n_boot=10)
    assert t.flipped and not t.margin_ok


def test_top1_and_pooled_means() -> None:
    assert stats.top1(np.array([0.3, 0.9, 0.9]), ["a", "b", "c"]) == {"b", "c"}
    assert stats.top1(np.array([np.nan]), ["a"]) == set()
    pooled = stats.pooled_means([np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([[10.0, np.nan]])])
    assert pooled.tolist() == [6.0, 3.0]


def test_pooled_gain_hand_computed() -> None:
    # one condition: 1 - mean(ours) / mean(base) = 1 - 2 / 4
    one = stats.pooled_gain([(np.array([1.0, 3.0]), np.array([4.0, 4.0]))], n_boot=100)
    assert one.value == pytest.approx(0.5)
    # two conditions with ratios 0.5 and 2: geometric mean 1, gain 0
    two = stats.pooled_gain(
        [(np.array([1.0]), np.array([2.0])), (np.array([2.0]), np.array([1.0]))], n_boot=10
    )
    assert two.value == pytest.approx(0.0) and two.lo == pytest.approx(0.0)
    # identical replicates: the interval collapses onto the point
    same = stats.pooled_gain([(np.full(5, 3.0), np.full(5, 4.0))], n_boot=50)
    assert same.lo == pytest.approx(0.25) and same.hi == pytest.approx(0.25)


def test_vectorised_correlations_match_scipy() -> None:
    rng = np.random.default_rng(3)
    x = rng.integers(0, 4, size=(200, 7)).astype(float)
    y = rng.integers(0, 4, size=(200, 7)).astype(float)
    x[5, 3] = np.nan
    for rows, one in (
        (stats.kendall_tau_b_rows, stats.kendall_tau_b),
        (stats.spearman_rho_rows, stats.spearman_rho),
    ):
        ref = np.array([one(a, b) for a, b in zip(x, y, strict=True)])
        assert np.allclose(rows(x, y), ref, equal_nan=True)
