"""The predictor's part in a request, and the predictor's life beside the gateway.

Per request (step 2 of the path in docs/ARCHITECTURE.md): `size` counts a job's prompt with
the backend's tokenizer when the job must queue, beside everything else; `predict` gives the
job its output-length distribution, waited for only when the job must queue (an idle gateway
adds no embedding time to TTFT); after a completion `learn` teaches the predictor the true
length from the prompt's embedding it already made. Work beside requests is bounded
(`MAX_PENDING`) and awaited at `stop`.

Per app, paired: `start` loads the predictor (or takes the one the app was given) and starts
the snapshot saver; `stop` waits for the work beside requests, saves and closes it. A worker of
`serve --workers N` owns no predictor: its `host` is the host's (`Predicts`, over the socket;
`gateway.workers.host_predictor`), and the authority's `Prediction` owns the one predictor,
answering the workers' `predict_embedded` and `learn_embedded`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from gateway.config import GatewayConfig
from gateway.prediction import memory, shared_learning
from gateway.scheduling.dispatcher import Dispatcher, Ticket
from gateway.scheduling.prompts import PromptCounter
from policies import Job, LengthDist

if TYPE_CHECKING:
    from predictor import LengthPredictor
    from predictor.embedder import Embedder
    from predictor.encoders import Embeddings
    from predictor.shared import SharedLearning

log = logging.getLogger("sagesched.gateway")

MAX_PENDING = 1024
"""Predictor work running beside requests at most (refinements, learning): bounds memory if
the predictor falls behind the traffic (more is shed)."""


class Predicts(Protocol):
    """What a request's prediction asks of a predictor: a `LengthPredictor` in the process, or
    a worker's view of its host's (`gateway.workers.host_predictor.HostPredictor`)."""

    @property
    def embedder(self) -> Embedder: ...

    async def refine_async(
        self,
        prompt: str,
        *,
        prompt_tokens: float | None = ...,
        max_tokens: float | None = ...,
        model: str | None = ...,
    ) -> tuple[Embeddings, LengthDist, float]: ...

    async def global_dist_async(
        self, prompt_tokens: float | None = ..., *, model: str | None = ...
    ) -> LengthDist: ...

    async def observe_async(
        self,
        prompt: str,
        output_tokens: int,
        prompt_tokens: int,
        *,
        vector: Embeddings | None = ...,
        model: str | None = ...,
    ) -> None: ...

    async def aclose(self) -> None: ...


class Prediction:
    """Prompt sizing and length prediction for the dispatcher's jobs; one per app."""

    def __init__(
        self,
        config: GatewayConfig,
        dispatcher: Dispatcher,
        counter: PromptCounter | None = None,
        *,
        given: LengthPredictor | None = None,
        host: Callable[[], Awaitable[Predicts]] | None = None,
        embeds: bool = True,
    ) -> None:
        """`counter`: the backends' tokenizers (None: characters / 4 only); `given`: a loaded
        predictor to use instead of loading one (tests, embedding); `host`: a worker's, makes
        its view of the host's predictor (the worker then loads, learns and saves nothing);
        `embeds` false: this process's predictor learns and predicts vectors embedded
        elsewhere (the host's authority), so it loads its embedding model only if it must
        embed (a warm start)."""
        self._config = config
        self._embeds = embeds
        self._dispatcher = dispatcher
        self._counter = counter
        self._given = given
        self._host = host
        self.predictor: Predicts | None = None
        """What this process's requests are predicted with (None: no prediction)."""
        self.local: LengthPredictor | None = None
        """The predictor this process owns (loads, snapshots, shares); None in a worker."""
        self.shared: SharedLearning | None = None
        """Learning shared with other replicas through Redis (`shared_learning`; None: off)."""
        """None when the policy needs no prediction and none was asked for."""
        self.background: set[asyncio.Task[None]] = set()
        """Predictor work running beside requests (refinements, learning); bounded."""
        self._saver: asyncio.Task[None] | None = None
        self._saving: asyncio.Future[None] | None = None
        """A periodic save in its thread (stop waits for it: it must not rename its older
        snapshot over the last one)."""

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the predictor if the policy needs it (or the config asks for it), and start
        saving snapshots. Raises ValueError when the policy needs it and the config forbids."""
        needed = self._dispatcher.needs_prediction
        settings = self._config.predictor
        enabled = needed if settings.enabled is None else settings.enabled
        if needed and not enabled:
            raise ValueError(
                f"policy {self._config.policy!r} needs the predictor; do not disable it"
            )
        if not enabled:
            return
        if self._host is not None:
            self.predictor = await self._host()
            return
        if self._given is not None:
            local = self._given
        else:
            local = await asyncio.to_thread(_load, self._config, lazy_embedder=not self._embeds)
        self.predictor = self.local = local
        self.shared = await shared_learning.start(self._config, local)
        if settings.snapshot_path and settings.save_interval_s > 0:
            self._saver = asyncio.create_task(self._save_loop(), name="predictor-saver")

    async def stop(self) -> None:
        """Stop saving, wait for the work beside requests (a capture record waiting for its
        prompt's embedding gets it), save a last snapshot and close the predictor."""
        if self._saver is not None:
            self._saver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._saver
            self._saver = None
        if self._saving is not None:
            await asyncio.gather(self._saving, return_exceptions=True)
        await asyncio.gather(*self.background, return_exceptions=True)
        if self.shared is not None:  # publishes what is buffered, before the last snapshot
            await self.shared.stop()
            self.shared = None
        predictor, self.predictor = self.predictor, None
        local, self.local = self.local, None
        if predictor is None:
            return
        path = self._config.predictor.snapshot_path
        if path and local is not None:
            await asyncio.to_thread(_save, local, path)
        # The async embedder is bound to this loop; a shared predictor makes a new one lazily.
        with contextlib.suppress(Exception):
            await predictor.aclose()

    async def _save_loop(self) -> None:
        settings = self._config.predictor
        assert settings.snapshot_path
        while True:
            await asyncio.sleep(settings.save_interval_s)
            if self.local is not None:
                save = asyncio.to_thread(_save, self.local, settings.snapshot_path)
                self._saving = asyncio.ensure_future(save)
                await asyncio.shield(self._saving)

    # -- per request ----------------------------------------------------------------------

    def size(self, job: Job) -> asyncio.Task[None] | None:
        """Count the prompt with the backend's tokenizer when the job must queue (its size can
        then change the order); a job that starts at once keeps the estimate until its usage
        reports the true count. Nothing waits for the count: it runs beside the prediction,
        and if it lands after the job was queued it rekeys the job (`Dispatcher.resized`).
        The caller cancels the task when the request ends."""
        counter, call = self._counter, job.ctx.call
        if counter is None or self._dispatcher.can_start_now(call.model):
            return None

        async def count() -> None:
            n, job.ctx.trace.prompt_count_source, job.ctx.token_chain = await counter.count(call)
            job.prompt_tokens = n
            self._dispatcher.resized(job)

        return asyncio.create_task(count())

    async def predict(self, job: Job) -> None:
        """Give `job` its predicted length distribution.

        When the job would start at once (nothing of its model waiting, a backend free), the
        prediction cannot change any decision yet, so the job starts on the recent global
        distribution and the semantic prediction runs beside it (it still feeds the running
        key, the admin view and the prediction-error metric): an idle gateway adds no
        embedding time to TTFT. Otherwise the prediction orders the queue, so the job waits
        for it (its time is part of TTFT).
        """
        predictor = self.predictor
        if predictor is None:
            return
        ticket: Ticket = job.ctx
        call = ticket.call
        if not has_text(ticket):  # token ids only: nothing to embed (see `has_text`)
            await _global(predictor, job)
            return
        if self._dispatcher.can_start_now(call.model):
            await _global(predictor, job)
            ticket.refining = self._beside(self._refine(predictor, job))
            return
        await self._refine(predictor, job)

    def learn(self, job: Job) -> None:
        """Teach the predictor a completed job's true length (`trace.output_tokens`), in the
        background."""
        ticket: Ticket = job.ctx
        if self.predictor is not None and ticket.trace.output_tokens > 0 and has_text(ticket):
            self._beside(_observe(self.predictor, ticket))

    async def predict_embedded(
        self, vector: Embeddings, prompt_tokens: float | None, max_tokens: float | None,
        model: str | None,
    ) -> tuple[LengthDist, float]:  # fmt: skip
        """A worker's prompt, embedded there: its distribution and rank score."""
        assert self.local is not None, "the host's predictor is not loaded"
        return await self.local.refine_vector_async(
            vector, prompt_tokens=prompt_tokens, max_tokens=max_tokens, model=model
        )

    def learn_embedded(self, model: str | None, vector: Embeddings, prompt_tokens: int,
                       output_tokens: int) -> None:  # fmt: skip
        """A worker's completion, embedded there: learnt in the background, batched with the
        others (`observe_async`)."""
        if self.local is not None and output_tokens > 0:
            self._beside(self.local.observe_async(
                "", output_tokens, prompt_tokens, vector=vector, model=model
            ))  # fmt: skip

    async def _refine(self, predictor: Predicts, job: Job) -> None:
        ticket: Ticket = job.ctx
        call, trace = ticket.call, ticket.trace
        start = time.monotonic()
        # the prompt count runs beside the prediction and is never waited for: if it is done,
        # `job.prompt_tokens` is the backend's count; if not, it rekeys the queued job when it is
        ticket.prompt_vector, dist, job.rank_score = await predictor.refine_async(
            embedded_text(ticket),
            prompt_tokens=job.prompt_tokens, max_tokens=call.max_tokens, model=call.model,
        )  # fmt: skip
        trace.predictor_s = time.monotonic() - start
        trace.predicted_median = dist.quantile(0.5)
        job.dist = dist

    def _beside(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        """Run predictor work beside the request; bounded, so a predictor that falls behind
        the traffic sheds work instead of growing memory. The task, or None if shed."""
        if len(self.background) >= MAX_PENDING:
            work.close()
            return None
        task = asyncio.create_task(work)
        self.background.add(task)
        task.add_done_callback(self._forget)
        return task

    def _forget(self, task: asyncio.Task[None]) -> None:
        self.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background predictor work failed: %r", task.exception())


def has_text(ticket: Ticket) -> bool:
    """Does the request carry text to embed? A prompt of token ids only (`/v1/completions`
    with `prompt: [1, 2, 3]`) does not: rendering the ids as digits would embed a meaningless
    string, and the empty string would make every such prompt the neighbour of every other.
    Such a request is predicted from the global distribution of recent completions at its
    prompt size (the ids' count), and its completion is not learned into the neighbour index
    (docs/reliability.md, "Token-id prompts")."""
    return bool(embedded_text(ticket).strip())


def embedded_text(ticket: Ticket) -> str:
    """The text the predictor embeds for this request (`predictor.request_text`), as valid
    Unicode: JSON lets a client send lone surrogates ("\\ud800"), which the tokenizer refuses;
    they become U+FFFD."""
    from predictor import request_text

    text = request_text(ticket.call.text_body)
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


async def _global(predictor: Predicts, job: Job) -> None:
    """The recent global distribution at the job's prompt size, capped at its max tokens."""
    call = job.ctx.call
    dist = await predictor.global_dist_async(job.prompt_tokens, model=call.model)
    job.dist = dist if call.max_tokens is None else dist.truncate(call.max_tokens)


async def _observe(predictor: Predicts, ticket: Ticket) -> None:
    """Learn with the prompt's embedding from the prediction: wait for a prediction still
    running beside the request rather than embed the prompt a second time (if the prediction
    failed or was shed, the prompt is embedded now)."""
    if ticket.refining is not None:
        await asyncio.wait([ticket.refining])
    call, trace = ticket.call, ticket.trace
    prompt_tokens = trace.prompt_tokens or call.prompt_tokens_estimate  # usage's, if any
    await predictor.observe_async(
        embedded_text(ticket), trace.output_tokens, prompt_tokens,
        vector=ticket.prompt_vector, model=call.model,
    )  # fmt: skip


def _load(config: GatewayConfig, *, lazy_embedder: bool) -> LengthPredictor:
    from predictor import Embedder, LengthPredictor, PredictorConfig
    from predictor.history import clean_stale

    settings = config.predictor

    def chosen(predictor_config: PredictorConfig) -> PredictorConfig:
        backend = settings.embed_backend
        return replace(predictor_config, embed_backend=backend) if backend else predictor_config

    path = settings.snapshot_path
    if path and (n := clean_stale(path)):
        log.warning("predictor: removed %d unfinished snapshot saves of %s", n, path)
    if path and os.path.exists(path):
        log.info("predictor: loading snapshot %s", path)
        saved = chosen(LengthPredictor.snapshot_config(path))
        return LengthPredictor.load(path, saved, lazy_embedder=lazy_embedder)
    fresh = chosen(PredictorConfig())
    predictor = LengthPredictor(fresh, embedder=Embedder.from_config(fresh, lazy=lazy_embedder))
    if settings.warm_start_jsonl:
        n = predictor.warm_start(settings.warm_start_jsonl)
        log.info("predictor: warm start learned %d requests", n)
    return predictor


def _save(predictor: LengthPredictor, path: str) -> None:
    """A snapshot, then its temporary buffers' pages given back to the system
    (`memory.release_free_memory`): else each save's high-water mark stays in the heap as RSS
    (+18 MB for a 4,096-item history, docs/reliability.md)."""
    predictor.save(path)
    memory.release_free_memory()
