"""The host's scheduling authority (`serve --workers N`): one queue per model for N workers.

It owns what must be one per host: the backend pool (health checks, model discovery, the
self-tuning cap's scrapes, in-flight accounting) and the dispatcher (one `policies.Scheduler`
per model), so the policy orders all of the host's traffic as one process would. Workers
connect over a Unix-domain socket (`gateway.workers.wire` lists the messages) and hold each of their
requests' slots here: the authority drives one `LocalSlot` per remote request, exactly as
the relay drives one in a single process, and turns what happens to it into messages: the
grant, the next review point, a preemption, a timeout or shed error.

A worker's connection closing (the worker died or stopped) finishes every job it held, so
their queue places and backend slots come back at once. The authority also pushes the pool's
state (health, models, caps) and, per model, whether a job could start at once (a worker
decides from it whether a new request waits for its prediction), and answers the workers'
`/metrics` (its own series merged with every worker's, `metrics.merge_expositions`) and
admin views. Everything runs on one event loop; state changes are synchronous.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import aiohttp

from gateway.config import GatewayConfig
from gateway.errors import GatewayError
from gateway.observability.metrics import GatewayMetrics, RequestTrace, merge_expositions
from gateway.prediction.predict import Prediction
from gateway.scheduling.backends import BackendPool
from gateway.scheduling.dispatcher import Dispatcher, LocalSlot
from gateway.scheduling.slot import Attempt, Grant, PreemptWindow
from gateway.serving.openai_api import Call
from gateway.workers import wire
from policies import Job, parse_policy
from policies.routing import parse_router

if TYPE_CHECKING:
    from predictor import LengthPredictor

log = logging.getLogger("sagesched.authority")

POOL_PUSH_S = 0.25
"""How often the pool's state is compared with what the workers last got (sent on change)."""
SCRAPE_TIMEOUT_S = 2.0
"""A worker that does not answer a metrics scrape within this is left out of that scrape."""
REQUEST_OPS = frozenset({"admit", "tokens", "ended", "finish", "resized", "refused"})
"""Worker messages about one request (what `messages` counts per request)."""


class RemoteWindow(PreemptWindow):
    """The authority's stand-in for a worker's `PreemptWindow`: open from a grant until the
    attempt ends; `preempt()` sends the preemption to the worker, which stops its relay (or,
    when its own window is not open, answers `refused` and this one opens again)."""

    def __init__(self, send: Any) -> None:
        super().__init__()
        self._send = send

    @property
    def open(self) -> bool:
        return not self.requested

    def preempt(self) -> bool:
        if self.requested:
            return False
        self.requested = True
        self._send()
        return True


class _Held:
    """One remote request's slot, held for a worker."""

    __slots__ = ("rid", "slot", "waiter")

    def __init__(self, rid: int, slot: LocalSlot) -> None:
        self.rid = rid
        self.slot = slot
        self.waiter: asyncio.Task[None] | None = None


class WorkerConn:
    """One worker's connection and the requests it holds."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.index = -1
        self.pid = 0
        self.ready = False
        self.held: dict[int, _Held] = {}
        self.admitted = 0
        self.received: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()
        self.exposition = b""
        """The worker's series at its last scrape (kept when it goes)."""

    def send(self, msg: wire.Message) -> None:
        writer = self.writer
        if writer.is_closing():
            return
        self.sent[msg["op"]] += 1
        writer.write(wire.pack(msg))
        if writer.transport.get_write_buffer_size() > wire.BUFFER_LIMIT:
            log.error("worker %d does not read its messages: dropping it", self.index)
            writer.close()

    def describe(self) -> dict[str, Any]:
        return {"index": self.index, "pid": self.pid, "ready": self.ready,
                "admitted": self.admitted, "holding": len(self.held),
                "received": dict(self.received), "sent": dict(self.sent)}  # fmt: skip


class Authority:
    """The pool, the dispatcher and the workers' connections (paired `start` / `stop`)."""

    def __init__(self, config: GatewayConfig, *, predictor: LengthPredictor | None = None) -> None:
        """`predictor`: a loaded one for the host (tests; else loaded as the config says)."""
        self.config = config
        self._given = predictor
        self.metrics = GatewayMetrics()
        self.workers: list[WorkerConn] = []
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._changed = asyncio.Event()
        self._startable: dict[str, bool] = {}
        self._flush_soon = False
        self._pool_state: list[dict[str, Any]] = []
        self._scrapes: dict[int, tuple[int, list[bytes], asyncio.Future[None]]] = {}
        self._retired = b""
        """Counters and histograms of workers that are gone, at their last scrape: a
        restarted worker counts from zero, and the sum must not fall back."""
        self._sids = iter(range(1, 1 << 62))
        self.prediction: Prediction | None = None
        """The host's one predictor (made at `start`)."""

    async def start(self, path: str) -> None:
        config = self.config
        policy = parse_policy(config.policy)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        )
        self.pool = BackendPool(config.backends, self._session,
                                health_interval_s=config.health_interval_s,
                                adaptive=config.adaptive_cap,
                                memory_path=config.adaptive_cap.memory_file(
                                    config.predictor.snapshot_path),
                                router=parse_router(config.routing))  # fmt: skip
        self.dispatcher = Dispatcher(policy, self.pool, config)
        self.metrics.declare_classes(config.classes.list, config.classes.tenant_labels)
        self.metrics.watch(self.pool, self.dispatcher)
        self.metrics.watch_engine_shares(self.dispatcher)
        # the host's one predictor: the workers embed, it predicts, learns and snapshots
        self.prediction = prediction = Prediction(
            config, self.dispatcher, given=self._given, embeds=False
        )
        await prediction.start()
        if prediction.shared is not None:
            self.metrics.watch_shared_learning(prediction.shared.stats)
        self.pool.listen(self._soon)
        await self.pool.start()
        self._server = await asyncio.start_unix_server(self._serve, path, limit=wire.LINE_LIMIT)
        os.chmod(path, 0o600)  # only this user's processes may hold slots
        self._tasks.append(asyncio.create_task(self._push_pool(), name="authority-pool"))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.workers):
            await self._drop(conn)
            conn.writer.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        if self.prediction is not None:
            await self.prediction.stop()  # learns what the workers sent last, then saves
        if self._session is not None:
            await self.pool.stop()
            await self._session.close()

    async def wait_workers(self, n: int, timeout_s: float) -> bool:
        """Until `n` workers are listening (True) or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while sum(c.ready for c in self.workers) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return True

    # -- connections ------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = WorkerConn(writer)
        self.workers.append(conn)
        try:
            while line := await reader.readline():
                msg = wire.unpack(line)
                conn.received[wire.kind(msg)] += 1
                try:
                    await self._handle(conn, msg)
                except Exception:  # a bug with one request must not drop the worker's others
                    log.exception("authority: failed on %s from worker %d", msg["op"], conn.index)
                    if "rid" in msg:
                        error = wire.error_fields(GatewayError("internal error in the gateway"))
                        conn.send({"op": "error", "rid": msg["rid"], "error": error})
                self._soon()
        except (ConnectionError, ValueError) as exc:
            log.warning("worker %d: connection failed: %r", conn.index, exc)
        finally:
            if conn.held:
                log.warning("worker %d (pid %d) gone: finishing its %d requests", conn.index,
                            conn.pid, len(conn.held))  # fmt: skip
            await self._drop(conn)
            writer.close()
            self._changed.set()

    async def _drop(self, conn: WorkerConn) -> None:
        """Finish every request of a worker that is gone (their backend slots come back)."""
        for held in list(conn.held.values()):
            await self._release(conn, held)
        if conn in self.workers:
            self.workers.remove(conn)
            if conn.exposition:
                self._retired = merge_expositions(b"", [self._retired, conn.exposition])

    async def _handle(self, conn: WorkerConn, msg: wire.Message) -> None:
        op = msg["op"]
        if op in REQUEST_OPS:
            held = conn.held.get(msg["rid"])
            if op == "admit":
                await self._admit(conn, msg)
            elif held is not None:
                await self._request(conn, held, op, msg)
        elif op == "hello":
            conn.index, conn.pid = msg["worker"], msg["pid"]
            conn.send({"op": "pool", "backends": self._pool_rows()})
            conn.send({"op": "startable", "models": self._startable_now()})
        elif op == "ready":
            conn.ready = True
            self._changed.set()
        elif op == "call":
            asyncio.create_task(self._answer(conn, msg))  # noqa: RUF006 - short, self-ending
        elif op == "learn" and self.prediction is not None:
            self.prediction.learn_embedded(msg["model"], wire.vector_of(msg["vector"]),
                                           msg["prompt_tokens"], msg["output_tokens"])  # fmt: skip
        elif op == "exposition":
            self._scraped(conn, msg)

    # -- requests ---------------------------------------------------------------------

    async def _admit(self, conn: WorkerConn, msg: wire.Message) -> None:
        """Queue a worker's job; with `now`, only if it starts at once (the worker skipped
        its prediction on a pushed state that may be stale by the time the job arrives):
        otherwise `later`, and the worker sends it again with its prediction."""
        rid = msg["rid"]
        if msg.get("now") and not self.dispatcher.can_start_now(msg["job"]["model"]):
            conn.send({"op": "later", "rid": rid})
            return
        slot = self.dispatcher.slot(self._job(msg["job"]))
        try:
            await slot.__aenter__()
        except GatewayError as exc:
            conn.send({"op": "error", "rid": rid, "error": wire.error_fields(exc)})
            return
        held = conn.held[rid] = _Held(rid, slot)
        conn.admitted += 1
        reply: wire.Message = {"op": "admitted", "rid": rid}
        future = slot.future
        if future is not None and future.done() and future.exception() is None:
            reply["grant"] = self._granted(conn, held, future.result())
        else:
            held.waiter = asyncio.create_task(self._wait_grant(conn, held))
        conn.send(reply)

    def _job(self, fields: wire.Message) -> Job:
        """The worker's job as this dispatcher's: its class, sizes, prediction and arrival."""
        klass = self.dispatcher.classes.by_name[fields["klass"]]
        # a stub of the client's call: the scheduler reads the model, the kind and whether a
        # stream can be resumed (`Call.continuable` reads the body's `n` and `prompt`)
        body: dict[str, Any] = {"prompt": ""} if fields["continuable"] else {"n": 0}
        call = Call(kind=fields["kind"], body=body, model=fields["model"],
                    stream=fields["stream"], wants_usage=False, max_tokens=fields["max_tokens"],
                    priority=0, prompt_text="", tenant=fields["tenant"])  # fmt: skip
        trace = RequestTrace(model=call.model, arrived=fields["arrival"],
                             policy=self.dispatcher.label)  # fmt: skip
        job = self.dispatcher.new_job(call, trace, wire.dist_of(fields), klass, fields["session"])
        job.prompt_tokens = fields["prompt_tokens"]
        job.prefix, job.block_tokens = tuple(fields["prefix"]), fields["block_tokens"]
        job.rank_score = fields["rank_score"]
        return job

    def _granted(self, conn: WorkerConn, held: _Held, grant: Grant) -> wire.Message:
        """A grant as sent; the slot's window now forwards preemptions to the worker."""
        rid = held.rid
        held.slot.window = RemoteWindow(lambda: conn.send({"op": "preempt", "rid": rid}))
        return {"backend": grant.backend.name, "priority": grant.priority,
                "review_at": held.slot.review_at}  # fmt: skip

    async def _wait_grant(self, conn: WorkerConn, held: _Held) -> None:
        try:
            grant = await held.slot.granted()
        except GatewayError as exc:
            conn.send({"op": "error", "rid": held.rid, "error": wire.error_fields(exc)})
            return
        finally:
            held.waiter = None
        conn.send({"op": "grant", "rid": held.rid, **self._granted(conn, held, grant)})
        self._soon()

    async def _request(self, conn: WorkerConn, held: _Held, op: str, msg: wire.Message) -> None:
        slot = held.slot
        if "generated" in msg and slot.backend is not None:
            new = msg["generated"] - slot.job.generated
            if new > 0:
                slot.tokens(new)
        if op == "tokens":
            conn.send({"op": "review", "rid": held.rid, "review_at": slot.review_at})
        elif op == "ended":
            self._ended(conn, held, Attempt(msg["attempt"]), bool(msg.get("down")))
        elif op == "finish":
            await self._release(conn, held)
        elif op == "resized":
            slot.job.prompt_tokens = msg["prompt_tokens"]
            if msg.get("chain"):  # the prompt's token chain: exact prefix matching
                slot.job.ctx.token_chain = tuple(msg["chain"])
            self.dispatcher.resized(slot.job)
        elif op == "refused" and isinstance(slot.window, RemoteWindow):
            slot.window.requested = False  # the worker was not streaming: not a preemption
            key = (slot.job.ctx.call.model, slot.backend.name if slot.backend else "")
            if self.dispatcher.preemptions.get(key, 0) > 0:
                self.dispatcher.preemptions[key] -= 1

    def _ended(self, conn: WorkerConn, held: _Held, attempt: Attempt, down: bool) -> None:
        try:
            held.slot.ended(attempt, backend_down=down)
        except GatewayError as exc:  # retries used up: the worker raises it too
            conn.send({"op": "error", "rid": held.rid, "error": wire.error_fields(exc)})
            return
        if attempt is Attempt.COMPLETED:
            conn.held.pop(held.rid, None)
            return
        future = held.slot.future
        if future is not None and future.done() and future.exception() is None:
            conn.send({"op": "grant", "rid": held.rid,
                       **self._granted(conn, held, future.result())})  # fmt: skip
        else:
            held.waiter = asyncio.create_task(self._wait_grant(conn, held))

    async def _release(self, conn: WorkerConn, held: _Held) -> None:
        """The request is over: the slot's exit finishes it (idempotent)."""
        conn.held.pop(held.rid, None)
        if held.waiter is not None:
            held.waiter.cancel()
        await held.slot.__aexit__(None, None, None)

    # -- state pushed to the workers ----------------------------------------------------

    def _soon(self) -> None:
        """Send the per-model start-at-once state after this loop iteration, if it changed."""
        if not self._flush_soon:
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_soon = False
        now = self._startable_now()
        if now != self._startable:
            self._startable = now
            for conn in self.workers:
                conn.send({"op": "startable", "models": now})

    def _startable_now(self) -> dict[str, bool]:
        models = {m for b in self.pool.backends for m in b.models}
        return {m: self.dispatcher.can_start_now(m) for m in sorted(models)}

    def _pool_rows(self) -> list[dict[str, Any]]:
        return [{"name": b.name, "healthy": b.healthy, "models": sorted(b.models),
                 "cards": b.discovered, "cap": b.cap, "inflight": b.inflight,
                 "event_block": b.events.cache.block_size if b.events and b.events.exact
                 else None}
                for b in self.pool.backends]  # fmt: skip

    async def _push_pool(self) -> None:
        while True:
            rows = self._pool_rows()
            if rows != self._pool_state:
                self._pool_state = rows
                for conn in self.workers:
                    conn.send({"op": "pool", "backends": rows})
                self._soon()
            await asyncio.sleep(POOL_PUSH_S)

    # -- calls: metrics and admin views ---------------------------------------------------

    async def _answer(self, conn: WorkerConn, msg: wire.Message) -> None:
        try:
            data = await self._data(msg)
        except Exception as exc:
            log.exception("authority: failed on a %s call from worker %d", msg["what"],
                          conn.index)  # fmt: skip
            error = exc if isinstance(exc, GatewayError) else GatewayError("internal error")
            conn.send({"op": "reply", "sid": msg["sid"], "error": wire.error_fields(error)})
            return
        conn.send({"op": "reply", "sid": msg["sid"], "data": data})

    async def _data(self, msg: wire.Message) -> Any:
        """The answer to a worker's call (`wire` lists them)."""
        what = msg["what"]
        if what in ("predictor", "predict", "global"):
            return await self._predictor_data(msg)
        if what == "metrics":
            return (await self.exposition()).decode()
        if what == "queue":
            d = self.dispatcher
            return {"policy": d.label, "waiting": d.waiting(), "jobs": d.snapshot(),
                    "running": d.running_snapshot(),
                    "workers": [c.describe() for c in self.workers]}  # fmt: skip
        return self._pool_rows()

    async def _predictor_data(self, msg: wire.Message) -> Any:
        """A worker's call to the host's predictor: its config, a prediction, the global
        distribution."""
        prediction = self.prediction
        local = None if prediction is None else prediction.local
        if prediction is None or local is None:
            raise GatewayError("the gateway's predictor is off")
        what = msg["what"]
        if what == "predictor":
            return local.config.to_dict()
        if what == "predict":
            dist, rank = await prediction.predict_embedded(
                wire.vector_of(msg["vector"]), msg["prompt_tokens"], msg["max_tokens"],
                msg["model"])  # fmt: skip
            return {**wire.dist_field(dist), "rank_score": rank}
        return wire.dist_field(local.global_dist(msg["prompt_tokens"], model=msg["model"]))

    async def exposition(self) -> bytes:
        """This process's series merged with every worker's (those answering in time)."""
        sid = next(self._sids)
        ready = [c for c in self.workers if c.ready]
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        texts: list[bytes] = []
        self._scrapes[sid] = (len(ready), texts, done)
        for conn in ready:
            conn.send({"op": "scrape", "sid": sid})
        if ready:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(done), SCRAPE_TIMEOUT_S)
        self._scrapes.pop(sid, None)
        return merge_expositions(self.metrics.exposition()[0], [*texts, self._retired])

    def _scraped(self, conn: WorkerConn, msg: wire.Message) -> None:
        conn.exposition = msg["text"].encode()
        entry = self._scrapes.get(msg["sid"])
        if entry is None:
            return
        wanted, texts, done = entry
        texts.append(conn.exposition)
        if len(texts) >= wanted and not done.done():
            done.set_result(None)
