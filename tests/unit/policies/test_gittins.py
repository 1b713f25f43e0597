"""The Gittins index against an independent brute-force computation."""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import gittins_index
from policies.gittins import gittins_index_and_horizon


def brute_force(support: list[float], probs: list[float], attained: float) -> float:
    """Direct transcription of the definition, in exact rational arithmetic."""
    s = [Fraction(x) for x in support]
    p = [Fraction(x) for x in probs]
    a = Fraction(attained)
    best = Fraction(0)
    for sj in s:
        if sj <= a:
            continue
        finish = sum((pi for si, pi in zip(s, p, strict=True) if a < si <= sj), Fraction(0))
        spent = sum(
            (pi * (min(si, sj) - a) for si, pi in zip(s, p, strict=True) if si > a), Fraction(0)
        )
        best = max(best, finish / spent)
    return float(best)


@st.composite
def distributions(draw: st.DrawFn) -> tuple[list[float], list[float], float]:
    n = draw(st.integers(1, 40))
    points = draw(
        st.lists(st.integers(1, 100_000), min_size=n, max_size=n, unique=True).map(sorted)
    )
    weights = draw(st.lists(st.integers(1, 1000), min_size=n, max_size=n))
    total = sum(weights)
    probs = [w / total for w in weights]
    attained = draw(st.one_of(st.just(0.0), st.floats(0, points[-1] * 1.1, allow_nan=False)))
    return [float(x) for x in points], probs, attained


@settings(max_examples=400, deadline=None)
@given(distributions())
def test_matches_brute_force(case: tuple[list[float], list[float], float]) -> None:
    support, probs, attained = case
    expected = brute_force(support, probs, attained)
    got = gittins_index(support, probs, attained)
    assert got == pytest.approx(expected, rel=1e-9, abs=0.0)


def test_point_mass_is_srpt() -> None:
    # One point: the index is 1 / remaining, so ordering by index is SRPT order.
    remaining = [5.0, 50.0, 500.0]
    indices = [gittins_index([r + 10.0], [1.0], 10.0) for r in remaining]
    assert indices == pytest.approx([1 / 5, 1 / 50, 1 / 500])
    assert sorted(range(3), key=lambda i: -indices[i]) == [0, 1, 2]


def test_past_support_is_zero() -> None:
    assert gittins_index([10.0, 20.0], [0.5, 0.5], 20.0) == 0.0
    assert gittins_index_and_horizon([10.0], [1.0], 11.0) == (0.0, None)


def test_bimodal_prefers_short_horizon_then_long_after_surviving() -> None:
    # 90% of jobs are tiny, 10% are huge: a fresh job is worth serving (likely short);
    # once it survives past the small mode, its index collapses (it is probably huge).
    support, probs = [2.0, 1000.0], [0.9, 0.1]
    fresh, horizon = gittins_index_and_horizon(support, probs, 0.0)
    survivor = gittins_index(support, probs, 2.0)
    assert horizon == 2.0
    assert fresh > 10 * survivor


def test_decreasing_hazard_tail_behaves_like_las() -> None:
    # Pareto-like tail: the index falls as attained service grows.
    support = np.geomspace(1, 10_000, 30)
    probs = support**-1.5
    probs /= probs.sum()
    values = [gittins_index(support, probs, a) for a in (0.0, 10.0, 100.0, 1000.0)]
    assert all(x > y for x, y in itertools.pairwise(values))
