"""The fleet loop: one queue and a router in front of B engines with prefix caching."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from loadgen.engine.configs import engine_config
from loadgen.schema import TraceRequest
from loadgen.sim.fleet import Fleet, lru_hit_ratio, simulate_fleet
from loadgen.sim.simulator import Contender, simulate
from policies.job import Job
from policies.registry import parse_policy
from policies.routing import BackendState, Router, router_names
from policies.routing.base import least_loaded, open_backends
from policies.routing.chain import chain_ids

ENGINE = engine_config("h200-llama3-8b")


def _req(t: float, blocks: range | list[int], out: int = 20, session: str | None = None,
         think: float | None = None, extra: int = 0) -> TraceRequest:  # fmt: skip
    ids = list(blocks)
    return TraceRequest(t, 16 * len(ids) + extra, out, "test", session=session, think_s=think,
                        block_hashes=chain_ids(ids), block_tokens=16)  # fmt: skip


def _shared_prefix_workload(n: int, systems: int, seed: int = 0) -> list[TraceRequest]:
    """`n` requests, each one of `systems` 2,000-token system prompts plus its own 100 tokens."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(20.0)
        s = rng.randrange(systems)
        ids = [s * 1000 + b for b in range(125)] + [10**6 + i * 10 + b for b in range(6)]
        out.append(_req(t, ids, out=rng.randint(5, 60), extra=4))
    return out


def test_one_backend_is_the_single_engine_simulator() -> None:
    reqs = [
        _req(0.0, range(50), 50, "a"),
        _req(0.01, range(100, 103), 5, "b"),
        _req(2.0, list(range(50)) + list(range(200, 253)), 20, "a", think=0.3),
        _req(0.02, range(300, 400), 30, "c"),
        _req(9.0, list(range(50)) + list(range(200, 253)) + list(range(400, 406)), 7, "a", 0.1),
    ]
    engine = ENGINE.with_(drain_s=1e6)
    single = simulate(reqs, Contender("fcfs", parse_policy("fcfs"), engine, 2), "h200-llama3-8b")
    fleet = simulate_fleet(reqs, "fcfs", "least-loaded", Fleet(1, engine, cap=2))
    for a, b in zip(single.records, fleet.records, strict=True):
        assert b.arrival_s == pytest.approx(a.arrival_s)
        assert b.first_token_s == pytest.approx(a.first_token_s)
        assert b.finish_s == pytest.approx(a.finish_s)
    assert fleet.prefix_cache_hits == single.extra["prefix_cache_hits"] > 0
    assert fleet.prefix_cache_queries == single.extra["prefix_cache_queries"]


def test_hits_come_from_the_engines_where_the_router_sent_the_turns() -> None:
    # turn 2 re-sends turn 1's 40 blocks; sticky routing finds them, round-robin cannot
    reqs = [_req(0.0, range(40), 16, "s"), _req(1.0, [*range(40), 99], 4, "s", think=0.5)]
    sticky = simulate_fleet(reqs, "fcfs", "session", Fleet(2, ENGINE))
    spread = simulate_fleet(reqs, "fcfs", "round-robin", Fleet(2, ENGINE))
    assert sticky.routed in ([2, 0], [0, 2]) and spread.routed == [1, 1]
    # 41 full blocks in turn 2's chain: 40 prompt blocks + turn 1's 16-token answer (1 block)
    assert sticky.prefix_cache_hits == 16 * 40
    assert spread.prefix_cache_hits == 0
    assert sticky.prefix_cache_queries == spread.prefix_cache_queries == 16 * 40 + 16 * 41


def test_a_later_turn_arrives_its_think_time_after_the_previous_one_ends() -> None:
    reqs = [_req(0.0, range(30), 40, "a"), _req(0.1, range(500, 530), 40, "b"),
            _req(5.0, [*range(30), 7], 10, "a", think=1.5)]  # fmt: skip
    res = simulate_fleet(reqs, "sagesched:cost=time", "sagesched", Fleet(2, ENGINE))
    first, turn = res.records[0], res.records[2]
    assert first.finish_s is not None
    assert turn.arrival_s == pytest.approx(first.finish_s + 1.5)
    assert all(r.completed for r in res.records)


def test_prefix_routers_find_more_cache_than_least_loaded() -> None:
    reqs = _shared_prefix_workload(300, systems=8)
    fleet = Fleet(4, ENGINE.with_(kv_tokens=16 * 2000), cap=8)  # room for ~one system each
    base = simulate_fleet(reqs, "fcfs", "least-loaded", fleet).hit_ratio
    for router in ("prefix", "sagesched", "cache-aware"):
        assert simulate_fleet(reqs, "fcfs", router, fleet).hit_ratio > base + 0.05


@pytest.mark.parametrize("router", router_names())
def test_every_router_completes_every_request_within_the_cap(router: str) -> None:
    reqs = _shared_prefix_workload(120, systems=3, seed=1)
    res = simulate_fleet(reqs, "sagesched:cost=time", router, Fleet(3, ENGINE, cap=4))
    assert all(r.completed for r in res.records)
    assert sum(res.routed) == len(reqs)
    assert 0.0 <= res.hit_ratio <= 1.0
    assert res.summary()["ttft_mean"] > 0


def test_saturated_throughput_counts_only_while_jobs_wait() -> None:
    reqs = _shared_prefix_workload(200, systems=2)
    burst = [TraceRequest(0.0, r.prompt_tokens, 200, "test", block_hashes=r.block_hashes,
                          block_tokens=16) for r in reqs]  # fmt: skip
    res = simulate_fleet(burst, "fcfs", "least-loaded", Fleet(2, ENGINE, cap=4))
    s = res.summary()
    assert 0 < res.saturated_done < len(burst)
    assert s["saturated_throughput"] == pytest.approx(res.saturated_done / res.saturated_s)
    light = simulate_fleet(reqs[:5], "fcfs", "least-loaded", Fleet(2, ENGINE, cap=64))
    assert light.saturated_s == 0.0 and math.isnan(light.summary()["saturated_throughput"])


def test_lru_hit_ratio_counts_tokens_and_evicts_least_recent() -> None:
    a, b = list(range(10)), list(range(100, 110))
    reqs = [_req(0.0, a, extra=1), _req(1.0, b, extra=1), _req(2.0, a, extra=1)]
    total = 3 * (160 + 1)
    assert lru_hit_ratio(reqs, math.inf) == pytest.approx(160 / total)
    assert lru_hit_ratio(reqs, 16 * 20) == pytest.approx(160 / total)  # both fit
    # room for 15 blocks: b evicts a's tail first (vLLM frees tail first), its head still hits
    assert lru_hit_ratio(reqs, 16 * 15) == pytest.approx(80 / total)
    assert lru_hit_ratio(reqs, 16 * 10) == 0.0  # b pushed all of a out
    # at most prompt − 1 tokens hit: a prompt of exactly 10 blocks hits 9
    exact = [_req(0.0, a), _req(1.0, a)]
    assert lru_hit_ratio(exact, math.inf) == pytest.approx(144 / 320)


def test_precise_routers_read_what_the_engines_really_hold() -> None:
    # KV for about two of the six system prompts per backend: the approximate index (sized to
    # the KV, but blind to what running requests hold) and the engine's cache disagree
    reqs = _shared_prefix_workload(200, systems=6, seed=2)
    engine = ENGINE.with_(kv_tokens=16 * 300)
    approx = simulate_fleet(reqs, "fcfs", "prefix", Fleet(2, engine, cap=4))
    precise = simulate_fleet(reqs, "fcfs", "prefix", Fleet(2, engine, cap=4, precise=True))
    assert precise.routed != approx.routed
    assert all(r.completed for r in precise.records)
    base = simulate_fleet(reqs, "fcfs", "least-loaded", Fleet(2, engine, cap=4))
    assert precise.hit_ratio > base.hit_ratio + 0.05


SEEN: list[int | None] = []


@dataclass(eq=False)
class _Spy(Router):
    """Least-loaded, remembering the engine queue each backend showed at every decision."""

    name = "spy"
    description = "test"

    def pick(self, job: Job, backends: Sequence[BackendState]) -> BackendState | None:
        SEEN.extend(b.waiting for b in backends)
        return least_loaded(open_backends(backends))


@pytest.mark.parametrize("shown", [True, False])
def test_routers_see_the_engine_queue_unless_it_is_hidden(shown: bool) -> None:
    SEEN.clear()
    reqs = _shared_prefix_workload(60, systems=2)
    simulate_fleet(reqs, "fcfs", _Spy(), Fleet(2, ENGINE, cap=8, engine_waiting=shown))
    assert SEEN
    if shown:
        assert any(w for w in SEEN)  # None only before a backend was first scraped
    else:
        assert all(w is None for w in SEEN)
