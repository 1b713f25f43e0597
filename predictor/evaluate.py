"""Offline evaluation of length predictors against two baselines.

Every predictor is fitted on a train list of records `{prompt, output_tokens, prompt_tokens}`
and predicts a `LengthDist` per test record. Scores (all lengths in tokens):

- `mae_median`: mean |median − truth|;
- `spearman`: Spearman rank correlation of predicted mean with truth;
- `kendall_tau`: Kendall τ-b between the *scheduling order* the prediction induces and the
  truth: jobs ordered by descending Gittins index of the `kv` cost (O²/2 + I·O at a fixed
  I = `KEY_PROMPT_TOKENS`, nothing generated yet), as SageSched orders its queue at
  admission. +1 = shortest truly first; 0 = no information (a predictor that gives everyone
  the same distribution scores 0, not NaN); `kendall_tau_median`, `kendall_tau_mean`: the
  same for the predicted median and mean;
- `pinball_0.1/0.5/0.9`: quantile loss of the predicted quantiles;
- `coverage_10_90`: share of truths inside the predicted [q10, q90] interval (ideal 0.8).

Baselines: `global` (the train set's length distribution for everyone) and
`length_regression` (log output = a + b·log prompt, least squares, with the residuals'
empirical quantiles as the spread).
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from policies import LengthDist, gittins_index
from policies.cost import KVCost
from predictor.model import LengthPredictor

Record = dict[str, Any]
QUANTILES = (0.1, 0.5, 0.9)


class Predictor(Protocol):
    """What `evaluate` needs of a predictor."""

    name: str

    def fit(self, train: Sequence[Record]) -> None: ...

    def predict(self, test: Sequence[Record]) -> list[LengthDist]: ...


def pinball(q: float, pred: NDArray[np.float64], truth: NDArray[np.float64]) -> float:
    """Mean quantile (pinball) loss of predictions of the q-quantile, tokens."""
    diff = truth - pred
    return float(np.mean(np.maximum(q * diff, (q - 1.0) * diff)))


def rank_corr(kind: str, x: NDArray[np.float64], y: NDArray[np.float64]) -> float:
    """Spearman's or Kendall's rank correlation of `x` with `y` (0 when either is constant)."""
    from scipy import stats

    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return 0.0  # a constant prediction carries no ordering information
    res = stats.spearmanr(x, y) if kind == "spearman" else stats.kendalltau(x, y)
    value = float(res.statistic)
    return 0.0 if math.isnan(value) else value


KEY_PROMPT_TOKENS = 256.0
"""The fixed prompt length at which `scheduling_key` prices a prediction, so τ measures the
output-length prediction alone (the queue itself uses each job's own prompt length)."""


def scheduling_key(dist: LengthDist, prompt_tokens: float = KEY_PROMPT_TOKENS) -> float:
    """The admission order key SageSched gives the prediction: −Gittins index of the `kv`
    cost distribution (O²/2 + I·O) at zero attained service (lower goes first)."""
    cost = KVCost().cost(prompt_tokens, dist.support)
    return -gittins_index(cost, dist.probs, 0.0)


def score(
    dists: Sequence[LengthDist], truth: Sequence[float] | NDArray[np.float64]
) -> dict[str, float]:
    """The metrics above for predictions `dists` of lengths `truth`."""
    y = np.asarray(truth, dtype=np.float64)
    qs = {q: np.array([d.quantile(q) for d in dists]) for q in QUANTILES}
    mean = np.array([d.mean() for d in dists])
    key = np.array([scheduling_key(d) for d in dists])
    out = {
        "mae_median": float(np.mean(np.abs(qs[0.5] - y))),
        "spearman": rank_corr("spearman", mean, y),
        "kendall_tau": rank_corr("kendall", key, y),
        "kendall_tau_median": rank_corr("kendall", qs[0.5], y),
        "kendall_tau_mean": rank_corr("kendall", mean, y),
        "coverage_10_90": float(np.mean((qs[0.1] <= y) & (y <= qs[0.9]))),
    }
    out.update({f"pinball_{q}": pinball(q, qs[q], y) for q in QUANTILES})
    return out


def _lengths(records: Sequence[Record], key: str) -> NDArray[np.float64]:
    return np.array([max(float(r[key]), 1.0) for r in records])


class GlobalBaseline:
    """Everyone gets the train set's empirical length distribution."""

    name = "global"

    def __init__(self, bucket_count: int = 24) -> None:
        self.bucket_count = bucket_count
        self.dist = LengthDist.point(1)

    def fit(self, train: Sequence[Record]) -> None:
        y = _lengths(train, "output_tokens")
        self.dist = LengthDist.from_samples(y, max_points=self.bucket_count)

    def predict(self, test: Sequence[Record]) -> list[LengthDist]:
        return [self.dist] * len(test)


class LengthRegressionBaseline:
    """log(output) = a + b·log(prompt) by least squares; spread = residual quantiles."""

    name = "length_regression"

    def __init__(self, points: int = 24) -> None:
        self.points = points
        self.coef = (0.0, 0.0)
        self.residuals = np.zeros(1)

    def fit(self, train: Sequence[Record]) -> None:
        x = np.log(_lengths(train, "prompt_tokens"))
        y = np.log(_lengths(train, "output_tokens"))
        b, a = np.polyfit(x, y, 1)
        self.coef = (float(a), float(b))
        qs = (np.arange(self.points) + 0.5) / self.points
        self.residuals = np.quantile(y - (a + b * x), qs)

    def predict(self, test: Sequence[Record]) -> list[LengthDist]:
        a, b = self.coef
        x = np.log(_lengths(test, "prompt_tokens"))
        return [LengthDist.from_samples(np.exp(a + b * xi + self.residuals)) for xi in x]


class SemanticPredictor:
    """The semantic history predictor, fitted by learning every train record online (in
    file order). With `cache_dir`, embeddings come from `cached_embeddings`. After `predict`,
    `rank_scores` holds the ranking model's score per test record (for the `ltr` policy)."""

    name = "semantic"

    def __init__(
        self, model: LengthPredictor, cache_dir: str | os.PathLike[str] | None = None
    ) -> None:
        self.model = model
        self.cache_dir = cache_dir
        self.rank_scores: list[float] = []

    def fit(self, train: Sequence[Record]) -> None:
        vectors = cached_embeddings(self.model, [r["prompt"] for r in train], self.cache_dir)
        self.model.learn_vectors(
            vectors,
            [float(r["output_tokens"]) for r in train],
            [float(r["prompt_tokens"]) for r in train],
        )

    def predict(self, test: Sequence[Record]) -> list[LengthDist]:
        vectors = cached_embeddings(self.model, [r["prompt"] for r in test], self.cache_dir)
        prompts = [float(r["prompt_tokens"]) for r in test]
        self.rank_scores = self.model.rank_scores(vectors, prompts)
        return self.model.predict_vectors(vectors, prompts)


def fill_prompt_tokens(model: LengthPredictor, records: Sequence[Record]) -> None:
    """Give each record without a `prompt_tokens` count the model's count of its prompt."""
    missing = [r for r in records if "prompt_tokens" not in r]
    for r, n in zip(missing, model.count_tokens([r["prompt"] for r in missing]), strict=True):
        r["prompt_tokens"] = n


def cached_embeddings(
    model: LengthPredictor, prompts: Sequence[str], cache_dir: str | os.PathLike[str] | None
) -> NDArray[np.float32]:
    """Embeddings of `prompts` as `model` makes them (clipped text, its embedder), read from
    `cache_dir/emb-<hash>.npz` when an earlier run stored them. The hash covers the model
    folder's name, the backend and every clipped text, so another clip length, model or
    backend misses the cache.
    Without `cache_dir`, embeds."""
    texts = [model.text(p) for p in prompts]
    if cache_dir is None:
        return model.embedder.encode(texts)
    digest = hashlib.sha256(str(model.embedder.path.name).encode())
    backend = str(getattr(model.embedder, "backend", "torch"))
    if backend != "torch":  # the torch reference keeps the key it had before backends existed
        digest.update(backend.encode())
    for t in texts:
        digest.update(hashlib.sha256(t.encode()).digest())
    path = Path(cache_dir) / f"emb-{digest.hexdigest()[:24]}.npz"
    if path.exists():
        with np.load(path) as z:
            return np.asarray(z["vectors"], dtype=np.float32)
    vectors = model.embedder.encode(texts)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, vectors=vectors)
    os.replace(tmp, path)
    return vectors


def evaluate(
    predictors: Sequence[Predictor], train: Sequence[Record], test: Sequence[Record]
) -> dict[str, dict[str, float]]:
    """Fit and score each predictor; per name, the metrics plus `n_test`, `fit_s`,
    `predict_ms_per_item` (wall time, including embedding for the semantic one)."""
    truth = [float(r["output_tokens"]) for r in test]
    results: dict[str, dict[str, float]] = {}
    for p in predictors:
        t0 = time.perf_counter()
        p.fit(train)
        t1 = time.perf_counter()
        dists = p.predict(test)
        t2 = time.perf_counter()
        results[p.name] = score(dists, truth) | {
            "n_test": float(len(test)),
            "fit_s": t1 - t0,
            "predict_ms_per_item": (t2 - t1) * 1000.0 / max(len(test), 1),
        }
        ranks = getattr(p, "rank_scores", None)
        if ranks:
            y = np.asarray(truth)
            results[p.name]["kendall_tau_rank_score"] = rank_corr("kendall", np.asarray(ranks), y)
    return results
