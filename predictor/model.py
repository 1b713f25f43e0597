"""`LengthPredictor`: prompt → distribution of output length, learning from completions.

Model (docs/predictor.md): embed the prompt (see `predictor.text` for what is embedded), find
the k most similar completed requests of the served model (cosine ≥ the similarity floor) and
weight each neighbour by exp((similarity − best similarity) / temperature). The centre (log
tokens) mixes their weighted mean log length with an online ridge regression on the
embedding; the neighbours' spread around the centre plus the ridge's prequential residuals
(or, before the ridge is trained, the recent global distribution) give the shape, and the
blend becomes `bucket_count` equal-mass quantile points. Before anything was learned, the
answer is a broad log-normal prior. Each served model has its own state (`predictor.state`);
a model with too little history of its own is answered from the default state.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from policies import LengthDist
from predictor.config import PredictorConfig
from predictor.embedder import AsyncEmbedder, Embedder
from predictor.encoders import Embeddings
from predictor.history import HistoryIndex, Neighbours, SnapshotError
from predictor.state import (
    DEFAULT_MODEL,
    ModelState,
    load_states,
    read_snapshot_header,
    save_states,
)
from predictor.text import clip_text

Learned = Callable[[str | None, Embeddings, int, int], None]
"""A listener told of each completion `observe_async` learned: (model, embedding, prompt
tokens, output tokens). Called on the event loop; it must not block (`predictor.shared`)."""

_Completion = tuple[str | None, Embeddings, int, int]
"""One completion waiting to be learned: (model, embedding, prompt tokens, output tokens)."""

_PRIOR_SIGMA = 1.0  # log-space spread of the cold-start prior (±1σ ≈ ×2.7)


def prior_dist(median_tokens: float, points: int = 16) -> LengthDist:
    """A log-normal belief with the given median, discretised into equal-mass quantiles."""
    z = [NormalDist().inv_cdf((i + 0.5) / points) for i in range(points)]
    return LengthDist.from_samples(median_tokens * np.exp(_PRIOR_SIGMA * np.asarray(z)))


def neighbour_weights(
    nb: Neighbours, cfg: PredictorConfig, prompt_tokens: float | None = None
) -> NDArray[np.float64]:
    """Normalised weight of each neighbour: exp((similarity − best) / temperature), times
    exp(−|log prompt-length ratio| / `prompt_length_scale_log`)."""
    logw = (nb.similarity - nb.similarity.max()) / cfg.similarity_temperature
    if prompt_tokens is not None and cfg.prompt_length_scale_log > 0:
        ratio = np.log(np.maximum(nb.prompt_tokens, 1.0) / max(prompt_tokens, 1.0))
        logw -= np.abs(ratio) / cfg.prompt_length_scale_log
    w = np.exp(logw - logw.max())
    return np.asarray(w / w.sum())


def quantile_points(log_x: NDArray[np.float64], w: NDArray[np.float64], n: int) -> LengthDist:
    """The weighted sample (log lengths) as `n` equal-mass quantile points. Unlike fixed
    log-spaced buckets over the sample's range, the points follow the mass, so a sharp
    distribution stays sharp and the median moves smoothly with the neighbours."""
    order = np.argsort(log_x, kind="stable")
    x, cum = log_x[order], np.cumsum(w[order])
    levels = (np.arange(n) + 0.5) / n * cum[-1]
    picks = x[np.minimum(np.searchsorted(cum, levels), x.size - 1)]
    return LengthDist.from_samples(np.round(np.exp(picks), 6))  # exp(log 10) is not 10


def blend(
    nb: Neighbours,
    background: LengthDist,
    cfg: PredictorConfig,
    prompt_tokens: float | None = None,
    *,
    ridge_centre: float | None = None,
    residuals: NDArray[np.float64] | None = None,
) -> LengthDist:
    """The predicted distribution from neighbours, the online ridge and the background.

    Centre c (log tokens) = `ridge_weight`·ridge + (1 − `ridge_weight`)·the neighbours'
    weighted mean log length (all ridge with no usable neighbours). Samples: each neighbour's
    log length, moved so the neighbours' mean sits on c and its spread scaled by
    `neighbour_spread_scale`; the background share g = max(`prior_weight`, missing
    neighbours) is c + the ridge's recent prequential residuals when the ridge is trained,
    else the global distribution. The blend becomes `bucket_count` equal-mass points."""
    use_ridge = ridge_centre is not None and residuals is not None and residuals.size >= 16
    if len(nb) == 0 and not use_ridge:
        return background
    missing = max(cfg.min_neighbours - len(nb), 0) / cfg.min_neighbours
    g = max(cfg.prior_weight, missing)
    logs: list[NDArray[np.float64]] = []
    weights: list[NDArray[np.float64]] = []
    if len(nb) > 0:
        w = neighbour_weights(nb, cfg, prompt_tokens)
        log_nb = np.log(np.maximum(nb.output_tokens, 1.0))
        knn_centre = float(w @ log_nb)
        centre = knn_centre
        if use_ridge:
            alpha = max(cfg.ridge_weight, missing)
            centre = alpha * float(ridge_centre) + (1.0 - alpha) * knn_centre  # type: ignore[arg-type]
        logs.append(centre + cfg.neighbour_spread_scale * (log_nb - knn_centre))
        weights.append(w * (1.0 - g))
    else:
        centre, g = float(ridge_centre), 1.0  # type: ignore[arg-type]
    if use_ridge:
        assert residuals is not None
        logs.append(centre + residuals)
        weights.append(np.full(residuals.size, g / residuals.size))
    else:
        logs.append(np.log(background.support))
        weights.append(background.probs * g)
    return quantile_points(np.concatenate(logs), np.concatenate(weights), cfg.bucket_count)


def prompt_band(prompt_tokens: float) -> int:
    """Prompt-length band: ⌊log2(tokens)⌋ (1 token → 0, 2–3 → 1, ..., 1024–2047 → 10)."""
    return int(math.log2(max(prompt_tokens, 1.0)))


class LengthPredictor:
    """Predicts output-length distributions and learns from completed requests.

    Per served model: every method takes an optional `model` (the request's model name); each
    model learns into its own history and online models, so two models behind one gateway are
    never mixed. A model with fewer than `model_min_items` completions of its own is answered
    from the default state (warm start, requests without a model, version-1 snapshots).

    Sync methods block (embedding ≈ 10 ms, lookup ≈ 0.3 ms) and are thread-safe. On an event
    loop use `predict_async` / `observe_async`: they batch embeddings with concurrent callers
    and keep all model and index work off the loop; they are bound to one loop.
    """

    def __init__(
        self,
        config: PredictorConfig | None = None,
        *,
        embedder: Embedder | None = None,
        index: HistoryIndex | None = None,
        states: dict[str, ModelState] | None = None,
    ) -> None:
        self.config = cfg = config or PredictorConfig()
        self.embedder = embedder or Embedder.from_config(cfg)
        if index is not None and index.dim != self.embedder.dim:
            raise SnapshotError(f"index is {index.dim}-d, embedder {self.embedder.dim}-d")
        self._states = states or {DEFAULT_MODEL: ModelState.new(self.embedder.dim, cfg, index)}
        self._states_lock = threading.Lock()
        self._prior = prior_dist(cfg.prior_median_tokens)
        self._async: AsyncEmbedder | None = None
        self._learning: tuple[list[_Completion], asyncio.Task[None]] | None = None
        """The completions `observe_async` is gathering, and the task that will learn them."""
        self.listeners: list[Learned] = []
        """Told of every completion `observe_async` learns (not of `learn_vectors` calls, so
        records learned from other replicas are not echoed back)."""

    @property
    def index(self) -> HistoryIndex:
        """The default state's history."""
        return self._states[DEFAULT_MODEL].index

    def models(self) -> list[str]:
        """Names of the served models with a state of their own ("" = the default)."""
        return sorted(self._states)

    def state(self, model: str | None = None) -> ModelState:
        """The state that answers for `model`: its own once it holds `model_min_items`,
        else the default one."""
        own = self._states.get(model or DEFAULT_MODEL)
        if own is not None and (not model or len(own.index) >= self.config.model_min_items):
            return own
        return self._states[DEFAULT_MODEL]

    def own_state(self, model: str | None) -> ModelState:
        """`model`'s own state, where its completions are learned (created when missing)."""
        name = model or DEFAULT_MODEL
        with self._states_lock:
            if name not in self._states:
                self._states[name] = ModelState.new(self.embedder.dim, self.config)
            return self._states[name]

    # -- embedding --------------------------------------------------------------------

    def text(self, prompt: str) -> str:
        """The clipped text that is embedded for `prompt`."""
        return clip_text(prompt, self.config.embed_max_chars, self.config.embed_head_fraction)

    def embed(self, prompts: Sequence[str], batch_size: int | None = None) -> Embeddings:
        """Embeddings of many prompts (blocking; batch for throughput)."""
        return self.embedder.encode([self.text(p) for p in prompts], batch_size=batch_size)

    def count_tokens(self, prompts: Sequence[str]) -> list[int]:
        """Prompt lengths by the MiniLM BERT tokenizer (an approximation of the serving
        model's tokenizer; used only when the caller does not know the real count)."""
        if not prompts:
            return []
        enc = self.embedder.tokenizer(list(prompts), add_special_tokens=False, verbose=False)
        return [len(ids) for ids in enc["input_ids"]]

    # -- prediction -------------------------------------------------------------------

    def global_dist(
        self, prompt_tokens: float | None = None, *, model: str | None = None
    ) -> LengthDist:
        """Distribution of the `global_window_items` latest completions of `model` (in the
        prompt's length band when it holds `band_min_items`), or the prior when nothing is
        learned. Cached; recomputed after 1% of the window has been replaced."""
        cfg = self.config
        st = self.state(model)
        band = None if prompt_tokens is None else prompt_band(prompt_tokens)
        stale_after = max(cfg.global_window_items // 100, 1)
        with st.lock:
            hit = st.global_cache.get(band)
            if hit is not None and st.index.added - hit[0] < stale_after:
                return hit[1]
        out, prm = st.index.recent(cfg.global_window_items)
        if out.size == 0:
            dist = self._prior
        else:
            if band is not None:
                same = np.floor(np.log2(np.maximum(prm, 1.0))) == band
                if same.sum() >= cfg.band_min_items:
                    out = out[same]
            dist = LengthDist.from_samples(out, max_points=cfg.bucket_count)
        with st.lock:
            st.global_cache[band] = (st.index.added, dist)
        return dist

    def predict_vector(
        self,
        vector: ArrayLike,
        *,
        prompt_tokens: float | None = None,
        max_tokens: float | None = None,
        model: str | None = None,
    ) -> LengthDist:
        """Prediction for an already embedded prompt (blocking, ~0.3 ms)."""
        dist = self.predict_vectors(np.asarray(vector).reshape(1, -1), [prompt_tokens], model)[0]
        return dist if max_tokens is None else dist.truncate(max_tokens)

    def predict_vectors(
        self,
        vectors: ArrayLike,
        prompt_tokens: Sequence[float | None],
        model: str | None = None,
    ) -> list[LengthDist]:
        """`predict_vector` for many rows at once (offline evaluation)."""
        cfg = self.config
        st = self.state(model)
        x = np.asarray(vectors, dtype=np.float32).reshape(-1, self.embedder.dim)
        nbs = st.index.query_many(x, cfg.k_neighbours, cfg.similarity_floor)
        known = [cfg.prior_median_tokens if p is None else p for p in prompt_tokens]
        centres = st.ridge_centre(x, known) if cfg.ridge_weight > 0 else None
        resid = st.residuals() if centres is not None else None
        return [
            blend(
                nb,
                self.global_dist(p, model=model),
                cfg,
                p,
                ridge_centre=None if centres is None else float(centres[i]),
                residuals=resid,
            )
            for i, (nb, p) in enumerate(zip(nbs, prompt_tokens, strict=True))
        ]

    def rank_scores(
        self, vectors: ArrayLike, prompt_tokens: Sequence[float | None], model: str | None = None
    ) -> list[float]:
        """The learned ranking score of each embedded prompt (higher = predicted longer; only
        the order matters), for `Job.rank_score` and the `ltr` policy. Blocking, µs."""
        known = [self.config.prior_median_tokens if p is None else p for p in prompt_tokens]
        x = np.asarray(vectors, dtype=np.float32).reshape(-1, self.embedder.dim)
        return [float(v) for v in self.state(model).rank_scores(x, known)]

    def rank_score(
        self, vector: ArrayLike, prompt_tokens: float | None = None, model: str | None = None
    ) -> float:
        """`rank_scores` of one embedded prompt."""
        return self.rank_scores(np.asarray(vector).reshape(1, -1), [prompt_tokens], model)[0]

    def predict(
        self,
        prompt: str,
        *,
        prompt_tokens: float | None = None,
        max_tokens: float | None = None,
        model: str | None = None,
    ) -> LengthDist:
        """Predicted output length (tokens) for a prompt text, capped at `max_tokens`.
        Blocking (~10 ms on CPU): on an event loop use `predict_async`."""
        vec = self.embed([prompt])[0]
        return self.predict_vector(
            vec, prompt_tokens=prompt_tokens, max_tokens=max_tokens, model=model
        )

    async def embed_async(self, prompt: str) -> Embeddings:
        """One prompt's embedding, micro-batched with concurrent callers, never blocking the
        loop. With `observe_async(..., vector=)` later, a prompt is embedded once instead of
        twice (`refine_async` returns the embedding with its prediction)."""
        return await self._async_embedder().embed(self.text(prompt))

    async def predict_async(
        self,
        prompt: str,
        *,
        prompt_tokens: float | None = None,
        max_tokens: float | None = None,
        model: str | None = None,
    ) -> LengthDist:
        """`predict`, micro-batched with concurrent callers, never blocking the loop (the
        distribution of `refine_async`)."""
        refined = await self.refine_async(
            prompt, prompt_tokens=prompt_tokens, max_tokens=max_tokens, model=model
        )
        return refined[1]

    async def refine_async(
        self,
        prompt: str,
        *,
        prompt_tokens: float | None = None,
        max_tokens: float | None = None,
        model: str | None = None,
    ) -> tuple[Embeddings, LengthDist, float]:
        """The prompt's embedding, its `predict_vector` and its `rank_score`, with one trip
        off the loop: on the embedder's worker right after the prompt's batch, or (a cached
        embedding) one worker thread for the query and the score."""

        def then(vec: Embeddings) -> tuple[Embeddings, LengthDist, float]:
            return (vec, *self._refined(vec, prompt_tokens, max_tokens, model))

        text = self.text(prompt)
        if (vec := self.embedder.cached(text)) is not None:
            return await asyncio.to_thread(then, vec)
        result: tuple[Embeddings, LengthDist, float] = await self._async_embedder().embed_then(
            text, then
        )
        return result

    async def refine_vector_async(
        self,
        vector: Embeddings,
        *,
        prompt_tokens: float | None = None,
        max_tokens: float | None = None,
        model: str | None = None,
    ) -> tuple[LengthDist, float]:
        """`refine_async` of a prompt embedded elsewhere (a worker process): its
        `predict_vector` and `rank_score` in one worker-thread trip."""
        return await asyncio.to_thread(self._refined, vector, prompt_tokens, max_tokens, model)

    async def global_dist_async(
        self, prompt_tokens: float | None = None, *, model: str | None = None
    ) -> LengthDist:
        """`global_dist` (cached, microseconds), for callers that may ask another process."""
        return self.global_dist(prompt_tokens, model=model)

    def _refined(
        self,
        vec: Embeddings,
        prompt_tokens: float | None,
        max_tokens: float | None,
        model: str | None,
    ) -> tuple[LengthDist, float]:
        dist = self.predict_vector(
            vec, prompt_tokens=prompt_tokens, max_tokens=max_tokens, model=model
        )
        return dist, self.rank_score(vec, prompt_tokens, model)

    def _async_embedder(self) -> AsyncEmbedder:
        if self._async is None:
            self._async = AsyncEmbedder.for_config(self.embedder, self.config)
        return self._async

    async def aclose(self) -> None:
        """Learn the completions still gathering, then stop the async embedder (pending calls
        fail); sync methods keep working."""
        batch = self._learning
        if batch is not None and batch[1].get_loop() is asyncio.get_running_loop():
            await asyncio.wait([batch[1]])
        if self._async is not None:
            await self._async.close()
            self._async = None

    # -- learning ---------------------------------------------------------------------

    def observe(
        self,
        prompt: str,
        output_tokens: int,
        prompt_tokens: int | None = None,
        *,
        model: str | None = None,
    ) -> None:
        """Learn one completed request (true output length, tokens). Blocking (~10 ms)."""
        self.observe_many(
            [prompt],
            [output_tokens],
            None if prompt_tokens is None else [prompt_tokens],
            model=model,
        )

    def observe_many(
        self,
        prompts: Sequence[str],
        output_tokens: Sequence[int],
        prompt_tokens: Sequence[int] | None = None,
        batch_size: int | None = None,
        *,
        model: str | None = None,
    ) -> None:
        """Learn many completed requests at once (embedding batched)."""
        if prompt_tokens is None:
            prompt_tokens = self.count_tokens(prompts)
        self.learn_vectors(self.embed(prompts, batch_size), output_tokens, prompt_tokens, model)

    def learn_vectors(
        self,
        vectors: ArrayLike,
        output_tokens: Sequence[float],
        prompt_tokens: Sequence[float],
        model: str | None = None,
    ) -> None:
        """Learn already embedded completed requests into `model`'s own state (blocking)."""
        self.own_state(model).learn(vectors, output_tokens, prompt_tokens)

    async def observe_async(
        self,
        prompt: str,
        output_tokens: int,
        prompt_tokens: int | None = None,
        *,
        vector: Embeddings | None = None,
        model: str | None = None,
    ) -> None:
        """`observe` for the gateway: batched embedding (none if `vector`, the prompt's
        embedding, is given); the index and model updates off the loop, gathered with the
        completions of the next `learn_wait_ms` into one worker-thread trip. Returns once
        learned."""
        vec = vector if vector is not None else await self.embed_async(prompt)
        if prompt_tokens is None:
            prompt_tokens = (await asyncio.to_thread(self.count_tokens, [prompt]))[0]
        loop = asyncio.get_running_loop()
        batch = self._learning
        if batch is None or batch[1].done() or batch[1].get_loop() is not loop:
            gathered: list[_Completion] = []  # the first of a batch: others join it a while
            batch = self._learning = (gathered, loop.create_task(self._learn_later(gathered)))
        gathered, flush = batch
        gathered.append((model, vec, prompt_tokens, output_tokens))
        await asyncio.shield(flush)  # a cancelled caller's completion is still learned
        for listener in self.listeners:
            listener(model, vec, prompt_tokens, output_tokens)

    async def _learn_later(self, gathered: list[_Completion]) -> None:
        """Learn `gathered` after `learn_wait_ms`, in one worker-thread trip."""
        try:
            await asyncio.sleep(self.config.learn_wait_ms / 1000.0)
        finally:  # later completions start the next batch (also if this one was cancelled)
            if self._learning is not None and self._learning[0] is gathered:
                self._learning = None
        await asyncio.to_thread(self._learn_gathered, gathered)

    def _learn_gathered(self, gathered: list[_Completion]) -> None:
        by_model: dict[str | None, list[_Completion]] = {}
        for row in gathered:
            by_model.setdefault(row[0], []).append(row)
        for model, rows in by_model.items():
            vectors = np.stack([np.asarray(r[1], dtype=np.float32).reshape(-1) for r in rows])
            self.learn_vectors(vectors, [r[3] for r in rows], [r[2] for r in rows], model)

    def warm_start(
        self, jsonl: str | os.PathLike[str], batch_size: int = 256, *, model: str | None = None
    ) -> int:
        """Learn every `{prompt, output_tokens[, prompt_tokens]}` line of a JSONL file into
        `model`'s state (default: the default state); returns how many were added."""
        added = 0
        for chunk in _chunks(read_jsonl(jsonl), batch_size):
            counts = [r.get("prompt_tokens") for r in chunk]
            known = [int(c) for c in counts if c is not None]
            self.observe_many(
                [r["prompt"] for r in chunk],
                [int(r["output_tokens"]) for r in chunk],
                known if len(known) == len(chunk) else None,
                model=model,
            )
            added += len(chunk)
        return added

    # -- persistence ------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        """Snapshot every model's state (histories, online models) and the config atomically
        to one file (format version 2, `predictor.state`)."""
        extra = {"config": self.config.to_dict(), "model": str(self.embedder.path.name)}
        with self._states_lock:
            states = dict(self._states)
        save_states(path, states, extra)

    @staticmethod
    def snapshot_config(path: str | os.PathLike[str]) -> PredictorConfig:
        """The config a snapshot was saved with (fields it lacks keep their defaults)."""
        saved = read_snapshot_header(path)["extra"]["config"]
        known = {f.name for f in fields(PredictorConfig)}
        return PredictorConfig.from_dict({k: v for k, v in saved.items() if k in known})

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        config: PredictorConfig | None = None,
        *,
        embedder: Embedder | None = None,
        lazy_embedder: bool = False,
    ) -> LengthPredictor:
        """Restore a snapshot (version 2, or a version-1 history snapshot, which becomes the
        default state). `config` defaults to the snapshot's own (fields it lacks keep their
        defaults); ring capacities are the snapshot's; without `embedder`, the config's is made
        (loaded at its first use with `lazy_embedder`). Raises `SnapshotError` on a mismatched
        embedding dimension or an unknown format."""
        config = config or cls.snapshot_config(path)
        embedder = embedder or Embedder.from_config(config, lazy=lazy_embedder)
        states = load_states(path, config, embedder.dim)
        return cls(config, embedder=embedder, states=states)


def read_jsonl(path: str | os.PathLike[str]) -> Iterable[dict[str, Any]]:
    """Records of a JSONL file (blank lines skipped); each must have prompt, output_tokens."""
    with Path(path).open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if not isinstance(rec, dict) or "prompt" not in rec or "output_tokens" not in rec:
                raise ValueError(f"{path}:{n}: need an object with prompt and output_tokens")
            yield rec


def _chunks(items: Iterable[dict[str, Any]], size: int) -> Iterable[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
