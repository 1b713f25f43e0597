"""Stopping and reloading a running gateway: the SIGTERM drain and the SIGHUP key reload.

SIGTERM (aiohttp's `run_app`, or a worker's own runner): the listening sockets close at once
(new connections are refused), idle keep-alive connections close, then `Drain.run` (an
`on_shutdown` hook) waits up to `shutdown_grace_s` for every request in flight. A request
still running at the end of the grace is *cut*: its handler task is cancelled with a marker,
and `_counted` (gateway.serving.app) ends it cleanly, a started stream with an SSE error event
`shutting_down` then `[DONE]`, a request not yet answered with a 503 JSON error. Either way
it is counted once, outcome `shutdown` with code 503 (an operator's stop, not an upstream
fault: the error-rate rules skip it). Only then does aiohttp's own
shutdown run, with nothing left to wait for, and the app's cleanup saves the predictor
snapshot (after the last completions were learned).

Why not aiohttp's `shutdown_timeout` alone: on timeout it cancels the handler and closes the
connection, so a stream ends without any end event and is counted as a client disconnect.

SIGHUP (`KeySource`, `reload_keys`): the config file and environment the gateway started
with are read again and only the keys are applied — `api_keys`, `admin_key` and each class's
`api_keys` — to requests that arrive afterwards; streams in flight are not touched. An invalid
config keeps the old keys and logs the error (never a key).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from gateway.config import ConfigError, GatewayConfig, load

log = logging.getLogger("sagesched.gateway")

CUT_S = 5.0
"""After the grace: how long cut requests get to write their last event and settle (also
aiohttp's own per-connection shutdown timeout, a backstop that then finds nothing to wait
for). A process therefore exits within `shutdown_grace_s` + `CUT_S` + the snapshot save."""
CUT_MESSAGE = "sagesched: shutting down"
"""The cancellation message of a cut request (tells a cut from a client disconnect)."""
RELOADED = ("api_keys", "admin_key")
"""Top-level config fields SIGHUP applies (plus `classes.list[*].api_keys`)."""


@dataclass
class Drain:
    """The requests in flight (their handler tasks) and the shutdown that waits for them."""

    draining: bool = False
    """True from SIGTERM on: `/ready` answers 503."""
    active: set[asyncio.Task[Any]] = field(default_factory=set)
    cut: set[asyncio.Task[Any]] = field(default_factory=set)
    """Tasks cancelled because the grace ran out (`was_cut`)."""

    def was_cut(self, task: asyncio.Task[Any] | None) -> bool:
        return task is not None and task in self.cut

    async def run(self, grace_s: float) -> tuple[int, int]:
        """Wait up to `grace_s` for the requests in flight, then cut the rest and wait up to
        `CUT_S` for them to end. Returns (finished in the grace, cut)."""
        self.draining = True
        start, deadline = len(self.active), time.monotonic() + grace_s
        log.info("draining: %d requests in flight, grace %.0f s", start, grace_s)
        while self.active and (left := deadline - time.monotonic()) > 0:
            await asyncio.wait(list(self.active), timeout=left)
        late = list(self.active)
        for task in late:
            self.cut.add(task)
            task.cancel(CUT_MESSAGE)
        if late:
            log.warning("shutdown grace of %.0f s over: ending %d requests", grace_s, len(late))
            await asyncio.wait(late, timeout=CUT_S)
        log.info("drained: %d finished, %d cut", start - len(late), len(late))
        return start - len(late), len(late)


@dataclass(frozen=True)
class KeySource:
    """Where the running gateway's config came from (file, flags; the environment is read
    again), so that SIGHUP can read its keys again. Picklable: workers get it too."""

    path: str | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def load(self) -> GatewayConfig:
        return load(self.path, dict(self.overrides))


def reload_keys(
    current: GatewayConfig, source: KeySource, why: str = "SIGHUP"
) -> GatewayConfig | None:
    """The current config with the keys of a fresh read of `source`, or None (logged, each line
    starting with `why`) when it is invalid. Other changed fields are named in a warning: they
    need a restart."""
    try:
        fresh = source.load()
    except ConfigError as exc:  # names the key, never a value that is a secret
        log.error("%s: config not reloaded, keeping the old keys: %s", why, exc)
        return None
    except yaml.YAMLError as exc:  # its text can quote the file's lines: only where it broke
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        log.error("%s: config not reloaded, keeping the old keys: invalid YAML%s", why, where)
        return None
    except OSError as exc:
        log.error("%s: config not reloaded, keeping the old keys: %s", why, exc.strerror)
        return None
    keys = {c.name: c.api_keys for c in fresh.classes.list}
    if set(keys) != {c.name for c in current.classes.list}:
        log.error("%s: config not reloaded: the class names changed (needs a restart)", why)
        return None
    classes = dataclasses.replace(
        current.classes,
        list=tuple(dataclasses.replace(c, api_keys=keys[c.name]) for c in current.classes.list),
    )
    updated = dataclasses.replace(
        current, api_keys=fresh.api_keys, admin_key=fresh.admin_key, classes=classes
    )
    ignored = _changed(updated, fresh)
    if ignored:
        log.warning("%s: changes to %s need a restart; applied the keys only", why, ignored)
    log.info("%s: keys reloaded (%d client keys, admin key %s, %d class keys)", why,
             len(updated.api_keys), "set" if updated.admin_key else "unset",
             sum(len(k) for k in keys.values()))  # fmt: skip
    return updated


def _changed(updated: GatewayConfig, fresh: GatewayConfig) -> list[str]:
    """Top-level fields that differ (a worker's own paths and replica id excepted: they are
    derived from the fresh config's, `gateway.workers.supervisor.worker_config`)."""
    skip = {"predictor", "capture", "shared_learning"} if updated.workers > 1 else set()
    return [
        f.name
        for f in dataclasses.fields(GatewayConfig)
        if f.name not in skip and getattr(updated, f.name) != getattr(fresh, f.name)
    ]
