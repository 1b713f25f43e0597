"""LengthDist: construction, statistics, conditioning, truncation, sampling."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies import LengthDist


def test_from_samples_counts_and_normalises() -> None:
    d = LengthDist.from_samples([10, 10, 20, 40])
    assert d.support.tolist() == [10, 20, 40]
    assert d.probs.tolist() == pytest.approx([0.5, 0.25, 0.25])
    assert d.mean() == pytest.approx(20.0)
    assert d.quantile(0.5) == 10
    assert d.quantile(0.51) == 20
    assert d.quantile(1.0) == 40
    assert d.cdf(15) == pytest.approx(0.5)


def test_weights_and_buckets() -> None:
    rng = np.random.default_rng(0)
    x = rng.lognormal(5, 1, 5000)
    d = LengthDist.from_samples(x, max_points=16)
    assert len(d) <= 16
    assert d.mean() == pytest.approx(np.maximum(x, 1).mean(), rel=1e-9)  # bucket means keep mass
    w = LengthDist.from_samples([1, 100], weights=[3, 1])
    assert w.probs.tolist() == pytest.approx([0.75, 0.25])


@pytest.mark.parametrize(
    ("support", "probs"),
    [([], []), ([2, 1], [0.5, 0.5]), ([0.5], [1.0]), ([1, 2], [1.0]), ([1], [-1.0]), ([1], [0.0])],
)
def test_rejects_bad_input(support: list[float], probs: list[float]) -> None:
    with pytest.raises(ValueError):
        LengthDist(support, probs)


def test_condition_keeps_upper_support() -> None:
    d = LengthDist([10, 20, 40], [0.5, 0.25, 0.25])
    c = d.condition(10)
    assert c.support.tolist() == [20, 40]
    assert c.probs.tolist() == pytest.approx([0.5, 0.5])
    assert d.condition(0) is d
    assert d.condition(5) is d


def test_condition_past_support_assumes_as_long_again() -> None:
    d = LengthDist([10, 20], [0.5, 0.5])
    assert d.condition(25).support.tolist() == [50]


def test_truncate_moves_mass_to_cap() -> None:
    d = LengthDist([10, 20, 40], [0.5, 0.25, 0.25])
    t = d.truncate(15)
    assert t.support.tolist() == [10, 15]
    assert t.probs.tolist() == pytest.approx([0.5, 0.5])
    assert d.truncate(100) is d
    assert d.truncate(20).support.tolist() == [10, 20]


def test_noisy_oracle_zero_error_is_exact_and_spread_grows() -> None:
    rng = np.random.default_rng(1)
    assert LengthDist.noisy_oracle(123, 0.0, rng).support.tolist() == [123]
    narrow = LengthDist.noisy_oracle(1000, 0.1, np.random.default_rng(2))
    wide = LengthDist.noisy_oracle(1000, 0.8, np.random.default_rng(2))
    spread = lambda d: d.quantile(0.9) / d.quantile(0.1)  # noqa: E731
    assert spread(wide) > spread(narrow) > 1.0


def test_noisy_oracle_median_error_matches_requested_sigma() -> None:
    rng = np.random.default_rng(3)
    medians = np.array([LengthDist.noisy_oracle(500, 0.2, rng).quantile(0.5) for _ in range(2000)])
    assert np.std(np.log(medians / 500)) == pytest.approx(0.2, rel=0.1)


@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=50), st.integers(0, 2**32 - 1))
def test_samples_lie_in_support(xs: list[int], seed: int) -> None:
    d = LengthDist.from_samples(xs)
    draws = d.sample(np.random.default_rng(seed), 64)
    assert set(draws.tolist()) <= set(d.support.tolist())
    assert d.quantile(0.0) == min(xs)
    assert d.quantile(1.0) == max(xs)
