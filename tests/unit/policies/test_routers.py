"""Each router's own rule, on small hand-made fleets."""

from __future__ import annotations

import pytest

from policies import Job, LengthDist, LinearProfile
from policies.routing import BackendState, make_router
from policies.routing.catalog.cache_aware import CacheAware
from policies.routing.catalog.sagesched import SageSchedRouter


def chain(root: int, n: int) -> tuple[int, ...]:
    return tuple(root * 1000 + k for k in range(n))


def job(blocks: int = 0, root: int = 1, out: int = 100, session: str | None = None) -> Job:
    """A job whose prompt is `blocks` 16-token blocks of chain `root`, predicted `out` long."""
    return Job(
        id=0,
        arrival_s=0.0,
        prompt_tokens=max(blocks, 1) * 16,
        prefix=chain(root, blocks),
        block_tokens=16 if blocks else 0,
        session=session,
        dist=LengthDist.point(out),
    )


def fleet(*inflight: int, cap: int = 8) -> list[BackendState]:
    return [BackendState(f"b{i}", n, cap) for i, n in enumerate(inflight)]


def test_least_loaded_is_the_pools_rule() -> None:
    router = make_router("least-loaded")
    backends = [BackendState("a", 3, 4), BackendState("b", 2, 4), BackendState("c", 1, 2)]
    assert router.pick(job(), backends) is backends[1]  # 0.5 ties with c: the earlier
    backends[1].serving = False
    assert router.pick(job(), backends) is backends[2]
    backends[2].inflight = 2
    assert router.pick(job(), backends) is backends[0]


def test_round_robin_cycles_and_skips_full() -> None:
    router = make_router("round-robin")
    backends = fleet(0, 0, 0)
    names = [router.pick(job(), backends).name for _ in range(4)]  # type: ignore[union-attr]
    assert names == ["b0", "b1", "b2", "b0"]
    backends[1].inflight = 8
    assert router.pick(job(), backends).name == "b2"  # type: ignore[union-attr]


def test_random_is_seeded() -> None:
    def draws(seed: int) -> list[str]:
        router, backends = make_router("random", seed=seed), fleet(0, 0, 0, 0)
        return [router.pick(job(), backends).name for _ in range(40)]  # type: ignore[union-attr]

    assert draws(1) == draws(1) and draws(1) != draws(2)
    assert set(draws(1)) == {"b0", "b1", "b2", "b3"}


def test_session_is_sticky_with_fallback() -> None:
    router, backends = make_router("session"), fleet(0, 0, 0, 0)
    home = router.pick(job(session="s1"), backends)
    assert home is not None
    assert all(router.pick(job(session="s1"), backends) is home for _ in range(5))
    home.inflight = home.cap  # full: elsewhere, then home again once it has room
    away = router.pick(job(session="s1"), backends)
    assert away is not None and away is not home
    home.inflight = 0
    assert router.pick(job(session="s1"), backends) is home
    spread = {router.pick(job(session=f"s{i}"), backends).name for i in range(40)}  # type: ignore[union-attr]
    assert len(spread) == 4
    backends[0].inflight = 5
    assert router.pick(job(), backends) is backends[1]  # no session: least-loaded


def test_llmd_prefix_weighs_match_queue_and_kv() -> None:
    router = make_router("prefix")
    backends = fleet(0, 0)
    router.on_route(job(blocks=10), backends[1])  # b1 now holds blocks 0..9 of chain 1
    backends[1].waiting = 4
    backends[0].waiting = 0
    # full match on b1: 3·1 + 2·0 = 3 > b0's 0 + 2·1 = 2
    assert router.pick(job(blocks=10), backends) is backends[1]
    # half match: 3·0.5 = 1.5 < 2
    assert router.pick(job(blocks=20), backends) is backends[0]
    # equal queues: the match decides; then KV usage: 2·(1 − 0.9) loses to 2·1 without match
    backends[1].waiting = 0
    assert router.pick(job(blocks=20), backends) is backends[1]
    backends[1].kv_usage = 0.9
    assert router.pick(job(blocks=4, root=7), backends) is backends[0]


def test_llmd_prefix_ties_spread_by_load() -> None:
    router = make_router("prefix")
    backends = fleet(3, 1, 2)
    assert router.pick(job(blocks=5), backends) is backends[1]


def test_cache_aware_rule() -> None:
    router = make_router("cache-aware")
    assert isinstance(router, CacheAware)
    backends = fleet(0, 0, 0, cap=200)
    router.on_route(job(blocks=10), backends[2])
    router.on_route(job(blocks=3, root=2), backends[0])
    assert router.pick(job(blocks=10), backends) is backends[2]  # match 1.0 > 0.3
    # match 2/10 ≤ 0.3: the smallest index (b1, empty)
    partial = job(blocks=10)
    partial.prefix = chain(1, 2) + chain(9, 8)
    assert router.pick(partial, backends) is backends[1]
    # imbalanced: 100 − 10 > 64 and 100 > 1.5·10 → least loaded, whatever the match
    backends[0].inflight, backends[1].inflight, backends[2].inflight = 10, 50, 100
    assert router.imbalanced(backends)
    assert router.pick(job(blocks=10), backends) is backends[0]
    backends[0].inflight = 40  # gap 60 ≤ 64: balanced again
    assert not router.imbalanced(backends)
    assert router.pick(job(blocks=10), backends) is backends[2]


LAT = LinearProfile(
    prefill_base_s=5e-3, prefill_s_per_token=2e-5, step_s=1e-4, context_s_per_token=3e-8
)


def test_sagesched_router_weighs_cache_against_load() -> None:
    router = make_router("sagesched").on_engine(LAT)
    assert isinstance(router, SageSchedRouter) and router.latency == LAT
    assert router.fresh().latency == LAT
    backends = fleet(2, 2, cap=32)
    router.on_route(job(blocks=200), backends[1])  # 3,200 tokens cached on b1
    assert router.pick(job(blocks=200, out=50), backends) is backends[1]  # equal load: cache
    # 4 more sequences on b1: the 64 ms of prefill a long job skips there would also stall the
    # 2 sequences running on b0, more than 4 batchmates stretch its 1,000 decode steps
    backends[1].inflight = 6
    assert router.pick(job(blocks=200, out=1000), backends) is backends[1]
    backends[1].inflight = 20  # 18 more batchmates: the cache is not worth it any more
    assert router.pick(job(blocks=200, out=1000), backends) is backends[0]
    assert router.pick(job(blocks=200, out=50), backends) is backends[1]  # a short one: still
    backends[0].inflight, backends[0].waiting = 6, 4  # 4 prefills queued ahead on b0
    assert router.pick(job(blocks=200, out=1000), backends) is backends[1]


def test_sagesched_router_without_the_stall_term_weighs_only_its_own_prefill() -> None:
    """`stall_weight=0`: the 64 ms a long job skips on b1 no longer outweighs 4 batchmates."""
    backends = fleet(2, 6, cap=32)
    for weight, chosen in ((1.0, 1), (0.0, 0)):
        router = make_router("sagesched", stall_weight=weight).on_engine(LAT)
        router.on_route(job(blocks=200), backends[1])
        assert router.pick(job(blocks=200, out=1000), backends) is backends[chosen]


def test_sagesched_router_prefers_a_full_hit_on_a_busy_backend() -> None:
    """A prompt wholly cached on a backend running 30 stalls none of them; sent to the idle
    one, its 1,600 prefilled tokens would stall the 2 running there and wait for themselves."""
    router = make_router("sagesched").on_engine(LAT)
    backends = fleet(30, 2, cap=64)
    router.on_route(job(blocks=100), backends[0])
    assert router.pick(job(blocks=100, out=20), backends) is backends[0]
    fresh = router.fresh()  # nothing cached anywhere: the idle backend
    assert fresh.pick(job(blocks=100, out=20), backends) is backends[1]


def test_sagesched_router_reads_the_engine_queue_as_the_prefills_sent_there() -> None:
    """Equal queues, but the jobs sent to b0 were cache hits and those sent to b1 were not:
    b0's queue clears sooner."""
    router = make_router("sagesched").on_engine(LAT)
    backends = fleet(4, 4, cap=32)
    for k in range(20):
        router.on_route(job(blocks=200, root=1), backends[0])  # one miss, then hits
        router.on_route(job(blocks=200, root=100 + k), backends[1])  # every one a miss
    backends[0].waiting = backends[1].waiting = 3
    assert router.pick(job(out=20), backends) is backends[0]
    backends[0].waiting = 4  # one more queued on b0 still costs less than b1's three
    assert router.pick(job(out=20), backends) is backends[0]


def test_sagesched_router_sets_cached_tokens() -> None:
    router = make_router("sagesched")
    backends = fleet(0, 0)
    router.on_route(job(blocks=8), backends[0])
    again = job(blocks=12)
    choice = router.pick(again, backends)
    assert choice is backends[0]
    router.on_route(again, choice)
    assert again.cached_tokens == 8 * 16
    elsewhere = job(blocks=12)
    router.on_route(elsewhere, backends[1])
    assert elsewhere.cached_tokens == 0


def test_engine_reported_index_wins_over_the_routers_own() -> None:
    class Holds:
        def match(self, prefix: object) -> int:
            return 5

    router = make_router("prefix")
    backends = fleet(0, 0)
    backends[1].index = Holds()
    assert router.pick(job(blocks=5), backends) is backends[1]


@pytest.mark.parametrize("name", ["prefix", "cache-aware", "sagesched"])
def test_index_forgets_what_the_engine_evicted(name: str) -> None:
    router = make_router(name)
    backends = fleet(0, 0)
    router.on_route(job(blocks=6), backends[1])
    router.on_evict("b1", reversed(chain(1, 6)))
    j = job(blocks=6)
    router.on_route(j, backends[1])
    assert j.cached_tokens == 0


@pytest.mark.parametrize("name", ["prefix", "cache-aware", "sagesched"])
def test_a_job_routed_again_sees_what_its_first_route_cached(name: str) -> None:
    """The matches a decision remembers are dropped once the index changes: the same job
    sent twice (a requeued one) finds its own blocks the second time."""
    router = make_router(name)
    backends = fleet(0, 0)
    j = job(blocks=6)
    router.pick(j, backends)
    router.on_route(j, backends[1])
    assert j.cached_tokens == 0
    router.pick(j, backends)
    router.on_route(j, backends[1])
    assert j.cached_tokens == 6 * 16


def test_reasons_affinity_balance_fallback() -> None:
    router = make_router("prefix")
    backends = fleet(0, 0)
    first = job(blocks=10)
    router.on_route(first, backends[0])  # b0 now holds chain 1
    again = job(blocks=12)
    assert router.pick(again, backends) is backends[0]
    assert router.reason(again, backends[0], backends) == "affinity"
    assert router.reason(again, backends[1], backends) == "balance"  # sent past the holder
    backends[0].inflight = 8  # the holder is full: where the job goes is load's choice
    assert router.pick(again, backends) is backends[1]
    assert router.reason(again, backends[1], backends) == "balance"
    assert router.reason(job(blocks=5, root=2), backends[1], backends) == "fallback"
    assert router.reason(job(), backends[1], backends) == "fallback"  # no prefix at all
    assert make_router("least-loaded").reason(again, backends[1], backends) == "balance"
