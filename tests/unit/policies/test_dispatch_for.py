"""`Scheduler.dispatch_for`: the waiting job best on the backend whose slot freed."""

from __future__ import annotations

import numpy as np
import pytest

from policies import Job, LengthDist, LinearProfile, Scheduler, make_policy, parse_policy

PROFILE = LinearProfile(prefill_base_s=5e-3, prefill_s_per_token=2e-5, step_s=1e-4)


def jobs(seed: int, n: int = 40) -> list[Job]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        true = int(rng.integers(5, 400))
        out.append(
            Job(
                id=i,
                arrival_s=float(rng.integers(0, 5)),
                prompt_tokens=int(rng.integers(16, 8000)),
                dist=LengthDist.noisy_oracle(true, 0.3, rng),
                true_output_tokens=true,
            )
        )
    return out


def cached_on_b(job: Job) -> int:
    """A backend holding most of every third prompt."""
    return job.prompt_tokens - 16 if job.id % 3 == 0 else 0


def order(spec: str, slot_aware: bool, seed: int = 1) -> list[int]:
    s = Scheduler(parse_policy(spec), PROFILE)
    for j in jobs(seed):
        s.admit(j, j.arrival_s)
    picked = []
    while True:
        j = s.dispatch_for(10.0, cached_on_b) if slot_aware else s.dispatch(10.0)
        if j is None:
            return picked
        picked.append(j.id)
        s.finish(j, 10.0)


@pytest.mark.parametrize("spec", ["fcfs", "sagesched", "sagesched:cost=tokens", "ssjf"])
def test_a_key_blind_to_the_cache_dispatches_as_before(spec: str) -> None:
    assert order(spec, slot_aware=True) == order(spec, slot_aware=False)


def test_time_cost_prefers_the_job_cached_on_that_backend() -> None:
    aware, plain = order("sagesched:cost=time", True), order("sagesched:cost=time", False)
    assert sorted(aware) == sorted(plain) == list(range(40))
    assert aware != plain
    first_cached = [i for i in aware if i % 3 == 0][:5]
    assert aware.index(first_cached[-1]) < plain.index(first_cached[-1])


def test_winner_keeps_its_discount_and_the_others_theirs() -> None:
    s = Scheduler(make_policy("sagesched", cost="time"), PROFILE)
    short = Job(id=0, arrival_s=0.0, prompt_tokens=4000, dist=LengthDist.point(50))
    cached = Job(id=1, arrival_s=0.0, prompt_tokens=4000, dist=LengthDist.point(60))
    other = Job(id=2, arrival_s=0.0, prompt_tokens=100, dist=LengthDist.point(900))
    other.cached_tokens = 64  # routed before, requeued
    for j in (short, cached, other):
        s.admit(j, 0.0)
    assert s.queue.peek(0.0) is short  # alone, the shorter job goes first
    here = {0: 0, 1: 4000, 2: 0}
    got = s.dispatch_for(0.0, lambda j: here[j.id])
    assert got is cached and cached.cached_tokens == 4000  # its prefill is free there
    assert short.cached_tokens == 0 and other.cached_tokens == 64
    assert s.dispatch(0.0) is short and s.dispatch(0.0) is other  # the queue is intact
    assert s.dispatch_for(0.0, lambda j: 0) is None


def test_one_candidate_or_a_composite_queue_takes_the_head() -> None:
    for spec, candidates in (("sagesched:cost=time", 1), ("bands:inner=sagesched", 8)):
        s = Scheduler(parse_policy(spec), PROFILE)
        for j in jobs(2, n=10):
            s.admit(j, j.arrival_s)
        head = s.queue.peek(10.0)
        got = s.dispatch_for(10.0, cached_on_b, candidates=candidates)
        assert got is head and got is not None and got.cached_tokens == cached_on_b(got)
