"""A worker's predictor (`serve --workers N`): the prompt's embedding here, everything learnt
in the host's scheduling authority.

One predictor per host: the history of completions, the online models, the snapshot and
shared learning live in the authority (`gateway.workers.authority`, its `Prediction`), so
every worker's requests are predicted from all of the host's completions, and that memory is
not multiplied by the workers. What costs CPU per request, the prompt's embedding (a MiniLM
forward pass), stays in the worker that holds the request, so the forward passes spread over
the workers' cores; only the vector crosses the socket: once to be predicted (`call predict`,
answered with the distribution and the rank score) and once to be learnt (`learn`, no answer).
The worker embeds with the authority's predictor config, so a vector means the same on both
sides. A job that starts at once starts on the host's recent global distribution, which moves
slowly: the worker keeps the one it last got per model and prompt band for `GLOBAL_FRESH_S`,
so an idle worker's request does not wait a round trip for it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from gateway.workers import wire
from policies import LengthDist
from predictor.config import PredictorConfig
from predictor.embedder import AsyncEmbedder, Embedder
from predictor.encoders import Embeddings
from predictor.model import prompt_band
from predictor.text import clip_text

GLOBAL_FRESH_S = 1.0
"""How long a worker starts jobs on the global distribution it last got from the host (per
model and prompt band) before asking again. The host's own recomputes after 1% of its window
of completions is replaced (`LengthPredictor.global_dist`)."""


class Link(Protocol):
    """The worker's connection to the authority (`gateway.workers.remote.AuthorityLink`)."""

    async def call(self, what: str, **args: Any) -> Any: ...

    def send(self, msg: wire.Message) -> None: ...


class HostPredictor:
    """The `gateway.prediction.predict.Predicts` of a worker (`build` makes one)."""

    def __init__(self, link: Link, config: PredictorConfig, embedder: Embedder) -> None:
        self.config = config
        self.embedder = embedder
        self._link = link
        self._async: AsyncEmbedder | None = None
        self._globals: dict[tuple[str | None, int | None], tuple[float, LengthDist]] = {}
        """(model, prompt band) → (when it came, the host's global distribution)."""

    @classmethod
    async def build(cls, link: Link, embedder: Embedder | None = None) -> HostPredictor:
        """Ask the authority for its predictor's config and load the same embedder (off the
        loop), unless one is given."""
        config = PredictorConfig.from_dict(await link.call("predictor"))
        if embedder is None:
            embedder = await asyncio.to_thread(Embedder.from_config, config)
        return cls(link, config, embedder)

    async def refine_async(
        self,
        prompt: str,
        *,
        prompt_tokens: float | None = None,
        max_tokens: float | None = None,
        model: str | None = None,
    ) -> tuple[Embeddings, LengthDist, float]:
        """The prompt's embedding (made here), its distribution and rank score (the host's)."""
        vec = await self._embed(prompt)
        data = await self._link.call("predict", vector=wire.vector_field(vec),
                                     prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                                     model=model)  # fmt: skip
        return vec, _dist(data), float(data["rank_score"])

    async def global_dist_async(
        self, prompt_tokens: float | None = None, *, model: str | None = None
    ) -> LengthDist:
        """The host's recent global distribution at the prompt's size (the one last got for
        the same model and band, if it is fresh)."""
        key = (model, None if prompt_tokens is None else prompt_band(prompt_tokens))
        now = time.monotonic()
        if (kept := self._globals.get(key)) is not None and now - kept[0] < GLOBAL_FRESH_S:
            return kept[1]
        dist = _dist(await self._link.call("global", prompt_tokens=prompt_tokens, model=model))
        self._globals[key] = (now, dist)
        return dist

    async def observe_async(
        self,
        prompt: str,
        output_tokens: int,
        prompt_tokens: int,
        *,
        vector: Embeddings | None = None,
        model: str | None = None,
    ) -> None:
        """Send a completion to the host's predictor (embedded here if `vector` is None)."""
        vec = vector if vector is not None else await self._embed(prompt)
        self._link.send({"op": "learn", "model": model, "vector": wire.vector_field(vec),
                         "prompt_tokens": prompt_tokens,
                         "output_tokens": output_tokens})  # fmt: skip

    async def aclose(self) -> None:
        """Stop the embedder's batching (pending calls fail)."""
        if self._async is not None:
            await self._async.close()
            self._async = None

    async def _embed(self, prompt: str) -> Embeddings:
        if self._async is None:
            self._async = AsyncEmbedder.for_config(self.embedder, self.config)
        cfg = self.config
        return await self._async.embed(
            clip_text(prompt, cfg.embed_max_chars, cfg.embed_head_fraction)
        )


def _dist(data: wire.Message) -> LengthDist:
    dist = wire.dist_of(data)
    assert dist is not None, "the host's predictor answered without a distribution"
    return dist
