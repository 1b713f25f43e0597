"""The gateway's per-request shortcuts (issue 17 part 2) keep their meaning: only a
preempting setup keeps continuation text, the relay reports a read's tokens to its slot once,
label lookups hit the same series, the scrape reads the same samples from fewer lines, a
backend without `/metrics` is scraped rarely, and the relay's bulk event path relays and
counts what the general path would. No network: backends are marked healthy by hand and never
contacted, except the one scraped (a real aiohttp server)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.backends import BackendPool
from gateway.config import GatewayConfig, build
from gateway.dispatcher import Dispatcher
from policies import parse_policy

MODEL = "m"


def config(**extra: Any) -> GatewayConfig:
    backends = [{"url": "http://b0:1", "name": "b0", "max_inflight": 4, "models": [MODEL]}]
    return build({"backends": backends, "adaptive_cap": {"enabled": False}, **extra})


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def dispatcher(cfg: GatewayConfig, session: aiohttp.ClientSession) -> Dispatcher:
    pool = BackendPool(cfg.backends, session, health_interval_s=60.0, adaptive=cfg.adaptive_cap)
    for b in pool.backends:
        b.healthy = True
    return Dispatcher(parse_policy(cfg.policy), pool, cfg)


@pytest.mark.parametrize(
    ("policy", "preemption", "expect"),
    [("fcfs", True, False), ("srpt-oracle", True, True), ("srpt-oracle", False, False)],
)
async def test_only_a_preempting_setup_keeps_continuation_text(
    session: aiohttp.ClientSession, policy: str, preemption: bool, expect: bool
) -> None:
    d = dispatcher(config(policy=policy, preemption=preemption), session)
    assert d.may_preempt is expect
