"""A served gateway process: its sites, its stop signal and its drain, in one place.

`sagesched serve` (one process) and each worker of `serve --workers N` run their app here:
the main address (and the admin address when `admin_listen` is set) served through
`security.GuardedRunner` (parser limits, header deadline, keep-alive timeout), until `stop`
is set; then `runner.cleanup()` closes the listeners, runs the SIGTERM drain
(`gateway.serving.drain`, an `on_shutdown` hook) and the app's cleanup (the predictor snapshot).
aiohttp's `run_app` is not used: it builds its own runner, which cannot carry the header
deadline.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

from aiohttp import web

from gateway.config import GatewayConfig
from gateway.serving.drain import CUT_S
from gateway.serving.security import GuardedRunner, admin_socket

log = logging.getLogger("sagesched.gateway")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def serve_until(
    app: web.Application,
    config: GatewayConfig,
    stop: asyncio.Event,
    *,
    reuse_port: bool = False,
    ready: Callable[[], None] | None = None,
) -> None:
    """Serve `app` until `stop` is set, then drain and clean up. `reuse_port`: several
    processes share the addresses (workers). `ready` is called once both addresses listen."""
    from gateway.serving.app import ADMIN

    runner = GuardedRunner(
        app, config, handler_cancellation=True, access_log=None, shutdown_timeout=CUT_S
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port, backlog=1024, reuse_port=reuse_port)
        await site.start()
        admin = admin_socket(config, app[ADMIN], reuse_port=reuse_port)
        if admin is not None:
            log.info("admin routes on http://%s only", config.admin_listen)
            await web.SockSite(runner, admin).start()
        if ready is not None:
            ready()
        await stop.wait()
        log.info("stopping: draining")
    finally:
        await runner.cleanup()  # stops accepting, drains (`gateway.serving.drain`), then cleanup


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set `stop` (a second one while draining changes nothing: SIGKILL
    ends a process at once)."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
