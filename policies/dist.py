"""Discrete distributions of output length (tokens).

`LengthDist` is what the predictor hands the scheduler: a sorted support of total output
lengths with their probabilities. It is immutable; conditioning and truncation return new
objects. Everything is numpy on small arrays (tens of points), so each operation costs a few
microseconds.
"""

from __future__ import annotations

from statistics import NormalDist
from typing import Self

import numpy as np
from numpy.typing import ArrayLike, NDArray

FloatArray = NDArray[np.float64]

_STD_NORMAL = NormalDist()


def _frozen(a: FloatArray) -> FloatArray:
    a.setflags(write=False)
    return a


class LengthDist:
    """A discrete distribution over total output lengths, in tokens.

    Invariants: `support` is strictly increasing and every point is ≥ 1; `probs` are positive
    and sum to 1 (normalised on construction; zero-probability points are dropped).
    """

    __slots__ = ("_cdf", "probs", "support")

    support: FloatArray
    probs: FloatArray

    def __init__(self, support: ArrayLike, probs: ArrayLike) -> None:
        s = np.asarray(support, dtype=np.float64).ravel()
        p = np.asarray(probs, dtype=np.float64).ravel()
        if s.shape != p.shape or s.size == 0:
            raise ValueError("support and probs must be non-empty and of equal length")
        if not (np.all(np.isfinite(s)) and np.all(np.isfinite(p))):
            raise ValueError("support and probs must be finite")
        if np.any(p < 0):
            raise ValueError("probabilities must be non-negative")
        if s[0] < 1 or np.any(np.diff(s) <= 0):
            raise ValueError("support must be strictly increasing and >= 1 token")
        keep = p > 0
        s, p = s[keep], p[keep]
        total = p.sum()
        if total <= 0:
            raise ValueError("probabilities must not all be zero")
        self.support = _frozen(s.copy())
        self.probs = _frozen(p / total)
        self._cdf = _frozen(np.cumsum(self.probs))

    @classmethod
    def _trusted(cls, support: FloatArray, probs: FloatArray) -> LengthDist:
        """Build from arrays already known to satisfy the invariants (no validation).

        Used by `condition` and `truncate`, whose inputs come from a valid distribution;
        skipping the checks keeps them cheap on the scheduler's hot path.
        """
        self = cls.__new__(cls)
        total = probs.sum()
        self.support = _frozen(support)
        self.probs = _frozen(probs / total if total != 1.0 else probs)
        self._cdf = _frozen(np.cumsum(self.probs))
        return self

    # -- constructors -------------------------------------------------------------------

    @classmethod
    def point(cls, tokens: float) -> Self:
        """All mass on one length (an exact oracle, or a point prediction)."""
        return cls([max(1.0, float(tokens))], [1.0])

    @classmethod
    def from_samples(
        cls,
        samples: ArrayLike,
        weights: ArrayLike | None = None,
        *,
        max_points: int | None = None,
    ) -> Self:
        """The (weighted) empirical distribution of observed lengths.

        With `max_points`, lengths are merged into at most that many log-spaced buckets, each
        represented by the weighted mean of its members, so the support stays small however
        many samples come in. Lengths below 1 are clamped to 1.
        """
        x = np.maximum(np.asarray(samples, dtype=np.float64).ravel(), 1.0)
        w = np.ones_like(x) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
        if x.size == 0 or x.shape != w.shape:
            raise ValueError("need at least one sample and one weight per sample")
        if max_points is not None and max_points < 1:
            raise ValueError("max_points must be >= 1")
        if max_points is not None and np.unique(x).size > max_points:
            return cls._bucketed(x, w, max_points)
        values, inverse = np.unique(x, return_inverse=True)
        return cls(values, np.bincount(inverse, weights=w, minlength=values.size))

    @classmethod
    def _bucketed(cls, x: FloatArray, w: FloatArray, max_points: int) -> Self:
        lo, hi = np.log(x.min()), np.log(x.max())
        edges = np.linspace(lo, hi, max_points + 1)[1:-1]
        bucket = np.searchsorted(edges, np.log(x), side="right")
        mass = np.bincount(bucket, weights=w, minlength=max_points)
        centre = np.bincount(bucket, weights=w * x, minlength=max_points)
        keep = mass > 0
        return cls(centre[keep] / mass[keep], mass[keep])

    @classmethod
    def noisy_oracle(
        cls,
        true_tokens: float,
        rel_error: float,
        rng: np.random.Generator,
        *,
        points: int = 16,
    ) -> Self:
        """A calibrated log-normal belief around a noisy reading of the true length.

        The centre is `true × exp(σ·z)` with σ = `rel_error` and z standard normal; the belief
        is a log-normal of the same σ around that centre, discretised into `points` equal-mass
        quantiles. σ = 0 gives the exact oracle (a point mass at the true length).
        """
        if rel_error < 0:
            raise ValueError("rel_error must be >= 0")
        if rel_error == 0:
            return cls.point(true_tokens)
        centre = float(true_tokens) * float(np.exp(rel_error * rng.standard_normal()))
        qs = (np.arange(points) + 0.5) / points
        z = np.array([_STD_NORMAL.inv_cdf(float(q)) for q in qs])
        support = np.maximum(centre * np.exp(rel_error * z), 1.0)
        return cls.from_samples(support)

    # -- statistics ---------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.support.size)

    def __repr__(self) -> str:
        return f"LengthDist(n={len(self)}, mean={self.mean():.1f}, p50={self.quantile(0.5):.0f})"

    def mean(self) -> float:
        """Expected total output length (tokens)."""
        return float(self.support @ self.probs)

    def quantile(self, q: float) -> float:
        """Smallest support point whose cumulative probability reaches `q` (0 ≤ q ≤ 1)."""
        if not 0.0 <= q <= 1.0:
            raise ValueError("q must be in [0, 1]")
        i = int(np.searchsorted(self._cdf, q - 1e-12, side="left"))
        return float(self.support[min(i, self.support.size - 1)])

    def cdf(self, tokens: float) -> float:
        """P(length ≤ tokens)."""
        i = int(np.searchsorted(self.support, tokens, side="right"))
        return 0.0 if i == 0 else float(self._cdf[i - 1])

    def sample(self, rng: np.random.Generator, size: int | None = None) -> FloatArray:
        """Draw lengths (float array of support values)."""
        return np.asarray(rng.choice(self.support, size=size, p=self.probs), dtype=np.float64)

    # -- transformations ----------------------------------------------------------------

    def condition(self, generated: float) -> LengthDist:
        """The distribution of the total length given that `generated` tokens exist already.

        Keeps the support above `generated`, renormalised. When the job has outlived every
        support point the prediction has failed; we then assume the output is as long again
        (a point mass at `2·generated`), which treats an overrun as a long job rather than an
        almost finished one, so a mispredicted long job cannot jump the queue.
        """
        if generated <= 0:
            return self
        i = int(np.searchsorted(self.support, generated, side="right"))
        if i == 0:
            return self
        if i >= self.support.size:
            return LengthDist.point(overrun_length(generated))
        return LengthDist._trusted(self.support[i:].copy(), self.probs[i:].copy())

    def truncate(self, max_tokens: float) -> LengthDist:
        """Respect a client cap: mass above `max_tokens` moves onto `max_tokens`."""
        cap = max(1.0, float(max_tokens))
        if self.support[-1] <= cap:
            return self
        below = self.support < cap
        support = np.append(self.support[below], cap)
        probs = np.append(self.probs[below], self.probs[~below].sum())
        return LengthDist._trusted(support, probs)


def overrun_length(generated: float) -> float:
    """The total length assumed for a job that has outlived every support point of its
    prediction: as long again (`LengthDist.condition`)."""
    return max(2.0 * generated, generated + 1.0)
