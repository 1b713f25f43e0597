"""`sagesched serve --workers N`: N relay processes on one port, one scheduling authority.

Why: one Python process relays a few thousand short streams per second on one core; the
byte relay, the SSE parsing and the predictor's embeddings spread over processes, but the
queue must not: N independent queues would each order only their own share of the traffic
(docs/gateway.md "Worker processes"). So the parent process is the host's scheduling
authority (`gateway.authority`: the backend pool with its health checks and self-tuning
caps, and the dispatcher with one queue per model), and it supervises N workers:

- each worker is *spawned* (a fresh interpreter, never a fork of a process whose event loop
  runs) and runs the aiohttp app with `reuse_port=True` on the configured port, so the kernel
  spreads connections over the workers (SO_REUSEPORT); the parent never listens on it;
- a worker reaches the authority over one Unix-domain socket with per-request messages
  (`gateway.remote`), never per token;
- a worker that dies is restarted (at most once a second per slot); the authority sees its
  connection close and finishes all its jobs, so their backend slots come back;
- SIGTERM or SIGINT to the parent: every worker stops accepting and drains its in-flight
  streams (up to `DRAIN_S`), then the authority stops; exit status 0.

`--workers 1` does not come here: one process does everything, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

from gateway.config import GatewayConfig

log = logging.getLogger("sagesched.workers")

DRAIN_S = 60.0
"""In-flight streams a stopping worker waits for (aiohttp's shutdown timeout)."""
READY_TIMEOUT_S = 300.0
"""A starting worker must listen within this (it loads the predictor's model first)."""
RESTART_DELAY_S = 1.0
"""Least time between two starts of one worker slot (a crash loop costs no more)."""
SOCKET_NAME = "authority.sock"


@dataclass
class _Slot:
    """One worker position (its index is stable across restarts)."""

    index: int
    process: BaseProcess | None = None
    started: float = 0.0
    restarts: int = 0
    exited: asyncio.Event = field(default_factory=asyncio.Event)


def serve(config: GatewayConfig) -> int:
    """Run the authority and `config.workers` workers until SIGTERM/SIGINT; the exit status."""
    runner = _runner()
    with runner:
        return runner.run(_parent(config))


def _runner() -> asyncio.Runner:
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


async def _parent(config: GatewayConfig) -> int:
    from gateway.authority import Authority

    folder = tempfile.mkdtemp(prefix="sagesched-")
    path = os.path.join(folder, SOCKET_NAME)
    authority = Authority(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    slots = [_Slot(i) for i in range(config.workers)]
    try:
        await authority.start(path)
        for slot in slots:
            _spawn(config, path, slot)
        if not await _all_ready(authority, slots, stop):
            return 0 if stop.is_set() else 1  # a stop signal while starting is no failure
        log.info("listening on http://%s:%d with %d workers", config.host, config.port,
                 config.workers)  # fmt: skip
        await _supervise(config, path, slots, stop)
        return 0
    finally:
        await _stop_workers(slots)
        await authority.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        shutil.rmtree(folder, ignore_errors=True)


def _spawn(config: GatewayConfig, path: str, slot: _Slot) -> None:
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=worker_main, args=(config, path, slot.index),
                       name=f"sagesched-worker-{slot.index}", daemon=True)  # fmt: skip
    proc.start()
    slot.process, slot.started = proc, time.monotonic()
    slot.exited = asyncio.Event()
    loop = asyncio.get_running_loop()
    sentinel = proc.sentinel

    def gone() -> None:
        loop.remove_reader(sentinel)
        slot.exited.set()

    loop.add_reader(sentinel, gone)


async def _all_ready(authority: Any, slots: list[_Slot], stop: asyncio.Event) -> bool:
    """Wait until every worker listens; False if one exits first, or on a stop signal."""
    ready = asyncio.ensure_future(authority.wait_workers(len(slots), READY_TIMEOUT_S))
    died = [asyncio.ensure_future(s.exited.wait()) for s in slots]
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([ready, stopped, *died], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for f in (stopped, *died):
            f.cancel()
    if not ready.done():
        ready.cancel()
        for s in slots:
            if s.exited.is_set() and s.process is not None:
                log.error("worker %d exited with %s before listening", s.index,
                          s.process.exitcode)  # fmt: skip
        return False
    if not ready.result():
        log.error("workers not listening after %.0f s", READY_TIMEOUT_S)
        return False
    return True


async def _supervise(config: GatewayConfig, path: str, slots: list[_Slot],
                     stop: asyncio.Event) -> None:  # fmt: skip
    """Restart workers that die, until a stop signal."""
    while not stop.is_set():
        waits = {asyncio.ensure_future(s.exited.wait()): s for s in slots}
        stopped = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait([stopped, *waits], return_when=asyncio.FIRST_COMPLETED)
        for f in (stopped, *waits):
            f.cancel()
        if stop.is_set():
            return
        for future, slot in waits.items():
            if future not in done:
                continue
            assert slot.process is not None
            code = slot.process.exitcode
            delay = max(0.0, slot.started + RESTART_DELAY_S - time.monotonic())
            log.warning("worker %d (pid %s) exited with %s; restarting in %.1f s", slot.index,
                        slot.process.pid, code, delay)  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            if stop.is_set():
                return
            slot.restarts += 1
            _spawn(config, path, slot)


async def _stop_workers(slots: list[_Slot]) -> None:
    """SIGTERM to every live worker (each drains), then wait; SIGKILL after the drain time."""
    live = [s for s in slots if s.process is not None and not s.exited.is_set()]
    for s in live:
        assert s.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(s.process.pid or 0, signal.SIGTERM)
    if not live:
        return
    waits = [asyncio.ensure_future(s.exited.wait()) for s in live]
    _, pending = await asyncio.wait(waits, timeout=DRAIN_S + 10)
    for s, f in zip(live, waits, strict=True):
        if f in pending:
            assert s.process is not None
            log.warning("worker %d did not drain in time; killing it", s.index)
            s.process.kill()
        f.cancel()
    for s in live:
        assert s.process is not None
        await asyncio.to_thread(s.process.join, 5)


# -- the worker process -------------------------------------------------------------------


def worker_main(config: GatewayConfig, path: str, index: int) -> None:
    """A worker's entry point (a spawned process): connect to the authority, serve the app on
    the shared port until SIGTERM/SIGINT, drain, exit."""
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s[w{index}]: %(message)s",
    )
    runner = _runner()
    with runner:
        runner.run(_worker(worker_config(config, index), path, index))


def worker_config(config: GatewayConfig, index: int) -> GatewayConfig:
    """Worker `index`'s config: the files a worker writes are its own. Its traffic capture
    goes to `<capture.dir>/worker-<index>`; worker 0 keeps the predictor snapshot, worker i > 0
    saves to `<snapshot_path>.worker-<i>` (the first time starting from worker 0's), so no
    two processes write one file. A configured shared-learning replica id gets the suffix
    `-worker-<index>`, so the workers of one host learn each other's completions too."""
    predictor, capture = config.predictor, config.capture
    path = predictor.snapshot_path
    if path and index > 0:
        own = f"{path}.worker-{index}"
        if not os.path.exists(own) and os.path.exists(path):
            shutil.copyfile(path, own)
        predictor = dataclasses.replace(predictor, snapshot_path=own)
    if capture.dir is not None:
        capture = dataclasses.replace(capture, dir=os.path.join(capture.dir, f"worker-{index}"))
    shared = config.shared_learning
    if shared.replica_id:  # a replica skips its own records: the workers must differ
        shared = dataclasses.replace(shared, replica_id=f"{shared.replica_id}-worker-{index}")
    return dataclasses.replace(config, predictor=predictor, capture=capture,
                               shared_learning=shared)  # fmt: skip


async def _worker(config: GatewayConfig, path: str, index: int) -> None:
    from aiohttp import web

    from gateway.app import ADMIN
    from gateway.remote import AuthorityLink, create_worker_app
    from gateway.security import admin_socket, server_limits

    link = await AuthorityLink.connect(path, index, config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    link.on_lost(stop.set)  # no authority, no scheduling: stop (the parent is gone)
    app = create_worker_app(config, link)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=DRAIN_S, **server_limits(config))  # fmt: skip
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port, backlog=1024, reuse_port=True)
        await site.start()
        admin = admin_socket(config, app[ADMIN], reuse_port=True)
        if admin is not None:
            await web.SockSite(runner, admin).start()
        link.ready()
        await stop.wait()
        log.info("worker %d draining", index)
    finally:
        await runner.cleanup()  # stops accepting, waits for in-flight handlers, then cleanup
        await link.close()
