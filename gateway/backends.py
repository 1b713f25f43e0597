"""The backend pool: health, models, in-flight accounting and the in-flight cap.

Why a cap at all: vLLM admits every request into its own FCFS queue, so the gateway's policy
only orders anything if the backlog waits here. Each backend therefore runs at most `cap`
requests; the rest wait in the gateway queue.

Adaptive cap (AIMD, `AdaptiveCapConfig`): every `interval_s` the pool scrapes the backend's
`/metrics`. If vLLM's own queue is forming (`vllm:num_requests_waiting` > `waiting_high`) or
its KV cache is nearly full (`vllm:kv_cache_usage_perc` > `kv_high`), the cap shrinks by an
eighth (at least 1): the engine is past saturation and extra requests only wait inside it,
out of the policy's reach. If the gateway is using the whole cap and the engine has no queue
and KV room, the cap grows by 1: the engine could take more. Otherwise it holds. The cap stays
within [min_inflight, max_inflight].
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import aiohttp

from gateway.config import AdaptiveCapConfig, BackendConfig
from gateway.metrics import GatewayMetrics, scrape_values

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0


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


def next_cap(cap: int, inflight: int, waiting: float, kv: float, cfg: AdaptiveCapConfig) -> int:
    """One step of the AIMD control law (see the module docstring)."""
    if waiting > cfg.waiting_high or kv > cfg.kv_high:
        cap -= max(1, cap // 8)
    elif inflight >= cap:
        cap += 1
    return max(cfg.min_inflight, min(cfg.max_inflight, cap))


class BackendPool:
    """All backends, their health loop and (optionally) the adaptive-cap loop."""

    def __init__(
        self,
        configs: Iterable[BackendConfig],
        session: aiohttp.ClientSession,
        metrics: GatewayMetrics,
        *,
        on_capacity: Callable[[], None],
        health_interval_s: float,
        adaptive: AdaptiveCapConfig,
    ) -> None:
        self.backends = [
            Backend(c, cap=c.max_inflight, models=frozenset(c.models)) for c in configs
        ]
        self._session = session
        self._metrics = metrics
        self._on_capacity = on_capacity
        self._interval = health_interval_s
        self._adaptive = adaptive
        self._tasks: list[asyncio.Task[None]] = []
        for b in self.backends:
            metrics.cap.labels(b.name).set(b.cap)
            metrics.inflight.labels(b.name).set(0)
            metrics.healthy.labels(b.name).set(0)

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Check every backend once, then keep checking in the background."""
        await asyncio.gather(*(self.check(b) for b in self.backends))
        self._tasks.append(asyncio.create_task(self._health_loop(), name="health-loop"))
        if self._adaptive.enabled:
            self._tasks.append(asyncio.create_task(self._adapt_loop(), name="adaptive-cap"))

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
        """The least-loaded healthy backend with room that serves `model`, or None."""
        open_ = [
            b for b in self.backends if model in b.models and b.name not in exclude and b.has_room()
        ]
        return min(open_, key=lambda b: b.inflight / b.cap, default=None)

    def candidates(self, model: str, exclude: set[str]) -> int:
        """How many backends serve `model` and have not been excluded (healthy or not)."""
        return sum(1 for b in self.backends if model in b.models and b.name not in exclude)

    # -- accounting ---------------------------------------------------------------------

    def acquire(self, b: Backend) -> None:
        b.inflight += 1
        self._metrics.inflight.labels(b.name).set(b.inflight)

    def release(self, b: Backend) -> None:
        b.inflight -= 1
        self._metrics.inflight.labels(b.name).set(b.inflight)
        self._on_capacity()

    def mark_down(self, b: Backend) -> None:
        """A request just failed to reach `b`: stop routing to it until a check passes."""
        if b.healthy:
            log.warning("backend %s marked down after a failed request", b.name)
        b.healthy = False
        self._metrics.healthy.labels(b.name).set(0)

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
        self._metrics.healthy.labels(b.name).set(1 if ok else 0)
        if ok and not was:
            log.info("backend %s healthy; models %s", b.name, sorted(b.models))
            self._on_capacity()

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

    async def _adapt_loop(self) -> None:
        while True:
            await asyncio.sleep(self._adaptive.interval_s)
            await asyncio.gather(*(self._adapt(b) for b in self.backends if b.healthy))

    async def _adapt(self, b: Backend) -> None:
        try:
            _, text = await self._get(b, "/metrics")
        except (aiohttp.ClientError, TimeoutError):
            return
        values = scrape_values(text, ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"))
        new = next_cap(
            b.cap,
            b.inflight,
            values.get("vllm:num_requests_waiting", 0.0),
            values.get("vllm:kv_cache_usage_perc", 0.0),
            self._adaptive,
        )
        if new != b.cap:
            log.info("backend %s cap %d -> %d", b.name, b.cap, new)
            grew = new > b.cap
            b.cap = new
            self._metrics.cap.labels(b.name).set(new)
            if grew:
                self._on_capacity()
