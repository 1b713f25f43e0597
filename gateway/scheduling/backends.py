"""The backend pool: health, models, in-flight accounting and the in-flight cap.

Why a cap at all: vLLM admits every request into its own FCFS queue, so the gateway's policy
only orders anything if the backlog waits here. Each backend therefore runs at most `cap`
requests; the rest wait in the gateway queue.

Self-tuning cap (on by default, `AdaptiveCapConfig`): one loop per backend scrapes its
`/metrics` (`read_sample`: waiting and running requests, KV usage and capacity, the generated-
and prompt-token counters, the iteration count) and feeds a `policies.capacity.CapController`,
the same control law the simulator runs on its engine model: it fits the engine's iteration
time against its batch, sets the cap at the efficient batch of that curve, and shrinks it when
vLLM's own queue forms or its KV fills. Scrapes come every `interval_s` (faster while the
curve is unknown); a failed scrape is skipped, a missing series is unknown (not 0), and a
server with several engines (label `engine`) counts the sum of their queues and counters and
the fullest engine's KV. The fitted curves are remembered in a small JSON file
(`AdaptiveCapConfig.memory_file`), so a restarted gateway starts at the last efficient batch.
The cap starts at the backend's `max_inflight` (or the remembered batch) and stays within the
adaptive config's [min_inflight, max_inflight].

Routing (`GatewayConfig.routing`, a `policies.routing` router, one per served model so each
keeps its own index of what it sent where): `pick(model, exclude, job)` shows the router every
backend this gateway may send the job to as a `BackendState` (in flight, cap, health, the
engine's queue, KV use and capacity from the last scrape) and returns its choice; `routed`
tells the router where the job went (a prefix router records the prompt's blocks there and
sets `Job.cached_tokens`), `release` that it left. Without a job, `pick` only asks whether a
backend has room (the least-loaded one).

Capacity changes (a slot released, a backend turned healthy, a cap grown) are announced to the
listeners (`listen`: the dispatcher's `pump`). What the metrics show (in-flight, cap, health)
is read off the `Backend` objects when Prometheus scrapes (`gateway.observability.metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from gateway.config import AdaptiveCapConfig, BackendConfig
from gateway.scheduling.kv_events import ExactLookup, KvEventStream
from policies import Job
from policies.capacity import CapController, EngineSample, combine_kv
from policies.cost import LinearProfile
from policies.routing import BackendState, Router, make_router

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
MEMORY_SAVE_S = 60.0
"""Seconds between writes of the curve memory (also written at stop)."""
KV_BLOCK_TOKENS = 16
"""vLLM's default KV block size: the unit a backend's capacity is counted in for routers."""
NO_METRICS_RETRY_S = 30.0
"""A backend that answered 404 for `/metrics` (not vLLM) is asked again after this long,
not every quarter second of a slow start that never ends without samples."""


@dataclass(eq=False)
class Backend:
    """One upstream server and what the gateway knows about it. Event-loop confined."""

    config: BackendConfig
    cap: int
    inflight: int = 0
    healthy: bool = False
    models: frozenset[str] = field(default_factory=frozenset)
    discovered: list[dict[str, object]] = field(default_factory=list)
    """The model cards of its last `/v1/models` answer."""
    controller: CapController | None = None
    """The self-tuning cap's state (None: fixed cap)."""
    sample: EngineSample | None = None
    """What its last `/metrics` scrape read (None: not scraped, or not vLLM); set through
    `observed`."""
    events: KvEventStream | None = None
    """Its KV-event subscription (`BackendConfig.kv_events`), if it publishes them."""
    _view: BackendState | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def url(self) -> str:
        return self.config.url.rstrip("/")

    def headers(self) -> dict[str, str]:
        key = self.config.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def has_room(self) -> bool:
        return self.healthy and self.inflight < self.cap

    def state(self) -> BackendState:
        """This backend as a router sees it (`policies.routing.BackendState`): one record,
        refreshed in place (a decision reads it and keeps nothing)."""
        view = self._view
        if view is None:
            view = self._view = BackendState(self.name, self.inflight, self.cap)
            self.observed(self.sample)
        view.inflight, view.cap, view.serving = self.inflight, self.cap, self.healthy
        return view

    def lookup(self, chain: tuple[int, ...] | None, job_block: int) -> ExactLookup | None:
        """What the engine reports it caches, for a job whose token chain is `chain`: None
        unless its events are exact and the chain is in the engine's block size."""
        events = self.events
        if chain is None or events is None or not events.exact:
            return None
        return ExactLookup(events.cache, chain, job_block)

    def engine_blocks(self) -> int | None:
        """The engine's KV capacity in its own blocks (the events' block size), if known."""
        sample, events = self.sample, self.events
        if sample is None or not sample.kv_capacity_tokens or events is None:
            return None
        size = events.cache.block_size
        return int(sample.kv_capacity_tokens) // size if size else None

    def observed(self, sample: EngineSample | None) -> None:
        """A scrape read `sample`: the engine's queue and KV the router sees from now on."""
        self.sample = sample
        view = self._view
        if view is None:
            return
        capacity = None if sample is None else sample.kv_capacity_tokens
        view.waiting = None if sample is None or sample.waiting is None else int(sample.waiting)
        view.kv_usage = None if sample is None else sample.kv_usage
        view.kv_blocks = None if not capacity else int(capacity) // KV_BLOCK_TOKENS
        view.block_tokens = KV_BLOCK_TOKENS


def curve_view(b: Backend) -> dict[str, Any]:
    """The self-tuning cap's view of a backend for `/admin/backends`: its fitted curve, the
    efficient batch with its relative error and the per-request cost it implies (None where
    not known yet)."""
    ctl = b.controller
    if ctl is None:
        return {"adaptive": False}
    est = ctl.efficient_batch()
    profile = ctl.profile()
    return {
        "adaptive": True,
        "curve": ctl.fit.coefficients(),
        "efficient_batch": None if est is None else {"batch": est[0], "rel_error": est[1]},
        "curve_trusted": ctl.confident(),
        "curve_changes": ctl.changes,
        "engine_cost": None if profile is None else dataclasses.asdict(profile),
    }


def memory_key(b: Backend) -> str:
    """A backend's entry in the curve memory: its URL and the models it serves (another
    model on the same server is another engine)."""
    return f"{b.url} {','.join(sorted(b.models))}"


def load_memory(path: str | None) -> dict[str, Any]:
    """The curve memory file (`AdaptiveCapConfig.memory_path`): {key: controller memory}.
    A missing or unreadable file is an empty memory (logged), never an error."""
    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        log.warning("cap memory %s unreadable (%s): starting cold", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def save_memory(path: str, entries: dict[str, Any]) -> None:
    """Write the curve memory atomically (temporary file, fsync, rename)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(entries, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
"""V1's name, then V0's (same meaning)."""
GENERATED = ("vllm:generation_tokens_total", "vllm:generation_tokens")
PROMPT = ("vllm:prompt_tokens_total", "vllm:prompt_tokens")
ITERATIONS = "vllm:iteration_tokens_total_count"
"""The count of vLLM's tokens-per-iteration histogram: one per engine iteration."""
TOKEN_GAP = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
"""vLLM's inter-token latency histogram (V1's name, then the older one): its sum and count."""
CACHE_CONFIG = "vllm:cache_config_info"
"""An info series whose labels carry `num_gpu_blocks` and `block_size`."""
_GAP_SUM = tuple(f"{n}_sum" for n in TOKEN_GAP)
_GAP_COUNT = tuple(f"{n}_count" for n in TOKEN_GAP)
_WANTED = {WAITING, RUNNING, *KV_USAGE, *GENERATED, *PROMPT, ITERATIONS, *_GAP_SUM, *_GAP_COUNT}
_WANTED_PREFIXES = (*_WANTED, CACHE_CONFIG)


def read_sample(text: str) -> EngineSample:
    """vLLM's `/metrics` text → `EngineSample`. A series absent from the text is unknown
    (None); samples of several engines (label `engine`) or models are summed for the queues,
    the batch and the counters, and the KV usage is the fullest engine's (`combine_kv`), never
    a sum above 1. Only the lines of the wanted series are parsed: vLLM's exposition has
    hundreds of histogram lines, ~12 us each to parse, scraped every second (text without
    them reads as all unknown). Raises ValueError when a wanted line is malformed."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, list[float]] = {}
    capacity = 0.0
    lines = "\n".join(line for line in text.splitlines() if line.startswith(_WANTED_PREFIXES))
    for family in text_string_to_metric_families(lines):
        for sample in family.samples:
            if sample.name in _WANTED:
                values.setdefault(sample.name, []).append(float(sample.value))
            elif sample.name == CACHE_CONFIG:
                labels = sample.labels
                with contextlib.suppress(KeyError, ValueError):
                    capacity += float(labels["num_gpu_blocks"]) * float(labels["block_size"])

    def total(*names: str) -> float | None:
        found = next((values[n] for n in names if n in values), None)
        return sum(found) if found else None

    # the sum and the count of one name, so the two always describe the same tokens
    gap = next((i for i, n in enumerate(_GAP_COUNT) if n in values and _GAP_SUM[i] in values), None)
    return EngineSample(
        waiting=total(WAITING),
        kv_usage=combine_kv(next((values[n] for n in KV_USAGE if n in values), [])),
        generation_tokens=total(*GENERATED),
        running=total(RUNNING),
        prompt_tokens=total(*PROMPT),
        iterations=total(ITERATIONS),
        kv_capacity_tokens=capacity or None,
        token_gap_s=None if gap is None else total(_GAP_SUM[gap]),
        token_gaps=None if gap is None else total(_GAP_COUNT[gap]),
    )


class BackendPool:
    """All backends, their health loop and (when a self-tuning cap or the router needs the
    engine's view) a loop per backend scraping its `/metrics`."""

    def __init__(
        self,
        configs: Iterable[BackendConfig],
        session: aiohttp.ClientSession,
        *,
        health_interval_s: float,
        adaptive: AdaptiveCapConfig,
        memory_path: str | None = None,
        router: Router | None = None,
    ) -> None:
        """`memory_path`: the curve memory file (`AdaptiveCapConfig.memory_file`), read at
        `start` and written every `MEMORY_SAVE_S` and at `stop`. `router`: the configured
        router (a template: each model routes with its own fresh copy; default least-loaded)."""
        self.backends = [
            Backend(c, cap=c.max_inflight, models=frozenset(c.models)) for c in configs
        ]
        self._by_name = {b.name: b for b in self.backends}
        for b in self.backends:
            if b.config.kv_events:
                b.events = KvEventStream(b.name, b.config.kv_events, b.config.kv_events_topic,
                                         capacity=b.engine_blocks)  # fmt: skip
        self._router = router or make_router("least-loaded")
        self._routers: dict[str, Router] = {}
        self._decision: tuple[Job | None, list[BackendState]] = (None, [])
        """The job of the last `pick` and the states its router saw."""
        self.decisions: dict[tuple[str, str, str], int] = {}
        """(model, backend, reason) → jobs routed there (`policies.routing.REASONS`)."""
        self.routed_tokens: dict[tuple[str, str], int] = {}
        """(model, backend) → prompt tokens of the jobs routed there."""
        self.cached_tokens: dict[tuple[str, str], int] = {}
        """(model, backend) → of those, the tokens the router expected cached there."""
        self.exact_decisions: dict[str, int] = {}
        """model → decisions that matched the prompt against an engine's own KV events."""
        self._law = adaptive.law() if adaptive.enabled else None
        self._memory_path = memory_path
        self._memory: dict[str, Any] = {}
        if self._law is not None:
            for b in self.backends:
                b.controller = CapController(self._law, b.cap)
        self._session = session
        self._listeners: list[Callable[[], None]] = []
        self._interval = health_interval_s
        self._adaptive = adaptive
        self._tasks: list[asyncio.Task[None]] = []

    def listen(self, on_capacity: Callable[[], None]) -> None:
        """Call `on_capacity()` whenever a slot may have opened (a release, a backend turning
        healthy, a cap growing)."""
        self._listeners.append(on_capacity)

    def _capacity(self) -> None:
        for listener in self._listeners:
            listener()

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Check every backend once, start each self-tuning cap from its remembered curve
        (if any), then keep checking in the background."""
        await asyncio.gather(*(self.check(b) for b in self.backends))
        for b in self.backends:
            if b.events is not None:
                b.events.start()
        self._memory = load_memory(self._memory_path)
        self._tasks.append(asyncio.create_task(self._health_loop(), name="health-loop"))
        for b in self.backends:
            if b.controller is None or self._law is None:
                continue
            remembered = self._memory.get(memory_key(b))
            if isinstance(remembered, dict):
                b.controller = CapController(self._law, b.cap, memory=remembered)
                if b.controller.confident():
                    log.info("backend %s: remembered curve, cap %d", b.name, b.controller.cap)
            self.set_cap(b, b.controller.cap)
        # the engine's queue and KV: for the self-tuning cap, and for a router that reads them
        engine_view = self._router.reads_engine and len(self.backends) > 1
        for b in self.backends:
            if b.controller is not None or engine_view:
                self._tasks.append(
                    asyncio.create_task(self._scrape_loop(b), name=f"scrape-{b.name}")
                )
        if self._memory_path and self._law is not None:
            self._tasks.append(asyncio.create_task(self._memory_loop(), name="cap-memory"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        for b in self.backends:
            if b.events is not None:
                await b.events.stop()
        self.remember()

    def remember(self) -> None:
        """Write every fitted curve to the memory file (a backend with no evidence yet keeps
        its old entry)."""
        if not self._memory_path:
            return
        for b in self.backends:
            memory = None if b.controller is None else b.controller.memory()
            if memory is not None:
                self._memory[memory_key(b)] = memory
        try:
            save_memory(self._memory_path, self._memory)
        except OSError as e:
            log.warning("cap memory %s not written: %s", self._memory_path, e)

    async def _memory_loop(self) -> None:
        while True:
            await asyncio.sleep(MEMORY_SAVE_S)
            self.remember()

    # -- queries ------------------------------------------------------------------------

    def serves(self, model: str) -> bool:
        """Does any backend (healthy or not) list this model?"""
        return any(model in b.models for b in self.backends)

    def ready(self) -> bool:
        return any(b.healthy for b in self.backends)

    def model_cards(self) -> list[dict[str, object]]:
        """Union of the backends' `/v1/models` entries, one per model id."""
        cards: dict[str, dict[str, object]] = {}
        for b in self.backends:
            for card in b.discovered:
                cards.setdefault(str(card.get("id")), card)
            for model in b.models:
                cards.setdefault(model, {"id": model, "object": "model", "owned_by": "sagesched"})
        return list(cards.values())

    @property
    def routing(self) -> str:
        """The configured router's label (metrics, admin views)."""
        return self._router.label()

    def router(self, model: str) -> Router:
        """The router of `model`'s jobs: a fresh copy of the configured one, bound to the
        engine's cost as the self-tuning caps fitted it when the model was first routed."""
        router = self._routers.get(model)
        if router is None:
            router = self._router.fresh()
            cost = self.engine_profile(model)
            if cost is not None:
                router = router.on_engine(cost)
            self._routers[model] = router
        return router

    def pick(
        self,
        model: str,
        exclude: frozenset[str] | set[str] = frozenset(),
        job: Job | None = None,
        allow: Callable[[Backend], bool] | None = None,
    ) -> Backend | None:
        """Where `job` goes: the router's choice among the healthy backends with room that
        serve `model` (and that `allow`, when given: the policy's start rule), or None. Only
        this gateway's own backends (`BackendConfig.owned`, one replica's share) while one of
        them serving `model` is healthy: another replica's would be over-admitted. Without a
        job: the least-loaded one (is there room at all?)."""
        mine = self._candidates(model, exclude)
        if job is None:
            open_ = [b for b in mine if b.has_room()]
            return min(open_, key=lambda b: b.inflight / b.cap, default=None)
        if allow is not None:
            mine = [b for b in mine if allow(b)]
        chain = getattr(job.ctx, "token_chain", None)  # tokenized: exact where events are
        states, exact = [], False
        for b in mine:
            state = b.state()
            state.index = b.lookup(chain, job.block_tokens)
            exact = exact or state.index is not None
            states.append(state)
        if exact:
            self.exact_decisions[model] = self.exact_decisions.get(model, 0) + 1
        chosen = self.router(model).pick(job, states)
        self._decision = (job, states)
        return None if chosen is None else self._by_name[chosen.name]

    def _candidates(self, model: str, exclude: frozenset[str] | set[str]) -> list[Backend]:
        serving = [b for b in self.backends if model in b.models and b.name not in exclude]
        return [b for b in serving if b.config.owned and b.healthy] or serving

    def candidate_states(self, model: str, exclude: set[str]) -> list[BackendState]:
        """What the router of `model` is shown at a decision (by the approximate index)."""
        states = [b.state() for b in self._candidates(model, exclude)]
        for state in states:
            state.index = None
        return states

    def routed(self, model: str, job: Job, b: Backend) -> None:
        """`job` was sent to `b` (after `pick`): the router records it, and the decision is
        counted by its reason, with the prompt tokens expected cached there."""
        router, state = self.router(model), b.state()
        decided, states = self._decision
        candidates = states if decided is job else self.candidate_states(model, set())
        reason = router.reason(job, state, candidates)
        router.on_route(job, state)
        key = (model, b.name)
        self.decisions[(*key, reason)] = self.decisions.get((*key, reason), 0) + 1
        self.routed_tokens[key] = self.routed_tokens.get(key, 0) + job.prompt_tokens
        self.cached_tokens[key] = self.cached_tokens.get(key, 0) + job.cached_tokens

    def event_block_size(self, model: str) -> int | None:
        """The block size of a backend of `model` whose KV events are exact (a prompt's token
        chain is made in it), or None."""
        for b in self.backends:
            events = b.events
            if events is not None and events.exact and model in b.models:
                return events.cache.block_size
        return None

    def engine_profile(self, model: str) -> LinearProfile | None:
        """What one request of `model` costs its engines, from the self-tuning caps' fitted
        curves (the mean of the backends serving it whose curve is trusted), or None."""
        found = [
            p
            for b in self.backends
            if model in b.models and b.controller is not None
            if (p := b.controller.profile()) is not None
        ]
        if not found:
            return None
        n = len(found)
        return LinearProfile(
            prefill_base_s=sum(p.prefill_base_s for p in found) / n,
            prefill_s_per_token=sum(p.prefill_s_per_token for p in found) / n,
            step_s=sum(p.step_s for p in found) / n,
            context_s_per_token=sum(p.context_s_per_token for p in found) / n,
        )

    def candidates(self, model: str, exclude: set[str]) -> int:
        """How many backends serve `model` and have not been excluded (healthy or not)."""
        return sum(1 for b in self.backends if model in b.models and b.name not in exclude)

    # -- accounting ---------------------------------------------------------------------

    def acquire(self, b: Backend) -> None:
        b.inflight += 1

    def release(self, b: Backend, model: str | None = None, job: Job | None = None) -> None:
        """`b`'s slot is free again (the job, if given, left it: its router is told)."""
        b.inflight -= 1
        if job is not None and model is not None:
            self.router(model).on_finish(job, b.state())
        self._capacity()

    def mark_down(self, b: Backend) -> None:
        """A request just failed to reach `b`: stop routing to it until a check passes."""
        if b.healthy:
            log.warning("backend %s marked down after a failed request", b.name)
        b.healthy = False

    # -- health and caps ----------------------------------------------------------------

    async def _get(self, b: Backend, path: str) -> tuple[int, str]:
        """A short GET to a backend's control endpoint: (status, body text)."""
        timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
        async with self._session.get(f"{b.url}{path}", timeout=timeout, headers=b.headers()) as r:
            return r.status, await r.text()

    async def check(self, b: Backend) -> None:
        """GET /health and /v1/models; update health and models."""
        try:
            ok = (await self._get(b, "/health"))[0] == 200
            if ok:
                await self._discover(b)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            ok = False
        was = b.healthy
        b.healthy = ok
        if ok and not was:
            log.info("backend %s healthy; models %s", b.name, sorted(b.models))
            self._capacity()

    async def _discover(self, b: Backend) -> None:
        status, text = await self._get(b, "/v1/models")
        if status != 200:
            return
        data = json.loads(text)
        if not isinstance(data, dict):
            return
        cards = [c for c in data.get("data", []) if isinstance(c, dict) and "id" in c]
        b.discovered = cards
        if not b.config.models:
            b.models = frozenset(str(c["id"]) for c in cards)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await asyncio.gather(*(self.check(b) for b in self.backends))

    async def _scrape_loop(self, b: Backend) -> None:
        wait_s = self._adaptive.interval_s if b.controller is None else b.controller.interval_s
        while True:
            await asyncio.sleep(wait_s)
            if b.healthy:
                wait_s = await self._scrape(b)

    async def _scrape(self, b: Backend) -> float:
        """One scrape of `b`'s `/metrics`: the engine's queue and KV the router sees, and one
        step of its cap controller when the cap tunes itself. Returns the seconds until the
        next scrape."""
        ctl = b.controller
        interval_s = self._adaptive.interval_s if ctl is None else ctl.interval_s
        try:
            status, text = await self._get(b, "/metrics")
            sample = read_sample(text) if status == 200 else EngineSample()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return interval_s  # no reading this time: wait for the next one
        b.observed(sample)
        if ctl is not None:
            changes = ctl.changes
            self.set_cap(b, ctl.observe(time.monotonic(), sample, b.inflight))
            if log.isEnabledFor(logging.DEBUG):
                log.debug("backend %s: %s", b.name, json.dumps(ctl.trace(sample, b.inflight)))
            if ctl.changes != changes:
                log.warning("backend %s no longer matches its curve: learning it again", b.name)
            interval_s = ctl.interval_s
        return NO_METRICS_RETRY_S if status == 404 else interval_s

    def set_cap(self, b: Backend, new: int) -> None:
        """Apply a new cap; a larger one wakes the dispatcher."""
        if new == b.cap:
            return
        log.info("backend %s cap %d -> %d", b.name, b.cap, new)
        grew = new > b.cap
        b.cap = new
        if grew:
            self._capacity()
