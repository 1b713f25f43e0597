"""From tidy grid rows to the study's tables: τ between sources, reversal counts, cross-metric
agreement and leave-one-source-out. Every statistic comes from `loadgen.study.stats`.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from loadgen.study import stats
from loadgen.study.grid import AXES, HEADLINE_POLICIES, METRICS, PRIMARY_METRIC, SOURCES, Row

Key = tuple[str, str, str, str]
"""(axis, source, region, metric)."""


@dataclass(slots=True)
class Grid:
    """Oriented matrices (windows x policies, higher is better) per condition."""

    policies: tuple[str, ...]
    matrices: dict[Key, stats.Matrix]
    sources: tuple[str, ...]
    axes: tuple[str, ...]
    regions: dict[str, tuple[str, ...]]
    metrics: tuple[str, ...]

    def get(self, axis: str, source: str, region: str, metric: str) -> stats.Matrix:
        return self.matrices[(axis, source, region, metric)]


def build(
    rows: Sequence[Row],
    policies: Sequence[str] = HEADLINE_POLICIES,
    sources: Sequence[str] = SOURCES,
) -> Grid:
    """Group rows into oriented matrices; windows in sorted order, policies in `policies`,
    sources in `sources` order (those with rows)."""
    col = {p: i for i, p in enumerate(policies)}
    cells: dict[Key, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r.policy in col and r.metric in METRICS:
            cells[(r.axis, r.source, r.region, r.metric)][r.window][col[r.policy]] = r.value
    mats: dict[Key, stats.Matrix] = {}
    for key, by_window in cells.items():
        m = np.full((len(by_window), len(policies)), np.nan)
        for w, (_, values) in enumerate(sorted(by_window.items())):
            for j, v in values.items():
                m[w, j] = v
        mats[key] = stats.orient(m, METRICS[key[3]])
    present = {k[1] for k in mats}
    axes = tuple(a for a in AXES if any(k[0] == a for k in mats))
    regions = {
        a: tuple(r for r in AXES[a] if any(k[:1] + k[2:3] == (a, r) for k in mats)) for a in axes
    }
    return Grid(
        tuple(policies),
        mats,
        tuple(s for s in sources if s in present),
        axes,
        regions,
        tuple(m for m in METRICS if any(k[3] == m for k in mats)),
    )


def source_pairs(grid: Grid) -> list[tuple[str, str]]:
    return list(itertools.combinations(grid.sources, 2))


def tau_table(
    grid: Grid,
    axis: str,
    metric: str = PRIMARY_METRIC,
    *,
    spearman: bool = False,
    n_boot: int = stats.N_BOOT,
) -> dict[tuple[str, str, str], stats.Estimate]:
    """(region, source A, source B) → τ-b (or Spearman) of the two rankings, with CI."""
    out = {}
    for region in grid.regions[axis]:
        for a, b in source_pairs(grid):
            out[(region, a, b)] = stats.tau_between(
                grid.get(axis, a, region, metric),
                grid.get(axis, b, region, metric),
                n_boot=n_boot,
                spearman=spearman,
            )
    return out


@dataclass(slots=True)
class Reversals:
    """Reversal classes per (metric, region), plus the supported ones in detail."""

    counts: dict[tuple[str, str], Counter[str]] = field(default_factory=dict)
    supported: list[tuple[str, str, str, str, stats.PairTest]] = field(default_factory=list)
    """(metric, region, source A, source B, test)."""

    def total(self, metric: str | None = None, region: str | None = None) -> Counter[str]:
        c: Counter[str] = Counter()
        for (m, r), counts in self.counts.items():
            if (metric is None or m == metric) and (region is None or r == region):
                c.update(counts)
        return c


def reversals(
    grid: Grid, axis: str, metrics: Sequence[str] | None = None, *, n_boot: int = stats.N_BOOT
) -> Reversals:
    """Every policy pair x source pair, classified; BH per (metric, region)."""
    out = Reversals()
    for metric in metrics or grid.metrics:
        for region in grid.regions[axis]:
            family: list[tuple[str, str, stats.PairTest]] = []
            for a, b in source_pairs(grid):
                tests = stats.pair_tests(
                    grid.get(axis, a, region, metric),
                    grid.get(axis, b, region, metric),
                    grid.policies,
                    n_boot=n_boot,
                )
                family += [(a, b, t) for t in tests]
            classes = stats.classify([t for _, _, t in family])
            out.counts[(metric, region)] = Counter(classes)
            out.supported += [
                (metric, region, a, b, t)
                for (a, b, t), c in zip(family, classes, strict=True)
                if c == "supported_practical"
            ]
    return out


@dataclass(slots=True)
class CrossMetric:
    """Agreement between metrics within each (source, region) condition."""

    tau_vs_primary: dict[tuple[str, str, str], float]
    """(source, region, metric) → τ-b between that metric's ranking and ANWG's."""
    tau_all_pairs: list[float]
    top1_differs: dict[tuple[str, str, str], bool]
    """(source, region, metric) → the best policy under the metric is not ANWG's best."""
    top1: dict[tuple[str, str, str], set[str]]

    def median_tau_vs_primary(self) -> float:
        v = [t for t in self.tau_vs_primary.values() if not math.isnan(t)]
        return float(np.median(v)) if v else math.nan

    def median_tau_all_pairs(self) -> float:
        v = [t for t in self.tau_all_pairs if not math.isnan(t)]
        return float(np.median(v)) if v else math.nan

    def top1_change_share(self) -> float:
        v = list(self.top1_differs.values())
        return sum(v) / len(v) if v else math.nan


def cross_metric(grid: Grid, axis: str) -> CrossMetric:
    """τ-b between metric rankings and top-1 agreement, per (source, region)."""
    vs, pairs, differs, best = {}, [], {}, {}
    for source in grid.sources:
        for region in grid.regions[axis]:
            means = {m: stats.policy_means(grid.get(axis, source, region, m)) for m in grid.metrics}
            for m in grid.metrics:
                best[(source, region, m)] = stats.top1(means[m], grid.policies)
            primary = means[PRIMARY_METRIC]
            for m in grid.metrics:
                if m == PRIMARY_METRIC:
                    continue
                vs[(source, region, m)] = stats.kendall_tau_b(primary, means[m])
                differs[(source, region, m)] = not (
                    best[(source, region, m)] & best[(source, region, PRIMARY_METRIC)]
                )
            pairs += [
                stats.kendall_tau_b(means[x], means[y])
                for x, y in itertools.combinations(grid.metrics, 2)
            ]
    return CrossMetric(vs, pairs, differs, best)


def leave_one_source_out(
    grid: Grid, axis: str, metric: str = PRIMARY_METRIC
) -> dict[tuple[str, str], float]:
    """(region, left-out source) → τ-b between its ranking and the others' pooled ranking."""
    out = {}
    for region in grid.regions[axis]:
        for left in grid.sources:
            rest = [grid.get(axis, s, region, metric) for s in grid.sources if s != left]
            out[(region, left)] = stats.kendall_tau_b(
                stats.policy_means(grid.get(axis, left, region, metric)), stats.pooled_means(rest)
            )
    return out


def rankings(
    grid: Grid, axis: str, metric: str = PRIMARY_METRIC
) -> dict[tuple[str, str], list[str]]:
    """(source, region) → policies best first by mean over windows."""
    return {
        (s, r): stats.ranking(stats.policy_means(grid.get(axis, s, r, metric)), grid.policies)
        for s in grid.sources
        for r in grid.regions[axis]
    }
