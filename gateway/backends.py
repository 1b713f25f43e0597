"""The backend pool: health, models, in-flight accounting and the in-flight cap.

Why a cap at all: vLLM admits every request into its own FCFS queue, so the gateway's policy
only orders anything if the backlog waits here. Each backend therefore runs at most `cap`
requests; the rest wait in the gateway queue.

Self-tuning cap (on by default, `AdaptiveCapConfig`): one loop per backend scrapes its
`/metrics` (`read_sample`: waiting requests, KV usage, generated-token counter) and feeds a
`policies.capacity.CapController`, the same control law the simulator runs on its engine
model: shrink when vLLM's own queue forms or its KV fills, otherwise hill-climb on token
throughput toward the efficient batch. Scrapes come every `interval_s` (faster while
slow-starting); a failed scrape is skipped, a missing series is unknown (not 0), and a server
with several engines (label `engine`) counts the sum of their queues and counters and the
fullest engine's KV. The cap starts at the backend's `max_inflight` and stays within the
adaptive config's [min_inflight, max_inflight].

Capacity changes (a slot released, a backend turned healthy, a cap grown) are announced to the
listeners (`listen`: the dispatcher's `pump`). What the metrics show (in-flight, cap, health)
is read off the `Backend` objects when Prometheus scrapes (`gateway.metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import aiohttp

from gateway.config import AdaptiveCapConfig, BackendConfig
from policies.capacity import CapController, CapLaw, EngineSample, combine_kv

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
NO_METRICS_RETRY_S = 30.0
"""A backend that answered 404 for `/metrics` (not vLLM) is asked again after this long,
not every quarter second of a slow start that never ends without samples."""


@dataclass(eq=False)
class Backend:
    """One upstream server and what the gateway knows about it. Event-loop confined."""

    config: BackendConfig
    cap: int
    inflight: int = 0
    finished: int = 0
    """Requests released since start (done, failed or aborted): the cap controller's
    turnover count."""
    healthy: bool = False
    models: frozenset[str] = field(default_factory=frozenset)
    discovered: list[dict[str, object]] = field(default_factory=list)
    """The model cards of its last `/v1/models` answer."""
    controller: CapController | None = None
    """The self-tuning cap's state (None: fixed cap)."""

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


def cap_law(cfg: AdaptiveCapConfig) -> CapLaw:
    """The control law's parameters from the gateway config."""
    return CapLaw(
        interval_s=cfg.interval_s,
        slow_start_interval_s=cfg.interval_s / 4,
        min_cap=cfg.min_inflight,
        max_cap=cfg.max_inflight,
        kv_high=cfg.kv_high,
        waiting_high=cfg.waiting_high,
    )


WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
"""V1's name, then V0's (same meaning)."""
GENERATED = ("vllm:generation_tokens_total", "vllm:generation_tokens")
_WANTED_PREFIXES = (WAITING, *KV_USAGE, *GENERATED)


def read_sample(text: str) -> EngineSample:
    """vLLM's `/metrics` text → `EngineSample`. A series absent from the text is unknown
    (None); samples of several engines (label `engine`) or models are summed for the queue and
    the token counter, and the KV usage is the fullest engine's (`combine_kv`), never a sum
    above 1. Only the lines of the wanted series are parsed: vLLM's exposition has hundreds of
    histogram lines, ~12 us each to parse, scraped every second (text without them reads as
    all unknown). Raises ValueError when a wanted line is malformed."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, list[float]] = {}
    wanted = {WAITING, *KV_USAGE, *GENERATED}
    lines = "\n".join(line for line in text.splitlines() if line.startswith(_WANTED_PREFIXES))
    for family in text_string_to_metric_families(lines):
        for sample in family.samples:
            if sample.name in wanted:
                values.setdefault(sample.name, []).append(float(sample.value))

    def first(names: tuple[str, ...]) -> list[float]:
        return next((values[n] for n in names if n in values), [])

    waiting = values.get(WAITING)
    generated = first(GENERATED)
    return EngineSample(
        waiting=sum(waiting) if waiting else None,
        kv_usage=combine_kv(first(KV_USAGE)),
        generation_tokens=sum(generated) if generated else None,
    )


class BackendPool:
    """All backends, their health loop and (optionally) the adaptive-cap loop."""

    def __init__(
        self,
        configs: Iterable[BackendConfig],
        session: aiohttp.ClientSession,
        *,
        health_interval_s: float,
        adaptive: AdaptiveCapConfig,
    ) -> None:
        self.backends = [
            Backend(c, cap=c.max_inflight, models=frozenset(c.models)) for c in configs
        ]
        if adaptive.enabled:
            law = cap_law(adaptive)
            for b in self.backends:
                b.controller = CapController(law, b.cap)
                b.cap = b.controller.cap
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
        """Check every backend once, then keep checking in the background."""
        await asyncio.gather(*(self.check(b) for b in self.backends))
        self._tasks.append(asyncio.create_task(self._health_loop(), name="health-loop"))
        for b in self.backends:
            if b.controller is not None:
                self._tasks.append(asyncio.create_task(self._adapt_loop(b), name=f"cap-{b.name}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

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

    def pick(self, model: str, exclude: frozenset[str] | set[str] = frozenset()) -> Backend | None:
        """The least-loaded healthy backend with room that serves `model`, or None. Only this
        gateway's own backends (`BackendConfig.owned`, one replica's share) while one of them
        serving `model` is healthy: another replica's would be over-admitted."""
        serving = [b for b in self.backends if model in b.models and b.name not in exclude]
        mine = [b for b in serving if b.config.owned and b.healthy] or serving
        open_ = [b for b in mine if b.has_room()]
        return min(open_, key=lambda b: b.inflight / b.cap, default=None)

    def candidates(self, model: str, exclude: set[str]) -> int:
        """How many backends serve `model` and have not been excluded (healthy or not)."""
        return sum(1 for b in self.backends if model in b.models and b.name not in exclude)

    # -- accounting ---------------------------------------------------------------------

    def acquire(self, b: Backend) -> None:
        b.inflight += 1

    def release(self, b: Backend) -> None:
        b.inflight -= 1
        b.finished += 1
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

    async def _adapt_loop(self, b: Backend) -> None:
        assert b.controller is not None
        wait_s = b.controller.interval_s
        while True:
            await asyncio.sleep(wait_s)
            if b.healthy:
                wait_s = await self._adapt(b)

    async def _adapt(self, b: Backend) -> float:
        """One scrape of `b`'s `/metrics` and one step of its cap controller. Returns the
        seconds until the next scrape."""
        assert b.controller is not None
        try:
            status, text = await self._get(b, "/metrics")
            sample = read_sample(text) if status == 200 else EngineSample()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return b.controller.interval_s  # no reading this time: wait for the next one
        self.set_cap(b, b.controller.observe(time.monotonic(), sample, b.inflight, b.finished))
        return NO_METRICS_RETRY_S if status == 404 else b.controller.interval_s

    def set_cap(self, b: Backend, new: int) -> None:
        """Apply a new cap; a larger one wakes the dispatcher."""
        if new == b.cap:
            return
        log.info("backend %s cap %d -> %d", b.name, b.cap, new)
        grew = new > b.cap
        b.cap = new
        if grew:
            self._capacity()
