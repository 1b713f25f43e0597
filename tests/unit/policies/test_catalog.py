"""Each catalog policy orders a small hand-made set of jobs as its definition says."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import Job, LengthDist, Scheduler, make_policy, parse_policy, policy_names
from policies.catalog.fastserve import FastServe
from policies.catalog.vtc import VTC


def job(i: int, arrival: float = 0.0, prompt: int = 10, **kw: object) -> Job:
    return Job(id=i, arrival_s=arrival, prompt_tokens=prompt, **kw)  # type: ignore[arg-type]


def order(policy_name: str, jobs: list[Job], now: float = 0.0, **params: object) -> list[int]:
    s = Scheduler(make_policy(policy_name, **params))
    for j in jobs:
        s.admit(j, j.arrival_s)
    out = []
    while (j := s.dispatch(now)) is not None:
        out.append(j.id)
    return out


def test_catalog_has_the_issue_names() -> None:
    required = {"fcfs", "sjf-oracle", "srpt-oracle", "ssjf", "ltr", "trail", "fastserve",
                "sagesched", "edf", "llf", "est-first", "vtc", "wfs"}  # fmt: skip
    assert required <= set(policy_names())


def test_fcfs_is_arrival_order() -> None:
    assert order("fcfs", [job(1, 3.0), job(2, 1.0), job(3, 2.0)]) == [2, 3, 1]


def test_oracles_use_true_lengths() -> None:
    jobs = [
        job(1, true_output_tokens=50),
        job(2, true_output_tokens=5),
        job(3, true_output_tokens=20),
    ]
    assert order("sjf-oracle", jobs) == [2, 3, 1]
    jobs[0].generated = 48  # 2 left: SRPT puts it first
    assert order("srpt-oracle", jobs) == [1, 2, 3]


def test_ssjf_uses_median_prediction() -> None:
    jobs = [job(1, dist=LengthDist.point(300)), job(2, dist=LengthDist([10, 1000], [0.6, 0.4]))]
    assert order("ssjf", jobs) == [2, 1]


def test_est_first_weighs_prompt() -> None:
    a = job(1, prompt=1000, dist=LengthDist.point(10))  # 0.5·1000 + 10 = 510
    b = job(2, prompt=10, dist=LengthDist.point(100))  # 5 + 100 = 105
    assert order("est-first", [a, b]) == [2, 1]


def test_edf_and_llf() -> None:
    a = job(1, deadline_s=10.0, dist=LengthDist.point(9000))  # laxity 10 − 9.005
    b = job(2, deadline_s=5.0, dist=LengthDist.point(10))  # laxity 5 − 0.015
    c = job(3, dist=LengthDist.point(1))  # no deadline: last
    assert order("edf", [a, b, c]) == [2, 1, 3]
    assert order("llf", [a, b, c]) == [1, 2, 3]


def test_ltr_orders_by_rank_and_promotes_starved_jobs() -> None:
    old_long = job(1, arrival=0.0, dist=LengthDist.point(5000))
    new_short = job(2, arrival=50.0, dist=LengthDist.point(5))
    assert order("ltr", [old_long, new_short], now=55.0, starvation_s=100.0) == [2, 1]
    # Once the long job has waited starvation_s it goes first, whatever the earlier keys said.
    s = Scheduler(make_policy("ltr", starvation_s=30.0))
    s.admit(old_long, 0.0)
    s.admit(new_short, 20.0)
    assert s.queue.peek(20.0) is new_short
    assert s.dispatch(31.0) is old_long


def test_ltr_orders_by_the_learned_rank_score_when_there_is_one() -> None:
    # The ranking model's score wins over the distribution: it says job 1 is the shorter.
    a = job(1, arrival=0.0, dist=LengthDist.point(5000), rank_score=-2.0)
    b = job(2, arrival=1.0, dist=LengthDist.point(5), rank_score=3.0)
    c = job(3, arrival=2.0, dist=LengthDist.point(5), rank_score=0.5)
    assert order("ltr", [a, b, c], now=3.0) == [1, 3, 2]
    # Without a score (no ranker yet) it falls back to E[log length], which differs from
    # SSJF's median on a skewed distribution.
    skewed = job(4, dist=LengthDist([10, 2000], [0.55, 0.45]))  # median 10, E[log] ≈ 4.7
    steady = job(5, arrival=1.0, dist=LengthDist.point(60))  # median 60, E[log] ≈ 4.1
    assert order("ltr", [skewed, steady]) == [5, 4]
    assert order("ssjf", [skewed, steady]) == [4, 5]


def test_sagesched_prefers_likely_short_and_uses_kv_cost() -> None:
    sure_medium = job(1, dist=LengthDist.point(100))
    bimodal = job(2, dist=LengthDist([5, 2000], [0.9, 0.1]))
    assert order("sagesched", [sure_medium, bimodal]) == [2, 1]
    # kv cost: same output, a much longer prompt costs more memory → served later;
    # with the tokens cost the two are tied and arrival decides.
    long_prompt = job(3, arrival=0.0, prompt=8000, dist=LengthDist.point(50))
    short_prompt = job(4, arrival=1.0, prompt=10, dist=LengthDist.point(50))
    assert order("sagesched", [long_prompt, short_prompt]) == [4, 3]
    assert order("sagesched", [long_prompt, short_prompt], cost="tokens") == [3, 4]


def test_sagesched_respects_max_tokens() -> None:
    capped = job(1, max_tokens=10, dist=LengthDist([5, 5000], [0.2, 0.8]))
    other = job(2, dist=LengthDist.point(50))
    assert order("sagesched", [other, capped]) == [1, 2]


def test_sagesched_review_points_are_support_points() -> None:
    p = make_policy("sagesched")
    j = job(1, dist=LengthDist([10, 100, 1000], [0.3, 0.3, 0.4]))
    assert p.next_review(j) == 10
    j.generated = 10
    assert p.next_review(j) == 100
    j.generated = 1000
    assert p.next_review(j) == 2000  # overrun: the belief moves to "as long again"


@settings(max_examples=300, deadline=None)
@given(
    points=st.lists(st.integers(1, 5000), min_size=1, max_size=24, unique=True),
    weights=st.lists(st.floats(0.01, 1.0), min_size=24, max_size=24),
    generated=st.integers(0, 12000),
    max_tokens=st.one_of(st.none(), st.integers(1, 6000)),
)
def test_sagesched_reviews_where_its_belief_has_its_next_support_point(
    points: list[int], weights: list[float], generated: int, max_tokens: int | None
) -> None:
    """`next_review` reads the review point off the predicted support; it is the first point
    above `generated` of the belief the key uses (capped at max_tokens, then conditioned)."""
    p = make_policy("sagesched")
    support = sorted(points)
    j = job(1, dist=LengthDist(support, weights[: len(support)]), max_tokens=max_tokens)
    j.generated = generated
    belief = p.belief(j).support  # type: ignore[attr-defined]
    want = next(math.ceil(x) for x in belief if x > generated)
    assert p.next_review(j) == want


def test_fastserve_skip_join_and_demotion_at_quantum_boundaries() -> None:
    p = FastServe(quantum_tokens=4, levels=4, entry_prompt_tokens=100)
    short, long_prompt = job(1, prompt=50), job(2, prompt=350)
    assert p.entry_level(short) == 0 and p.entry_level(long_prompt) == 2
    levels = []
    for g in range(0, 30):
        short.generated = g
        levels.append(p.key(short, 0.0)[0])
    # quanta 4, 8, 16 → demoted at 4, 12, 28; the last level keeps it.
    assert [g for g in range(1, 30) if levels[g] != levels[g - 1]] == [4, 12, 28]
    short.generated = 0
    assert p.next_review(short) == 4
    short.generated = 4
    assert p.next_review(short) == 12
    short.generated = 28
    assert p.next_review(short) is None


def test_trail_refines_and_stops_preempting_past_its_limit() -> None:
    p = make_policy("trail", preempt_fraction=0.5)
    j = job(1, dist=LengthDist([20, 200], [0.5, 0.5]))  # median 20 → limit 10 tokens
    assert p.key(j, 0.0) == (20.0,)
    assert p.can_be_preempted(j)
    assert p.next_review(j) == 10  # the preemption limit comes before the next support point
    j.generated = 10
    assert not p.can_be_preempted(j)
    j.generated = 20  # outlived the short mode: the refined estimate jumps to the long one
    assert p.key(j, 0.0) == (180.0,)


def test_vtc_serves_lowest_counter_and_lifts_returning_tenant() -> None:
    s = Scheduler(VTC())
    a1, a2 = job(1, tenant="a", prompt=100), job(2, tenant="a", prompt=100)
    b1 = job(3, arrival=1.0, tenant="b", prompt=100)
    s.admit(a1, 0.0)
    s.admit(a2, 0.0)
    assert s.dispatch(0.0) is a1  # a's counter: 100
    s.admit(b1, 1.0)  # b becomes backlogged: lifted to min over backlogged (a = 100)
    assert s.policy.counters["b"] == 100.0  # type: ignore[attr-defined]
    s.progress(a1, 10, 1.0)  # a's counter: 100 + 2·10 = 120
    assert s.dispatch(1.0) is b1  # b (100) before a's second job (120)


def test_wfs_alternates_between_equal_tenants() -> None:
    jobs = [
        job(i, arrival=i * 0.01, tenant="ab"[i % 2], dist=LengthDist.point(90)) for i in range(6)
    ]
    # Both tenants sent 3 equal jobs; the heavy tenant "a" is weighted ×2 in the second run.
    assert order("wfs", jobs) == [0, 1, 2, 3, 4, 5]
    heavy = [
        job(i, arrival=0.0, tenant="a" if i < 4 else "b", dist=LengthDist.point(90))
        for i in range(6)
    ]
    assert order("wfs", heavy) == [0, 4, 1, 5, 2, 3]


def test_parse_policy_spec() -> None:
    p = parse_policy("sagesched:cost=tokens,preemptive=false")
    assert p.params() == {
        "preemptive": False,
        "cost": "tokens",
        "preempt_rule": "pays",
        "latency": None,
    }
    assert p.label() == "sagesched:preemptive=False,cost=tokens"
    with pytest.raises(ValueError, match="no parameter"):
        parse_policy("fcfs:quantum=3")
    with pytest.raises(ValueError, match="unknown policy"):
        parse_policy("nope")
    with pytest.raises(ValueError, match="cannot read"):
        parse_policy("fastserve:levels=many")
