"""The `bands` composition: strict bands, shares against starvation, tenant fairness inside a
band, the inner policy's order inside a tenant, preemption and engine priorities."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np
import pytest

from policies import Job, LengthDist, Scheduler, make_policy, parse_policy
from policies.bands import BandQueue
from policies.capacity import priority_level
from policies.catalog.bands import BAND_STRIDE, Bands


def job(i: int, band: int = 0, tenant: str = "t", out: int = 10, arrival: float = 0.0) -> Job:
    return Job(
        id=i, arrival_s=arrival, prompt_tokens=10, priority=band, tenant=tenant,
        dist=LengthDist.point(out), true_output_tokens=out,
    )  # fmt: skip


def drain(s: Scheduler, now: float = 0.0) -> list[int]:
    out = []
    while (j := s.dispatch(now)) is not None:
        out.append(j.id)
        s.finish(j, now)
    return out


def test_strict_priority_between_bands() -> None:
    s = Scheduler(make_policy("bands", inner="fcfs"))
    for i, band in enumerate([2, 2, 1, 0, 2, 0]):
        s.admit(job(i, band, arrival=float(i)), float(i))
    assert drain(s, 10.0) == [3, 5, 2, 0, 1, 4]


def test_one_band_one_tenant_is_the_inner_order() -> None:
    rng = np.random.default_rng(4)
    jobs = [
        Job(id=i, arrival_s=float(rng.integers(0, 5)), prompt_tokens=int(rng.integers(1, 2000)),
            dist=LengthDist.noisy_oracle(int(rng.integers(1, 900)), 0.5, rng))
        for i in range(80)
    ]  # fmt: skip
    orders = []
    for policy in (make_policy("sagesched"), make_policy("bands")):
        s = Scheduler(policy)
        for j in jobs:
            s.admit(j, j.arrival_s)
        orders.append(drain(s, 5.0))
    assert orders[0] == orders[1]


def serve(
    policy: Bands,
    feed: Callable[[int, Callable[[Job], None]], None],
    steps: int,
    slots: int = 2,
) -> tuple[dict[tuple[int, str], float], Scheduler]:
    """Run `steps` decode steps on `slots` slots, one token per running job per step;
    `feed(step, admit)` adds arrivals. Returns the work (prompt + 2·output) each (band,
    tenant) received."""
    s = Scheduler(policy)
    served: dict[tuple[int, str], float] = defaultdict(float)
    for step in range(steps):
        t = float(step)
        feed(step, lambda j, t=t: s.admit(j, t))  # type: ignore[misc]
        while len(s.running) < slots and (j := s.dispatch(t)) is not None:
            served[j.priority, j.tenant] += j.prompt_tokens
        for j in list(s.running.values()):
            s.progress(j, 1, t)
            served[j.priority, j.tenant] += 2
            if j.generated >= (j.true_output_tokens or 0):
                s.finish(j, t)
    return served, s


def flooding(bands: dict[int, int]) -> Callable[[int, Callable[[Job], None]], None]:
    """Every band in `bands` keeps at least `bands[b]` jobs of 20 tokens waiting."""
    ids = iter(range(10**9))
    backlog: dict[int, list[Job]] = defaultdict(list)

    def feed(step: int, admit: Callable[[Job], None]) -> None:
        for band, depth in bands.items():
            backlog[band] = [j for j in backlog[band] if j.generated == 0]
            while len(backlog[band]) < depth:
                j = job(next(ids), band, out=20, arrival=float(step))
                backlog[band].append(j)
                admit(j)

    return feed


def test_strict_bands_starve_a_lower_band_and_a_share_prevents_it() -> None:
    strict, _ = serve(make_policy("bands", inner="fcfs"), flooding({0: 4, 2: 4}), 3000)
    assert strict[2, "t"] == 0  # band 0 never runs dry: band 2 waits forever
    shared, _ = serve(
        make_policy("bands", inner="fcfs", band_shares=((2, 0.2),)), flooding({0: 4, 2: 4}), 3000
    )
    share = shared[2, "t"] / (shared[2, "t"] + shared[0, "t"])
    assert 0.17 < share < 0.23  # the guaranteed fifth of the work, not more
    # with no contention a share is not a cap: band 2 alone gets everything
    alone, _ = serve(
        make_policy("bands", inner="fcfs", band_shares=((2, 0.2),)), flooding({2: 4}), 500
    )
    assert alone[2, "t"] > 0 and (0, "t") not in alone


def test_tenants_share_a_band_fairly_and_keep_their_inner_order() -> None:
    """Tenant `noisy` keeps 30 jobs waiting, `quiet` 2; both get the same work (VTC), and
    inside each tenant the inner policy (SJF by true length) orders its jobs."""
    ids = iter(range(10**9))
    waiting: dict[str, list[Job]] = defaultdict(list)

    def feed(step: int, admit: Callable[[Job], None]) -> None:
        for tenant, depth in (("noisy", 30), ("quiet", 2)):
            waiting[tenant] = [j for j in waiting[tenant] if j.generated == 0]
            while len(waiting[tenant]) < depth:
                j = job(next(ids), 1, tenant, out=5 + next(ids) % 40, arrival=float(step))
                waiting[tenant].append(j)
                admit(j)

    policy = make_policy("bands", inner="sjf-oracle")
    served, _ = serve(policy, feed, 4000)
    assert served[1, "quiet"] / served[1, "noisy"] == pytest.approx(1.0, abs=0.05)
    # the inner order inside a flow: every pop of a tenant takes its shortest waiting job
    q = BandQueue(make_policy("sjf-oracle"))
    for i, out in enumerate([30, 5, 20, 10]):
        q.push(job(i, 0, "a", out=out), 0.0)
        q.push(job(10 + i, 0, "b", out=out), 0.0)
    popped = []
    while (j := q.pop(0.0)) is not None:
        popped.append(j)
    for tenant in ("a", "b"):
        assert [j.true_output_tokens for j in popped if j.tenant == tenant] == [5, 10, 20, 30]


def test_a_returning_tenant_is_lifted_not_credited_for_idling() -> None:
    q_policy = make_policy("bands", inner="fcfs")
    s = Scheduler(q_policy)
    for i in range(50):  # tenant a alone for a while: its counter grows
        s.admit(job(i, 0, "a", arrival=float(i)), float(i))
    for _ in range(40):
        j = s.dispatch(50.0)
        assert j is not None
        s.progress(j, 10, 50.0)
        s.finish(j, 50.0)
    # b arrives now: lifted to a's level, so it alternates with a instead of running alone
    for i in range(100, 110):
        s.admit(job(i, 0, "b", arrival=60.0), 60.0)
    order = []
    for _ in range(8):
        j = s.dispatch(61.0)
        assert j is not None
        order.append(j.tenant)
        s.progress(j, 10, 61.0)
        s.finish(j, 61.0)
    assert order.count("a") >= 3 and order.count("b") >= 3


def test_tenant_state_is_bounded_by_the_active_tenants() -> None:
    s = Scheduler(make_policy("bands", inner="fcfs"))
    for i in range(2000):  # each tenant sends one request and leaves
        s.admit(job(i, 0, f"user-{i}"), float(i))
        j = s.dispatch(float(i))
        assert j is not None
        s.progress(j, 3, float(i))
        s.finish(j, float(i))
    q = s.queue
    assert isinstance(q, BandQueue)
    assert not q._bands  # idle: nothing kept


def test_preemption_stays_inside_the_band_unless_allowed() -> None:
    def run(policy: Bands) -> Job | None:
        s = Scheduler(policy)
        long = job(1, 2, out=5000)
        s.admit(long, 0.0)
        assert s.dispatch(0.0) is long
        s.progress(long, 1, 0.0)
        s.admit(job(2, 0, out=2), 0.1)
        return s.preemption_victim(0.1)

    assert run(make_policy("bands", inner="srpt-oracle")) is None
    victim = run(make_policy("bands", inner="srpt-oracle", preempt_lower_bands=True))
    assert victim is not None and victim.id == 1
    # inside a band the inner policy decides as it would alone
    s = Scheduler(make_policy("bands", inner="srpt-oracle"))
    long = job(1, 0, out=5000)
    s.admit(long, 0.0)
    assert s.dispatch(0.0) is long
    s.admit(job(2, 0, out=2), 0.1)
    assert s.preemption_victim(0.1) is long


def test_engine_priority_keeps_bands_apart_and_the_inner_level_inside() -> None:
    p = make_policy("bands")
    inner = make_policy("sagesched")
    a, b = job(1, 0, out=10), job(2, 1, out=3000)
    ka, kb = p.key(a, 0.0), p.key(b, 0.0)
    assert ka[1:] == inner.key(a, 0.0)
    assert p.engine_priority(ka) == priority_level(ka[1])
    assert p.engine_priority(kb) == BAND_STRIDE + priority_level(kb[1])
    assert p.engine_priority(ka) < p.engine_priority(kb)


def test_inner_spec_params_and_engine_pass_through() -> None:
    p = parse_policy("bands:inner=sagesched:cost=tokens;preempt_rule=index")
    assert isinstance(p, Bands)
    assert p.inner_policy.params()["cost"] == "tokens"
    assert p.inner_policy.params()["preempt_rule"] == "index"
    assert not make_policy("bands", inner="fcfs").needs_prediction
    assert make_policy("bands").needs_prediction
    with pytest.raises(ValueError, match="share"):
        make_policy("bands", band_shares=((2, 1.5),))
    with pytest.raises(ValueError, match="cannot be bands"):
        make_policy("bands", inner="bands")
    clone = p.fresh()
    assert clone.params() == p.params() and clone.inner_policy is not p.inner_policy


def test_a_time_review_of_the_inner_policy_is_seen_across_flows() -> None:
    """ltr promotes a job that waited `starvation_s`: it must overtake other tenants' jobs."""
    s = Scheduler(make_policy("bands", inner="ltr:starvation_s=5"))
    old = job(1, 0, "a", arrival=0.0)
    old.rank_score = 9.0  # ranked long: last until promoted
    s.admit(old, 0.0)
    for i in range(2, 6):
        j = job(i, 0, "b", arrival=1.0)
        j.rank_score = 0.0
        s.admit(j, 1.0)
    s.queue.peek(1.0)  # b's entries are current, a's is stale from now on
    first = s.dispatch(6.0)  # past a's promotion time
    assert first is old


def test_pair_parameters_are_written_key_value_pairs() -> None:
    p = parse_policy("bands:band_shares=2:0.1;1:0.05,preempt_lower_bands=true")
    assert isinstance(p, Bands)
    assert p.band_shares == ((2, 0.1), (1, 0.05)) and p.preemptive
    assert parse_policy("vtc:tenant_weights=a:2;b:1").params()["tenant_weights"] == (
        ("a", 2.0),
        ("b", 1.0),
    )
    with pytest.raises(ValueError, match="key:value"):
        parse_policy("bands:band_shares=2")
    with pytest.raises(ValueError, match="cannot read"):
        parse_policy("bands:band_shares=x:0.1")


def test_flow_entries_stay_bounded() -> None:
    """One entry per flow is live; superseded ones are skipped and compacted away."""
    s = Scheduler(make_policy("bands", inner="fcfs"))
    for i in range(1000):
        s.admit(job(i, 0, "solo" if i % 2 else f"t{i % 10}", arrival=float(i)), float(i))
    q = s.queue
    assert isinstance(q, BandQueue)
    band = q._bands[0]
    assert len(band.heap) <= 2 * len(band.flows) + 65
    for _ in range(500):
        j = s.dispatch(2000.0)
        assert j is not None
        s.progress(j, 7, 2000.0)
        s.finish(j, 2000.0)
    assert len(band.heap) <= 2 * len(band.flows) + 65
    assert set(band.latest) <= set(band.flows)
