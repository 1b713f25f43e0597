"""A worker's side of `serve --workers N`: the authority's queue, reached over a socket.

The worker runs the same app, handlers and relay as a single process (`gateway.serving.app`); only
where the pool and the dispatcher come from differs (`AuthorityLink.attach`):

- `RemoteSlot` is a `gateway.scheduling.slot.Slot` whose queue place is in the authority: entering
it
  sends `admit` (one round trip: the answer is the admission, with the grant when the job
  starts at once); `granted()` waits for the grant message; `tokens(n)` counts locally and
  sends one message when the request reaches the review point the authority asked for;
  `ended` and the exit send one message each. A preemption arrives as a message and stops the
  relay's `PreemptWindow` exactly as a local preemption does.
- `RemoteDispatcher` is the local `Dispatcher` (classes, job ids, labels) whose `slot()` is a
  `RemoteSlot`, whose `can_start_now` reads the authority's pushed per-model state and whose
  `resized` is a message.
- `RemotePool` is a view of the authority's pool (health, models, caps pushed on change),
  for the routes that read it: `/ready`, `/v1/models`, the passthrough, the prompt counter.
- `/metrics` and the admin views are answered by the authority (`worker_routes`): the sum over
  all workers, and the one queue.

If the authority goes away, every waiting request fails with 503 and the worker stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from gateway.config import BackendConfig, GatewayConfig
from gateway.errors import GatewayError, NoBackend, UpstreamFailed
from gateway.scheduling.backends import Backend, BackendPool
from gateway.scheduling.dispatcher import Dispatcher
from gateway.scheduling.slot import Attempt, Grant, PreemptWindow, Slot
from gateway.workers import wire
from policies import Job, Policy

if TYPE_CHECKING:
    from gateway.workers.host_predictor import HostPredictor
    from predictor import Embedder

log = logging.getLogger("sagesched.remote")


class AuthorityGone(NoBackend):
    """The scheduling authority's connection closed: nothing can be scheduled (503)."""


class RemotePool(BackendPool):
    """The authority's pool as last pushed (health, models, cards, caps, in-flight counts);
    never checks or scrapes a backend itself."""

    def __init__(self, configs: Iterable[BackendConfig], session: aiohttp.ClientSession,
                 config: GatewayConfig) -> None:  # fmt: skip
        super().__init__(configs, session, health_interval_s=config.health_interval_s,
                         adaptive=config.adaptive_cap)  # fmt: skip
        self.rows: list[dict[str, Any]] = []

    async def start(self) -> None:
        """Nothing to start: the authority checks the backends."""

    async def stop(self) -> None:
        """Nothing to stop."""

    def by_name(self, name: str) -> Backend:
        return next(b for b in self.backends if b.name == name)

    def event_block_size(self, model: str) -> int | None:
        """The authority's answer (pushed with the pool): a backend of `model` follows its
        engine's KV events in blocks of this size."""
        for row in self.rows:
            if row.get("event_block") and model in row["models"]:
                return int(row["event_block"])
        return None

    def apply(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        by_name = {b.name: b for b in self.backends}
        for row in rows:
            b = by_name.get(row["name"])
            if b is not None:
                b.healthy, b.models = row["healthy"], frozenset(row["models"])
                b.discovered, b.cap, b.inflight = row["cards"], row["cap"], row["inflight"]


class RemoteSlot:
    """A `gateway.scheduling.slot.Slot` held in the authority (the contract is there)."""

    def __init__(self, link: AuthorityLink, job: Job) -> None:
        self.job = job
        self.review_at: int | None = None
        self.window: PreemptWindow | None = None
        self._link = link
        self._admitted: asyncio.Future[str] | None = None
        self._next: asyncio.Future[Grant] = link.loop.create_future()
        self._backend = ""
        self._excluded: set[str] = set()
        self._held = False

    async def __aenter__(self) -> RemoteSlot:
        """Admit the job. A job that skipped waiting for its prediction because the pushed
        state said it would start at once is admitted only if it still does (the authority
        decides, atomically); if not, it waits for its prediction and is admitted with it,
        as one process would have done."""
        link = self._link
        if link.gone is not None:
            raise link.gone
        link.slots[self.job.id] = self
        self._held = True
        try:
            refining = self.job.ctx.refining
            if await self._admit(now=refining is not None) == "later":
                await asyncio.wait([refining])  # the prediction (never cancelled from here)
                await self._admit(now=False)
        except GatewayError:
            self._forget()  # refused: the authority holds nothing
            raise
        except asyncio.CancelledError:
            self._exit()
            raise
        return self

    async def _admit(self, *, now: bool) -> str:
        """`admitted`, or `later` (with `now`: the job would not start at once)."""
        self._admitted = self._link.loop.create_future()
        msg = {"op": "admit", "rid": self.job.id, "job": wire.job_fields(self.job)}
        self._link.send({**msg, "now": True} if now else msg)
        return await self._admitted

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._exit()

    async def granted(self) -> Grant:
        if self._link.gone is not None:
            _fail(self._next, self._link.gone)
        return await self._next

    def tokens(self, n: int) -> None:
        job = self.job
        job.generated += n
        if self.review_at is not None and job.generated >= self.review_at:
            self.review_at = None  # until the authority names the next one
            self._link.send({"op": "tokens", "rid": job.id, "generated": job.generated})

    def preemptible(self) -> PreemptWindow:
        self.window = PreemptWindow()
        return self.window

    def ended(self, attempt: Attempt, *, backend_down: bool = False) -> None:
        job = self.job
        self._link.send({"op": "ended", "rid": job.id, "attempt": attempt.value,
                         "down": backend_down, "generated": job.generated})  # fmt: skip
        self.window = None
        if attempt is Attempt.COMPLETED:
            self._forget()  # finished in the authority with this message
            return
        self._next = self._link.loop.create_future()
        if attempt is Attempt.RETRY:  # the authority's rule, decided here too (`ended` is sync)
            self._excluded.add(self._backend)
            pool, model = self._link.pool, job.ctx.call.model
            tried = len(self._excluded)
            if tried > self._link.max_retries or not pool.candidates(model, self._excluded):
                raise UpstreamFailed(f"no backend could serve the request (tried {tried})")

    # -- messages from the authority -------------------------------------------------------

    def on_message(self, msg: wire.Message) -> None:
        op = msg["op"]
        if op in ("admitted", "later"):
            _resolve(self._admitted, op)
            if "grant" in msg:
                self._grant(msg["grant"])
        elif op == "grant":
            self._grant(msg)
        elif op == "error":
            error = wire.rebuild_error(msg["error"])
            waiting = self._admitted if not _settled(self._admitted) else self._next
            _fail(waiting, error)
        elif op == "review":
            self.review_at = msg["review_at"]
            self.tokens(0)  # already past it: report at once
        elif op == "preempt" and (self.window is None or not self.window.preempt()):
            self._link.send({"op": "refused", "rid": self.job.id})

    def lost(self, error: GatewayError) -> None:
        _fail(self._admitted, error)
        _fail(self._next, error)

    def _grant(self, fields: wire.Message) -> None:
        self._backend = fields["backend"]
        self.review_at = fields["review_at"]
        backend = self._link.pool.by_name(self._backend)
        _resolve(self._next, Grant(backend, fields["priority"]))

    def _exit(self) -> None:
        if self._held:
            self._link.send({"op": "finish", "rid": self.job.id, "generated": self.job.generated})
            self._forget()

    def _forget(self) -> None:
        self._held = False
        self._link.slots.pop(self.job.id, None)


if TYPE_CHECKING:

    def _conforms(slot: RemoteSlot) -> Slot:
        return slot  # mypy checks that a RemoteSlot meets the Slot contract


def _settled(future: asyncio.Future[Any] | None) -> bool:
    return future is None or future.done()


def _resolve(future: asyncio.Future[Any] | None, value: Any) -> None:
    if future is not None and not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any] | None, error: BaseException) -> None:
    if future is not None and not future.done():
        future.set_exception(error)
        future.add_done_callback(_retrieved)  # nobody may wait any more (e.g. client gone)


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class RemoteDispatcher(Dispatcher):
    """The dispatcher of a worker: classes, job ids and labels as the local one; the queue
    is the authority's (`slot`, `can_start_now`, `resized`). Its own queue stays empty, so
    the depths it reports are 0 and the authority's are exported instead."""

    def __init__(self, policy: Policy, pool: BackendPool, config: GatewayConfig,
                 link: AuthorityLink) -> None:  # fmt: skip
        super().__init__(policy, pool, config)
        self._link = link

    def slot(self, job: Job) -> RemoteSlot:  # type: ignore[override]
        return RemoteSlot(self._link, job)

    def can_start_now(self, model: str) -> bool:
        return self._link.startable.get(model, False)

    def resized(self, job: Job) -> None:
        if job.id in self._link.slots:
            msg = {"op": "resized", "rid": job.id, "prompt_tokens": job.prompt_tokens}
            chain = job.ctx.token_chain
            self._link.send({**msg, "chain": list(chain)} if chain else msg)


class AuthorityLink:
    """A worker's connection to the authority: messages out, messages in, routed to the
    request's `RemoteSlot` or to the pushed state."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 config: GatewayConfig) -> None:  # fmt: skip
        self.loop = asyncio.get_running_loop()
        self.config = config
        self.max_retries = config.max_retries
        self.slots: dict[int, RemoteSlot] = {}
        self.startable: dict[str, bool] = {}
        self.pool_rows: list[dict[str, Any]] = []
        self._pool: RemotePool | None = None
        self.own_exposition: Callable[[], bytes] = lambda: b""
        self._reader, self._writer = reader, writer
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._sids = itertools.count(1)
        self._lost: list[Callable[[], None]] = []
        self.gone: AuthorityGone | None = None
        """Set once the connection closed: nothing can be admitted or granted any more."""
        self.embedder: Embedder | None = None
        """A loaded embedder for the worker's predictor (tests; None: load the host's)."""
        self._first_pool = self.loop.create_future()
        self._task = asyncio.create_task(self._read(), name="authority-link")

    @classmethod
    async def connect(cls, path: str, index: int, config: GatewayConfig) -> AuthorityLink:
        reader, writer = await asyncio.open_unix_connection(path, limit=wire.LINE_LIMIT)
        link = cls(reader, writer, config)
        link.send({"op": "hello", "worker": index, "pid": os.getpid()})
        await asyncio.wait_for(asyncio.shield(link._first_pool), 30)
        return link

    @property
    def pool(self) -> RemotePool:
        """The pool view (made by `attach`)."""
        assert self._pool is not None, "attach() first"
        return self._pool

    def attach(self, session: aiohttp.ClientSession, policy: Policy,
               config: GatewayConfig) -> tuple[BackendPool, Dispatcher]:  # fmt: skip
        """The pool view and the dispatcher for the worker's app
        (`gateway.serving.app.lifecycle`)."""
        self._pool = pool = RemotePool(config.backends, session, config)
        pool.apply(self.pool_rows)
        return pool, RemoteDispatcher(policy, pool, config, self)

    def send(self, msg: wire.Message) -> None:
        writer = self._writer
        if writer.is_closing():
            return
        writer.write(wire.pack(msg))
        if writer.transport.get_write_buffer_size() > wire.BUFFER_LIMIT:
            log.error("the authority does not read its messages: closing the connection")
            writer.close()

    def ready(self) -> None:
        """The worker listens on the port."""
        self.send({"op": "ready"})

    def on_lost(self, callback: Callable[[], None]) -> None:
        self._lost.append(callback)

    async def host_predictor(self) -> HostPredictor:
        """The worker's view of the host's one predictor (it embeds with the same config)."""
        from gateway.workers.host_predictor import HostPredictor

        return await HostPredictor.build(self, self.embedder)

    async def call(self, what: str, **args: Any) -> Any:
        """Ask the authority for `metrics` (text), `queue` or `backends` (admin views), or
        its predictor's `predictor` (config), `predict` or `global` (`wire` lists them)."""
        sid = next(self._sids)
        future = self._calls[sid] = self.loop.create_future()
        self.send({"op": "call", "sid": sid, "what": what, **args})
        try:
            return await asyncio.wait_for(future, 10)
        finally:
            self._calls.pop(sid, None)

    async def close(self) -> None:
        self._writer.close()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _read(self) -> None:
        try:
            while line := await self._reader.readline():
                self._on(wire.unpack(line))
        except (ConnectionError, ValueError) as exc:
            log.error("authority connection failed: %r", exc)
        finally:
            self._gone()

    def _on(self, msg: wire.Message) -> None:
        op = msg["op"]
        rid = msg.get("rid")
        if rid is not None:
            slot = self.slots.get(rid)
            if slot is not None:
                slot.on_message(msg)
        elif op == "pool":
            self.pool_rows = msg["backends"]
            if self._pool is not None:
                self._pool.apply(self.pool_rows)
            _resolve(self._first_pool, None)
        elif op == "startable":
            self.startable = msg["models"]
        elif op == "scrape":
            text = self.own_exposition().decode()
            self.send({"op": "exposition", "sid": msg["sid"], "text": text})
        elif op == "reply" and "error" in msg:
            _fail(self._calls.get(msg["sid"]), wire.rebuild_error(msg["error"]))
        elif op == "reply":
            _resolve(self._calls.get(msg["sid"]), msg["data"])

    def _gone(self) -> None:
        self.gone = error = AuthorityGone("the gateway's scheduling authority is gone")
        for slot in list(self.slots.values()):
            slot.lost(error)
        for future in self._calls.values():
            _fail(future, error)
        for callback in self._lost:
            callback()


# -- the worker's app --------------------------------------------------------------------


def create_worker_app(
    config: GatewayConfig, link: AuthorityLink, *, embedder: Embedder | None = None
) -> web.Application:
    """The gateway app on the authority's pool, queue and predictor
    (`gateway.serving.app.create_app`, with `/metrics` and the admin views answered by the
    authority). `embedder`: a loaded one for the prompts (tests; else loaded as the host's
    predictor config says)."""
    from gateway.serving.app import REMOTE, STATE, create_app

    link.embedder = embedder
    app = create_app(config)
    app[REMOTE] = link
    app.middlewares.append(worker_routes(link))

    async def expose(app: web.Application) -> AsyncIterator[None]:
        state = app[STATE]
        link.own_exposition = lambda: state.metrics.exposition()[0]
        yield

    app.cleanup_ctx.append(expose)
    return app


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def worker_routes(link: AuthorityLink) -> Any:
    """Middleware: `/metrics` from the authority (every process's series, summed);
    `/admin/queue` with the authority's one queue (and its workers) once the app's own handler
    let the caller in; `/admin/backends` from the pool view refreshed from the authority."""
    from gateway.observability.metrics import CONTENT_TYPE

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "GET":
            return await handler(request)
        if request.path == "/metrics":
            text = await link.call("metrics")
            return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})
        if request.path == "/admin/backends":
            link.pool.apply(await link.call("backends"))
        response = await handler(request)
        if request.path == "/admin/queue" and response.status == 200:
            return web.json_response(await link.call("queue"))
        return response

    return middleware
