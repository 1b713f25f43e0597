from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from policies import LengthDist
from predictor import Embedder, LengthPredictor, Neighbours, PredictorConfig, blend, prior_dist

POEMS = [f"Write a short poem about the {w}." for w in ("sea", "moon", "rain", "wind", "snow")]
ESSAYS = [
    f"Write a detailed 2000-word essay on the economic history of {c}."
    for c in ("France", "Japan", "Brazil", "Kenya", "Canada")
]


def _nb(sims: list[float], outs: list[float]) -> Neighbours:
    return Neighbours(np.array(sims), np.array(outs, dtype=float), np.ones(len(sims)))


def test_cold_start_gives_a_sane_prior(predictor: LengthPredictor) -> None:
    dist = predictor.predict("Hello, who are you?")
    assert 100 <= dist.quantile(0.5) <= 400
    assert dist.quantile(0.9) > 2 * dist.quantile(0.1)  # broad: it knows it knows nothing


def test_max_tokens_is_respected(predictor: LengthPredictor) -> None:
    dist = predictor.predict("Tell me everything.", max_tokens=50)
    assert dist.support[-1] == 50 and dist.mean() <= 50


def test_learning_separates_short_from_long(predictor: LengthPredictor) -> None:
    predictor.observe_many(POEMS, [60, 70, 65, 55, 62], [10] * 5)
    predictor.observe_many(ESSAYS, [1500, 1700, 1600, 1800, 1550], [15] * 5)
    poem = predictor.predict("Write a short poem about the sun.", prompt_tokens=10)
    essay = predictor.predict("Write a detailed 2000-word essay on the history of Italy.")
    assert poem.quantile(0.5) < 100
    assert essay.quantile(0.5) > 1_000
    assert poem.mean() < essay.mean()


def test_observe_one(predictor: LengthPredictor) -> None:
    predictor.observe("Translate 'good morning' into German.", 8, 9)
    assert len(predictor.index) == 1
    predictor.observe("Translate 'good night' into German.", 7)  # tokens counted for us
    assert predictor.index.recent(1)[1][0] > 3


def test_blend_weights_similar_neighbours_more() -> None:
    cfg = PredictorConfig(
        min_neighbours=2, prior_weight=0.0, similarity_temperature=0.05, neighbour_spread_scale=1
    )
    background = LengthDist.point(1_000)
    dist = blend(_nb([0.95, 0.70], [10, 500]), background, cfg)
    assert dist.cdf(10) > 0.9  # exp(-0.25/0.05) makes the far neighbour nearly irrelevant


def test_blend_falls_back_with_few_neighbours() -> None:
    cfg = PredictorConfig(min_neighbours=4, prior_weight=0.1)
    background = LengthDist.point(1_000)
    assert blend(_nb([], []), background, cfg) is background
    dist = blend(_nb([0.9], [10]), background, cfg)  # 3 of 4 missing → 75% background
    assert dist.cdf(10) == pytest.approx(0.25, abs=1e-9)
    full = blend(_nb([0.9] * 5, [10] * 5), background, cfg)
    # prior_weight always mixed in (to within one of the bucket_count equal-mass points)
    assert full.cdf(10) == pytest.approx(0.9, abs=1 / cfg.bucket_count)


def test_global_distribution_is_conditioned_on_prompt_band(embedder: Embedder) -> None:
    cfg = PredictorConfig(band_min_items=3, global_window_items=100, capacity_items=100)
    model = LengthPredictor(cfg, embedder=embedder)
    vecs = np.eye(embedder.dim, dtype=np.float32)[:8]
    model.index.add(vecs, [10, 11, 12, 13, 900, 950, 1000, 1100], [5] * 4 + [3000] * 4)
    assert model.global_dist(6).quantile(0.5) < 20  # band 2 (4–7 tokens): the short ones
    assert model.global_dist(2500).quantile(0.5) > 800
    assert model.global_dist(1).quantile(0.5) in (13, 900)  # thin band → everything
    assert model.global_dist(None).support.size == 8


def test_prior_dist_median() -> None:
    assert prior_dist(200).quantile(0.5) == pytest.approx(200, rel=0.1)


def test_warm_start_from_jsonl(predictor: LengthPredictor, tmp_path: Path) -> None:
    path = tmp_path / "warm.jsonl"
    rows = [{"prompt": p, "output_tokens": 60} for p in POEMS]
    rows += [{"prompt": p, "output_tokens": 1600, "prompt_tokens": 15} for p in ESSAYS]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert predictor.warm_start(path, batch_size=3) == 10
    assert len(predictor.index) == 10
    assert predictor.predict(POEMS[0]).quantile(0.5) < 100


def test_bad_jsonl_line_is_reported(predictor: LengthPredictor, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        predictor.warm_start(path)


async def test_predict_async_many_callers(predictor: LengthPredictor) -> None:
    predictor.observe_many(POEMS, [60] * 5, [10] * 5)
    prompts = [f"Write a short poem about the {i}th star." for i in range(30)]
    try:
        dists = await asyncio.gather(*(predictor.predict_async(p, max_tokens=500) for p in prompts))
        await predictor.observe_async("Write a short poem about dawn.", 58, 9)
    finally:
        await predictor.aclose()
    assert all(d.quantile(0.5) < 100 and d.support[-1] <= 500 for d in dists)
    assert len(predictor.index) == 6
    sync = predictor.predict(prompts[0], max_tokens=500)
    assert sync.quantile(0.5) == dists[0].quantile(0.5)


def test_blend_prefers_neighbours_with_similar_prompt_length() -> None:
    cfg = PredictorConfig(
        min_neighbours=1, prior_weight=0.0, prompt_length_scale_log=0.5, neighbour_spread_scale=1
    )
    nb = Neighbours(np.array([0.9, 0.9]), np.array([20.0, 800.0]), np.array([10.0, 3000.0]))
    short = blend(nb, LengthDist.point(1), cfg, prompt_tokens=12)
    long = blend(nb, LengthDist.point(1), cfg, prompt_tokens=2500)
    assert short.quantile(0.5) == 20 and long.quantile(0.5) == 800
    off = PredictorConfig(
        min_neighbours=1, prior_weight=0.0, prompt_length_scale_log=0.0, neighbour_spread_scale=1
    )
    assert blend(nb, LengthDist.point(1), off, prompt_tokens=12).cdf(20) == pytest.approx(0.5)


async def test_refine_async_is_the_prediction_and_the_rank_score_in_one_trip(
    predictor: LengthPredictor,
) -> None:
    """The embedding, its prediction and its rank score come back together, equal to the
    separate calls', computed on the embedder's worker (an uncached prompt) or one worker
    thread (a cached one), never on the loop."""
    import threading

    predictor.observe_many(POEMS + ESSAYS, [60, 70, 65, 55, 62, 1500, 1700, 1600, 1800, 1550])
    loop_thread = threading.get_ident()
    ran_on: list[int] = []
    score = predictor.rank_score

    def spy(*args: object, **kw: object) -> float:
        ran_on.append(threading.get_ident())
        return score(*args, **kw)  # type: ignore[arg-type]

    predictor.rank_score = spy  # type: ignore[method-assign]
    prompt = "Write a detailed essay on the history of Chile."
    try:
        first = await predictor.refine_async(prompt, prompt_tokens=12, max_tokens=900)
        again = await predictor.refine_async(prompt, prompt_tokens=12, max_tokens=900)
    finally:
        await predictor.aclose()
    vec = predictor.embed([prompt])[0]
    dist = predictor.predict_vector(vec, prompt_tokens=12, max_tokens=900)
    for got_vec, got_dist, got_score in (first, again):
        assert np.allclose(got_vec, vec, atol=1e-6)
        assert got_dist.quantile(0.5) == dist.quantile(0.5) and got_dist.support[-1] <= 900
        assert got_score == pytest.approx(score(vec, 12))
    assert len(ran_on) == 2 and loop_thread not in ran_on


async def test_concurrent_completions_are_learned_in_one_trip(
    predictor: LengthPredictor,
) -> None:
    """Completions arriving together are learned by one `learn_vectors` call per model, each
    caller returning once its completion is in the history; listeners hear every one."""
    calls: list[tuple[str | None, int]] = []
    learn = predictor.learn_vectors

    def counting(
        vectors: object, outputs: list[float], prompts: list[float], model: object
    ) -> None:
        calls.append((model, len(outputs)))  # type: ignore[arg-type]
        learn(vectors, outputs, prompts, model)  # type: ignore[arg-type]

    predictor.learn_vectors = counting  # type: ignore[method-assign]
    heard: list[int] = []
    predictor.listeners.append(lambda model, vec, p, out: heard.append(out))
    prompts = POEMS + ESSAYS
    vectors = predictor.embed(prompts)  # embedded beforehand: all ten arrive in one tick
    try:
        await asyncio.gather(
            *(predictor.observe_async(p, 100 + i, 10, vector=vectors[i],
                                      model="m" if i % 2 else None)
              for i, p in enumerate(prompts))
        )  # fmt: skip
        await predictor.observe_async("Write a short poem about dawn.", 58, 9)  # a new batch
    finally:
        await predictor.aclose()
    assert sorted(calls, key=str) == sorted([(None, 5), ("m", 5), (None, 1)], key=str)
    assert len(predictor.index) == 6 and len(predictor.own_state("m").index) == 5
    assert sorted(heard) == sorted([100 + i for i in range(10)] + [58])


async def test_a_batch_cancelled_at_shutdown_does_not_wedge_later_learning(
    predictor: LengthPredictor,
) -> None:
    """A batch whose task was cancelled (its loop stopping) is dropped; the next completion
    starts a batch of its own and is learned."""
    first = asyncio.create_task(predictor.observe_async(POEMS[0], 60, 10))
    await asyncio.sleep(0)  # `first` has started a batch and waits for it
    assert predictor._learning is not None
    predictor._learning[1].cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    try:
        await asyncio.wait_for(predictor.observe_async(POEMS[1], 61, 10), 5.0)
    finally:
        await predictor.aclose()
    assert len(predictor.index) == 1
