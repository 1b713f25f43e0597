"""The self-tuning cap's control law and vLLM priority levels (`policies.capacity`)."""

from __future__ import annotations

import itertools
import math
import random
import statistics
from dataclasses import replace

import pytest

from policies.capacity import (
    CapController,
    CapLaw,
    EngineSample,
    combine_kv,
    priority_level,
)
from policies.engine_fit import Reading, interval_between


class LinearEngine:
    """An engine whose iteration takes alpha + beta * B seconds (relative jitter `noise`),
    every running request one token per iteration: throughput B / (alpha + beta B), whose
    plateau share f is reached at B_f = f / (1 - f) * alpha / beta (the known knee).
    Demand keeps `demand` requests at the gateway; beyond `max_seqs` they wait inside it."""

    def __init__(self, alpha: float, beta: float, *, noise: float = 0.02, seed: int = 1) -> None:
        self.alpha, self.beta, self.noise = alpha, beta, noise
        self.rng = random.Random(seed)
        self.t = self.tokens = self.iterations = 0.0

    def knee(self, fraction: float = CapLaw().plateau_fraction) -> float:
        return fraction / (1 - fraction) * self.alpha / self.beta

    def drive(
        self,
        ctl: CapController,
        seconds: float,
        *,
        demand: int = 10_000,
        max_seqs: int | None = None,
        kv: float = 0.3,
    ) -> list[int]:
        caps, end = [], self.t + seconds
        while self.t < end:
            dt = ctl.interval_s
            inflight = min(ctl.cap, demand)
            running = inflight if max_seqs is None else min(inflight, max_seqs)
            step = (self.alpha + self.beta * running) * (1 + self.rng.gauss(0, self.noise))
            n = dt / step
            self.t += dt
            self.tokens += n * running
            self.iterations += n
            sample = EngineSample(
                waiting=float(inflight - running), kv_usage=kv, generation_tokens=self.tokens,
                running=float(running), iterations=self.iterations,
            )  # fmt: skip
            caps.append(ctl.observe(self.t, sample, inflight))
        return caps


def within(caps: list[int], knee: float, tolerance: float = 0.2) -> bool:
    """The last 10 samples average within ±tolerance of `knee`, and none is further off than
    the refinement dither (`CapLaw.refine_step`) adds to that."""
    tail = caps[-10:]
    spread = tolerance + CapLaw().refine_step
    return abs(statistics.mean(tail) - knee) <= tolerance * knee and all(
        abs(c - knee) <= spread * knee for c in tail
    )


CPU_TINY = (0.00613, 0.000677)
"""The vLLM CPU build's fitted iteration (6.13 ms + 0.677 ms per request): knee ~18."""
H200_SHORT = (0.00508, 0.0000509)
"""H200 Llama-8B decode at ~1,300 tokens of context per request: knee ~200."""


@pytest.mark.parametrize("engine", [CPU_TINY, H200_SHORT, (0.02, 0.002)])
def test_settles_at_the_knee_from_a_cold_start(engine: tuple[float, float]) -> None:
    e = LinearEngine(*engine)
    ctl = CapController(CapLaw(), 8)
    caps = e.drive(ctl, 30.0)
    assert within(caps, e.knee()), (e.knee(), caps)
    assert ctl.confident() and not ctl.slow_start


def test_lands_in_the_same_place_on_identical_runs() -> None:
    """Five runs of the same engine with different jitter: the settled caps within ±20% of
    their median (the hill climb it replaces wandered between 7 and 25 on a flat curve)."""
    ends = []
    for seed in range(5):
        e = LinearEngine(*CPU_TINY, noise=0.03, seed=seed)
        ends.append(e.drive(CapController(CapLaw(), 8), 40.0)[-1])
    median = statistics.median(ends)
    assert all(abs(c - median) <= 0.2 * median for c in ends), ends


def test_comes_down_from_far_above() -> None:
    e = LinearEngine(*CPU_TINY)
    caps = e.drive(CapController(CapLaw(), 600), 30.0)
    assert within(caps, e.knee()), caps


def test_follows_a_change_of_the_engine() -> None:
    """The engine becomes 4x more efficient per request (beta / 4): the curve no longer
    matches, the fit starts over and the cap settles at the new knee."""
    e = LinearEngine(*CPU_TINY)
    ctl = CapController(CapLaw(), 8)
    e.drive(ctl, 30.0)
    old = e.knee()
    e.beta /= 4
    caps = e.drive(ctl, 120.0)
    assert ctl.changes >= 1
    assert within(caps, e.knee()), (old, e.knee(), caps)


def test_a_remembered_curve_starts_at_the_knee() -> None:
    e = LinearEngine(*CPU_TINY)
    first = CapController(CapLaw(), 8)
    e.drive(first, 30.0)
    memory = first.memory()
    restarted = CapController(CapLaw(), 8, memory=memory)
    assert restarted.confident() and not restarted.slow_start
    assert abs(restarted.cap - e.knee()) <= 0.2 * e.knee()
    caps = e.drive(restarted, 5.0)
    assert within(caps, e.knee()), caps
    # a different engine behind the same name: detected, re-learnt
    other = LinearEngine(CPU_TINY[0], CPU_TINY[1] / 4, seed=3)
    ctl = CapController(CapLaw(), 8, memory=memory)
    caps = other.drive(ctl, 60.0)
    assert ctl.changes == 1 and within(caps, other.knee()), (other.knee(), caps)


def test_slow_start_does_not_outrun_the_fit() -> None:
    """A knee below the starting cap (about 5.7 < 8): from a cold start the cap takes one step
    to a second batch size (8 -> 12) and holds it until the fit has an estimate, instead of
    doubling while it has none (8 -> 16 -> 32 released the backlog the policy orders). The
    curve stays untrusted here, so the cap ends at the floor of 8. A knee far above (the
    H200's ~200) is still reached in `test_settles_at_the_knee_from_a_cold_start`."""
    e = LinearEngine(0.002, 0.002, noise=0.05, seed=2)
    ctl = CapController(CapLaw(), 8)
    caps = e.drive(ctl, 30.0)
    assert max(caps) == 12 and caps[-10:] == [8] * 10, caps


def test_an_uncertain_cap_errs_high() -> None:
    """A knee below the starting cap (5.7 < 8) behind noisy samples: while the curve is not
    trusted, exploration does not take the cap below where it started (too small a cap
    throttles the engine); without that floor the same run explores down to 3."""

    def exploring(law: CapLaw) -> list[int]:
        e = LinearEngine(0.002, 0.002, noise=0.25, seed=2)
        ctl = CapController(law, 8)
        caps = []
        for _ in range(40):
            cap = e.drive(ctl, 1.0)[-1]
            if not ctl.confident() and not ctl.slow_start:
                caps.append(cap)
        return caps

    floored, unfloored = exploring(CapLaw()), exploring(CapLaw(uncertain_floor=1))
    assert len(floored) >= 10 and min(floored) >= 8, floored
    assert min(unfloored) < 8, unfloored


def test_an_exploration_that_cannot_pay_rests_at_one_level() -> None:
    """A noisy engine (20% jitter per sample, knee 15): where the fit's error could not
    reach `confident_error` within `explore_horizon` more observations, the cap rests at the
    discounted estimate instead of alternating between probes. Over six runs' last 30 s the
    cap moves a few times in all; with an endless horizon (always explore) the same runs move
    it dozens of times."""

    def moves(law: CapLaw) -> tuple[int, int]:
        total = rested = 0
        for seed in range(6):
            e = LinearEngine(0.0053, 0.002, noise=0.2, seed=seed)
            ctl = CapController(law, 8)
            caps = e.drive(ctl, 60.0)[-30:]
            total += sum(a != b for a, b in itertools.pairwise(caps))
            rested += ctl.trace(EngineSample(), 0)["rest"] is not None
        return total, rested

    (resting, rested), (probing, _) = moves(CapLaw()), moves(CapLaw(explore_horizon=math.inf))
    assert resting <= 10 and rested >= 4, (resting, rested)
    assert probing >= 30, probing


def test_an_untrusted_memory_lends_its_evidence_not_its_cap() -> None:
    """A gateway stopped while its cap explored low (the curve not trusted yet) restarts
    at its configured cap, in slow start, with the evidence kept."""
    e = LinearEngine(*CPU_TINY, noise=0.3)
    first = CapController(CapLaw(), 8)
    e.drive(first, 3.0)
    assert not first.confident()
    first.cap = 2
    memory = first.memory()
    assert memory is not None
    restarted = CapController(CapLaw(), 8, memory=memory)
    assert restarted.cap == 8 and restarted.slow_start
    assert restarted.fit.observations == pytest.approx(first.fit.observations)


def test_a_malformed_memory_is_a_cold_start() -> None:
    ctl = CapController(CapLaw(), 8, memory={"fit": {"xx": "nonsense"}})
    assert ctl.cap == 8 and ctl.slow_start and not ctl.confident()


def test_engine_queue_caps_at_what_it_runs() -> None:
    """The knee lies beyond what the engine runs (64): the cap stays just above it."""
    e = LinearEngine(0.02, 0.00001)  # knee 4,000
    caps = e.drive(CapController(CapLaw(), 8), 60.0, max_seqs=64)
    tail = caps[-20:]
    assert min(tail) >= 64 - 1 and max(tail) <= 64 * 1.25, tail


def test_waiting_limit_cuts_to_running_plus_allowance() -> None:
    ctl = CapController(CapLaw(waiting_high=2), 300)
    assert ctl.observe(1.0, EngineSample(30.0, 0.5, 100.0), 300) == 300  # once: a transient
    assert ctl.observe(2.0, EngineSample(30.0, 0.5, 200.0), 300) == 300 - 30 + 2
    assert not ctl.slow_start


def test_after_slow_start_a_queue_must_last_to_count() -> None:
    """A burst's prefill backlog (prompts waiting a few steps for the token budget) is no
    limit; a queue that stays `queue_confirm_s` is. (30 in flight under a cap of 40: the cap
    does not bind, so nothing but the queue can move it.)"""
    ctl = CapController(CapLaw(waiting_high=2, queue_confirm_s=5.0), 40)
    ctl.slow_start = False

    def queue(t: int, waiting: float) -> int:
        return ctl.observe(float(t), EngineSample(waiting, 0.5, 100.0 * t), 30)

    assert [queue(t, 10.0) for t in range(1, 5)] == [40] * 4  # 3 s of queue: a backlog
    queue(5, 0.0)  # it clears
    caps = [queue(t, 10.0) for t in range(6, 13)]
    # 5 s of queue: the engine runs no more than 20; the cap goes to that plus the allowance
    assert caps[:5] == [40] * 5 and caps[5] == 30 - 10 + 2, caps


def test_kv_limit_backs_off_and_holds_a_ceiling() -> None:
    ctl = CapController(CapLaw(kv_high=0.9, backoff=0.125, limit_hold_s=30.0), 80)
    assert ctl.observe(1.0, EngineSample(0.0, 0.95, 0.0), 80) == 70
    assert ctl.observe(2.0, EngineSample(None, 0.99, None), 70) == 61  # queue unknown: KV alone
    # a knee far above: the curve may not lift the cap over the ceiling for limit_hold_s
    e = LinearEngine(0.02, 0.00001)
    e.t = 2.0
    caps = e.drive(ctl, 20.0, kv=0.5)
    assert max(caps) <= 61, caps


def test_unknown_series_are_not_zero() -> None:
    # nothing known (no /metrics): hold the configured cap, even while it binds
    ctl = CapController(CapLaw(), 16)
    assert all(ctl.observe(t, EngineSample(), 16) == 16 for t in range(1, 20))
    # no throughput series: grows only while the engine shows no queue (AIMD)
    ctl = CapController(CapLaw(), 8)
    assert ctl.observe(1.0, EngineSample(waiting=0.0, kv_usage=0.1), 8) > 8
    assert ctl.observe(3.0, EngineSample(waiting=9.0, kv_usage=0.1), 16) > 8
    assert ctl.observe(4.0, EngineSample(waiting=9.0, kv_usage=0.1), 16) == 16 - 9 + 2


def test_holds_when_the_cap_does_not_bind() -> None:
    ctl = CapController(CapLaw(), 40)
    caps = [ctl.observe(t * 0.25, EngineSample(0.0, 0.2, t * 100.0), 10) for t in range(1, 40)]
    assert set(caps) == {40}


def test_counter_reset_is_skipped() -> None:
    ctl = CapController(CapLaw(), 8)
    ctl.observe(0.25, EngineSample(0.0, 0.1, 5_000.0, running=8.0), 8)
    # the engine restarted: its counter went back; no interval from a negative delta
    ctl.observe(0.5, EngineSample(0.0, 0.1, 10.0, running=8.0), 8)
    assert ctl.fit.observations == 0


def test_samples_of_one_batch_are_merged_and_a_moved_batch_is_not_fitted() -> None:
    law = CapLaw(min_iterations=8)
    ctl = CapController(law, 8)

    def sample(tokens: float, running: float, iterations: float) -> EngineSample:
        return EngineSample(0.0, 0.1, tokens, running=running, iterations=iterations)

    ctl.observe(0.25, sample(100.0, 8.0, 10.0), 8)
    ctl.observe(0.5, sample(200.0, 20.0, 16.0), 20)  # 8 -> 20: the batch moved too far
    assert ctl.fit.observations == 0
    ctl.observe(0.75, sample(300.0, 20.0, 21.0), 20)  # 5 iterations: gathered, not yet fitted
    assert ctl.fit.observations == 0
    ctl.observe(1.0, sample(400.0, 20.0, 26.0), 20)  # 10 iterations of one batch: one point
    assert ctl.fit.observations == pytest.approx(1.0)
    # idle at one end: part of the interval may have been idle
    ctl.observe(1.25, sample(410.0, 0.0, 27.0), 0)
    assert ctl.fit.observations == pytest.approx(1.0, rel=1e-3)


def test_a_counted_batch_is_its_mean_whatever_the_ends() -> None:
    """With the engine's iteration counter, output tokens per iteration is the mean decoding
    batch even when the batch moved between the readings (within `COUNTED_BATCH`); without
    it, the ends must agree."""
    last = Reading(0.0, EngineSample(0.0, 0.1, 0.0, running=10.0, iterations=0.0), 10)
    now = Reading(1.0, EngineSample(0.0, 0.1, 180.0, running=16.0, iterations=10.0), 16)
    counted = interval_between(last, now)
    assert counted is not None and counted.batch == pytest.approx(16.0)
    assert counted.in_batch == pytest.approx(16.0)  # never fewer than the decoding ones
    plain = [replace(r, sample=replace(r.sample, iterations=None)) for r in (last, now)]
    assert interval_between(*plain) is None  # 10 -> 16 is beyond STEADY_BATCH
    far = replace(now, sample=replace(now.sample, running=25.0))
    assert interval_between(last, far) is None  # beyond COUNTED_BATCH


def test_stays_within_bounds() -> None:
    ctl = CapController(CapLaw(min_cap=4, max_cap=50), 1)
    assert ctl.cap == 4
    caps = LinearEngine(0.02, 0.00001).drive(ctl, 30.0)
    assert max(caps) == 50 and min(caps) >= 4
    ctl = CapController(CapLaw(min_cap=4, max_cap=50), 10)
    for t in range(1, 30):
        ctl.observe(float(t), EngineSample(500.0, 1.0, 0.0), 10)
    assert ctl.cap == 4


def test_law_validation() -> None:
    with pytest.raises(ValueError):
        CapLaw(min_cap=5, max_cap=4)
    with pytest.raises(ValueError):
        CapLaw(min_iterations=0)
    with pytest.raises(ValueError):
        CapLaw(slow_start_factor=1.0)
    with pytest.raises(ValueError):
        CapLaw(plateau_fraction=1.0)
    with pytest.raises(ValueError):
        CapLaw(explore_rest_s=300.0)  # beyond its own maximum


def test_the_cost_profile_comes_from_the_fit() -> None:
    e = LinearEngine(*CPU_TINY)
    ctl = CapController(CapLaw(), 8)
    assert ctl.profile() is None
    e.drive(ctl, 30.0)
    profile = ctl.profile()
    assert profile is not None
    assert profile.prefill_base_s == pytest.approx(CPU_TINY[0], rel=0.2)
    assert profile.step_s == pytest.approx(CPU_TINY[0] / ctl.cap + CPU_TINY[1], rel=0.2)


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


def test_trace_says_why_the_cap_is_where_it_is() -> None:
    import json

    e = LinearEngine(*CPU_TINY)
    ctl = CapController(CapLaw(), 8)
    e.drive(ctl, 30.0)
    sample = EngineSample(waiting=0.0, generation_tokens=1.0)
    record = json.loads(json.dumps(ctl.trace(sample, 5)))
    assert record["cap"] == ctl.cap and record["inflight"] == 5
    assert record["sample"] == {"waiting": 0.0, "generation_tokens": 1.0}
    assert record["efficient"][0] == pytest.approx(ctl.efficient_batch()[0], rel=0.01)  # type: ignore[index]
    assert record["fit"]["alpha"] == pytest.approx(CPU_TINY[0], rel=0.2)
