"""SageSched preempts only when the swap pays, and `cost=time` reads the engine's profile."""

from __future__ import annotations

import pytest

from policies.catalog.sagesched import DEFAULT_ENGINE
from policies.cost import LinearProfile
from policies.dist import LengthDist
from policies.job import Job
from policies.registry import parse_policy
from policies.scheduler import Scheduler


def _job(i: int, prompt: int, length: float, generated: int = 0, at: float = 0.0) -> Job:
    job = Job(i, at, prompt, dist=LengthDist.point(length))
    job.generated = generated
    return job


def _victim_for(spec: str, victim: Job, waiting: Job) -> Job | None:
    """The victim a one-slot scheduler picks when `waiting` arrives (default engine costs)."""
    s = Scheduler(parse_policy(spec))
    s.admit(victim, 0.0)
    s.dispatch(0.0)
    s.admit(waiting, 1.0)
    return s.preemption_victim(1.0)


def test_a_long_recompute_for_a_small_saving_does_not_pay() -> None:
    # the index prefers the 10-token job over the last 60 tokens of one with a 3,000-token
    # prompt; recomputing 3,000+ tokens stalls the batch longer than 50 decode steps save
    victim = _job(0, 3000, 100.0)
    victim.generated = 40
    waiting = _job(1, 10, 10.0, at=1.0)
    assert _victim_for("sagesched:preempt_rule=index", victim, waiting) is not None
    victim = _job(0, 3000, 100.0)
    victim.generated = 40
    assert _victim_for("sagesched", victim, _job(1, 10, 10.0, at=1.0)) is None


def test_a_large_saving_for_a_short_recompute_pays() -> None:
    victim = _job(0, 20, 2000.0)
    victim.generated = 5
    assert _victim_for("sagesched", victim, _job(1, 10, 10.0, at=1.0)) is victim


def test_the_rule_is_the_exchange_argument() -> None:
    policy = parse_policy("sagesched").on_engine(LinearProfile(0.0, 1e-4, 1e-3))
    waiting = _job(1, 10, 50.0)  # R_w = 50

    def victim(remaining: float) -> Job:  # recompute 990 + 10 tokens: 0.1 s
        return _job(0, 990, 10 + remaining, generated=10)

    # alone in the engine, one queued: saving (R_v − 50)·1·1e-3 must beat (1 + 1)·0.1 s
    for remaining, expected in ((250.0, False), (251.0, True)):
        v = victim(remaining)
        assert policy.preemption_pays(waiting, v, [v], 1) is expected
    # a queue behind makes the recompute dearer: 9 queued, R_v − 50 > 1,000
    v = victim(1049.0)
    assert not policy.preemption_pays(waiting, v, [v], 9)
    v = victim(1051.0)
    assert policy.preemption_pays(waiting, v, [v], 9)


def test_no_swap_pays_when_a_slot_frees_soon_anyway() -> None:
    policy = parse_policy("sagesched").on_engine(LinearProfile(0.0, 1e-4, 1e-3))
    waiting = _job(1, 10, 50.0)
    v = _job(0, 990, 10_010.0, generated=10)
    almost_done = _job(2, 10, 100.0, generated=40)  # 60 tokens left: a slot in 60 steps
    assert not policy.preemption_pays(waiting, v, [v, almost_done], 1)
    busy = _job(3, 10, 6000.0, generated=1000)  # 5,000 left: swapping saves ~950 steps
    short_victim = _job(0, 990, 1010.0, generated=10)  # 1,000 left; the other has 5,000
    assert policy.preemption_pays(waiting, short_victim, [short_victim, busy], 1)


def test_the_engine_sets_the_cost_profile_once() -> None:
    lat = LinearProfile(0.01, 1e-4, 1e-3, 1e-6)
    s = Scheduler(parse_policy("sagesched:cost=time"), lat)
    assert s.policy.latency == lat
    assert s.policy.fresh().latency == lat  # kept across runs
    assert s.policy.label() == "sagesched:cost=time"  # not a user parameter
    mine = LinearProfile(0.0, 0.0, 2e-3, 0.0)
    assert parse_policy("sagesched").on_engine(mine).on_engine(lat).latency == mine
    assert parse_policy("sagesched").latency is None
    assert DEFAULT_ENGINE.prefill_s_per_token > 0


def test_time_cost_orders_by_engine_time_not_by_tokens() -> None:
    # same predicted output, different prompts: `tokens` cannot tell them apart, `time`
    # charges the long prompt's prefill and context
    lat = LinearProfile(0.005, 2e-5, 1e-4, 3e-8)
    short, long = _job(0, 10, 200.0), _job(1, 4000, 200.0)
    tokens = parse_policy("sagesched:cost=tokens")
    assert tokens.key(short, 0.0) == tokens.key(long, 0.0)
    time = parse_policy("sagesched:cost=time").on_engine(lat)
    assert time.key(short, 0.0) < time.key(long, 0.0)
    # and it is not `tokens` scaled: a long prompt can outweigh a shorter answer
    longer_answer = _job(2, 10, 400.0)
    assert time.key(longer_answer, 0.0) < time.key(long, 0.0)
    assert tokens.key(longer_answer, 0.0) > tokens.key(long, 0.0)


def test_unknown_rule_is_an_error() -> None:
    with pytest.raises(ValueError, match="preempt_rule"):
        parse_policy("sagesched:preempt_rule=sometimes")
