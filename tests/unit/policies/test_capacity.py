"""The self-tuning cap's control law and vLLM priority levels (`policies.capacity`)."""

from __future__ import annotations

import math

import pytest

from policies.capacity import (
    CapController,
    CapLaw,
    EngineSample,
    combine_kv,
    priority_level,
)


def drive(
    ctl: CapController,
    seconds: float,
    rate_at: float | int,
    t0: float = 0.0,
    tokens0: float = 0.0,
    *,
    demand: int = 10_000,
    max_seqs: int | None = None,
) -> tuple[float, float, list[int]]:
    """An engine whose token rate is `min(batch, B*)` per second (B* = `rate_at`): its
    throughput saturates at a known batch. Demand keeps `demand` requests at the gateway;
    with `max_seqs`, requests beyond it wait inside the engine."""
    t, tokens, caps = t0, tokens0, []
    while t < t0 + seconds:
        dt = ctl.interval_s
        inflight = min(ctl.cap, demand)
        running = inflight if max_seqs is None else min(inflight, max_seqs)
        t += dt
        tokens += min(running, rate_at) * 10.0 * dt
        waiting = float(inflight - running)
        caps.append(ctl.observe(t, EngineSample(waiting, 0.3, tokens), inflight))
    return t, tokens, caps


def settled(caps: list[int], knee: float) -> bool:
    """The last 20 samples average within ±25% of `knee` and none is off by more than 40%."""
    tail = caps[-20:]
    mean = sum(tail) / len(tail)
    return 0.75 * knee <= mean <= 1.25 * knee and all(0.6 * knee <= c <= 1.4 * knee for c in tail)


@pytest.mark.parametrize("knee", [16, 48, 200])
def test_settles_at_the_saturating_batch_from_a_cold_start(knee: int) -> None:
    ctl = CapController(CapLaw(), 8)
    _, _, caps = drive(ctl, 60.0, knee)
    assert settled(caps, knee), (knee, caps)


@pytest.mark.parametrize("knee", [16, 200])
def test_comes_down_from_far_above(knee: int) -> None:
    ctl = CapController(CapLaw(), 600)
    _, _, caps = drive(ctl, 120.0, knee)
    assert settled(caps, knee), (knee, caps)


def test_follows_a_change_of_the_efficient_batch() -> None:
    ctl = CapController(CapLaw(), 8)
    t, tokens, caps = drive(ctl, 60.0, 100)
    assert settled(caps, 100), caps
    t, tokens, caps = drive(ctl, 90.0, 30, t, tokens)
    assert settled(caps, 30), caps
    _, _, caps = drive(ctl, 90.0, 100, t, tokens)
    assert settled(caps, 100), caps


def test_engine_queue_caps_at_what_it_runs() -> None:
    """Throughput still rising but the engine runs at most 64: the cap stays just above."""
    ctl = CapController(CapLaw(), 8)
    _, _, caps = drive(ctl, 60.0, 10_000, max_seqs=64)
    tail = caps[-20:]
    assert min(tail) >= 64 - 1 and max(tail) <= 64 * 1.25, tail


def test_waiting_limit_cuts_to_running_plus_allowance() -> None:
    ctl = CapController(CapLaw(waiting_high=2), 300)
    assert ctl.observe(1.0, EngineSample(30.0, 0.5, 100.0), 300) == 300  # once: a transient
    assert ctl.observe(2.0, EngineSample(30.0, 0.5, 200.0), 300) == 300 - 30 + 2
    assert not ctl.slow_start


def test_kv_limit_backs_off_multiplicatively() -> None:
    ctl = CapController(CapLaw(kv_high=0.9, backoff=0.125), 80)
    assert ctl.observe(1.0, EngineSample(0.0, 0.95, 0.0), 80) == 70
    assert ctl.observe(2.0, EngineSample(None, 0.99, None), 70) == 61  # queue unknown: KV alone


def test_unknown_series_are_not_zero() -> None:
    # nothing known (no /metrics): hold the configured cap, even while it binds
    ctl = CapController(CapLaw(), 16)
    assert all(ctl.observe(t, EngineSample(), 16) == 16 for t in range(1, 20))
    # queue and KV unknown: no limit, the throughput climb still runs
    ctl = CapController(CapLaw(), 8)
    ctl.observe(0.25, EngineSample(generation_tokens=0.0), 8)
    assert ctl.observe(0.5, EngineSample(generation_tokens=80.0), 8) == 16
    # no throughput series: grows only while the engine shows no queue (AIMD)
    ctl = CapController(CapLaw(), 8)
    assert ctl.observe(1.0, EngineSample(waiting=0.0, kv_usage=0.1), 8) == 8  # settling
    assert ctl.observe(2.0, EngineSample(waiting=9.0, kv_usage=0.1), 8) > 8
    assert ctl.observe(3.0, EngineSample(waiting=9.0, kv_usage=0.1), 16) == 16 - 9 + 2


def test_holds_when_the_cap_does_not_bind() -> None:
    ctl = CapController(CapLaw(), 40)
    caps = [ctl.observe(t * 0.25, EngineSample(0.0, 0.2, t * 100.0), 10) for t in range(1, 40)]
    assert set(caps) == {40}


def test_counter_reset_restarts_the_measurement() -> None:
    ctl = CapController(CapLaw(), 8)
    ctl.observe(0.25, EngineSample(0.0, 0.1, 5_000.0), 8)
    # the engine restarted: its counter went back; no judgement from a negative delta
    assert ctl.observe(0.5, EngineSample(0.0, 0.1, 10.0), 8) == 8
    assert ctl.observe(0.75, EngineSample(0.0, 0.1, 30.0), 8) == 8  # settling
    assert ctl.observe(1.0, EngineSample(0.0, 0.1, 110.0), 8) == 16


def test_a_window_of_few_engine_iterations_is_extended() -> None:
    """8 in flight, 16 tokens per sample: two iterations, too few to judge a rate by. The
    level is measured until its window spans `min_iterations` (here 4 samples, 64 tokens)."""
    ctl = CapController(CapLaw(min_iterations=8), 8)
    caps = [ctl.observe(0.25 * i, EngineSample(0.0, 0.1, 16.0 * i), 8) for i in range(1, 6)]
    assert caps == [8, 8, 8, 8, 16], caps  # settle, three short samples, judged on the fourth
    ctl = CapController(CapLaw(min_iterations=0), 8)
    caps = [ctl.observe(0.25 * i, EngineSample(0.0, 0.1, 16.0 * i), 8) for i in range(1, 3)]
    assert caps == [8, 16], caps  # without the rule: judged on two iterations
    # a stalled engine (no tokens) is judged after 4x the samples, not never
    ctl = CapController(CapLaw(min_iterations=8), 8)
    caps = [ctl.observe(0.25 * i, EngineSample(0.0, 0.1, 0.0), 8) for i in range(1, 6)]
    assert caps == [8, 8, 8, 8, 16], caps


def test_stays_within_bounds() -> None:
    ctl = CapController(CapLaw(min_cap=4, max_cap=50), 1)
    assert ctl.cap == 4
    _, _, caps = drive(ctl, 30.0, 10_000)
    assert max(caps) == 50 and min(caps) >= 4
    ctl = CapController(CapLaw(min_cap=4, max_cap=50), 10)
    for t in range(1, 30):
        ctl.observe(float(t), EngineSample(500.0, 1.0, 0.0), 10)
    assert ctl.cap == 4


def test_law_validation() -> None:
    with pytest.raises(ValueError):
        CapLaw(min_cap=5, max_cap=4)
    with pytest.raises(ValueError):
        CapLaw(dwell=0)
    with pytest.raises(ValueError):
        CapLaw(slow_start_factor=1.0)


def test_combine_kv_takes_the_fullest_engine() -> None:
    assert combine_kv([0.6, 0.7]) == 0.7  # two engines never read as 130%
    assert combine_kv([]) is None


def test_priority_level_keeps_the_order() -> None:
    indices = [10.0**e for e in range(-8, 3)]
    keys = sorted(-x for x in indices)  # SageSched: minus the Gittins index, lower first
    levels = [priority_level(k) for k in keys]
    assert levels == sorted(levels) and len(set(levels)) == len(levels)
    lengths = [1.0, 3.0, 10.0, 300.0, 4096.0]  # a positive key (predicted length)
    assert [priority_level(k) for k in lengths] == sorted(priority_level(k) for k in lengths)
    # a factor of 2 is 4 levels apart; within 19% may share a level (FCFS inside vLLM)
    assert priority_level(-0.5) - priority_level(-1.0) == 4
    assert priority_level(0.0) == 0 and priority_level(-math.inf) < priority_level(-1e-300)


def test_a_level_is_judged_only_after_half_its_cap_turned_over() -> None:
    """After slow start, a new level's rate is biased until its batch has turned over: it
    is not judged before `turnover` x cap requests finished since the move."""
    law = CapLaw(min_iterations=0, turnover=0.5)
    ctl = CapController(law, 20)
    ctl.slow_start = False
    tokens, t = 0.0, 0.0
    finished = 0
    caps = []
    for _ in range(12):
        t += 1.0
        tokens += 200.0
        finished += 2  # 2 requests leave per sample: 10 (half of 20) after 5 samples
        caps.append(ctl.observe(t, EngineSample(0.0, 0.1, tokens), 20, finished))
    first_move = next(i for i, c in enumerate(caps) if c != 20)
    # sample 1 starts the counter, then settle, then 10 finished, then a 2-sample dwell
    assert first_move >= 6, caps
    # not counted (None): judged after settle + dwell alone
    ctl = CapController(law, 20)
    ctl.slow_start = False
    caps = [ctl.observe(float(i), EngineSample(0.0, 0.1, 200.0 * i), 20) for i in range(1, 6)]
    assert caps.index(next(c for c in caps if c != 20)) <= 3, caps


def test_a_move_that_did_not_pay_is_undone() -> None:
    """Up from 32 to 48 on a flat rate: back to 32 in one move (not 48 / 1.125 = 43)."""
    ctl = CapController(CapLaw(min_iterations=0), 32)
    ctl.slow_start = False
    t, tokens = 0.0, 0.0
    caps = []
    for _ in range(40):
        t += 1.0
        tokens += 1000.0  # flat: the same rate at any cap
        caps.append(ctl.observe(t, EngineSample(0.0, 0.1, tokens), ctl.cap))
    levels = [c for i, c in enumerate(caps) if i == 0 or c != caps[i - 1]]
    assert levels[:4] == [32, 36, 32, 28], levels  # up, undone, then down from 32
