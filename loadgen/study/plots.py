"""Study plots (matplotlib, Agg backend: no display, no warnings in tests)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from loadgen.study.grid import SOURCE_LABELS
from loadgen.study.stats import Estimate

if TYPE_CHECKING:
    from loadgen.study.analysis import Grid


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(s: str) -> str:
    return SOURCE_LABELS.get(s, s)


def tau_heatmap(
    taus: dict[tuple[str, str, str], Estimate], regions: Sequence[str], path: Path, title: str
) -> Path:
    """Regions x source pairs, cell = τ-b with its CI written in."""
    plt = _plt()
    pairs = sorted({(a, b) for _, a, b in taus})
    vals = np.array([[taus[(r, a, b)].value for a, b in pairs] for r in regions])
    fig, ax = plt.subplots(figsize=(6.4, 0.5 * len(regions) + 1.6))
    im = ax.imshow(vals, vmin=-1, vmax=1, cmap="RdBu", aspect="auto")
    ax.set_xticks(range(len(pairs)), [f"{_label(a)}–{_label(b)}" for a, b in pairs])
    ax.set_yticks(range(len(regions)), list(regions))
    for i, r in enumerate(regions):
        for j, (a, b) in enumerate(pairs):
            e = taus[(r, a, b)]
            text = "n/a" if np.isnan(e.value) else f"{e.value:.2f}\n[{e.lo:.2f}, {e.hi:.2f}]"
            ax.text(j, i, text, ha="center", va="center", fontsize=7)
    ax.set_title(f"Kendall τ-b between sources (ANWG), {title}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def bump_charts(ranks: dict[tuple[str, str], list[str]], grid: Grid, axis: str, path: Path) -> Path:
    """One panel per source: each policy's ANWG rank across the load points."""
    plt = _plt()
    regions = grid.regions[axis]
    fig, axes = plt.subplots(
        1, len(grid.sources), figsize=(4.2 * len(grid.sources), 4.2), sharey=True, squeeze=False
    )
    cmap = plt.get_cmap("tab20")
    for k, source in enumerate(grid.sources):
        ax = axes[0][k]
        for i, policy in enumerate(grid.policies):
            y = [ranks[(source, r)].index(policy) + 1 for r in regions]
            ax.plot(range(len(regions)), y, marker="o", ms=3, lw=1.2, color=cmap(i), label=policy)
        ax.set_xticks(range(len(regions)), list(regions), rotation=45, ha="right", fontsize=7)
        ax.set_title(_label(source), fontsize=9)
        ax.invert_yaxis() if k == 0 else None
    axes[0][0].set_ylabel("rank (1 = best ANWG)")
    axes[0][-1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
