"""The simulator: the gateway queue via `policies.Scheduler`, the in-flight cap, gateway
preemption, drain, determinism, and every contender on a small workload."""

from __future__ import annotations

import pytest

from loadgen.engine.configs import CONTINUOUS
from loadgen.engine.model import Engine
from loadgen.schema import TraceRequest
from loadgen.sim.simulator import Contender, belief, contender_names, resolve, simulate
from policies.registry import parse_policy, policy_names


def _req(t: float, prompt: int, out: int, slack: float = 10.0) -> TraceRequest:
    return TraceRequest(t, prompt, out, "t", predicted_output_tokens=out, deadline_s=t + slack)


WORKLOAD = [_req(i * 0.0007, 30 + 211 * i % 1500, 1 + 53 * i % 150) for i in range(80)]


def test_contender_names_cover_policies_and_engine_configs() -> None:
    names = contender_names()
    assert set(policy_names()) <= set(names)
    assert {"vllm-fcfs", "slai", "sarathi"} <= set(names)
    assert "continuous" not in names


@pytest.mark.parametrize("name", contender_names())
def test_every_contender_is_deterministic_and_loses_nothing(name: str) -> None:
    a = simulate(WORKLOAD, name)
    b = simulate(WORKLOAD, name)
    assert [(r.finish_s, r.first_token_s) for r in a.records] == [
        (r.finish_s, r.first_token_s) for r in b.records
    ]
    assert len(a.records) == len(WORKLOAD)
    assert all(r.completed and r.tokens == r.output_tokens for r in a.records)


def test_gateway_cap_bounds_what_the_engine_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    most = [0]
    original = Engine.add

    def add(self: Engine, seq: object) -> None:
        original(self, seq)  # type: ignore[arg-type]
        most[0] = max(most[0], len(self))

    monkeypatch.setattr(Engine, "add", add)
    simulate(WORKLOAD, resolve("fcfs", inflight_cap=5))
    assert most[0] == 5
    most[0] = 0
    simulate(WORKLOAD, resolve("fcfs", inflight_cap=None))
    assert most[0] > 5


def test_gateway_preemption_lets_a_short_job_displace_a_long_one() -> None:
    reqs = [_req(0.0, 10, 200), _req(0.05, 10, 5)]
    res = simulate(reqs, resolve("srpt-oracle", inflight_cap=1))
    long, short = res.records
    assert short.finish_s == pytest.approx(0.05 + 0.005)
    assert long.preemptions == 1 and long.tokens == 200
    # the resumed job recomputes its prompt + generated tokens but keeps its first token
    assert long.first_token_s == pytest.approx(0.001)
    fcfs = simulate(reqs, resolve("fcfs", inflight_cap=1))
    assert fcfs.records[1].finish_s > 0.2 and fcfs.records[0].preemptions == 0


def test_prediction_policies_get_a_belief_and_oracles_the_truth() -> None:
    dist = belief(100.0, 0.2)
    assert dist.quantile(0.5) == pytest.approx(100.0, rel=0.1)
    assert len(dist) == 16
    assert belief(7.0, 0.0).support.tolist() == [7.0]
    res = simulate(WORKLOAD, resolve("sagesched"))
    assert all(r.completed for r in res.records)


def test_unfinished_work_is_dropped_at_the_end_of_the_drain() -> None:
    cfg = CONTINUOUS.with_(drain_s=0.05, max_seqs=1)
    res = simulate(
        [_req(0.0, 10, 30), _req(0.0, 10, 100)], Contender("f", parse_policy("fcfs"), cfg, None)
    )
    first, second = res.records
    assert first.completed and first.met_slo()
    assert second.dropped and not second.completed and second.tokens == 20
    assert res.end_s == pytest.approx(0.05)


def test_stop_after_violations_stops_early() -> None:
    reqs = [_req(0.0, 10, 50, slack=0.01)] + [_req(0.001 * i, 10, 5) for i in range(1, 50)]
    res = simulate(reqs, "fcfs", stop_after_violations=1)
    assert res.stopped_early
    assert sum(r.completed for r in res.records) < len(reqs)


def test_rank_scores_order_the_ltr_policy() -> None:
    # Three requests queue behind a cap of 1; ltr serves the waiting ones by their learned
    # rank score, whatever their (identical) predicted lengths say.
    reqs = [_req(0.0, 10, 20), _req(0.001, 10, 20), _req(0.002, 10, 20)]
    scores = [0.0, 5.0, -5.0]  # request 2 ranked shortest, request 1 longest
    res = simulate(reqs, resolve("ltr", inflight_cap=1), rank_scores=scores)
    finish = [r.finish_s for r in res.records]
    assert finish[0] < finish[2] < finish[1]
    flipped = simulate(reqs, resolve("ltr", inflight_cap=1), rank_scores=[0.0, -5.0, 5.0])
    assert flipped.records[1].finish_s < flipped.records[2].finish_s
    with pytest.raises(ValueError, match="rank_scores"):
        simulate(reqs, "ltr", rank_scores=[1.0])
