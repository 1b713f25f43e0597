"""The self-tuning cap's curve memory in the pool (`gateway.scheduling.backends`): written, read
back at
start, keyed by backend and models; a broken file is a cold start, never an error."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from gateway.config import AdaptiveCapConfig, BackendConfig, ConfigError, build
from gateway.scheduling.backends import (
    BackendPool,
    curve_view,
    load_memory,
    memory_key,
    save_memory,
)
from policies.capacity import CapController, CapLaw, EngineSample


def trained(law: CapLaw) -> CapController:
    """A controller that has seen an engine of 6 ms + 0.7 ms per request at several batches."""
    ctl = CapController(law, 8)
    t = tokens = iterations = 0.0
    for batch in (4, 4, 8, 8, 16, 16, 32, 32, 12, 12, 24, 24) * 3:
        n = 1.0 / (0.006 + 0.0007 * batch)
        t, tokens, iterations = t + 1.0, tokens + n * batch, iterations + n
        sample = EngineSample(0.0, 0.2, tokens, running=float(batch), iterations=iterations)
        ctl.observe(t, sample, batch)
    return ctl


def pool_of(session: aiohttp.ClientSession, path: Path) -> BackendPool:
    cfg = BackendConfig(url="http://127.0.0.1:9", name="b", models=("m",), max_inflight=8)
    return BackendPool([cfg], session, health_interval_s=60.0, adaptive=AdaptiveCapConfig(),
                       memory_path=str(path))  # fmt: skip


async def test_remember_writes_and_a_restart_starts_there(tmp_path: Path) -> None:
    path = tmp_path / "curves.json"
    async with aiohttp.ClientSession() as session:
        pool = pool_of(session, path)
        b = pool.backends[0]
        b.controller = trained(AdaptiveCapConfig().law())
        assert b.controller.confident()
        pool.remember()
        data = json.loads(path.read_text())
        assert list(data) == [memory_key(b)] == ["http://127.0.0.1:9 m"]
        view = curve_view(b)
        assert view["curve_trusted"] and view["engine_cost"]["prefill_base_s"] > 0
        restarted = pool_of(session, path)
        await restarted.start()  # the backend is down; the memory is read all the same
        try:
            ctl = restarted.backends[0].controller
            assert ctl is not None and ctl.confident() and not ctl.slow_start
            assert restarted.backends[0].cap == ctl.cap == b.controller.cap != 8
            assert restarted.engine_profile("m") is not None
            assert restarted.engine_profile("other") is None
        finally:
            await restarted.stop()


def test_a_broken_memory_file_is_a_cold_start(tmp_path: Path) -> None:
    path = tmp_path / "curves.json"
    path.write_text("{not json")
    assert load_memory(str(path)) == {}
    assert load_memory(str(tmp_path / "missing.json")) == {}
    assert load_memory(None) == {}
    save_memory(str(path), {"k": {"fit": {}}})
    assert json.loads(path.read_text()) == {"k": {"fit": {}}}
    assert not list(tmp_path.glob("*.tmp*"))  # written whole, then renamed


def test_memory_file_defaults_beside_the_snapshot_and_settings_are_checked() -> None:
    cfg = AdaptiveCapConfig()
    assert cfg.memory_file("/var/lib/h.bin") == "/var/lib/h.bin.engines.json"
    assert cfg.memory_file(None) is None
    assert AdaptiveCapConfig(memory_path="/x.json").memory_file("/h.bin") == "/x.json"
    with pytest.raises(ConfigError, match="plateau_fraction"):
        build({"backends": [{"url": "http://x"}], "adaptive_cap": {"plateau_fraction": 1.0}})
