"""Honest settings: k-fold cross-validation on the training file only.

`cross_validate` splits the (already shuffled) train records into `folds` contiguous folds;
for each fold a fresh `LengthPredictor` state learns the other folds online (index, ridge,
ranker), and every candidate configuration predicts the held-out fold from that one state
(the candidates differ only in how neighbours and models are blended, which needs no refit).
`choose` then searches one parameter at a time (coordinate search over `GRID`, two rounds),
keeping the value with the best mean objective. The test file is never looked at: it is scored
once, with the chosen settings, by `predictor.evaluate`.

Objective: Kendall τ of the Gittins order (the quantity that orders SageSched's queue), minus
a penalty of 2 per unit that the 10–90% coverage leaves the band [0.75, 0.85], minus
0.1 × (MAE of the median / MAE of the fold's global distribution): ordering first, honest
spread second, the median last.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from predictor.config import PredictorConfig
from predictor.evaluate import Record, score
from predictor.model import LengthPredictor
from predictor.state import ModelState

GRID: dict[str, Sequence[Any]] = {
    "ridge_weight": (0.0, 0.3, 0.5, 0.7, 1.0),
    "similarity_temperature": (0.05, 0.1, 0.2, 0.5),
    "k_neighbours": (16, 32, 64),
    "neighbour_spread_scale": (0.0, 0.5, 0.75, 1.0),
    "prior_weight": (0.1, 0.3, 0.5, 0.8, 0.95),
}
"""Candidate values per parameter (searched in this order)."""


def objective(s: dict[str, float], global_mae: float) -> float:
    """Higher is better: τ(Gittins) − coverage penalty − 0.1 × relative MAE."""
    cov = s["coverage_10_90"]
    penalty = 2.0 * max(0.75 - cov, cov - 0.85, 0.0)
    return s["kendall_tau"] - penalty - 0.1 * s["mae_median"] / max(global_mae, 1e-9)


class _Fold:
    """One fold: a state fitted on the other folds and the held-out rows."""

    def __init__(
        self,
        base: LengthPredictor,
        vectors: NDArray[np.float32],
        y: NDArray[np.float64],
        p: NDArray[np.float64],
        fit: NDArray[np.intp],
        val: NDArray[np.intp],
    ) -> None:
        self.state = ModelState.new(base.embedder.dim, base.config)
        self.state.learn(vectors[fit], y[fit], p[fit])
        self.vectors, self.truth, self.prompts = vectors[val], y[val], [float(v) for v in p[val]]
        self.global_mae = float(np.mean(np.abs(np.median(y[fit]) - y[val])))
        self.embedder = base.embedder

    def score(self, cfg: PredictorConfig) -> dict[str, float]:
        view = LengthPredictor(cfg, embedder=self.embedder, states={"": self.state})
        return score(view.predict_vectors(self.vectors, self.prompts), self.truth)


def cross_validate(
    base: LengthPredictor,
    train: Sequence[Record],
    vectors: NDArray[np.float32],
    *,
    folds: int = 5,
    grid: dict[str, Sequence[Any]] | None = None,
    rounds: int = 2,
) -> tuple[PredictorConfig, list[dict[str, Any]]]:
    """Choose the settings of `base.config` in `grid` by `folds`-fold CV on `train` (with
    their embeddings `vectors`). Returns the chosen config and one log row per candidate."""
    y = np.array([float(r["output_tokens"]) for r in train])
    p = np.array([float(r["prompt_tokens"]) for r in train])
    parts = np.array_split(np.arange(len(train)), folds)
    fitted = [
        _Fold(base, vectors, y, p, np.concatenate(parts[:f] + parts[f + 1 :]), parts[f])
        for f in range(folds)
    ]
    cache: dict[PredictorConfig, float] = {}
    log: list[dict[str, Any]] = []

    def cv_objective(cfg: PredictorConfig) -> float:
        if cfg not in cache:
            rows = [f.score(cfg) for f in fitted]
            mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
            gm = float(np.mean([f.global_mae for f in fitted]))
            cache[cfg] = objective(mean, gm)
            changed = {k: getattr(cfg, k) for k in (grid or GRID)}
            log.append(changed | {"objective": cache[cfg]} | mean)
        return cache[cfg]

    best = base.config
    for _ in range(rounds):
        for name, values in (grid or GRID).items():
            cands = [dataclasses.replace(best, **{name: v}) for v in values]
            best = max(cands, key=cv_objective)
    return best, log
