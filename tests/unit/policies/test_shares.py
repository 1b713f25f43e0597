"""Engine shares and TPOT objectives per band (`policies.shares`), alone and through the
`bands` policy and the `Scheduler` (a held band makes way for the next band's head)."""

from __future__ import annotations

import pytest

from policies import Job, Scheduler
from policies.catalog.bands import Bands
from policies.dist import LengthDist
from policies.shares import EngineShares, EngineView, Start, share_slots, tpot_batch

INTERACTIVE, BATCH = 0, 2


def job(i: int, band: int, arrival: float = 0.0) -> Job:
    return Job(id=i, arrival_s=arrival, prompt_tokens=100, max_tokens=100, priority=band,
               dist=LengthDist.point(50))  # fmt: skip


def view(bands: list[int], cap: int = 8, alpha: float | None = None) -> EngineView:
    """A backend running one job per entry of `bands`; with `alpha`, an iteration of
    alpha + 1 ms per running request."""
    running = [job(100 + i, b) for i, b in enumerate(bands)]
    curve = None if alpha is None else (lambda n, a=alpha: a + 0.001 * n)
    return EngineView(running, cap, curve)


def test_share_slots_round_down_but_never_to_zero() -> None:
    assert [share_slots(s, 8) for s in (0.01, 0.25, 0.3, 0.5, 1.0)] == [1, 2, 2, 4, 8]


def test_a_share_bounds_the_kv_a_band_holds_where_the_backend_reports_it() -> None:
    """Batch's share 0.5 of a backend with 10,000 tokens of KV: while interactive is active,
    a second batch job starts only if the band's context (one 4,000-token job holding 4,100
    after 100 generated tokens) plus its prompt stays within 5,000; the first always may;
    idle interactive lends it; an unknown KV size bounds only the slots."""
    rule = EngineShares({BATCH: 0.5}, {}, window_s=10.0)
    rule.arrived(INTERACTIVE, 0.0)
    long = Job(id=1, arrival_s=0.0, prompt_tokens=4_000, max_tokens=500, priority=BATCH)
    long.generated = 100
    engine = EngineView([long], 16, None, 10_000.0)
    none = EngineView([], 16, None, 10_000.0)

    def waiting(band: int) -> int:
        return 0

    assert rule.start(BATCH, engine, 1.0, waiting, prompt_tokens=900) is Start.FREE
    assert rule.start(BATCH, engine, 1.0, waiting, prompt_tokens=901) is Start.HELD
    assert rule.start(BATCH, none, 1.0, waiting, prompt_tokens=20_000) is Start.FREE
    assert rule.start(BATCH, engine, 20.0, waiting, prompt_tokens=5_000) is Start.LENT
    unknown = EngineView([long], 16, None, None)
    assert rule.start(BATCH, unknown, 1.0, waiting, prompt_tokens=5_000) is Start.FREE


def test_tpot_batch_is_the_largest_batch_within_the_objective() -> None:
    def curve(n: int) -> float:
        return 0.010 + 0.001 * n  # 10 ms + 1 ms per request

    assert tpot_batch(curve, 0.0155, 64) == 5  # 15 ms at 5, 16 ms at 6
    assert tpot_batch(curve, 0.0155, 4) == 4  # bounded by the cap
    assert tpot_batch(curve, 0.005, 64) == 1  # even one more request breaks it
    assert tpot_batch(curve, 1.0, 64) == 64


def test_a_share_holds_a_band_only_while_a_more_urgent_one_is_active() -> None:
    rule = EngineShares({BATCH: 0.25}, {}, window_s=10.0)
    nothing: dict[int, int] = {}
    waiting = nothing.get
    backend = view([INTERACTIVE, BATCH, BATCH])  # batch holds 2 = its share of 8

    def start(now: float, queued: dict[int, int]) -> Start:
        return rule.start(BATCH, backend, now, lambda b: queued.get(b, 0))

    assert start(0.0, nothing) is Start.LENT  # no interactive request seen yet: lent
    rule.arrived(INTERACTIVE, 5.0)
    assert start(6.0, nothing) is Start.HELD  # arrived within the window
    assert start(15.5, nothing) is Start.LENT  # the window passed: lent again
    assert start(15.5, {INTERACTIVE: 1}) is Start.HELD  # one waits
    assert rule.start(BATCH, view([INTERACTIVE, BATCH]), 6.0, lambda b: 0) is Start.FREE
    assert rule.start(INTERACTIVE, backend, 6.0, lambda b: waiting(b, 0)) is Start.FREE


def test_a_tpot_objective_bounds_the_batch_the_less_urgent_bands_may_join() -> None:
    rule = EngineShares({}, {INTERACTIVE: 0.0155}, window_s=10.0)  # B* = 5 at alpha 10 ms
    rule.arrived(INTERACTIVE, 0.0)
    none = lambda b: 0  # noqa: E731
    assert rule.start(BATCH, view([INTERACTIVE] * 2 + [BATCH] * 2, alpha=0.01), 1.0, none) is (
        Start.FREE
    )
    full = view([INTERACTIVE] * 2 + [BATCH] * 3, alpha=0.01)
    assert rule.start(BATCH, full, 1.0, none) is Start.HELD
    assert rule.start(INTERACTIVE, full, 1.0, none) is Start.FREE  # never holds its own band
    assert rule.limits(full, 1.0, none) == {BATCH: 3}  # 5 minus the 2 interactive ones
    # an unknown curve bounds nothing; an idle urgent band neither
    assert rule.start(BATCH, view([INTERACTIVE] * 2 + [BATCH] * 3), 1.0, none) is Start.FREE
    assert rule.start(BATCH, full, 20.0, none) is Start.FREE


def test_invalid_shares_and_objectives_are_refused() -> None:
    with pytest.raises(ValueError, match="engine share"):
        EngineShares({BATCH: 0.0}, {})
    with pytest.raises(ValueError, match="TPOT objective"):
        EngineShares({}, {INTERACTIVE: -1.0})


def test_a_held_band_makes_way_for_the_next_bands_head() -> None:
    """Through `Bands` and the `Scheduler`: batch (band 2, share 0.25) at its share behind an
    active interactive band is held; the engine passes it over (`peek` / `dispatch` with the
    held bands) and a waiting job of band 3, which has no share, starts instead, as the gateway
    and the simulator do. Once interactive is idle, batch is lent the slot."""
    policy = Bands(inner="fcfs", engine_shares=((BATCH, 0.25),))
    assert policy.holds_starts and not Bands(inner="fcfs").holds_starts
    sched = Scheduler(policy)
    batch, bulk = job(1, BATCH, 0.0), job(2, 3, 0.5)
    sched.admit(job(3, INTERACTIVE, 0.2), 0.2)
    sched.admit(batch, 0.0)
    sched.admit(bulk, 0.5)
    assert sched.dispatch(1.0).priority == INTERACTIVE  # type: ignore[union-attr]
    backend = view([INTERACTIVE, BATCH, BATCH])
    assert sched.peek(1.0) is batch
    assert sched.start_rule(batch, backend, 1.0) is Start.HELD
    assert sched.peek(1.0, {BATCH}) is bulk
    assert sched.start_rule(bulk, backend, 1.0) is Start.FREE
    assert sched.dispatch(1.0, {BATCH}) is bulk
    assert sched.start_rule(batch, backend, 20.0) is Start.LENT  # interactive idle since 0.2
    assert sched.dispatch(20.0) is batch
