"""Portability statistics: pure functions of per-window metric matrices.

A *matrix* holds one (source, load point, metric) condition: rows are windows, columns are
policies, NaN where a metric is undefined. Rankings use the mean over windows (NaN excluded,
never imputed); agreement between two rankings is Kendall τ-b (headline) or Spearman, from
scipy. Confidence intervals resample whole windows (each source independently) 2,000 times
with a seeded generator, so every number is reproducible. All values are oriented so that
"higher is better" before any ranking or reversal test (`orient`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

N_BOOT = 2000
SEED = 20260
PRACTICAL_MARGIN = 0.10
FDR_Q = 0.05

Matrix = np.ndarray
"""windows x policies, float64, NaN where undefined."""


def orient(matrix: Matrix, higher_is_better: bool) -> Matrix:
    """The matrix with "higher is better" (lower-is-better metrics are negated)."""
    return matrix if higher_is_better else -matrix


def policy_means(matrix: Matrix) -> np.ndarray:
    """Mean over windows per policy, NaN values excluded (NaN if a policy has none)."""
    m = np.asarray(matrix, dtype=np.float64)
    counts = np.sum(~np.isnan(m), axis=0)
    sums = np.nansum(m, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def ranking(means: np.ndarray, policies: Sequence[str]) -> list[str]:
    """Policies best first (higher mean first; ties by name; undefined last)."""
    key = [(-v if not math.isnan(v) else math.inf, p) for v, p in zip(means, policies, strict=True)]
    return [p for _, p in sorted(key)]


def _paired(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keep = ~(np.isnan(x) | np.isnan(y))
    return x[keep], y[keep]


def kendall_tau_b(x: np.ndarray, y: np.ndarray) -> float:
    """Kendall τ-b of two score vectors over policies defined in both (NaN if undefined,
    e.g. when one vector is constant)."""
    a, b = _paired(np.asarray(x, float), np.asarray(y, float))
    if a.size < 2 or np.all(a == a[0]) or np.all(b == b[0]):
        return math.nan
    return float(sps.kendalltau(a, b, variant="b").statistic)


def spearman_rho(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman ρ (average ranks for ties) over policies defined in both."""
    a, b = _paired(np.asarray(x, float), np.asarray(y, float))
    if a.size < 2 or np.all(a == a[0]) or np.all(b == b[0]):
        return math.nan
    return float(sps.spearmanr(a, b).statistic)


def boot_indices(n_windows: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """n_boot x n_windows resampled window indices (with replacement)."""
    return rng.integers(0, n_windows, size=(n_boot, n_windows))


def boot_means(matrix: Matrix, idx: np.ndarray) -> np.ndarray:
    """n_boot x policies: the policy means of every resample."""
    m = np.asarray(matrix, dtype=np.float64)[idx]  # boot x windows x policies
    counts = np.sum(~np.isnan(m), axis=1)
    sums = np.nansum(m, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


@dataclass(frozen=True, slots=True)
class Estimate:
    """A point estimate with a percentile bootstrap interval."""

    value: float
    lo: float
    hi: float

    def fmt(self, digits: int = 3) -> str:
        if math.isnan(self.value):
            return "n/a"
        return f"{self.value:.{digits}f} [{self.lo:.{digits}f}, {self.hi:.{digits}f}]"


def interval(samples: Sequence[float] | np.ndarray, value: float) -> Estimate:
    """`value` with the 2.5-97.5 percentile interval of `samples` (NaN samples left out; a
    NaN interval when none is left or `value` is NaN)."""
    s = np.asarray(samples, dtype=np.float64)
    s = s[~np.isnan(s)]
    if s.size == 0 or math.isnan(value):
        return Estimate(value, math.nan, math.nan)
    lo, hi = np.percentile(s, [2.5, 97.5])
    return Estimate(value, float(lo), float(hi))


def kendall_tau_b_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Kendall τ-b of each row pair of two (replicates x policies) arrays, vectorised.

    τ-b = Σ sign(xᵢ−xⱼ)·sign(yᵢ−yⱼ) / √(Σ sign(xᵢ−xⱼ)² · Σ sign(yᵢ−yⱼ)²) over pairs i < j with
    both values defined in both rows: (C − D) / √((n₀ − n₁)(n₀ − n₂)), the same statistic as
    `scipy.stats.kendalltau(variant="b")` (checked by a test); NaN where undefined.
    """
    i, j = np.triu_indices(x.shape[1], k=1)
    valid = ~(np.isnan(x[:, i]) | np.isnan(x[:, j]) | np.isnan(y[:, i]) | np.isnan(y[:, j]))
    sx = np.where(valid, np.sign(np.nan_to_num(x[:, i] - x[:, j])), 0.0)
    sy = np.where(valid, np.sign(np.nan_to_num(y[:, i] - y[:, j])), 0.0)
    den = np.sqrt(np.sum(sx * sx, axis=1) * np.sum(sy * sy, axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, np.sum(sx * sy, axis=1) / np.where(den > 0, den, 1.0), np.nan)


def spearman_rho_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman ρ of each row pair (average ranks; rows with NaN use `spearman_rho`)."""
    out = np.full(x.shape[0], np.nan)
    clean = ~(np.isnan(x).any(axis=1) | np.isnan(y).any(axis=1))
    if clean.any():
        rx = sps.rankdata(x[clean], axis=1)
        ry = sps.rankdata(y[clean], axis=1)
        rx -= rx.mean(axis=1, keepdims=True)
        ry -= ry.mean(axis=1, keepdims=True)
        den = np.sqrt(np.sum(rx * rx, axis=1) * np.sum(ry * ry, axis=1))
        with np.errstate(invalid="ignore", divide="ignore"):
            out[clean] = np.where(
                den > 0, np.sum(rx * ry, axis=1) / np.where(den > 0, den, 1), np.nan
            )
    for k in np.nonzero(~clean)[0]:
        out[k] = spearman_rho(x[k], y[k])
    return out


def tau_between(
    a: Matrix, b: Matrix, *, n_boot: int = N_BOOT, seed: int = SEED, spearman: bool = False
) -> Estimate:
    """Agreement of the rankings of two sources (same policy columns), with a CI from
    resampling each source's windows independently. Resamples where τ is undefined (a
    constant ranking) are left out of the interval."""
    corr = spearman_rho if spearman else kendall_tau_b
    rows = spearman_rho_rows if spearman else kendall_tau_b_rows
    value = corr(policy_means(a), policy_means(b))
    rng = np.random.default_rng(seed)
    ma = boot_means(a, boot_indices(a.shape[0], n_boot, rng))
    mb = boot_means(b, boot_indices(b.shape[0], n_boot, rng))
    return interval(rows(ma, mb), value)


def bootstrap_p(samples: np.ndarray) -> float:
    """Two-sided bootstrap p-value that a difference is 0: 2·min(P(d ≤ 0), P(d ≥ 0)), with
    the +1 correction so it is never 0."""
    s = samples[~np.isnan(samples)]
    if s.size == 0:
        return 1.0
    tail = min(np.sum(s <= 0), np.sum(s >= 0))
    return float(min(1.0, 2 * (tail + 1) / (s.size + 1)))


def benjamini_hochberg(pvalues: Sequence[float] | np.ndarray, q: float = FDR_Q) -> np.ndarray:
    """Which hypotheses the Benjamini–Hochberg step-up procedure rejects at level `q`."""
    p = np.asarray(pvalues, dtype=np.float64)
    if p.size == 0:
        return np.zeros(0, dtype=bool)
    order = np.argsort(p, kind="stable")
    thresholds = q * np.arange(1, p.size + 1) / p.size
    below = p[order] <= thresholds
    reject = np.zeros(p.size, dtype=bool)
    if below.any():
        k = int(np.max(np.nonzero(below)[0]))
        reject[order[: k + 1]] = True
    return reject


@dataclass(frozen=True, slots=True)
class PairTest:
    """One policy pair compared in two sources (values oriented: higher is better)."""

    first: str
    second: str
    diff_a: Estimate
    """mean(first) − mean(second) in source A, with its paired bootstrap CI."""
    diff_b: Estimate
    p_a: float
    p_b: float
    margin_ok: bool
    """|difference| above `margin` × |loser's mean| in both sources."""

    @property
    def flipped(self) -> bool:
        return self.diff_a.value * self.diff_b.value < 0

    @property
    def p(self) -> float:
        """Intersection–union p-value of "the flip is real in both sources"."""
        return max(self.p_a, self.p_b)

    @property
    def both_ci_exclude_zero(self) -> bool:
        return all(e.lo > 0 or e.hi < 0 for e in (self.diff_a, self.diff_b))


def _margin_ok(means: np.ndarray, i: int, j: int, margin: float) -> bool:
    diff = abs(means[i] - means[j])
    loser = min(means[i], means[j])
    return bool(diff > margin * abs(loser))


def pair_tests(
    a: Matrix,
    b: Matrix,
    policies: Sequence[str],
    *,
    n_boot: int = N_BOOT,
    seed: int = SEED,
    margin: float = PRACTICAL_MARGIN,
) -> list[PairTest]:
    """Every policy pair in two sources (oriented matrices), with paired bootstrap CIs of the
    difference (the same resampled windows for both policies of a pair)."""
    rng = np.random.default_rng(seed)
    i, j = np.triu_indices(len(policies), k=1)
    per_source = []
    for m in (a, b):
        means = policy_means(m)
        d = boot_means(m, boot_indices(m.shape[0], n_boot, rng))
        d = d[:, i] - d[:, j]  # boot x pairs
        defined = ~np.isnan(d)
        if defined.all():
            lo, hi = np.percentile(d, [2.5, 97.5], axis=0)
        else:
            with np.errstate(invalid="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN column: NaN CI
                lo, hi = np.nanpercentile(d, [2.5, 97.5], axis=0)
        tail = np.minimum(np.sum((d <= 0) & defined, axis=0), np.sum((d >= 0) & defined, axis=0))
        p = np.minimum(1.0, 2 * (tail + 1) / (np.sum(defined, axis=0) + 1))
        per_source.append((means, lo, hi, p))
    out = []
    for k, (x, y) in enumerate(zip(i.tolist(), j.tolist(), strict=True)):
        if any(math.isnan(ms[0][q]) for ms in per_source for q in (x, y)):
            continue
        ests = [
            Estimate(float(m[x] - m[y]), float(lo[k]), float(hi[k])) for m, lo, hi, _ in per_source
        ]
        ok = all(_margin_ok(ms[0], x, y, margin) for ms in per_source)
        ps = [float(ms[3][k]) for ms in per_source]
        out.append(PairTest(policies[x], policies[y], ests[0], ests[1], ps[0], ps[1], ok))
    return out


CLASSES = ("stable", "microscopic", "wide_ci", "supported_practical")


def classify(tests: Sequence[PairTest], q: float = FDR_Q) -> list[str]:
    """Reversal class of each test; Benjamini–Hochberg runs over `tests` as one family
    (the caller passes one (metric, region) at a time).

    stable: no sign flip; microscopic: a flip within the practical margin in some source;
    wide_ci: a flip beyond the margin whose CIs include 0 or that fails BH;
    supported_practical: a flip beyond the margin, both CIs excluding 0, BH-significant."""
    reject = benjamini_hochberg([t.p for t in tests], q)
    out = []
    for t, rej in zip(tests, reject, strict=True):
        if not t.flipped:
            out.append("stable")
        elif not t.margin_ok:
            out.append("microscopic")
        elif t.both_ci_exclude_zero and rej:
            out.append("supported_practical")
        else:
            out.append("wide_ci")
    return out


def top1(means: np.ndarray, policies: Sequence[str], atol: float = 1e-12) -> set[str]:
    """The best policies (ties within `atol` all count as best)."""
    if np.all(np.isnan(means)):
        return set()
    best = np.nanmax(means)
    return {
        p for v, p in zip(means, policies, strict=True) if not math.isnan(v) and v >= best - atol
    }


def pooled_means(matrices: Sequence[Matrix]) -> np.ndarray:
    """Leave-one-source-out reference: the mean over sources of each source's policy means."""
    stacked = np.vstack([policy_means(m) for m in matrices])
    return policy_means(stacked)


def pooled_gain(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], *, n_boot: int = N_BOOT, seed: int = SEED
) -> Estimate:
    """Gain of a contender over a baseline, 1 − (ours / baseline), pooled over conditions.

    Each condition gives paired per-replicate values (ours, baseline) of a lower-is-better
    metric; its ratio is mean(ours) / mean(baseline), and conditions pool by the geometric
    mean of the ratios. The CI resamples replicates (pairs kept together) within every
    condition independently. One condition gives the plain 1 − mean(ours) / mean(baseline).
    """

    def gain(ratios: np.ndarray) -> np.ndarray:
        out: np.ndarray = 1.0 - np.exp(np.mean(np.log(ratios), axis=-1))
        return out

    rng = np.random.default_rng(seed)
    point = gain(np.array([np.mean(a) / np.mean(b) for a, b in pairs]))
    boots = np.empty((n_boot, len(pairs)))
    for k, (a, b) in enumerate(pairs):
        idx = boot_indices(len(a), n_boot, rng)
        boots[:, k] = np.asarray(a)[idx].mean(axis=1) / np.asarray(b)[idx].mean(axis=1)
    return interval(gain(boots), float(point))
