"""Renewal arrival processes with a given rate and coefficient of variation (CV).

ServeGen describes each client, per 600 s window, by its rate (req/s), the CV of its
inter-arrival times and the family fitted to them (`Gamma`, `Weibull`; empty = inactive).
We draw inter-arrival gaps from that family with the parameters *moment-matched* to the
window's rate and CV, so a long synthesis reproduces both:
- Gamma: shape k = 1 / CV², scale = CV² / rate;
- Weibull: shape k solves Γ(1 + 2/k) / Γ(1 + 1/k)² = 1 + CV², scale = 1 / (rate Γ(1 + 1/k));
- anything else (`Exponential`, empty name with a positive rate): exponential (CV 1).
ServeGen's two fitted parameters are not used: they come from a maximum-likelihood fit and do
not reproduce the window's own rate (e.g. m-large client 0, window 0: rate 1.33 req/s, but
Weibull(0.375, 0.397) has a mean gap of 1.6 s, i.e. 0.63 req/s).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

MAX_ARRIVALS_FACTOR = 20
"""A window of expected n arrivals is cut at 20 n + 1000 (bounds memory for extreme CVs)."""


@lru_cache(maxsize=4096)
def weibull_shape(cv: float) -> float:
    """The Weibull shape k whose CV is `cv` (> 0), by bisection on log k in [1e-2, 1e4]."""
    if cv <= 0:
        raise ValueError(f"cv must be > 0, got {cv}")
    target = math.log1p(cv * cv)

    def log_ratio(k: float) -> float:  # log(1 + CV(k)²), decreasing in k
        return math.lgamma(1 + 2 / k) - 2 * math.lgamma(1 + 1 / k)

    lo, hi = math.log(1e-2), math.log(1e4)
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if log_ratio(math.exp(mid)) > target:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


def sample_gaps(
    rng: np.random.Generator, dist: str, rate_rps: float, cv: float, n: int
) -> np.ndarray:
    """`n` inter-arrival gaps (s) of mean 1/rate_rps and CV `cv` from the family `dist`."""
    mean = 1.0 / rate_rps
    if cv <= 1e-9:
        return np.full(n, mean)
    if dist == "Gamma":
        shape = 1.0 / (cv * cv)
        return rng.gamma(shape, mean / shape, n)
    if dist == "Weibull":
        k = weibull_shape(cv)
        return (mean / math.exp(math.lgamma(1 + 1 / k))) * rng.weibull(k, n)
    return rng.exponential(mean, n)


def renewal_arrivals(
    rng: np.random.Generator, dist: str, rate_rps: float, cv: float, duration_s: float
) -> np.ndarray:
    """Arrival times (s, sorted) in [0, duration_s) of a renewal process.

    The first gap is shortened by a uniform fraction, as if the process had been running
    before t = 0, so consecutive windows do not all start with a burst at their boundary.
    """
    if rate_rps <= 0 or duration_s <= 0:
        return np.empty(0)
    expected = rate_rps * duration_s
    cap = int(MAX_ARRIVALS_FACTOR * expected) + 1000
    chunk = max(16, int(1.2 * expected) + 16)
    gaps = sample_gaps(rng, dist, rate_rps, cv, chunk)
    gaps[0] *= rng.random()
    times = np.cumsum(gaps)
    while times[-1] < duration_s and times.size < cap:
        more = np.cumsum(sample_gaps(rng, dist, rate_rps, cv, chunk)) + times[-1]
        times = np.concatenate([times, more])
    return times[times < duration_s][:cap]
