"""`sagesched serve --workers N`: N relay processes on one port, one scheduling authority.

Why: one Python process relays a few thousand short streams per second on one core; the
byte relay, the SSE parsing and the predictor's embeddings spread over processes, but the
queue must not: N independent queues would each order only their own share of the traffic
(docs/gateway.md "Worker processes"). So the parent process is the host's scheduling
authority (`gateway.workers.authority`: the backend pool with its health checks and self-tuning
caps, and the dispatcher with one queue per model), and it supervises N workers:

- each worker is *spawned* (a fresh interpreter, never a fork of a process whose event loop
  runs) and runs the aiohttp app with `reuse_port=True` on the configured port, so the kernel
  spreads connections over the workers (SO_REUSEPORT); the parent never listens on it;
- a worker reaches the authority over one Unix-domain socket with per-request messages
  (`gateway.workers.remote`), never per token;
- a worker that dies is restarted (at most once a second per slot); the authority sees its
  connection close and finishes all its jobs, so their backend slots come back;
- SIGTERM or SIGINT to the parent: every worker stops accepting and drains its in-flight
  streams (up to `shutdown_grace_s`, then ends the rest cleanly: `gateway.serving.drain`) and
  exits; then the authority stops, learning the workers' last completions and saving the one
  predictor snapshot; exit status 0;
- SIGHUP to the parent is forwarded to every worker, and each reloads its keys from the
  config's source (`gateway.serving.drain.reload_keys`); the parent itself checks no key.

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
from gateway.prediction import memory
from gateway.serving.drain import CUT_S, KeySource

log = logging.getLogger("sagesched.workers")

EXIT_SLACK_S = 30.0
"""Beyond a worker's own bound (grace, cut, aiohttp's backstop) before it is killed: the
predictor snapshot save and the interpreter's exit."""
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


def serve(config: GatewayConfig, source: KeySource | None = None) -> int:
    """Run the authority and `config.workers` workers until SIGTERM/SIGINT; the exit status.
    `source`: where the workers re-read their keys on SIGHUP (None: SIGHUP is ignored)."""
    with event_loop() as runner:
        return runner.run(_parent(config, source))


def event_loop() -> asyncio.Runner:
    """The loop a served process runs on: uvloop when it is installed. Caps the process's
    malloc arenas first (`memory.limit_malloc_arenas`), before any thread starts."""
    memory.limit_malloc_arenas()
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


async def _parent(config: GatewayConfig, source: KeySource | None = None) -> int:
    from gateway.workers.authority import Authority

    folder = tempfile.mkdtemp(prefix="sagesched-")
    path = os.path.join(folder, SOCKET_NAME)
    authority = Authority(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    slots = [_Slot(i) for i in range(config.workers)]
    loop.add_signal_handler(signal.SIGHUP, _forward, slots, signal.SIGHUP)
    try:
        await authority.start(path)
        for slot in slots:
            _spawn(config, path, slot, source)
        if not await _all_ready(authority, slots, stop):
            return 0 if stop.is_set() else 1  # a stop signal while starting is no failure
        log.info("listening on http://%s:%d with %d workers", config.host, config.port,
                 config.workers)  # fmt: skip
        await _supervise(config, path, slots, stop, source)
        return 0
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
        await _stop_workers(slots, config.shutdown_grace_s + 2 * CUT_S + EXIT_SLACK_S)
        await authority.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        shutil.rmtree(folder, ignore_errors=True)


def _forward(slots: list[_Slot], sig: int) -> None:
    """Send `sig` to every live worker (SIGHUP: each reloads its keys)."""
    for s in slots:
        if s.process is not None and s.process.pid and not s.exited.is_set():
            with contextlib.suppress(ProcessLookupError):
                os.kill(s.process.pid, sig)


def _spawn(config: GatewayConfig, path: str, slot: _Slot, source: KeySource | None) -> None:
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=worker_main, args=(config, path, slot.index, source),
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
                     stop: asyncio.Event, source: KeySource | None) -> None:  # fmt: skip
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
            _spawn(config, path, slot, source)


async def _stop_workers(slots: list[_Slot], bound_s: float) -> None:
    """SIGTERM to every live worker (each drains), then wait; SIGKILL after `bound_s`."""
    live = [s for s in slots if s.process is not None and not s.exited.is_set()]
    for s in live:
        assert s.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(s.process.pid or 0, signal.SIGTERM)
    if not live:
        return
    waits = [asyncio.ensure_future(s.exited.wait()) for s in live]
    _, pending = await asyncio.wait(waits, timeout=bound_s)
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


def worker_main(
    config: GatewayConfig, path: str, index: int, source: KeySource | None = None
) -> None:
    """A worker's entry point (a spawned process): connect to the authority, serve the app on
    the shared port until SIGTERM/SIGINT, drain, exit. SIGHUP reloads the keys from `source`
    (ignored until the app runs: SIGHUP's default action would end the process)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s[w{index}]: %(message)s",
    )
    with event_loop() as runner:
        runner.run(_worker(worker_config(config, index), path, index, source))


def worker_config(config: GatewayConfig, index: int) -> GatewayConfig:
    """Worker `index`'s config. The host has one predictor, the authority's: it loads the
    snapshot or warm start, learns every worker's completions, saves the snapshot and shares
    with other replicas, so a worker has none of those files or connections (it embeds its
    requests' prompts and asks the authority, `gateway.workers.host_predictor`). The files a
    worker writes are its own: its traffic capture goes to `<capture.dir>/worker-<index>`."""
    predictor = dataclasses.replace(config.predictor, snapshot_path=None, warm_start_jsonl=None)
    capture = config.capture
    if capture.dir is not None:
        capture = dataclasses.replace(capture, dir=os.path.join(capture.dir, f"worker-{index}"))
    shared = dataclasses.replace(config.shared_learning, redis_url=None)
    return dataclasses.replace(config, predictor=predictor, capture=capture,
                               shared_learning=shared)  # fmt: skip


async def _worker(config: GatewayConfig, path: str, index: int, source: KeySource | None) -> None:
    from gateway.serving.app import KEY_SOURCE
    from gateway.serving.server import serve_until, stop_on_signals
    from gateway.workers.remote import AuthorityLink, create_worker_app

    link = await AuthorityLink.connect(path, index, config)
    stop = asyncio.Event()
    stop_on_signals(stop)
    link.on_lost(stop.set)  # no authority, no scheduling: stop (the parent is gone)
    app = create_worker_app(config, link)
    if source is not None:
        app[KEY_SOURCE] = source
    try:
        await serve_until(app, config, stop, reuse_port=True, ready=link.ready)
    finally:
        await link.close()
