"""Scheduler: hook order, running set, review points and preemption decisions."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from policies import Job, Key, LengthDist, Policy, Scheduler, make_policy


@dataclass(eq=False)
class Recorder(Policy):
    name = "test-recorder"
    description = "records hook calls"
    calls: list[tuple[str, int]] = field(default_factory=list, init=False)

    def key(self, job: Job, now: float) -> Key:
        return (job.arrival_s,)

    def on_admit(self, job: Job, now: float) -> None:
        self.calls.append(("admit", job.id))

    def on_start(self, job: Job, now: float) -> None:
        self.calls.append(("start", job.id))

    def on_progress(self, job: Job, new_tokens: int, now: float) -> None:
        self.calls.append(("progress", new_tokens))

    def on_finish(self, job: Job, now: float) -> None:
        self.calls.append(("finish", job.id))


def test_hooks_in_lifecycle_order_and_fresh_state() -> None:
    template = Recorder()
    s = Scheduler(template)
    a, b = Job(id=1, arrival_s=0, prompt_tokens=1), Job(id=2, arrival_s=1, prompt_tokens=1)
    s.admit(a, 0)
    s.admit(b, 1)
    assert s.dispatch(1) is a
    s.progress(a, 3, 2)
    assert a.generated == 3
    s.finish(a, 3)
    s.finish(b, 3)  # cancelled while queued
    assert len(s.queue) == 0 and not s.running
    assert s.policy.calls == [  # type: ignore[attr-defined]
        ("admit", 1), ("admit", 2), ("start", 1), ("progress", 3), ("finish", 1), ("finish", 2)
    ]  # fmt: skip
    assert template.calls == []  # the configured object is a template, untouched by the run


def test_missing_prediction_is_refused() -> None:
    s = Scheduler(make_policy("sagesched"))
    with pytest.raises(ValueError, match="needs a predicted length"):
        s.admit(Job(id=1, arrival_s=0, prompt_tokens=1), 0)
    with pytest.raises(ValueError, match="needs the true length"):
        Scheduler(make_policy("sjf-oracle")).admit(Job(id=1, arrival_s=0, prompt_tokens=1), 0)


def test_progress_reports_review_points() -> None:
    s = Scheduler(make_policy("sagesched"))
    j = Job(id=1, arrival_s=0, prompt_tokens=10, dist=LengthDist([4, 40, 400], [0.4, 0.3, 0.3]))
    s.admit(j, 0)
    s.dispatch(0)
    before = s.running_key(j, 0)
    assert [s.progress(j, 1, 0) for _ in range(4)] == [False, False, False, True]
    assert s.running_key(j, 0) != before


def test_preemption_victim_is_worst_running_and_respects_margin() -> None:
    s = Scheduler(make_policy("srpt-oracle"))
    long_ = Job(id=1, arrival_s=0, prompt_tokens=1, true_output_tokens=1000)
    mid = Job(id=2, arrival_s=0, prompt_tokens=1, true_output_tokens=100)
    short = Job(id=3, arrival_s=1, prompt_tokens=1, true_output_tokens=90)
    for j in (long_, mid):
        s.admit(j, 0)
        s.dispatch(0)
    s.admit(short, 1)
    assert s.preemption_victim(1) is long_
    assert s.preemption_victim(1, margin=0.95) is None  # 90 is not 95% below 1000
    s.requeue(long_, 1, preempted=True)
    assert long_.preemptions == 1 and long_ in s.queue
    assert s.dispatch(1) is short


def test_non_preemptive_policy_never_preempts() -> None:
    s = Scheduler(make_policy("fcfs"))
    s.admit(Job(id=1, arrival_s=0, prompt_tokens=1), 0)
    s.dispatch(0)
    s.admit(Job(id=2, arrival_s=1, prompt_tokens=1), 1)
    assert s.preemption_victim(1) is None


def _running_sagesched(generated: int) -> tuple[Scheduler, Job]:
    """The review's example: support [10, 100] (tokens cost), `generated` tokens done."""
    s = Scheduler(make_policy("sagesched", cost="tokens"))
    j = Job(id=1, arrival_s=0, prompt_tokens=1, dist=LengthDist([10, 100], [0.5, 0.5]))
    s.admit(j, 0)
    s.dispatch(0)
    assert not any(s.progress(j, 1, 0) for _ in range(generated))  # no review point crossed
    return s, j


def test_running_key_is_current_between_review_points() -> None:
    s, j = _running_sagesched(9)
    assert s.running_key(j, 1) == pytest.approx((-0.5,))  # 0.5 / (0.5·1 + 0.5·1), not −0.05
    assert s.running_key(j, 1) == s.policy.key(j, 1)


def test_stale_key_does_not_let_a_worse_job_preempt() -> None:
    s, running = _running_sagesched(9)
    # index 0.1 (a point at 10 tokens): beats the stale −0.05 but not the true −0.5
    s.admit(Job(id=2, arrival_s=1, prompt_tokens=1, dist=LengthDist.point(10)), 1)
    assert s.queue.key_of(next(iter(s.queue))) == pytest.approx((-0.1,))
    assert s.preemption_victim(1) is None
    assert s.running_key(running, 1) < s.queue.key_of(next(iter(s.queue)))


def test_trail_compares_the_current_remaining_estimate() -> None:
    s = Scheduler(make_policy("trail"))
    j = Job(id=1, arrival_s=0, prompt_tokens=1, dist=LengthDist([20, 200], [0.5, 0.5]))
    s.admit(j, 0)
    s.dispatch(0)  # key 20 (median 20, nothing generated); next review at 10 (preempt limit)
    assert not any(s.progress(j, 1, 0) for _ in range(9))
    assert s.running_key(j, 1) == (11.0,)
    s.admit(Job(id=2, arrival_s=1, prompt_tokens=1, dist=LengthDist.point(15)), 1)
    assert s.preemption_victim(1) is None  # 15 beats the stale 20, not the true 11
