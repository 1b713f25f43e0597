"""The online models (ridge, pairwise ranker), per-model state and snapshot versions.

The quality test embeds a frozen Alpaca sample with the real MiniLM model (no mocks) and
checks the ordering the predictor and the ranker give on prompts they never saw."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import kendalltau

from predictor import Embedder, HistoryIndex, LengthPredictor, PredictorConfig, SnapshotError
from predictor.datasets import load_pairs
from predictor.evaluate import score
from predictor.learners import OnlineRidge, PairwiseRanker, features
from predictor.state import read_snapshot_header

DIM = 16


def _synthetic(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, DIM))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    log_y = 4.0 + 3.0 * x[:, 0] - 2.0 * x[:, 1] + 0.1 * rng.standard_normal(n)
    return x, np.exp(log_y), np.full(n, 20.0)


def test_ridge_learns_online_and_keeps_prequential_residuals() -> None:
    x, y, p = _synthetic(2_000)
    ridge = OnlineRidge(DIM, l2=0.01, refit_every=16, min_items=32)
    assert ridge.predict(features(x[:1], p[:1])) is None  # not ready: nothing learned
    for s in range(0, 2_000, 100):
        ridge.learn(features(x[s : s + 100], p[s : s + 100]), np.log(y[s : s + 100]))
    pred = ridge.predict(features(x, p))
    assert pred is not None and np.corrcoef(pred, np.log(y))[0, 1] > 0.95
    res = ridge.residual_sample()
    assert res.size == 1_900  # the first batch had no model to be scored by
    assert np.std(res[-500:]) < 0.3  # honest errors of the later, trained model


def test_pairwise_ranker_orders_by_length() -> None:
    x, y, p = _synthetic(3_000, seed=1)
    ranker = PairwiseRanker(DIM, seed=0)
    for s in range(0, 2_000, 50):
        ranker.learn(features(x[s : s + 50], p[s : s + 50]), np.log(y[s : s + 50]))
    tau = kendalltau(ranker.score(features(x[2_000:], p[2_000:])), y[2_000:]).statistic
    assert tau > 0.8


def test_models_do_not_mix_and_a_new_model_falls_back(embedder: Embedder) -> None:
    cfg = PredictorConfig(model_min_items=20, min_neighbours=2, global_window_items=100)
    model = LengthPredictor(cfg, embedder=embedder)
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((40, embedder.dim)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    model.learn_vectors(vecs, [500.0] * 40, [10.0] * 40)  # default state: warm start
    model.learn_vectors(vecs[:30], [5.0] * 30, [10.0] * 30, model="terse")
    model.learn_vectors(vecs[:10], [3000.0] * 10, [10.0] * 10, model="verbose")
    assert model.models() == ["", "terse", "verbose"]
    assert model.predict_vector(vecs[0], model="terse").quantile(0.5) < 10
    assert model.global_dist(10, model="terse").quantile(0.5) < 10
    # "verbose" has 10 < model_min_items of its own: the default state answers, not "terse".
    assert model.predict_vector(vecs[0], model="verbose").quantile(0.5) == pytest.approx(500)
    assert model.predict_vector(vecs[0], model="never-seen").quantile(0.5) == pytest.approx(500)
    assert len(model.state("verbose").index) == 40  # the default one
    assert len(model.own_state("verbose").index) == 10


def test_snapshot_v2_round_trip_and_v1_still_loads(embedder: Embedder, tmp_path: Path) -> None:
    cfg = PredictorConfig(model_min_items=10, min_neighbours=2, ridge_weight=0.5)
    model = LengthPredictor(cfg, embedder=embedder)
    x, y, p = _synthetic(200)
    vecs = np.hstack([x, np.zeros((200, embedder.dim - DIM))]).astype(np.float32)
    model.learn_vectors(vecs, y, p)
    model.learn_vectors(vecs[:50], y[:50] * 10, p[:50], model="big")
    path = tmp_path / "v2.npz"
    model.save(path)
    assert read_snapshot_header(path)["version"] == 2
    back = LengthPredictor.load(path, embedder=embedder)
    assert back.models() == ["", "big"] and back.config == cfg
    for name in ("", "big"):
        want = model.predict_vector(vecs[60], prompt_tokens=20, model=name)
        got = back.predict_vector(vecs[60], prompt_tokens=20, model=name)
        assert np.allclose(want.support, got.support) and np.allclose(want.probs, got.probs)
        assert back.rank_score(vecs[60], 20, name) == model.rank_score(vecs[60], 20, name)
    # Version 1: one history file (HistoryIndex.save); it becomes the default state and its
    # ridge and ranker are retrained from the stored embeddings.
    old = HistoryIndex(embedder.dim, 500)
    old.add(vecs, y, p)
    v1 = tmp_path / "v1.npz"
    old.save(v1, extra={"config": {"k_neighbours": 16, "similarity_floor": 0.2}})
    loaded = LengthPredictor.load(v1, embedder=embedder)
    assert loaded.models() == [""] and len(loaded.index) == 200
    assert loaded.config.k_neighbours == 16
    assert loaded.state().ridge.count == 200
    scores = loaded.rank_scores(vecs[:100], [20.0] * 100)
    assert kendalltau(scores, y[:100]).statistic > 0.5
    (tmp_path / "bad.npz").write_bytes(b"not a snapshot")
    with pytest.raises(SnapshotError):
        LengthPredictor.load(tmp_path / "bad.npz", embedder=embedder)


@pytest.mark.slow
def test_ordering_on_unseen_alpaca_prompts(embedder: Embedder, shared_data: Path) -> None:
    """A frozen 1,500/300 Alpaca sample (seed 3), real embeddings, the defaults plus Alpaca's
    CV choice (docs/benchmarks.md): τ of the Gittins order, of the ranker, and the 10–90%
    coverage. Measured 0.510 / 0.504 / 0.763 on this sample (v1 shipped: see the ablation);
    the thresholds leave a margin of ~0.09 in τ."""
    from predictor.offline import load_tokenizer

    pairs = load_pairs("alpaca", shared_data)
    random.Random(3).shuffle(pairs)
    pairs = pairs[:1_800]
    tok = load_tokenizer()
    p_len = [len(t) for t in tok([p for _, p, _ in pairs], add_special_tokens=False)["input_ids"]]
    y = [len(t) for t in tok([a for _, _, a in pairs], add_special_tokens=False)["input_ids"]]
    cfg = PredictorConfig(ridge_weight=0.5, neighbour_spread_scale=0.75)
    model = LengthPredictor(cfg, embedder=embedder)
    vecs = model.embed([p for _, p, _ in pairs])
    model.learn_vectors(vecs[:1_500], y[:1_500], p_len[:1_500])
    test_p = [float(v) for v in p_len[1_500:]]
    s = score(model.predict_vectors(vecs[1_500:], test_p), y[1_500:])
    rank_tau = kendalltau(model.rank_scores(vecs[1_500:], test_p), y[1_500:]).statistic
    assert s["kendall_tau"] > 0.42
    assert rank_tau > 0.42
    assert 0.7 <= s["coverage_10_90"] <= 0.9
