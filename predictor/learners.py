"""Small models trained online on the prompt embeddings (numpy only).

- `OnlineRidge`: ridge regression of log output length on [embedding, log prompt tokens, 1].
  It keeps the sufficient statistics (XᵀX, Xᵀy), so learning one completion is a rank-one
  update (~0.1 ms) and the weights are re-solved lazily once `refit_every` new items arrived.
  It also keeps a ring of its *prequential* residuals (log truth − the prediction it made
  before it learned that item): honest errors, whose quantiles give the predicted
  distribution its spread.
- `PairwiseRanker`: a linear scorer trained with the pairwise logistic loss (RankNet) on pairs
  of recent completions: for a pair with truly different lengths, the score of the longer one
  should be higher. Learning-to-rank's idea (Fu et al., 2024) on our embeddings; the `ltr`
  policy orders by its score.

Both are plain state (arrays) that `to_arrays`/`from_arrays` turn into snapshot members.
Neither is thread-safe on its own; `LengthPredictor` serialises access with its lock.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

FloatArray = NDArray[np.float64]


def features(vectors: ArrayLike, prompt_tokens: ArrayLike) -> FloatArray:
    """Rows [embedding, log(1 + prompt tokens) / 8, 1]: the log-length scaled to the size of an
    embedding coordinate's spread, so the ridge penalty treats it like the others."""
    x = np.asarray(vectors, dtype=np.float64)
    x = x.reshape(-1, x.shape[-1])
    p = np.log1p(np.maximum(np.asarray(prompt_tokens, dtype=np.float64).ravel(), 0.0)) / 8.0
    return np.hstack([x, p[:, None], np.ones((x.shape[0], 1))])


class OnlineRidge:
    """Ridge regression of log(output tokens) on `features`, updated one batch at a time."""

    def __init__(
        self,
        dim: int,
        l2: float = 1.0,
        refit_every: int = 64,
        residual_window: int = 4_000,
        min_items: int = 32,
    ) -> None:
        self.dim, self.l2, self.refit_every = dim, l2, refit_every
        self.min_items = min_items
        n = dim + 2
        self.gram = np.zeros((n, n))
        self.moment = np.zeros(n)
        self.count = 0
        self.weights: FloatArray | None = None
        self._fitted_at = 0
        self.residuals = np.zeros(residual_window)
        self.residuals_added = 0

    @property
    def ready(self) -> bool:
        """True once it has learned `min_items` items (before that `predict` gives None)."""
        return self.count >= self.min_items

    def _solve(self) -> FloatArray:
        if self.weights is None or self.count - self._fitted_at >= self.refit_every:
            reg = self.l2 * np.eye(self.gram.shape[0])
            reg[-1, -1] = 1e-6  # the intercept is not shrunk
            self.weights = np.asarray(np.linalg.solve(self.gram + reg, self.moment), np.float64)
            self._fitted_at = self.count
        return self.weights

    def predict(self, x: FloatArray) -> FloatArray | None:
        """Predicted log output length per feature row, or None while not `ready`."""
        if not self.ready:
            return None
        return np.asarray(x @ self._solve())

    def learn(self, x: FloatArray, log_y: FloatArray) -> None:
        """Add rows `x` with true log lengths `log_y`; their residuals under the weights of
        before this call (when `ready`) go to the residual ring."""
        before = self.predict(x)
        if before is not None:
            self._push_residuals(log_y - before)
        self.gram += x.T @ x
        self.moment += x.T @ log_y
        self.count += x.shape[0]

    def _push_residuals(self, r: FloatArray) -> None:
        size = self.residuals.size
        r = r[-size:]
        slots = (self.residuals_added + np.arange(r.size)) % size
        self.residuals[slots] = r
        self.residuals_added += r.size

    def residual_sample(self) -> FloatArray:
        """The recent prequential residuals (log space), empty before any."""
        return self.residuals[: min(self.residuals_added, self.residuals.size)]

    def to_arrays(self, prefix: str) -> dict[str, NDArray[np.float64]]:
        """Snapshot members (name → array)."""
        meta = [self.count, self.residuals_added, self.l2, self.refit_every, self.min_items]
        return {
            f"{prefix}gram": self.gram,
            f"{prefix}moment": self.moment,
            f"{prefix}residuals": self.residuals,
            f"{prefix}meta": np.asarray(meta, dtype=np.float64),
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, FloatArray], prefix: str) -> OnlineRidge:
        """Inverse of `to_arrays`."""
        count, added, l2, refit, min_items = arrays[f"{prefix}meta"].tolist()
        gram = arrays[f"{prefix}gram"]
        self = cls(gram.shape[0] - 2, l2, int(refit), arrays[f"{prefix}residuals"].size)
        self.min_items = int(min_items)
        self.gram, self.moment = gram.copy(), arrays[f"{prefix}moment"].copy()
        self.residuals = arrays[f"{prefix}residuals"].copy()
        self.count, self.residuals_added = int(count), int(added)
        return self


class PairwiseRanker:
    """Linear scorer s(x) = w·x trained by SGD on the pairwise logistic loss.

    Each `learn` call draws `pairs_per_item` random partners for every new item from a ring of
    recent items (its features and log lengths) and takes one gradient step per 16 new items on
    log(1 + exp(−sign(yᵢ − yⱼ)·(sᵢ − sⱼ))), pairs whose lengths differ by less than
    `min_log_gap` skipped (ties carry no order). Higher score = predicted longer.
    """

    def __init__(
        self,
        dim: int,
        *,
        learning_rate: float = 8.0,
        l2: float = 1e-4,
        pairs_per_item: int = 32,
        window: int = 4_000,
        min_log_gap: float = 0.1,
        seed: int = 0,
    ) -> None:
        self.weights = np.zeros(dim + 2)
        self.learning_rate, self.l2 = learning_rate, l2
        self.pairs_per_item, self.min_log_gap = pairs_per_item, min_log_gap
        self.ring_x = np.zeros((window, dim + 2))
        self.ring_y = np.zeros(window)
        self.added = 0
        self.steps = 0
        self._rng = np.random.default_rng(seed)

    def score(self, x: FloatArray) -> FloatArray:
        """Ranking score per feature row (higher = predicted longer; 0 before learning)."""
        return np.asarray(x @ self.weights)

    def learn(self, x: FloatArray, log_y: FloatArray) -> None:
        """Remember the new items, then take SGD steps on pairs (new item, recent item)."""
        size = self.ring_y.size
        slots = (self.added + np.arange(x.shape[0])) % size
        self.ring_x[slots[-size:]] = x[-size:]
        self.ring_y[slots[-size:]] = log_y[-size:]
        self.added += x.shape[0]
        held = min(self.added, size)
        for start in range(0, x.shape[0], 16):
            self._step(x[start : start + 16], log_y[start : start + 16], held)

    def _step(self, x: FloatArray, log_y: FloatArray, held: int) -> None:
        n = x.shape[0] * self.pairs_per_item
        a = np.repeat(np.arange(x.shape[0]), self.pairs_per_item)
        b = self._rng.integers(0, held, size=n)
        gap = log_y[a] - self.ring_y[b]
        keep = np.abs(gap) >= self.min_log_gap
        if not keep.any():
            return
        a, b, sign = a[keep], b[keep], np.sign(gap[keep])
        diff = x[a] - self.ring_x[b]
        margin = sign * (diff @ self.weights)
        # d/dw log(1 + e^{−m}) = −sign·diff·σ(−m)
        coef = -sign / (1.0 + np.exp(np.clip(margin, -30.0, 30.0)))
        grad = (coef[:, None] * diff).mean(axis=0) + self.l2 * self.weights
        self.steps += 1
        rate = self.learning_rate / np.sqrt(1.0 + self.steps / 100.0)
        self.weights -= rate * grad

    def to_arrays(self, prefix: str) -> dict[str, NDArray[np.float64]]:
        """Snapshot members (name → array)."""
        meta = [self.added, self.steps, self.learning_rate, self.l2, self.pairs_per_item]
        return {
            f"{prefix}weights": self.weights,
            f"{prefix}ring_x": self.ring_x,
            f"{prefix}ring_y": self.ring_y,
            f"{prefix}meta": np.asarray([*meta, self.min_log_gap], dtype=np.float64),
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, FloatArray], prefix: str) -> PairwiseRanker:
        """Inverse of `to_arrays`."""
        added, steps, rate, l2, pairs, gap = arrays[f"{prefix}meta"].tolist()
        ring_x = arrays[f"{prefix}ring_x"]
        self = cls(
            ring_x.shape[1] - 2,
            learning_rate=rate,
            l2=l2,
            pairs_per_item=int(pairs),
            window=ring_x.shape[0],
            min_log_gap=gap,
        )
        self.weights = arrays[f"{prefix}weights"].copy()
        self.ring_x, self.ring_y = ring_x.copy(), arrays[f"{prefix}ring_y"].copy()
        self.added, self.steps = int(added), int(steps)
        return self
