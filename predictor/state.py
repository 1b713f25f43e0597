"""What the predictor has learned about one served model, and the snapshot file of all of them.

`ModelState` bundles one model's `HistoryIndex` (the kNN ring), its `OnlineRidge` (log length
on the embedding) and its `PairwiseRanker` (the `ltr` policy's scorer), plus the cache of its
global distribution. `LengthPredictor` keeps one per served model name; the default state
(name "") holds what was learned without a model name (warm start, version-1 snapshots) and
answers for a model that has not learned `model_min_items` of its own yet.

Snapshot format "sagesched-predictor", version 2 (one .npz, no pickle): member `header` (UTF-8
JSON: format, version, `models` = [{name, history header}], `extra` = {config, model}) and,
for the i-th model, its index (`m<i>.output`, `m<i>.prompt`, `m<i>.graph`), ridge
(`m<i>.ridge.*`) and ranker (`m<i>.rank.*`) arrays. Version 1 ("sagesched-predictor-history",
one index, written by `HistoryIndex.save`) still loads: it becomes the default state, and its
ridge and ranker are retrained from the stored embeddings.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from policies import LengthDist
from predictor.config import PredictorConfig
from predictor.history import (
    SNAPSHOT_FORMAT as HISTORY_FORMAT,
)
from predictor.history import (
    HistoryIndex,
    SnapshotError,
    atomic_savez,
    json_member,
)
from predictor.learners import OnlineRidge, PairwiseRanker, features

DEFAULT_MODEL = ""
"""The state name of requests without a model name, and every model's fallback."""
FORMAT = "sagesched-predictor"
VERSION = 2
LEARN_CHUNK_ITEMS = 256
"""Items per online learning step when many are learned at once (warm start, retraining):
each chunk is scored before it is learned, so the ridge's residuals stay prequential."""


@dataclass
class ModelState:
    """One served model's history and online models. Mutations hold `lock`."""

    index: HistoryIndex
    ridge: OnlineRidge
    ranker: PairwiseRanker
    lock: threading.Lock = field(default_factory=threading.Lock)
    global_cache: dict[int | None, tuple[int, LengthDist]] = field(default_factory=dict)

    @classmethod
    def new(cls, dim: int, cfg: PredictorConfig, index: HistoryIndex | None = None) -> ModelState:
        """An empty state (or one around an existing index, whose items are then learned)."""
        fresh = index is None
        if index is None:
            index = HistoryIndex(
                dim,
                cfg.capacity_items,
                m=cfg.hnsw_m,
                ef_construction=cfg.hnsw_ef_construction,
                ef_search=cfg.hnsw_ef_search,
            )
        state = cls(index, _ridge(dim, cfg), PairwiseRanker(dim))
        if not fresh:
            state.retrain()
        return state

    def learn(self, vectors: ArrayLike, output_tokens: ArrayLike, prompt_tokens: ArrayLike) -> None:
        """Add completed requests to the index and train the ridge and ranker on them."""
        x = np.asarray(vectors, dtype=np.float32).reshape(-1, self.index.dim)
        out = np.asarray(output_tokens, dtype=np.float64).ravel()
        prm = np.asarray(prompt_tokens, dtype=np.float64).ravel()
        self.index.add(x, out, prm)
        self._train(x, out, prm)

    def _train(self, x: NDArray[np.float32], out: NDArray[np.float64], prm: ArrayLike) -> None:
        feats, log_y = features(x, prm), np.log(np.maximum(out, 1.0))
        with self.lock:
            for s in range(0, log_y.size, LEARN_CHUNK_ITEMS):
                e = s + LEARN_CHUNK_ITEMS
                self.ridge.learn(feats[s:e], log_y[s:e])
                self.ranker.learn(feats[s:e], log_y[s:e])

    def retrain(self) -> None:
        """Train fresh online models on every held item, oldest first."""
        x, out, prm = self.index.items_in_order()
        self._train(x, out, prm)

    def ridge_centre(self, vectors: ArrayLike, prompt_tokens: ArrayLike) -> NDArray[Any] | None:
        """The ridge's predicted log length per row (None while untrained)."""
        with self.lock:
            return self.ridge.predict(features(vectors, prompt_tokens))

    def rank_scores(self, vectors: ArrayLike, prompt_tokens: ArrayLike) -> NDArray[Any]:
        """The ranker's score per row (higher = predicted longer)."""
        with self.lock:
            return self.ranker.score(features(vectors, prompt_tokens))

    def residuals(self) -> NDArray[np.float64]:
        """A copy of the ridge's recent prequential residuals (log space)."""
        with self.lock:
            return self.ridge.residual_sample().copy()


def _ridge(dim: int, cfg: PredictorConfig) -> OnlineRidge:
    return OnlineRidge(dim, l2=cfg.ridge_l2, min_items=4 * cfg.min_neighbours)


def save_states(
    path: str | os.PathLike[str], states: dict[str, ModelState], extra: dict[str, Any]
) -> None:
    """Write every model's state to one version-2 snapshot, atomically."""
    models: list[dict[str, Any]] = []
    arrays: dict[str, NDArray[Any]] = {}
    for i, (name, st) in enumerate(sorted(states.items())):
        head, idx = st.index.to_arrays(f"m{i}.")
        arrays |= idx
        with st.lock:
            arrays |= st.ridge.to_arrays(f"m{i}.ridge.")
            arrays |= st.ranker.to_arrays(f"m{i}.rank.")
        models.append({"name": name, "history": head})
    header = {"format": FORMAT, "version": VERSION, "models": models, "extra": extra}
    atomic_savez(path, {"header": json_member(header)} | arrays)


def read_snapshot_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of a version-1 or version-2 snapshot."""
    try:
        with np.load(path, allow_pickle=False) as z:
            header = json.loads(z["header"].tobytes().decode())
    except (OSError, KeyError, ValueError) as exc:
        raise SnapshotError(f"cannot read predictor snapshot {path}: {exc}") from exc
    if not isinstance(header, dict) or header.get("format") not in (FORMAT, HISTORY_FORMAT):
        raise SnapshotError(f"{path} is not a predictor snapshot")
    want = VERSION if header["format"] == FORMAT else 1
    if header.get("version") != want:
        raise SnapshotError(
            f"{path} is {header['format']} version {header.get('version')}; this build reads "
            f"version {want}"
        )
    return header


def load_states(
    path: str | os.PathLike[str], cfg: PredictorConfig, dim: int
) -> dict[str, ModelState]:
    """Every model's state from a snapshot (version 1: the default state only)."""
    header = read_snapshot_header(path)
    if header["format"] == HISTORY_FORMAT:
        index, _ = HistoryIndex.load(path, dim=dim, ef_search=cfg.hnsw_ef_search)
        return {DEFAULT_MODEL: ModelState.new(dim, cfg, index)}
    states: dict[str, ModelState] = {}
    with np.load(Path(path), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    for i, m in enumerate(header["models"]):
        index = HistoryIndex.from_arrays(
            m["history"], arrays, f"m{i}.", dim=dim, ef_search=cfg.hnsw_ef_search
        )
        ridge = OnlineRidge.from_arrays(arrays, f"m{i}.ridge.")
        ranker = PairwiseRanker.from_arrays(arrays, f"m{i}.rank.")
        states[str(m["name"])] = ModelState(index, ridge, ranker)
    states.setdefault(DEFAULT_MODEL, ModelState.new(dim, cfg))
    return states
