"""Every registered policy passes the same checks; new policies are picked up automatically."""

from __future__ import annotations

import numpy as np
import pytest

from policies import Job, LengthDist, Scheduler, make_policy, policy_class, policy_names


def workload(seed: int, n: int = 60) -> list[Job]:
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(n):
        true = int(rng.lognormal(4, 1.2)) + 1
        jobs.append(
            Job(
                id=i,
                arrival_s=float(rng.integers(0, 10)),  # many ties on arrival
                prompt_tokens=int(rng.integers(1, 3000)),
                tenant=f"t{rng.integers(0, 3)}",
                deadline_s=float(rng.uniform(5, 50)) if rng.random() < 0.8 else None,
                dist=LengthDist.noisy_oracle(true, 0.5, rng),
                true_output_tokens=true,
            )
        )
    return jobs


def drain(name: str, seed: int) -> list[int]:
    """Admit a workload, serve it one job at a time with some progress, return the order."""
    s = Scheduler(make_policy(name))
    for j in workload(seed):
        s.admit(j, j.arrival_s)
    out, now = [], 10.0
    while (j := s.dispatch(now)) is not None:
        out.append(j.id)
        s.progress(j, 3, now)
        s.finish(j, now)
        now += 0.5
    return out


@pytest.mark.parametrize("name", policy_names())
def test_deterministic_total_order(name: str) -> None:
    first = drain(name, seed=7)
    assert sorted(first) == list(range(60))  # nothing lost or duplicated
    assert drain(name, seed=7) == first  # same input, same order (state is per run)


@pytest.mark.parametrize("name", policy_names())
def test_rekey_keeps_queue_valid(name: str) -> None:
    policy = make_policy(name)
    s = Scheduler(policy)
    jobs = workload(3)
    for j in jobs:
        s.admit(j, j.arrival_s)
    for j in jobs[::3]:  # predictions change while queued
        j.dist = LengthDist.point(5)
        s.queue.rekey(j, 10.0)
    popped = []
    while (j := s.queue.pop(10.0)) is not None:
        popped.append(j)
    assert len(popped) == len(jobs)
    if not policy.revalidate_on_pop:
        keys = [(s.policy.key(j, 10.0), j.arrival_s, j.id) for j in popped]
        assert keys == sorted(keys)


@pytest.mark.parametrize("name", policy_names())
def test_contract_metadata(name: str) -> None:
    cls = policy_class(name)
    assert cls.name == name and cls.description
    policy = make_policy(name)
    assert isinstance(policy.preemptive, bool)
    clone = policy.fresh()
    assert clone is not policy and clone.params() == policy.params()


@pytest.mark.parametrize("name", policy_names())
def test_two_engines_same_order(name: str) -> None:
    """Two schedulers built from one template, fed the same events, decide the same."""
    template = make_policy(name)
    a, b = Scheduler(template), Scheduler(template)
    orders = []
    for s in (a, b):
        for j in workload(11):
            s.admit(j, j.arrival_s)
        order = []
        while (j := s.dispatch(20.0)) is not None:
            order.append(j.id)
            s.finish(j, 20.0)
        orders.append(order)
    assert orders[0] == orders[1]
