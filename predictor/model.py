"""`LengthPredictor`: prompt → distribution of output length, learning from completions.

Model: embed the prompt (see `predictor.text` for what is embedded), find the k most similar
completed requests in the history (cosine ≥ the similarity floor), and weight each neighbour by
exp((similarity − best similarity) / temperature). Their true output lengths, so weighted,
form an empirical distribution in at most `bucket_count` log-spaced buckets. It is mixed with
the *global* distribution (the recent completions, restricted to the prompt-length band when
that band has enough of them): a fixed `prior_weight` always, more when fewer than
`min_neighbours` neighbours are usable, all of it when none are. Before anything was learned,
the global distribution is a broad log-normal prior, so request one gets a sane answer.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from policies import LengthDist
from predictor.config import PredictorConfig
from predictor.embedder import AsyncEmbedder, Embedder, Embeddings
from predictor.history import HistoryIndex, Neighbours, SnapshotError, read_header
from predictor.text import clip_text

_PRIOR_SIGMA = 1.0  # log-space spread of the cold-start prior (±1σ ≈ ×2.7)


def prior_dist(median_tokens: float, points: int = 16) -> LengthDist:
    """A log-normal belief with the given median, discretised into equal-mass quantiles."""
    z = [NormalDist().inv_cdf((i + 0.5) / points) for i in range(points)]
    return LengthDist.from_samples(median_tokens * np.exp(_PRIOR_SIGMA * np.asarray(z)))


def blend(
    nb: Neighbours,
    background: LengthDist,
    cfg: PredictorConfig,
    prompt_tokens: float | None = None,
) -> LengthDist:
    """The predicted distribution from neighbours and the background (global) one."""
    if len(nb) == 0:
        return background
    logw = (nb.similarity - nb.similarity.max()) / cfg.similarity_temperature
    if prompt_tokens is not None and cfg.prompt_length_scale_log > 0:
        ratio = np.log(np.maximum(nb.prompt_tokens, 1.0) / max(prompt_tokens, 1.0))
        logw -= np.abs(ratio) / cfg.prompt_length_scale_log
    w = np.exp(logw - logw.max())
    missing = max(cfg.min_neighbours - len(nb), 0) / cfg.min_neighbours
    g = max(cfg.prior_weight, missing)
    samples = np.concatenate([nb.output_tokens, background.support])
    weights = np.concatenate([w / w.sum() * (1.0 - g), background.probs * g])
    return LengthDist.from_samples(samples, weights, max_points=cfg.bucket_count)


def prompt_band(prompt_tokens: float) -> int:
    """Prompt-length band: ⌊log2(tokens)⌋ (1 token → 0, 2–3 → 1, ..., 1024–2047 → 10)."""
    return int(math.log2(max(prompt_tokens, 1.0)))


class LengthPredictor:
    """Predicts output-length distributions and learns from completed requests.

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
    ) -> None:
        self.config = cfg = config or PredictorConfig()
        self.embedder = embedder or Embedder(
            device=cfg.device,
            torch_threads=cfg.torch_threads,
            encode_batch_items=cfg.encode_batch_items,
        )
        if index is None:
            index = HistoryIndex(
                self.embedder.dim,
                cfg.capacity_items,
                m=cfg.hnsw_m,
                ef_construction=cfg.hnsw_ef_construction,
                ef_search=cfg.hnsw_ef_search,
            )
        if index.dim != self.embedder.dim:
            raise SnapshotError(f"index is {index.dim}-d, embedder {self.embedder.dim}-d")
        self.index = index
        self._prior = prior_dist(cfg.prior_median_tokens)
        self._global_cache: dict[int | None, tuple[int, LengthDist]] = {}
        self._cache_lock = threading.Lock()
        self._async: AsyncEmbedder | None = None

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

    def global_dist(self, prompt_tokens: float | None = None) -> LengthDist:
        """Distribution of the `global_window_items` latest completions (in the prompt's
        length band when it holds `band_min_items`), or the prior when nothing is learned.
        Cached; recomputed after 1% of the window has been replaced."""
        cfg = self.config
        band = None if prompt_tokens is None else prompt_band(prompt_tokens)
        stale_after = max(cfg.global_window_items // 100, 1)
        with self._cache_lock:
            hit = self._global_cache.get(band)
            if hit is not None and self.index.added - hit[0] < stale_after:
                return hit[1]
        out, prm = self.index.recent(cfg.global_window_items)
        if out.size == 0:
            dist = self._prior
        else:
            if band is not None:
                same = np.floor(np.log2(np.maximum(prm, 1.0))) == band
                if same.sum() >= cfg.band_min_items:
                    out = out[same]
            dist = LengthDist.from_samples(out, max_points=cfg.bucket_count)
        with self._cache_lock:
            self._global_cache[band] = (self.index.added, dist)
        return dist

    def predict_vector(
        self,
        vector: ArrayLike,
        *,
        prompt_tokens: float | None = None,
        max_tokens: float | None = None,
    ) -> LengthDist:
        """Prediction for an already embedded prompt (blocking, ~0.3 ms)."""
        cfg = self.config
        nb = self.index.query(vector, cfg.k_neighbours, cfg.similarity_floor)
        dist = blend(nb, self.global_dist(prompt_tokens), cfg, prompt_tokens)
        return dist if max_tokens is None else dist.truncate(max_tokens)

    def predict_vectors(
        self, vectors: ArrayLike, prompt_tokens: Sequence[float | None]
    ) -> list[LengthDist]:
        """`predict_vector` for many rows at once (offline evaluation)."""
        cfg = self.config
        nbs = self.index.query_many(vectors, cfg.k_neighbours, cfg.similarity_floor)
        return [
            blend(nb, self.global_dist(p), cfg, p) for nb, p in zip(nbs, prompt_tokens, strict=True)
        ]

    def predict(
        self, prompt: str, *, prompt_tokens: float | None = None, max_tokens: float | None = None
    ) -> LengthDist:
        """Predicted output length (tokens) for a prompt text, capped at `max_tokens`.
        Blocking (~10 ms on CPU): on an event loop use `predict_async`."""
        vec = self.embed([prompt])[0]
        return self.predict_vector(vec, prompt_tokens=prompt_tokens, max_tokens=max_tokens)

    async def embed_async(self, prompt: str) -> Embeddings:
        """One prompt's embedding, micro-batched with concurrent callers, never blocking the
        loop. With `predict_vector_async` now and `observe_async(..., vector=)` later, a prompt
        is embedded once instead of twice."""
        return await self._async_embedder().embed(self.text(prompt))

    async def predict_async(
        self, prompt: str, *, prompt_tokens: float | None = None, max_tokens: float | None = None
    ) -> LengthDist:
        """`predict`, micro-batched with concurrent callers, never blocking the loop."""
        vec = await self.embed_async(prompt)
        return await self.predict_vector_async(
            vec, prompt_tokens=prompt_tokens, max_tokens=max_tokens
        )

    async def predict_vector_async(
        self,
        vector: Embeddings,
        *,
        prompt_tokens: float | None = None,
        max_tokens: float | None = None,
    ) -> LengthDist:
        """`predict_vector` off the loop (the index query)."""
        return await asyncio.to_thread(
            self.predict_vector, vector, prompt_tokens=prompt_tokens, max_tokens=max_tokens
        )

    def _async_embedder(self) -> AsyncEmbedder:
        if self._async is None:
            cfg = self.config
            self._async = AsyncEmbedder(
                self.embedder,
                max_batch_items=cfg.max_batch_items,
                max_wait_ms=cfg.max_wait_ms,
                max_pending_items=cfg.max_pending_items,
            )
        return self._async

    async def aclose(self) -> None:
        """Stop the async embedder (pending calls fail); sync methods keep working."""
        if self._async is not None:
            await self._async.close()
            self._async = None

    # -- learning ---------------------------------------------------------------------

    def observe(self, prompt: str, output_tokens: int, prompt_tokens: int | None = None) -> None:
        """Learn one completed request (true output length, tokens). Blocking (~10 ms)."""
        self.observe_many(
            [prompt], [output_tokens], None if prompt_tokens is None else [prompt_tokens]
        )

    def observe_many(
        self,
        prompts: Sequence[str],
        output_tokens: Sequence[int],
        prompt_tokens: Sequence[int] | None = None,
        batch_size: int | None = None,
    ) -> None:
        """Learn many completed requests at once (embedding batched)."""
        if prompt_tokens is None:
            prompt_tokens = self.count_tokens(prompts)
        self.index.add(self.embed(prompts, batch_size), output_tokens, prompt_tokens)

    async def observe_async(
        self,
        prompt: str,
        output_tokens: int,
        prompt_tokens: int | None = None,
        *,
        vector: Embeddings | None = None,
    ) -> None:
        """`observe` for the gateway: batched embedding (none if `vector`, the prompt's
        embedding, is given), index update off the loop."""
        vec = vector if vector is not None else await self.embed_async(prompt)
        if prompt_tokens is None:
            prompt_tokens = (await asyncio.to_thread(self.count_tokens, [prompt]))[0]
        await asyncio.to_thread(self.index.add, vec, [output_tokens], [prompt_tokens])

    def warm_start(self, jsonl: str | os.PathLike[str], batch_size: int = 256) -> int:
        """Learn every `{prompt, output_tokens[, prompt_tokens]}` line of a JSONL file;
        returns how many were added."""
        added = 0
        for chunk in _chunks(read_jsonl(jsonl), batch_size):
            counts = [r.get("prompt_tokens") for r in chunk]
            known = [int(c) for c in counts if c is not None]
            self.observe_many(
                [r["prompt"] for r in chunk],
                [int(r["output_tokens"]) for r in chunk],
                known if len(known) == len(chunk) else None,
            )
            added += len(chunk)
        return added

    # -- persistence ------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        """Snapshot the history (index + lengths + config) atomically to one file."""
        extra = {"config": self.config.to_dict(), "model": str(self.embedder.path.name)}
        self.index.save(path, extra=extra)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        config: PredictorConfig | None = None,
        *,
        embedder: Embedder | None = None,
    ) -> LengthPredictor:
        """Restore a snapshot. `config` defaults to the snapshot's own; the ring capacity is
        always the snapshot's. Raises `SnapshotError` on a mismatched embedding dimension."""
        if config is None:
            config = PredictorConfig.from_dict(read_header(path)["extra"]["config"])
        embedder = embedder or Embedder(
            device=config.device,
            torch_threads=config.torch_threads,
            encode_batch_items=config.encode_batch_items,
        )
        index, _ = HistoryIndex.load(path, dim=embedder.dim, ef_search=config.hnsw_ef_search)
        return cls(config, embedder=embedder, index=index)


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
