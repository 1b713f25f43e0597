"""Running jobs are compared by their key at their current attained service, for every policy.

A key stored at dispatch or at the last review point goes stale as tokens stream (a Gittins
index rises between support points, a predicted remaining length shrinks); these properties
pin that every decision over running jobs uses a fresh `policy.key` at `job.generated`.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import Job, LengthDist, Scheduler, make_policy, policy_names

# sagesched once per cost model besides the registered default (kv)
POLICIES: list[tuple[str, dict[str, str]]] = [(name, {}) for name in policy_names()] + [
    ("sagesched", {"cost": "tokens"}),
    ("sagesched", {"cost": "time"}),
]


@st.composite
def dists(draw: st.DrawFn) -> LengthDist:
    support = draw(st.lists(st.integers(1, 4000), min_size=1, max_size=8, unique=True))
    probs = draw(st.lists(st.floats(0.01, 1.0), min_size=len(support), max_size=len(support)))
    return LengthDist(sorted(support), probs)


@st.composite
def running_jobs(draw: st.DrawFn, job_id: int) -> tuple[Job, list[int]]:
    """A job with a random belief, true length and cap, and the token chunks it will stream."""
    dist = draw(dists())
    true = int(draw(st.sampled_from(dist.support.tolist())))
    job = Job(
        id=job_id,
        arrival_s=float(draw(st.integers(0, 3))),
        prompt_tokens=draw(st.integers(1, 3000)),
        max_tokens=draw(st.none() | st.integers(1, 5000)),
        tenant=draw(st.sampled_from(["a", "b"])),
        deadline_s=draw(st.none() | st.floats(5, 50)),
        dist=dist,
        true_output_tokens=true,
    )
    chunks = draw(st.lists(st.integers(1, 300), max_size=6))  # may overrun the support
    return job, chunks


@pytest.mark.parametrize(
    ("name", "params"),
    POLICIES,
    ids=[name + "".join(f":{k}={v}" for k, v in p.items()) for name, p in POLICIES],
)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_running_keys_are_fresh_at_attained_service(
    name: str, params: dict[str, str], data: st.DataObject
) -> None:
    s = Scheduler(make_policy(name, **params))
    running = [data.draw(running_jobs(i)) for i in range(data.draw(st.integers(1, 4)))]
    for job, _ in running:
        s.admit(job, job.arrival_s)
    while s.dispatch(4.0) is not None:
        pass
    now = 4.0
    for job, chunks in running:  # stream in random chunks, past review points or not
        for n in chunks:
            now += 0.25
            s.progress(job, n, now)
    waiting, _ = data.draw(running_jobs(99))
    waiting.arrival_s = now
    s.admit(waiting, now)

    for job, _ in running:
        # the same job at the same attained service, keyed from scratch
        clone = dataclasses.replace(job, ctx=None)
        assert s.running_key(job, now) == s.policy.key(clone, now)

    victim = s.preemption_victim(now)
    candidates = [j for j, _ in running if s.policy.preemptive and s.policy.can_be_preempted(j)]
    if not candidates:
        assert victim is None
        return
    worst = max(candidates, key=lambda j: (s.policy.key(j, now), j.arrival_s, j.id))
    head = s.queue.peek(now)
    assert head is not None
    beats = s.queue.key_of(head) < s.policy.key(worst, now)
    pays = beats and s.policy.preemption_pays(head, worst, list(s.running.values()), len(s.queue))
    assert victim is (worst if pays else None)
