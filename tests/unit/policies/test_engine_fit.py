"""The engine's iteration-time fit (`policies.engine_fit`)."""

from __future__ import annotations

import json
import random

import pytest

from policies.engine_fit import EngineFit, Interval

ALPHA, BETA, KAPPA, PI = 0.006, 0.0007, 2e-7, 7e-5


def shaped(batch: float, context: float, prompt: float, rng: random.Random) -> Interval:
    """One second of an engine whose iteration is alpha + beta B + kappa C + pi P (1% jitter)."""
    step = (ALPHA + BETA * batch + KAPPA * context + PI * prompt) * (1 + rng.gauss(0, 0.01))
    n = 1.0 / step
    return Interval(1.0, n, batch, prompt * n, context)


def test_recovers_the_coefficients_of_a_linear_engine() -> None:
    rng = random.Random(0)
    fit = EngineFit()
    for _ in range(60):
        b = rng.uniform(2, 64)
        fit.add(shaped(b, b * rng.uniform(100, 2000), rng.uniform(0, 200), rng))
    c = fit.coefficients()
    assert c is not None
    for name, truth in (("alpha", ALPHA), ("beta", BETA), ("kappa", KAPPA), ("pi", PI)):
        assert c[name] == pytest.approx(truth, rel=0.1), (name, c)


def test_the_efficient_batch_and_its_error() -> None:
    rng = random.Random(1)
    fit = EngineFit()
    assert fit.efficient_batch(2 / 3) is None
    for _ in range(40):
        fit.add(shaped(rng.uniform(4, 40), 0.0, 0.0, rng))
    est = fit.efficient_batch(2 / 3)
    assert est is not None
    assert est[0] == pytest.approx(2 * ALPHA / BETA, rel=0.1)
    assert 0 < est[1] < 0.1
    # one batch size only: the fixed and per-request costs cannot be told apart
    flat = EngineFit()
    for _ in range(40):
        flat.add(shaped(16, 0.0, 0.0, rng))
    est_flat = flat.efficient_batch(2 / 3)
    assert est_flat is None or est_flat[1] > 0.5


def test_negative_coefficients_are_dropped() -> None:
    """An engine whose iteration does not grow with the batch: beta is 0, not negative."""
    fit = EngineFit()
    for b in (4, 8, 16, 32, 8, 4):
        fit.add(Interval(1.0, 1 / (0.01 - 1e-5 * b), float(b), 0.0))
    c = fit.coefficients()
    assert c is not None and c["beta"] == 0.0 and c["alpha"] > 0
    assert fit.efficient_batch(0.5) is None  # no plateau: the curve keeps rising


def test_old_intervals_fade() -> None:
    """60 s of one engine, then 60 s of one twice as costly per request: with a 10 s
    half-life the fit describes the second."""
    rng = random.Random(2)
    fit = EngineFit(half_life_s=10.0)
    for _ in range(60):
        fit.add(shaped(rng.uniform(4, 40), 0.0, 0.0, rng))
    for _ in range(60):
        b = rng.uniform(4, 40)
        n = 1.0 / (ALPHA + 2 * BETA * b)
        fit.add(Interval(1.0, n, b, 0.0))
    c = fit.coefficients()
    assert c is not None and c["beta"] == pytest.approx(2 * BETA, rel=0.05)


def test_round_trips_through_json() -> None:
    rng = random.Random(3)
    fit = EngineFit()
    for _ in range(50):
        fit.add(shaped(rng.uniform(4, 40), 0.0, rng.uniform(0, 50), rng))
    back = EngineFit.from_dict(json.loads(json.dumps(fit.to_dict())))
    assert back.coefficients() == fit.coefficients()
    with pytest.raises(ValueError):
        EngineFit.from_dict({"xx": [1, 2]})


def test_the_cost_profile_shares_the_fixed_cost() -> None:
    rng = random.Random(4)
    fit = EngineFit()
    for _ in range(40):
        fit.add(shaped(rng.uniform(4, 40), 0.0, rng.uniform(0, 100), rng))
    p = fit.profile(16)
    assert p is not None
    assert p.step_s == pytest.approx(ALPHA / 16 + BETA, rel=0.1)
    assert p.prefill_s_per_token == pytest.approx(PI, rel=0.15)
